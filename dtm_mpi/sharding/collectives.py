"""Reference semantics of redistribution steps in numpy, and a whole plan over all ranks at once.

The group functions take the local arrays of one group's members **in group order** (as
:meth:`MeshShape.group_of` orders them) and return each member's output in the same order:

* :func:`allgather` — concatenation along a dim in group order;
* :func:`allreduce` — the reduction folded left to right in group order (deterministic);
* :func:`reduce_scatter` — the same fold, member ``j`` keeping piece ``j`` along a dim;
* :func:`all_to_all` — member ``j`` sends piece ``c`` (along the target dim) to member ``c``,
  who concatenates what it receives along the source dim in member order;
* :func:`exchange` — general: moves the regions that per-rank :class:`ExchangeSpec` s name.

:func:`apply_plan` runs a :class:`RedistPlan` over every rank's local array (the kernel of an
in-process simulator). Identities of empty contributions (MAKE_PARTIAL fills) follow §7.1:
0 for sum, 1 for prod, -∞ / the least value for max, +∞ / the greatest value for min. These
functions are dtype-agnostic: bf16 values should be passed as float32 arrays (spec §13, Q12).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dtm_mpi.errors import PlanError
from dtm_mpi.ir.types import ReduceOp, TensorType
from dtm_mpi.sharding.blocks import local_shape
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import RedistPlan
from dtm_mpi.sharding.steps import (
    STEP_KINDS,
    ExchangeSpec,
    MakePartialSpec,
    RedistStep,
    ReduceScatterSpec,
    RelabelSpec,
    SliceSpec,
    StepKind,
    block_bounds,
    rank_spec,
)

__all__ = [
    "all_to_all",
    "allgather",
    "allreduce",
    "apply_plan",
    "apply_step",
    "exchange",
    "make_partial",
    "reduce_arrays",
    "reduce_scatter",
    "reduction_identity",
    "reference_all_to_all",
    "reference_allgather",
    "reference_allreduce",
    "reference_exchange",
    "reference_local",
    "reference_reduce_scatter",
    "relabel",
    "slice_block",
]

Array = np.ndarray[Any, np.dtype[Any]]

_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


def reduction_identity(op: ReduceOp, dtype: np.dtype[Any]) -> Any:
    """The identity of ``op`` for ``dtype`` (§7.1), as a numpy scalar of that dtype."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return np.bool_(op in (ReduceOp.PROD, ReduceOp.MIN))
    if op is ReduceOp.SUM:
        return dt.type(0)
    if op is ReduceOp.PROD:
        return dt.type(1)
    if dt.kind == "f":
        return dt.type(-np.inf if op is ReduceOp.MAX else np.inf)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return dt.type(info.min if op is ReduceOp.MAX else info.max)
    raise PlanError(f"no {op} identity for dtype {dt}")


def reduce_arrays(arrays: Sequence[Array], op: ReduceOp) -> Array:
    """``op`` over ``arrays`` (equal shapes), folded left to right: ``((a0 op a1) op a2) …``."""
    if not arrays:
        raise PlanError("a reduction needs at least one contribution")
    acc = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        if a.shape != acc.shape:
            raise PlanError(f"contributions differ in shape: {acc.shape} and {a.shape}")
        _UFUNC[op](acc, a, out=acc)
    return acc


def allgather(blocks: Sequence[Array], dim: int) -> list[Array]:
    """Every member gets the members' blocks concatenated along ``dim`` in group order."""
    whole = np.concatenate(list(blocks), axis=dim)
    return [whole.copy() for _ in blocks]


def allreduce(contribs: Sequence[Array], op: ReduceOp) -> list[Array]:
    """Every member gets the left-to-right ``op`` fold of the contributions."""
    total = reduce_arrays(contribs, op)
    return [total.copy() for _ in contribs]


def _take(a: Array, dim: int, start: int, length: int) -> Array:
    index = [slice(None)] * a.ndim
    index[dim] = slice(start, start + length)
    return a[tuple(index)]


