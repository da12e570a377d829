"""Shape ops: reshape, transpose, broadcast_to, slice, concat.

Sharding rules: ``transpose`` permutes the layout; ``reshape`` keeps a sharded dim only where
the same dim (same size, same product of leading dims) exists in the result, every other dim
of a sharded reshape being replicated; ``broadcast_to`` keeps the layout of kept dims and
replicates new ones; ``slice`` and ``concat`` need the dims they change unsharded. All are
linear, so pending reductions pass through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dtm_mpi.ir.build import Value
from dtm_mpi.ir.dtypes import as_dtype
from dtm_mpi.ir.grad_context import GradContext
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import dim_index, same_dtype, unsharded_dim
from dtm_mpi.ir.registry import OpContext, Trait, register_op
from dtm_mpi.ir.types import Layout, TensorType

Arr = np.ndarray


def _reshape_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (as_dtype(np.reshape(xs[0], rt[0].shape), rt[0]),)


@register_op("reshape", "$x:operand", reference=_reshape_ref, doc="row-major reshape",
             grad=lambda c: (c.reshape(c.g, c.xs[0].type.shape),))  # fmt: skip
def _reshape(ctx: OpContext) -> tuple[TensorType, ...]:
    t, d = ctx.operand_types[0], ctx.declared[0]
    if t.numel != d.numel:
        raise ctx.result_error(
            0, f"reshape must keep the element count; {list(t.shape)} has {t.numel}, "
            f"{list(d.shape)} has {d.numel}"
        )  # fmt: skip
    dims: list[tuple[str, ...]] = [() for _ in d.shape]
    for i, axes in enumerate(t.layout.dims):
        if not axes:
            continue
        prefix = math.prod(t.shape[:i])
        match = [
            j
            for j in range(d.rank)
            if d.shape[j] == t.shape[i] and math.prod(d.shape[:j]) == prefix
        ]
        if not match:
            raise ctx.operand_error(
                0, f"dim {i} is sharded over {','.join(axes)} but has no counterpart in "
                f"{list(d.shape)}; redistribute to replicate it before reshaping"
            )  # fmt: skip
        if dims[match[0]]:
            raise ctx.operand_error(
                0, f"dims sharded over {','.join(dims[match[0]])} and {','.join(axes)} would land on one "
                f"dim of {list(d.shape)}; redistribute first"
            )  # fmt: skip
        dims[match[0]] = axes
    return (TensorType(t.dtype, d.shape, Layout(tuple(dims), t.layout.partial)),)


def _transpose_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    perm: tuple[int, ...] = op.attr("perm")  # type: ignore[assignment]
    return (np.array(np.transpose(xs[0], perm), order="C"),)


def _d_transpose(c: GradContext) -> tuple[Value]:
    perm: tuple[int, ...] = c.attr("perm")  # type: ignore[assignment]
    return (c.transpose(c.g, sorted(range(len(perm)), key=perm.__getitem__)),)


@register_op("transpose", "$x:operand perm $perm:ints", reference=_transpose_ref,
             doc="permute dims", grad=_d_transpose)  # fmt: skip
def _transpose(ctx: OpContext) -> tuple[TensorType, ...]:
    t = ctx.operand_types[0]
    perm: tuple[int, ...] = ctx.attr("perm")
    if sorted(perm) != list(range(t.rank)):
        raise ctx.attr_error(
            "perm", f"perm must be a permutation of 0..{t.rank - 1}; got {list(perm)}"
        )
    shape = tuple(t.shape[p] for p in perm)
    dims = tuple(t.layout.dims[p] for p in perm)
    return (TensorType(t.dtype, shape, Layout(dims, t.layout.partial)),)


def _broadcast_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (np.array(np.broadcast_to(xs[0], rt[0].shape), order="C"),)


def _d_broadcast_to(c: GradContext) -> tuple[Value]:
    """The cotangent summed over the repeated dims (the leading ones and the size-1 ones)."""
    x, y = c.xs[0].type, c.ys[0].type
    lead = y.rank - x.rank
    dims = [*range(lead), *(lead + i for i, s in enumerate(x.shape) if s == 1 and y.shape[lead + i] != 1)]  # fmt: skip
    return (c.reshape(c.reduce_sum(c.g, dims, keepdims=True), x.shape),)


@register_op("broadcast_to", "$x:operand", reference=_broadcast_ref, grad=_d_broadcast_to,
             doc="numpy broadcasting to the result shape", traits=frozenset({Trait.BROADCASTS}))  # fmt: skip
def _broadcast_to(ctx: OpContext) -> tuple[TensorType, ...]:
    t, d = ctx.operand_types[0], ctx.declared[0]
    if d.dtype is not t.dtype:
        raise ctx.result_error(0, f"result dtype must be {t.dtype}; got {d.dtype}")
    if d.rank < t.rank:
        raise ctx.result_error(0, f"cannot broadcast rank {t.rank} to rank {d.rank}")
    lead = d.rank - t.rank
    dims: list[tuple[str, ...]] = [() for _ in range(lead)]
    for i, (s, axes) in enumerate(zip(t.shape, t.layout.dims, strict=True)):
        out = d.shape[lead + i]
        if s == out:
            dims.append(axes)
        elif s == 1:
            if axes:
                unsharded_dim(ctx, 0, i, "a broadcast (size-1)")
            dims.append(())
        else:
            raise ctx.result_error(
                0, f"cannot broadcast {list(t.shape)} to {list(d.shape)}: dim {i} has size {s}"
            )
    return (TensorType(t.dtype, d.shape, Layout(tuple(dims), t.layout.partial)),)


def _slice_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    idx = tuple(slice(a, b) for a, b in zip(op.attr("start"), op.attr("limit"), strict=True))  # type: ignore[arg-type]
    return (np.array(xs[0][idx], order="C"),)


def _d_slice(c: GradContext) -> tuple[Value]:
    """The cotangent put back in its box, zeros around it (a concat per cut dim)."""
    x = c.xs[0].type
    g = c.g
    start: tuple[int, ...] = c.attr("start")  # type: ignore[assignment]
    limit: tuple[int, ...] = c.attr("limit")  # type: ignore[assignment]
    for d, (a, b) in enumerate(zip(start, limit, strict=True)):
        parts = []
        for lo, hi in ((0, a), (b, x.shape[d])):
            if hi > lo:
                shape = (*g.type.shape[:d], hi - lo, *g.type.shape[d + 1 :])
                parts.append(c.zeros(TensorType(g.type.dtype, shape, g.type.layout.with_partial(None))))  # fmt: skip
        if parts:
            pieces = [parts[0], g, *parts[1:]] if a > 0 else [g, *parts]
            g = c.b.apply1("concat", pieces, {"dim": d}, span=c.span, hint="g")
    return (g,)


@register_op("slice", "$x:operand start $start:ints limit $limit:ints", reference=_slice_ref,
             doc="the box [start, limit) of the operand", grad=_d_slice)  # fmt: skip
def _slice(ctx: OpContext) -> tuple[TensorType, ...]:
    t = ctx.operand_types[0]
    start: tuple[int, ...] = ctx.attr("start")
    limit: tuple[int, ...] = ctx.attr("limit")
    for key, v in (("start", start), ("limit", limit)):
        if len(v) != t.rank:
            raise ctx.attr_error(key, f"{key} needs {t.rank} entries (one per dim); got {len(v)}")
    shape = []
    for i, (a, b, s) in enumerate(zip(start, limit, t.shape, strict=True)):
        if not 0 <= a <= b <= s:
            raise ctx.attr_error(
                "limit", f"dim {i}: need 0 <= start <= limit <= {s}; got [{a}, {b})"
            )
        if b - a != s:
            unsharded_dim(ctx, 0, i, "a sliced")
        shape.append(b - a)
    return (TensorType(t.dtype, tuple(shape), t.layout),)


def _concat_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (np.concatenate(list(xs), axis=int(op.attr("dim"))),)  # type: ignore[arg-type]


def _d_concat(c: GradContext) -> list[Value | None]:
    d = int(c.attr("dim"))  # type: ignore[arg-type]
    out: list[Value | None] = []
    at = 0
    for x, want in zip(c.xs, c.wants, strict=True):
        n = x.type.shape[d]
        if want:
            start = tuple(at if i == d else 0 for i in range(x.type.rank))
            limit = tuple(at + n if i == d else s for i, s in enumerate(c.g.type.shape))
            out.append(c.apply("slice", c.g, start=start, limit=limit))
        else:
            out.append(None)
        at += n
    return out


@register_op("concat", "$xs:operands dim $dim:int", reference=_concat_ref,
             doc="join operands along dim", grad=_d_concat)  # fmt: skip
def _concat(ctx: OpContext) -> tuple[TensorType, ...]:
    ts = ctx.operand_types
    if not ts:
        raise ctx.error("needs at least one operand")
    first = ts[0]
    d = dim_index(ctx, "dim", int(ctx.attr("dim")), first.rank)
    total = 0
    for i, t in enumerate(ts):
        same_dtype(ctx, 0, i)
        if t.rank != first.rank or any(
            a != b for j, (a, b) in enumerate(zip(t.shape, first.shape, strict=True)) if j != d
        ):
            raise ctx.operand_error(
                i,
                f"shapes must match except in dim {d}; got {list(first.shape)} and {list(t.shape)}",
            )
        if t.layout != first.layout:
            raise ctx.operand_error(i, f"layouts must match; got {first.layout} and {t.layout}")
        unsharded_dim(ctx, i, d, "the concatenated")
        total += t.shape[d]
    shape = (*first.shape[:d], total, *first.shape[d + 1 :])
    return (TensorType(first.dtype, shape, first.layout),)
