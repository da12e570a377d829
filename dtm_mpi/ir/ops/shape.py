"""Shape ops: reshape, transpose, broadcast_to, slice, concat.

Sharding rules: ``transpose`` permutes the layout; ``reshape`` keeps a sharded dim where the
same dim (same size, same product of leading dims) exists in the result, or moves its split to
the major dim it splits into (``[B,T,D]{-,-,tp}`` -> ``[B,T,H,hd]{-,-,tp,-}``: heads over tp)
or to the dim it merges into with unsharded dims after it (the reverse), where every shard
stays whole on the bound mesh (a plan check); every other dim is replicated; ``broadcast_to`` keeps the layout of kept dims and
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
from dtm_mpi.ir.registry import OpContext, ShardExtents, Trait, register_op
from dtm_mpi.ir.types import Layout, TensorType

Arr = np.ndarray


def _reshape_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (as_dtype(np.reshape(xs[0], rt[0].shape), rt[0]),)


def _reshape_moves(x: TensorType, shape: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Where each split dim of ``x`` goes in a reshape to ``shape``: (operand dim i, result
    dim j, kind, factor), kind 0: the same dim (same size, same product of leading dims);
    1: dim i splits into result dims j.. with the split on the major one (size s = factor x
    shape[j]); 2: operand dims i.. (only i split) merge into result dim j (shape[j] = factor x
    size of i). Raises ValueError with the reason where a split dim has no place."""
    moves = []
    for i, axes in enumerate(x.layout.dims):
        if not axes:
            continue
        s, prefix = x.shape[i], math.prod(x.shape[:i])
        at = [j for j in range(len(shape)) if math.prod(shape[:j]) == prefix]
        same = [j for j in at if shape[j] == s]
        if same:
            moves.append((i, same[0], 0, 1))
            continue
        split = [
            j
            for j in at
            if s > 0
            and shape[j] > 1
            and s % shape[j] == 0
            and any(math.prod(shape[j : k + 1]) == s for k in range(j, len(shape)))
        ]
        if split:
            moves.append((i, split[0], 1, s // shape[split[0]]))
            continue
        merge = [
            j
            for j in at
            for m in range(i + 1, x.rank)
            if s > 0
            and math.prod(x.shape[i : m + 1]) == shape[j]
            and not any(x.layout.dims[i + 1 : m + 1])
        ]
        if merge:
            moves.append((i, merge[0], 2, shape[merge[0]] // s))
            continue
        raise ValueError(
            f"dim {i} is sharded over {','.join(axes)} but has no counterpart in {list(shape)} "
            "(the same dim, its split into dims with the split on the first, or its merge with "
            "unsharded dims after it); redistribute to replicate it before reshaping"
        )
    return moves


def _reshape_aligned(op: Op, types: Sequence[TensorType], extents: ShardExtents) -> str | None:
    """A split or merged sharded dim keeps every shard whole: the shards of the new dim,
    scaled by the factor, are the shards of the old one (true for even splits; an uneven
    split may not align on the bound mesh)."""
    x, r = types[0], op.result_types[0]
    for i, j, kind, f in _reshape_moves(x, r.shape):
        if kind == 0:
            continue
        axes = x.layout.dims[i]
        old, new = extents(x.shape[i], axes), extents(r.shape[j], axes)
        want = (
            [(a * f, n * f) for a, n in new]
            if kind == 1
            else [(a // f, n // f) if a % f == 0 and n % f == 0 else (-1, -1) for a, n in new]
        )
        if list(old) != want:
            return (
                f"dim {i} (size {x.shape[i]}) split over {','.join(axes)} does not land on whole "
                f"{'rows of' if kind == 1 else 'blocks of'} result dim {j} (size {r.shape[j]}) on "
                f"this mesh: its shards are {[(a, a + n) for a, n in old]}; make the sizes divide "
                "evenly by the axes, or replicate the dim first"
            )
    return None


@register_op(
    "reshape",
    "$x:operand",
    reference=_reshape_ref,
    doc="row-major reshape",
    grad=lambda c: (c.reshape(c.g, c.xs[0].type.shape),),
    plan_check=_reshape_aligned,
)
def _reshape(ctx: OpContext) -> tuple[TensorType, ...]:
    t, d = ctx.operand_types[0], ctx.declared[0]
    if t.numel != d.numel:
        raise ctx.result_error(
            0,
            f"reshape must keep the element count; {list(t.shape)} has {t.numel}, "
            f"{list(d.shape)} has {d.numel}",
        )
    try:
        moves = _reshape_moves(t, d.shape)
    except ValueError as exc:
        raise ctx.operand_error(0, str(exc)) from None
    dims: list[tuple[str, ...]] = [() for _ in d.shape]
    for i, j, _, _ in moves:
        axes = t.layout.dims[i]
        if dims[j]:
            raise ctx.operand_error(
                0,
                f"dims sharded over {','.join(dims[j])} and {','.join(axes)} would land on one "
                f"dim of {list(d.shape)}; redistribute first",
            )
        dims[j] = axes
    return (TensorType(t.dtype, d.shape, Layout(tuple(dims), t.layout.partial)),)


def _transpose_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    perm: tuple[int, ...] = op.attr("perm")  # type: ignore[assignment]
    return (np.array(np.transpose(xs[0], perm), order="C"),)


def _d_transpose(c: GradContext) -> tuple[Value]:
    perm: tuple[int, ...] = c.attr("perm")  # type: ignore[assignment]
    return (c.transpose(c.g, sorted(range(len(perm)), key=perm.__getitem__)),)


@register_op(
    "transpose",
    "$x:operand perm $perm:ints",
    reference=_transpose_ref,
    doc="permute dims",
    grad=_d_transpose,
)
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
    dims = [
        *range(lead),
        *(lead + i for i, s in enumerate(x.shape) if s == 1 and y.shape[lead + i] != 1),
    ]
    return (c.reshape(c.reduce_sum(c.g, dims, keepdims=True), x.shape),)


@register_op(
    "broadcast_to",
    "$x:operand",
    reference=_broadcast_ref,
    grad=_d_broadcast_to,
    doc="numpy broadcasting to the result shape",
    traits=frozenset({Trait.BROADCASTS}),
)
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
                parts.append(
                    c.zeros(TensorType(g.type.dtype, shape, g.type.layout.with_partial(None)))
                )
        if parts:
            pieces = [parts[0], g, *parts[1:]] if a > 0 else [g, *parts]
            g = c.b.apply1("concat", pieces, {"dim": d}, span=c.span, hint="g")
    return (g,)


@register_op(
    "slice",
    "$x:operand start $start:ints limit $limit:ints",
    reference=_slice_ref,
    doc="the box [start, limit) of the operand",
    grad=_d_slice,
)
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


@register_op(
    "concat",
    "$xs:operands dim $dim:int",
    reference=_concat_ref,
    doc="join operands along dim",
    grad=_d_concat,
)
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