def reduce_scatter(
    contribs: Sequence[Array], op: ReduceOp, dim: int, pieces: Sequence[tuple[int, int]]
) -> list[Array]:
    """Member ``j`` gets piece ``pieces[j] = (start, length)`` along ``dim`` of the fold."""
    if len(pieces) != len(contribs):
        raise PlanError(f"reduce_scatter: {len(contribs)} members but {len(pieces)} pieces")
    total = reduce_arrays(contribs, op)
    return [_take(total, dim, s, n).copy() for s, n in pieces]


def all_to_all(
    blocks: Sequence[Array], src_dim: int, dst_dim: int, pieces: Sequence[tuple[int, int]]
) -> list[Array]:
    """Member ``c`` gets, concatenated along ``src_dim`` in member order, piece ``pieces[c]``
    (``(start, length)`` along ``dst_dim``) of every member's block."""
    if len(pieces) != len(blocks):
        raise PlanError(f"all_to_all: {len(blocks)} members but {len(pieces)} pieces")
    return [
        np.concatenate([_take(b, dst_dim, s, n) for b in blocks], axis=src_dim) for s, n in pieces
    ]


def exchange(inputs: Sequence[Array], specs: Sequence[ExchangeSpec]) -> list[Array]:
    """Run one group's exchange: ``inputs[j]`` and ``specs[j]`` belong to member ``j``."""
    ranks = [s.group[s.position] for s in specs]
    where = {r: j for j, r in enumerate(ranks)}
    outs = []
    for spec in specs:
        me = spec.group[spec.position]
        out = np.empty(spec.out_shape, dtype=inputs[0].dtype)
        filled = 0
        for recv in spec.recvs:
            j = where[recv.peer]
            send = [t for t in specs[j].sends if t.peer == me]
            if len(send) != 1:
                raise PlanError(f"exchange: rank {recv.peer} has no transfer for rank {me}")
            part = inputs[j][send[0].region]
            out[recv.region] = part
            filled += part.size
        if filled != out.size:
            raise PlanError(f"exchange: rank {me} received {filled} of {out.size} elements")
        outs.append(out)
    return outs


def slice_block(a: Array, spec: SliceSpec, full: Callable[..., Array] = np.full) -> Array:
    """One rank's SLICE: a C-ordered copy of ``a[spec.region]``."""
    return a[spec.region].copy(order="C")


def relabel(a: Array, spec: RelabelSpec, full: Callable[..., Array] = np.full) -> Array:
    """One rank's RELABEL: ``a`` itself (nothing moves)."""
    return a


def make_partial(a: Array, spec: MakePartialSpec, full: Callable[..., Array] = np.full) -> Array:
    """One rank's MAKE_PARTIAL: ``a`` placed at ``spec.region`` of an identity-filled array
    (``a`` itself when it fills the output; all identity unless ``spec.keep``). ``full``:
    the array module's ``full`` (``numpy.full``; a GPU backend passes its own)."""
    if spec.keep and tuple(a.shape) == tuple(spec.out_shape):
        return a
    out = full(spec.out_shape, reduction_identity(spec.op, np.dtype(a.dtype)), dtype=a.dtype)
    if spec.keep:
        out[spec.region] = a
    return out


# --- reference semantics per step kind, named by STEP_KINDS[kind].reference -----------------
# Each takes one group's members in group order (a single rank for local kinds) and returns
# each member's output.


def reference_local(
    step: RedistStep,
    mesh: MeshShape,
    group: tuple[int, ...],
    members: list[Array],
    specs: list[Any],
) -> list[Array]:
    """A local kind: every rank runs the kind's own function (``STEP_KINDS[kind].method``)."""
    run = _LOCAL[step.kind]
    return [run(a, spec, np.full) for a, spec in zip(members, specs, strict=True)]


def reference_allgather(
    step: RedistStep,
    mesh: MeshShape,
    group: tuple[int, ...],
    members: list[Array],
    specs: list[Any],
) -> list[Array]:
    return allgather(members, _require_dim(step))


def reference_allreduce(
    step: RedistStep,
    mesh: MeshShape,
    group: tuple[int, ...],
    members: list[Array],
    specs: list[Any],
) -> list[Array]:
    if step.op is None:
        raise PlanError(f"cannot run step {step}")
    return allreduce(members, step.op)


