"""Indexing along a dim (IR 1.1): ``take`` (``numpy.take``: embedding lookups) and its
transpose ``scatter_add`` (rows added at integer indices: the embedding gradient).

Sharding rules. ``take %x, %idx dim D``: the result's dims are ``x``'s before ``D``, then
``idx``'s, then ``x``'s after ``D``, each keeping its layout entry; a split ``D`` (a
vocab-parallel table) makes the result a pending sum over its axes, as Megatron's embedding
does: a rank looks up the indices in its range and gives zeros for the others.
``scatter_add %u, %idx dim D`` is the transpose: the declared result names the size and the
split of ``D`` (a rank adds only the indices in its range, no communication); the indexed dims
of ``u`` must be laid out as ``idx``, and a split ``idx`` makes the result a pending sum over
its axes (each rank adds its part of the updates). Indices outside ``[0, size of D)`` are an
error on the rank that holds them, never a silent wrap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from dtm_mpi.errors import KernelError
from dtm_mpi.ir.build import Value
from dtm_mpi.ir.grad_context import GradContext
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import dim_index, merge_partial, no_partial, require_numeric
from dtm_mpi.ir.registry import OpContext, Trait, register_op
from dtm_mpi.ir.types import Layout, Partial, ReduceOp, TensorType

__all__ = ["add_in_order", "check_indices", "scatter_rows", "scatter_window", "take_rows"]

Arr = np.ndarray
IR_1_1 = (1, 1)


def check_indices(op: str, idx: Arr, size: int, dim: int, origin: Sequence[int] = ()) -> None:
    """Every index in ``[0, size)``, else a :class:`KernelError` naming the first bad one and
    where it is in the global indices (``origin``: where the rank's block starts)."""
    if idx.size == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo >= 0 and hi < size:
        return
    bad = np.argwhere((idx < 0) | (idx >= size))[0]
    at = ", ".join(str(int(i) + (origin[j] if j < len(origin) else 0)) for j, i in enumerate(bad))
    raise KernelError(
        f"{op}: index {int(idx[tuple(bad)])} at [{at}] is outside [0, {size}) of dim {dim}"
    )


def take_rows(x: Arr, idx: Arr, dim: int, lo: int, size: int, origin: Sequence[int] = ()) -> Arr:
    """``x``'s rows along ``dim`` at ``idx``, where ``x`` holds rows ``[lo, lo + n)`` of a dim
    of ``size`` rows: indices outside the block give zeros (the rank's part of the pending
    sum)."""
    check_indices("take", idx, size, dim, origin)
    idx = idx.astype(np.int64, copy=False)  # a block past a small index dtype's range
    n = x.shape[dim]
    if lo == 0 and n == size:
        return np.take(x, idx, axis=dim)
    inside = (idx >= lo) & (idx < lo + n)
    shape = (*x.shape[:dim], *idx.shape, *x.shape[dim + 1 :])
    if n == 0:
        return np.zeros(shape, dtype=x.dtype)
    rows = np.take(x, np.where(inside, idx - lo, 0), axis=dim)
    keep = inside.reshape((1,) * dim + idx.shape + (1,) * (x.ndim - dim - 1))
    return np.where(keep, rows, np.zeros((), dtype=x.dtype))


def scatter_window(
    u: Arr, idx: Arr, dim: int, lo: int, n: int, size: int, origin: Sequence[int] = ()
) -> tuple[Arr, Arr]:
    """The updates of ``scatter_add(u, idx, dim)`` that land in the block ``[lo, lo + n)``
    along ``dim`` of a dim of ``size`` rows: their indices relative to the block (1-d int64)
    and their rows (along ``dim``, in the updates' order), after the indices are checked."""
    check_indices("scatter_add", idx, size, dim, origin)
    flat = idx.astype(np.int64, copy=False).reshape(-1)
    k = idx.ndim
    rows = u.reshape((*u.shape[:dim], flat.size, *u.shape[dim + k :]))
    if lo != 0 or n != size:
        inside = (flat >= lo) & (flat < lo + n)
        flat = flat[inside] - lo
        rows = np.compress(inside, rows, axis=dim)
    return flat, rows


def scatter_rows(
    u: Arr, idx: Arr, dim: int, lo: int, n: int, size: int, origin: Sequence[int] = ()
) -> Arr:
    """The block ``[lo, lo + n)`` along ``dim`` of ``scatter_add(u, idx, dim)`` into a dim of
    ``size`` rows: zeros plus each update whose index falls in the block, added in the order
    of the updates (``numpy.add.at``; deterministic)."""
    flat, rows = scatter_window(u, idx, dim, lo, n, size, origin)
    k = idx.ndim
    out = np.zeros((*u.shape[:dim], n, *u.shape[dim + k :]), dtype=u.dtype)
    add_in_order(np.moveaxis(out, dim, 0), flat, np.moveaxis(rows, dim, 0))
    return out


def add_in_order(out: Arr, flat: Arr, rows: Arr) -> None:
    """``numpy.add.at(out, flat, rows)`` (rows along the first axis), bit for bit: each row of
    ``out`` gets its updates added one by one in their order. Done in passes where that is
    faster: pass ``j`` adds the ``j``-th update of every target row at once (no target twice
    in a pass, so a plain indexed add), which ``add.at`` takes about 0.8 us per update for
    and a pass about 8 us (measured: the GPT's embedding gradient, 1,536 updates of 96
    floats into 96 rows, 1.29 ms -> 0.27 ms); a target with many updates (more passes than a
    tenth of the updates) keeps ``add.at``."""
    m = flat.size
    if m == 0:
        return
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    first = np.empty(m, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    rank = np.arange(m) - starts[np.cumsum(first) - 1]  # each update's place in its target's
    passes = int(rank.max()) + 1
    if passes * 10 > m:
        np.add.at(out, flat, rows)
        return
    by_pass = order[np.argsort(rank, kind="stable")]
    bounds = np.searchsorted(np.sort(rank, kind="stable"), np.arange(passes + 1))
    for a, b in itertools.pairwise(bounds):
        sel = by_pass[a:b]
        out[flat[sel]] += rows[sel]


# --- take ----------------------------------------------------------------------------------


def _take_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    d = int(op.attr("dim"))  # type: ignore[arg-type]
    return (np.asarray(take_rows(xs[0], xs[1], d, 0, xs[0].shape[d]), order="C"),)


def _d_take(c: GradContext) -> tuple[Value | None, None]:
    """The cotangent's rows added back at the indices (``scatter_add`` to ``x``'s shape and
    split of the indexed dim)."""
    if not c.wants[0]:
        return (None, None)
    x, idx = c.xs
    d = int(c.attr("dim"))  # type: ignore[arg-type]
    want = TensorType(x.type.dtype, x.type.shape, Layout(x.type.layout.dims))
    return (c.apply("scatter_add", c.g, idx, dim=d, declared=[want]), None)


def _index_operand(ctx: OpContext, i: int) -> TensorType:
    t = ctx.operand_types[i]
    if not t.dtype.is_int:
        raise ctx.operand_error(i, f"indices must have an integer dtype; got {t.dtype}")
    no_partial(ctx, i, "indices cannot be a pending reduction; allreduce them first")
    return t


def _axes_once(ctx: OpContext, dims: Sequence[tuple[str, ...]], partial: Partial | None) -> None:
    used = [a for d in dims for a in d] + list(partial.axes if partial else ())
    twice = sorted({a for a in used if used.count(a) > 1})
    if twice:
        raise ctx.operand_error(
            1,
            f"the result would use mesh axis {twice[0]!r} twice (the indices and the "
            "operand are split over it); redistribute one",
        )


@register_op(
    "take",
    "$x:operand , $idx:operand dim $dim:int",
    reference=_take_ref,
    doc="rows along dim at integer indices (numpy.take)",
    grad=_d_take,
    since=IR_1_1,
)
def _take(ctx: OpContext) -> tuple[TensorType, ...]:
    x = ctx.operand_types[0]
    idx = _index_operand(ctx, 1)
    if x.rank == 0:
        raise ctx.operand_error(0, "operand must have rank >= 1; got a scalar")
    d = dim_index(ctx, "dim", int(ctx.attr("dim")), x.rank)
    if (
        x.layout.partial is not None
        and x.layout.partial.op is not ReduceOp.SUM
        and x.layout.dims[d]
    ):
        raise ctx.operand_error(
            0,
            f"operand is {x.layout.partial} and split along the indexed dim {d}; "
            "a split dim gives a pending sum: allreduce it first",
        )
    partial = merge_partial(
        ctx, x.layout.partial, ReduceOp.SUM, x.layout.dims[d], zeros_elsewhere=True
    )
    dims = (*x.layout.dims[:d], *idx.layout.dims, *x.layout.dims[d + 1 :])
    _axes_once(ctx, dims, partial)
    shape = (*x.shape[:d], *idx.shape, *x.shape[d + 1 :])
    return (TensorType(x.dtype, shape, Layout(dims, partial)),)


# --- scatter_add ---------------------------------------------------------------------------


def _scatter_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    d = int(op.attr("dim"))  # type: ignore[arg-type]
    size = rt[0].shape[d]
    return (scatter_rows(xs[0], xs[1], d, 0, size, size),)


def _d_scatter_add(c: GradContext) -> tuple[Value | None, None]:
    """The cotangent's rows at the indices (``take``)."""
    if not c.wants[0]:
        return (None, None)
    return (c.apply("take", c.g, c.xs[1], dim=int(c.attr("dim"))), None)  # type: ignore[arg-type]


@register_op(
    "scatter_add",
    "$u:operand , $idx:operand dim $dim:int",
    reference=_scatter_ref,
    doc="zeros plus rows added at integer indices along dim",
    grad=_d_scatter_add,
    since=IR_1_1,
    traits=frozenset({Trait.SUMS}),
)
def _scatter_add(ctx: OpContext) -> tuple[TensorType, ...]:
    u = ctx.operand_types[0]
    idx = _index_operand(ctx, 1)
    require_numeric(ctx, 0)
    if len(ctx.declared) != 1:
        raise ctx.error("needs its result type declared (the size and split of the indexed dim)")
    t = ctx.declared[0]
    k = idx.rank
    rank = u.rank - k + 1
    if u.rank < k:
        raise ctx.operand_error(0, f"updates of rank {u.rank} cannot hold indices of rank {k}")
    d = dim_index(ctx, "dim", int(ctx.attr("dim")), rank)
    if u.shape[d : d + k] != idx.shape:
        raise ctx.operand_error(
            1,
            f"indices {list(idx.shape)} must match dims {d}..{d + k - 1} of the updates "
            f"{list(u.shape)}",
        )
    if u.layout.dims[d : d + k] != idx.layout.dims:
        raise ctx.operand_error(
            1,
            f"the indices must be split as the updates' dims {d}..{d + k - 1}; got "
            f"{idx.layout.dims_text()} and {u.layout.dims_text()} (redistribute one)",
        )
    shape = (*u.shape[:d], t.shape[d] if t.rank == rank else -1, *u.shape[d + k :])
    if t.rank != rank or t.dtype is not u.dtype or t.shape != shape:
        want = f"{u.dtype}[{','.join(str(s) for s in (*u.shape[:d], 'N', *u.shape[d + k :]))}]"
        raise ctx.result_error(
            0,
            f"result must be {want} (the updates' dtype and dims around the indexed dim {d}); got {t}",
        )
    if u.layout.partial is not None and u.layout.partial.op is not ReduceOp.SUM:
        raise ctx.operand_error(
            0, f"scatter_add is not linear in {u.layout.partial}; allreduce it first"
        )
    idx_axes = [a for dd in idx.layout.dims for a in dd]
    partial = merge_partial(ctx, u.layout.partial, ReduceOp.SUM, idx_axes)
    dims = (*u.layout.dims[:d], t.layout.dims[d], *u.layout.dims[d + k :])
    _axes_once(ctx, dims, partial)
    return (TensorType(u.dtype, shape, Layout(dims, partial)),)
