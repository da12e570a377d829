"""Batched matmul: ``[..., M, K] x [..., K, N] -> [..., M, N]`` (equal batch dims).

Sharding rule: batch dims must be sharded alike and stay so; M keeps the lhs sharding, N the
rhs sharding; the contracted K must be sharded alike on both sides, and its axes become a
pending ``partial(sum)`` of the result. At most one operand may be ``partial(sum)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.ir.build import Value
from dtm_mpi.ir.dtypes import as_dtype
from dtm_mpi.ir.grad_context import GradContext
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import merge_partial, require_numeric, same_dtype
from dtm_mpi.ir.registry import OpContext, Trait, register_op
from dtm_mpi.ir.types import Layout, ReduceOp, TensorType


def _matmul_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    return (as_dtype(np.matmul(xs[0], xs[1]), rt[0]),)


def _d_matmul(c: GradContext) -> tuple[Value | None, Value | None]:
    """d(a @ b) = g @ b^T for a and a^T @ g for b (last two dims swapped)."""
    a, b = c.xs
    swap = (*range(a.type.rank - 2), a.type.rank - 1, a.type.rank - 2)
    da = c.apply("matmul", c.g, c.transpose(b, swap)) if c.wants[0] else None
    db = c.apply("matmul", c.transpose(a, swap), c.g) if c.wants[1] else None
    return (da, db)


@register_op(
    "matmul",
    "$lhs:operand , $rhs:operand",
    reference=_matmul_ref,
    doc="batched matrix product",
    grad=_d_matmul,
    traits=frozenset({Trait.SUMS}),
    flops=lambda operands, results: 2 * results[0].numel * operands[0].shape[-1],
)
def _matmul(ctx: OpContext) -> tuple[TensorType, ...]:
    a, b = ctx.operand_types
    require_numeric(ctx, 0)
    same_dtype(ctx, 0, 1)
    if a.rank < 2 or b.rank < 2:
        bad = 0 if a.rank < 2 else 1
        raise ctx.operand_error(
            bad, f"operands must have rank >= 2; got rank {ctx.operand_types[bad].rank}"
        )
    if a.rank != b.rank or a.shape[:-2] != b.shape[:-2]:
        raise ctx.operand_error(
            1, f"batch dims must match; got {list(a.shape[:-2])} and {list(b.shape[:-2])}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ctx.operand_error(
            1,
            f"contracted dims differ: lhs {list(a.shape)} has K={a.shape[-1]}, rhs "
            f"{list(b.shape)} has K={b.shape[-2]}",
        )
    la, lb = a.layout, b.layout
    if la.dims[:-2] != lb.dims[:-2]:
        raise ctx.operand_error(
            1, f"batch dims must be sharded alike; got {la.dims_text()} and {lb.dims_text()}"
        )
    if la.dims[-1] != lb.dims[-2]:
        raise ctx.operand_error(
            1,
            f"the contracted dim must be sharded alike on both sides; lhs K is "
            f"{'-' if not la.dims[-1] else ','.join(la.dims[-1])}, rhs K is "
            f"{'-' if not lb.dims[-2] else ','.join(lb.dims[-2])}",
        )
    if la.partial is not None and lb.partial is not None:
        raise ctx.operand_error(
            1,
            f"both operands are pending reductions ({la.partial}, {lb.partial}); allreduce one first",
        )
    existing = la.partial or lb.partial
    if existing is not None and existing.op is not ReduceOp.SUM:
        raise ctx.operand_error(0 if la.partial else 1, f"matmul is not linear in {existing}")
    m_axes, n_axes = la.dims[-2], lb.dims[-1]
    clash = set(m_axes) & set(n_axes)
    if clash:
        raise ctx.operand_error(1, f"M and N are sharded over the same axis {sorted(clash)[0]!r}")
    partial = merge_partial(ctx, existing, ReduceOp.SUM, la.dims[-1])
    dims = (*la.dims[:-2], m_axes, n_axes)
    used = [x for d in dims for x in d] + list(partial.axes if partial else ())
    if len(used) != len(set(used)):
        raise ctx.operand_error(1, "the result would use one mesh axis twice")
    shape = (*a.shape[:-1], b.shape[-1])
    return (TensorType(a.dtype, shape, Layout(dims, partial)),)