def reference_reduce_scatter(
    step: RedistStep,
    mesh: MeshShape,
    group: tuple[int, ...],
    members: list[Array],
    specs: list[Any],
) -> list[Array]:
    first = specs[0]
    if not isinstance(first, ReduceScatterSpec):
        raise PlanError(f"cannot run step {step}")
    return reduce_scatter(members, first.op, first.dim, first.pieces)


def reference_all_to_all(
    step: RedistStep,
    mesh: MeshShape,
    group: tuple[int, ...],
    members: list[Array],
    specs: list[Any],
) -> list[Array]:
    if step.dim is None or step.dst_dim is None:
        raise PlanError(f"cannot run step {step}")
    j = step.dst_dim
    origin = block_bounds(step.in_type, mesh, group[0])[j][0]
    pieces = [
        (
            block_bounds(step.out_type, mesh, r)[j][0] - origin,
            block_bounds(step.out_type, mesh, r)[j][1],
        )
        for r in group
    ]
    return all_to_all(members, step.dim, j, pieces)


def reference_exchange(
    step: RedistStep,
    mesh: MeshShape,
    group: tuple[int, ...],
    members: list[Array],
    specs: list[Any],
) -> list[Array]:
    return exchange(members, specs)


def _require_dim(step: RedistStep) -> int:
    if step.dim is None:
        raise PlanError(f"cannot run step {step}")
    return step.dim


def _check_shape(a: Array, t: TensorType, mesh: MeshShape, rank: int, what: str) -> None:
    want = local_shape(t.shape, t.layout, mesh, rank)
    if a.shape != want:
        raise PlanError(f"rank {rank}: {what} of {t} must have local shape {want}; got {a.shape}")


def apply_step(step: RedistStep, mesh: MeshShape, arrays: Sequence[Array]) -> list[Array]:
    """Run ``step`` on every rank's local array (``arrays[r]`` for rank ``r``) with the
    reference semantics of its kind (``STEP_KINDS[step.kind].reference``)."""
    reference = _REFERENCE[step.kind]
    if step.kind.is_collective:
        groups: Sequence[tuple[int, ...]] = mesh.groups(step.axes)
    else:
        groups = [(r,) for r in range(mesh.size)]
    out: list[Array | None] = [None] * mesh.size
    for group in groups:
        members = [arrays[r] for r in group]
        specs = [rank_spec(step, mesh, r) for r in group]
        results = reference(step, mesh, group, members, specs)
        for r, res in zip(group, results, strict=True):
            out[r] = res
    done: list[Array] = []
    for r, got in enumerate(out):
        if got is None:  # pragma: no cover - groups partition the ranks
            raise PlanError(f"rank {r} got no output from step {step}")
        _check_shape(got, step.out_type, mesh, r, "output")
        done.append(got)
    return done


def apply_plan(plan: RedistPlan, mesh: MeshShape, arrays: Sequence[Array]) -> list[Array]:
    """Run every step of ``plan`` over all ranks' local arrays at once; ``arrays[r]`` is rank
    ``r``'s local array of ``plan.src``. Returns each rank's local array of ``plan.dst``."""
    if mesh != plan.mesh:
        raise PlanError(f"plan was made for mesh {plan.mesh}, not {mesh}")
    if len(arrays) != mesh.size:
        raise PlanError(f"mesh {mesh} has {mesh.size} ranks; got {len(arrays)} local arrays")
    current = list(arrays)
    for r, a in enumerate(current):
        _check_shape(a, plan.src, mesh, r, "input")
    for step in plan.steps:
        current = apply_step(step, mesh, current)
    return current


_Reference = Callable[[RedistStep, MeshShape, tuple[int, ...], list[Array], list[Any]], list[Array]]
_REFERENCE: dict[StepKind, _Reference] = {
    kind: globals()[rule.reference] for kind, rule in STEP_KINDS.items()
}
"""Each kind's reference semantics, resolved once from :data:`STEP_KINDS`."""
_LOCAL: dict[StepKind, Callable[..., Array]] = {
    kind: globals()[rule.method] for kind, rule in STEP_KINDS.items() if not kind.is_collective
}
"""Each local kind's per-rank function, resolved once from :data:`STEP_KINDS`."""
