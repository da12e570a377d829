"""Small checks shared by the op rules. Each raises a diagnostic naming the rule and what was
found ("rule ...; got ...")."""

from __future__ import annotations

from collections.abc import Sequence

from dtm_mpi.ir.registry import OPS, OpContext, Trait
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType

KNOWN_CAPABILITIES = ("CAP_QUANT", "CAP_CUDA", "CAP_HIP", "CAP_HDF5_MPI", "CAP_STORE")


def only(ctx: OpContext, i: int = 0) -> TensorType:
    return ctx.operand_types[i]


def declared(ctx: OpContext, i: int = 0) -> TensorType:
    return ctx.declared[i]


def require_float(ctx: OpContext, i: int) -> None:
    t = ctx.operand_types[i]
    if not t.dtype.is_float:
        raise ctx.operand_error(i, f"operand must have a floating dtype; got {t.dtype}")


def require_numeric(ctx: OpContext, i: int) -> None:
    t = ctx.operand_types[i]
    if t.dtype is DType.BOOL:
        raise ctx.operand_error(i, "operand must be numeric; got bool")


def no_partial(ctx: OpContext, i: int, why: str = "") -> None:
    t = ctx.operand_types[i]
    if t.layout.partial is not None:
        hint = why or f"{ctx.op.name} is not linear in a pending reduction; allreduce it first"
        raise ctx.operand_error(i, f"operand is {t.layout.partial}: {hint}")


def dim_index(ctx: OpContext, key: str, dim: int, rank: int) -> int:
    if not 0 <= dim < rank:
        raise ctx.attr_error(key, f"dim {dim} is out of range for rank {rank} (0..{rank - 1})")
    return dim


def unsharded_dim(ctx: OpContext, i: int, dim: int, what: str) -> None:
    axes = ctx.operand_types[i].layout.dims[dim]
    if axes:
        raise ctx.operand_error(
            i,
            f"{what} dim {dim} must not be sharded; it is sharded over {','.join(axes)} "
            "(redistribute or allgather it first)",
        )


def same_shape(ctx: OpContext, i: int, j: int) -> None:
    a, b = ctx.operand_types[i], ctx.operand_types[j]
    if a.shape != b.shape:
        raise ctx.operand_error(j, f"shapes must match; got {list(a.shape)} and {list(b.shape)}")


def same_dtype(ctx: OpContext, i: int, j: int) -> None:
    a, b = ctx.operand_types[i], ctx.operand_types[j]
    if a.dtype is not b.dtype:
        raise ctx.operand_error(j, f"dtypes must match; got {a.dtype} and {b.dtype}")


def same_dims(ctx: OpContext, i: int, j: int) -> None:
    a, b = ctx.operand_types[i].layout, ctx.operand_types[j].layout
    if a.dims != b.dims:
        raise ctx.operand_error(
            j, f"layouts must match; got {a.dims_text()} and {b.dims_text()} (redistribute one)"
        )


def merge_partial(
    ctx: OpContext,
    existing: Partial | None,
    op: ReduceOp,
    axes: Sequence[str],
    *,
    zeros_elsewhere: bool = False,
) -> Partial | None:
    """The result's pending reduction: ``existing`` (the operand's) with a pending ``op``
    over ``axes`` added. A pending sum a new op adds is a sum of floats in the mesh's order,
    so the op must say it sums (:data:`~dtm_mpi.ir.registry.Trait.SUMS`: deterministic mode
    then has its exact rule), unless each element has one contributor, the other ranks
    holding zeros (``zeros_elsewhere``: exact in any order)."""
    if not axes:
        return existing
    summing = op is ReduceOp.SUM and not zeros_elsewhere
    assert not summing or OPS[ctx.op.name].has(Trait.SUMS), (
        f"{ctx.op.name} sums floats across ranks: give it Trait.SUMS and an exact rule"
    )
    if existing is None:
        return Partial(op, tuple(axes))
    if existing.op is not op:
        raise ctx.operand_error(
            0,
            f"operand is {existing}, which cannot combine with a pending {op.value} "
            f"over {','.join(axes)}; allreduce first",
        )
    return Partial(op, existing.axes + tuple(a for a in axes if a not in existing.axes))


def mesh_axes_attr(ctx: OpContext, key: str) -> tuple[str, ...]:
    """The mesh axes named by attribute ``key``, each declared by the function's mesh, once."""
    axes: tuple[str, ...] = ctx.attr(key)
    if ctx.mesh is None:
        raise ctx.attr_error(key, "collective needs a mesh: the function names none (on @mesh)")
    seen: set[str] = set()
    for a in axes:
        if a not in ctx.mesh.axis_names:
            raise ctx.attr_error(
                key,
                f"axis {a!r} is not an axis of mesh @{ctx.mesh.name} "
                f"({', '.join(ctx.mesh.axis_names)})",
            )
        if a in seen:
            raise ctx.attr_error(key, f"axis {a!r} is listed twice")
        seen.add(a)
    return axes


def layout_of(
    t: TensorType, dims: tuple[tuple[str, ...], ...], partial: Partial | None
) -> TensorType:
    return t.with_layout(Layout(dims, partial))
