"""Redistribution steps, what one rank needs to execute each, and what each costs that rank.

A :class:`RedistStep` turns a value of type ``in_type`` into the same global value of type
``out_type`` (docs/spec/ir.md §7.1: collectives and redistribute are the identity on global
values). :func:`rank_spec` gives, for one rank, everything it needs to run the step without
exchanging sizes at run time (group members in order, per-member extents and counts, per-peer
sub-blocks); :func:`step_traffic` gives the bytes that rank sends, receives and stages.

Kinds (:class:`StepKind`):

* ``SLICE`` — local: every rank's output block lies inside its input block; take the sub-block.
* ``RELABEL`` — local: every rank's block and the pending reduction's meaning are unchanged
  (a collective over a group of size 1, or a new order of the pending axes); nothing moves.
* ``MAKE_PARTIAL`` — local: a value not pending over ``axes`` becomes pending ``op`` over them.
  An axis that splits the input (the innermost axes of a dim entry, where the splits nest) is
  dropped from the split: each rank places its block in an array of its new, larger block
  filled with the identity of ``op``. For an axis the value is replicated over, the rank at
  index 0 along those axes keeps its array and the others hold the identity.
* ``ALLGATHER`` — ``allgather %x on axes`` (dim ``dim``): concatenate the members' blocks.
* ``ALLREDUCE`` — ``allreduce op %x on axes``.
* ``REDUCE_SCATTER`` — ``reduce_scatter op %x on axes dim dim``.
* ``ALL_TO_ALL`` — ``all_to_all %x on axes from dim to dst_dim``.
* ``EXCHANGE`` — an alltoallv over the group along ``axes`` moving, from each rank to each
  peer, exactly the intersection of the sender's input block and the receiver's output block.
  A receiver takes each element from the unique group member that holds it and agrees with the
  receiver on every group axis that does not split the input (so replicated sources share the
  load and data a rank already holds is copied locally, never sent).

The structured collectives are only planned where they are exact under the §5 convention
(:func:`~dtm_mpi.sharding.blocks.splits_nest`); their specs assume it.

**One table per step kind.** :data:`STEP_KINDS` holds, for every kind, one :class:`StepRule`:
its spec builder (what :func:`rank_spec` calls), its traffic formula (:func:`step_traffic`),
its reference semantics (named in :mod:`dtm_mpi.sharding.collectives`, which ``apply_step``
runs) and its implementation: the communicator method of the ``Comm`` protocol for a
collective (the executor's ``STEP_RUNNERS`` call it), the per-rank function of
:mod:`~dtm_mpi.sharding.collectives` for a local kind. A new kind is one new entry.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from dtm_mpi.errors import PlanError
from dtm_mpi.ir.dtypes import held_itemsize
from dtm_mpi.ir.types import ReduceOp, TensorType
from dtm_mpi.sharding.blocks import dim_bounds
from dtm_mpi.sharding.mesh import MeshShape

__all__ = [
    "AllgatherSpec",
    "AllreduceSpec",
    "ExchangeSpec",
    "MakePartialSpec",
    "RedistStep",
    "ReduceScatterSpec",
    "RelabelSpec",
    "STEP_KINDS",
    "SliceSpec",
    "StepKind",
    "StepRule",
    "StepSpec",
    "StepTraffic",
    "Transfer",
    "allgather_traffic",
    "allreduce_moved_items",
    "allreduce_spec",
    "block_bounds",
    "exchange_traffic",
    "rank_spec",
    "reduce_scatter_traffic",
    "step_traffic",
    "step_volume",
]


class StepKind(enum.Enum):
    SLICE = "slice"
    RELABEL = "relabel"
    MAKE_PARTIAL = "make_partial"
    ALLGATHER = "allgather"
    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    EXCHANGE = "exchange"

    @property
    def is_collective(self) -> bool:
        """Whether every rank of a group takes part in a communication."""
        return self not in _LOCAL

    def __str__(self) -> str:
        return self.value


_LOCAL = frozenset({StepKind.SLICE, StepKind.RELABEL, StepKind.MAKE_PARTIAL})


@dataclass(frozen=True, slots=True)
class RedistStep:
    """One step of a plan. ``axes``: the group's axes (collectives, EXCHANGE in mesh order) or
    the newly pending axes (MAKE_PARTIAL); ``dim``: the gathered / scattered / source dim;
    ``dst_dim``: the target dim of ALL_TO_ALL; ``op``: the reduction (ALLREDUCE,
    REDUCE_SCATTER, MAKE_PARTIAL)."""

    kind: StepKind
    in_type: TensorType
    out_type: TensorType
    axes: tuple[str, ...] = ()
    dim: int | None = None
    dst_dim: int | None = None
    op: ReduceOp | None = None

    def __str__(self) -> str:
        parts = [self.kind.value]
        if self.op is not None:
            parts.append(self.op.value)
        if self.axes:
            parts.append("on " + ",".join(self.axes))
        if self.kind is StepKind.ALL_TO_ALL:
            parts.append(f"from {self.dim} to {self.dst_dim}")
        elif self.dim is not None:
            parts.append(f"dim {self.dim}")
        return f"{' '.join(parts)}: {self.in_type} -> {self.out_type}"


# --- per-rank specs --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """Output = ``input[region]`` (a copy)."""

    region: tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class RelabelSpec:
    """Output = input, unchanged."""


@dataclass(frozen=True, slots=True)
class MakePartialSpec:
    """Output: an array of ``out_shape`` filled with the identity of ``op`` (§7.1) holding, when
    ``keep``, the input at ``region``. When ``keep`` and ``region`` covers ``out_shape`` the
    output is the input itself."""

    keep: bool
    op: ReduceOp
    region: tuple[slice, ...]
    out_shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllgatherSpec:
    """Output = the members' arrays concatenated along ``dim`` in group order. ``extents``:
    each member's extent along ``dim``; ``counts``: each member's element count."""

    group: tuple[int, ...]
    position: int
    dim: int
    extents: tuple[int, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllreduceSpec:
    """Output = the ``op`` reduction of the members' arrays (all of ``count`` elements)."""

    group: tuple[int, ...]
    position: int
    op: ReduceOp
    count: int


@dataclass(frozen=True, slots=True)
class ReduceScatterSpec:
    """Member ``j`` gets the ``op`` reduction over the group of ``input[…, start:start+length,
    …]`` (along ``dim``) with ``(start, length) = pieces[j]``; ``counts[j]`` its elements."""

    group: tuple[int, ...]
    position: int
    op: ReduceOp
    dim: int
    pieces: tuple[tuple[int, int], ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """A sub-block exchanged with ``peer`` (possibly this rank itself: a local copy)."""

    peer: int
    region: tuple[slice, ...]
    count: int


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    """ALL_TO_ALL / EXCHANGE on one rank: ``sends`` are regions of the local input, one per peer
    that needs data from this rank; ``recvs`` are regions of the output (shape ``out_shape``),
    one per peer that supplies data. Peers are in group order; empty transfers are left out; the
    ``recvs`` regions tile the output exactly. ``max_count`` bounds every transfer of the
    whole group (the largest input block of a member), the same on every member: an executor
    that splits messages into rounds derives the number of rounds from it."""

    group: tuple[int, ...]
    position: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    out_shape: tuple[int, ...]
    max_count: int = 0
    uniform: int = 0


StepSpec = (
    SliceSpec
    | RelabelSpec
    | MakePartialSpec
    | AllgatherSpec
    | AllreduceSpec
    | ReduceScatterSpec
    | ExchangeSpec
)

Bounds = tuple[tuple[int, int], ...]


def block_bounds(t: TensorType, mesh: MeshShape, rank: int) -> Bounds:
    """``(start, length)`` per dim of ``rank``'s block of ``t`` (no layout checks)."""
    return tuple(
        dim_bounds(n, axes, mesh, rank) for n, axes in zip(t.shape, t.layout.dims, strict=True)
    )


def _numel(extents: tuple[int, ...] | list[int]) -> int:
    n = 1
    for e in extents:
        n *= e
    return n


def _intersect(a: Bounds, b: Bounds) -> Bounds | None:
    out = []
    for (s1, n1), (s2, n2) in zip(a, b, strict=True):
        lo, hi = max(s1, s2), min(s1 + n1, s2 + n2)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def _region(box: Bounds, origin: Bounds) -> tuple[slice, ...]:
    return tuple(slice(s - o, s - o + n) for (s, n), (o, _) in zip(box, origin, strict=True))


def _transfers(
    step: RedistStep, mesh: MeshShape, rank: int
) -> tuple[tuple[int, ...], list[Transfer], list[Transfer], Bounds, Bounds]:
    group = mesh.group_of(rank, step.axes)
    split_in = set(step.in_type.layout.sharded_axes)
    selectors = tuple(mesh.axis_position(a) for a in step.axes if a not in split_in)

    def agree(p: int, q: int) -> bool:
        cp, cq = mesh.coords(p), mesh.coords(q)
        return all(cp[i] == cq[i] for i in selectors)

    src = block_bounds(step.in_type, mesh, rank)
    dst = block_bounds(step.out_type, mesh, rank)
    sends, recvs = [], []
    for peer in group:
        if not agree(rank, peer):
            continue
        box = _intersect(src, block_bounds(step.out_type, mesh, peer))
        if box is not None:
            sends.append(Transfer(peer, _region(box, src), _numel([n for _, n in box])))
        box = _intersect(block_bounds(step.in_type, mesh, peer), dst)
        if box is not None:
            recvs.append(Transfer(peer, _region(box, dst), _numel([n for _, n in box])))
    return group, sends, recvs, src, dst


def region_run(shape: tuple[int, ...], region: tuple[slice, ...]) -> tuple[int, int] | None:
    """The flat ``(start, end)`` of ``region`` in a C-ordered array of ``shape`` when the region
    is one contiguous run (single indices, then one partial dim, then full dims), else None."""
    start, size, stride = 0, 1, 1
    partial_seen = False
    for n, sl in zip(reversed(shape), reversed(region), strict=True):
        lo, hi, _ = sl.indices(n)
        length = max(0, hi - lo)
        if partial_seen and length != 1:
            return None
        if length != n:
            partial_seen = True
        start += lo * stride
        size *= length
        stride *= n
    return start, start + size


def back_to_back(
    shape: tuple[int, ...], regions: list[tuple[slice, ...]]
) -> tuple[int, int] | None:
    """If the non-empty ``regions`` are contiguous runs, each starting where the previous one
    ends, the flat ``(start, end)`` they cover together; else None."""
    start = end = None
    for region in regions:
        run = region_run(shape, region)
        if run is None:
            return None
        if run[0] == run[1]:
            continue
        if end is not None and run[0] != end:
            return None
        start = run[0] if start is None else start
        end = run[1]
    return (start, end) if start is not None and end is not None else (0, 0)


def _uniform_run(step: RedistStep, mesh: MeshShape, rank: int) -> int:
    """The per-pair count ``c`` when this member sends ``c`` elements to every member and
    receives ``c`` from every member, all as back-to-back runs in member order covering its
    whole input and output (a plain alltoall moves it in place); else 0."""
    group, sends, recvs, src, dst = _transfers(step, mesh, rank)
    k = len(group)
    if len(sends) != k or len(recvs) != k:
        return 0
    counts = {t.count for t in sends} | {t.count for t in recvs}
    if len(counts) != 1:
        return 0
    src_shape = tuple(n for _, n in src)
    dst_shape = tuple(n for _, n in dst)
    if back_to_back(src_shape, [t.region for t in sends]) != (0, _numel(list(src_shape))):
        return 0
    if back_to_back(dst_shape, [t.region for t in recvs]) != (0, _numel(list(dst_shape))):
        return 0
    return counts.pop()


def _exchange(step: RedistStep, mesh: MeshShape, rank: int) -> ExchangeSpec:
    group, sends, recvs, _, dst = _transfers(step, mesh, rank)
    biggest = max(_numel([n for _, n in block_bounds(step.in_type, mesh, r)]) for r in group)
    # uniform only if every member of the group can take the same plain alltoall
    pairs = {_uniform_run(step, mesh, r) for r in group} if len(group) <= 64 else {0}
    uniform = pairs.pop() if len(pairs) == 1 else 0
    return ExchangeSpec(
        group,
        group.index(rank),
        tuple(sends),
        tuple(recvs),
        tuple(n for _, n in dst),
        biggest,
        uniform,
    )


def _require(value: int | None, what: str, step: RedistStep) -> int:
    if value is None:
        raise PlanError(f"{step.kind} step has no {what}: {step}")
    return value


def _op(step: RedistStep) -> ReduceOp:
    if step.op is None:
        raise PlanError(f"{step.kind} step has no reduction op: {step}")
    return step.op


def _spec_relabel(step: RedistStep, mesh: MeshShape, rank: int) -> RelabelSpec:
    return RelabelSpec()


def _spec_slice(step: RedistStep, mesh: MeshShape, rank: int) -> SliceSpec:
    src = block_bounds(step.in_type, mesh, rank)
    return SliceSpec(_region(block_bounds(step.out_type, mesh, rank), src))


def _spec_make_partial(step: RedistStep, mesh: MeshShape, rank: int) -> MakePartialSpec:
    split = set(step.in_type.layout.sharded_axes)
    replicated = tuple(a for a in step.axes if a not in split)
    src = block_bounds(step.in_type, mesh, rank)
    dst = block_bounds(step.out_type, mesh, rank)
    return MakePartialSpec(
        mesh.index_along(rank, replicated) == 0,
        _op(step),
        _region(src, dst),
        tuple(n for _, n in dst),
    )


def allreduce_spec(
    mesh: MeshShape, rank: int, axes: tuple[str, ...], op: ReduceOp, count: int
) -> AllreduceSpec:
    """Rank ``rank``'s part in an ``op`` allreduce of ``count`` elements over ``axes``."""
    group = mesh.group_of(rank, axes)
    return AllreduceSpec(group, group.index(rank), op, count)


def _spec_allreduce(step: RedistStep, mesh: MeshShape, rank: int) -> AllreduceSpec:
    count = _numel([n for _, n in block_bounds(step.in_type, mesh, rank)])
    return allreduce_spec(mesh, rank, step.axes, _op(step), count)


def _spec_allgather(step: RedistStep, mesh: MeshShape, rank: int) -> AllgatherSpec:
    group = mesh.group_of(rank, step.axes)
    dim = _require(step.dim, "dim", step)
    blocks = [[n for _, n in block_bounds(step.in_type, mesh, r)] for r in group]
    return AllgatherSpec(
        group,
        group.index(rank),
        dim,
        tuple(b[dim] for b in blocks),
        tuple(_numel(b) for b in blocks),
    )


def _spec_reduce_scatter(step: RedistStep, mesh: MeshShape, rank: int) -> ReduceScatterSpec:
    group = mesh.group_of(rank, step.axes)
    position = group.index(rank)
    dim = _require(step.dim, "dim", step)
    start, length = block_bounds(step.in_type, mesh, rank)[dim]
    pieces, counts = [], []
    for r in group:
        out = [n for _, n in block_bounds(step.out_type, mesh, r)]
        s = block_bounds(step.out_type, mesh, r)[dim][0] - start
        s = min(max(s, 0), length)
        pieces.append((s, out[dim]))
        counts.append(_numel(out))
    return ReduceScatterSpec(group, position, _op(step), dim, tuple(pieces), tuple(counts))


def rank_spec(step: RedistStep, mesh: MeshShape, rank: int) -> StepSpec:
    """What ``rank`` needs to execute ``step`` on ``mesh`` (a pure function of its arguments;
    the builder of the step kind's :data:`STEP_KINDS` entry)."""
    return STEP_KINDS[step.kind].build(step, mesh, rank)


# --- per-rank traffic ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepTraffic:
    """Bytes one rank sends to and receives from other ranks in one step, and the bytes of the
    staging buffers it needs beyond the step's input and output arrays (see
    :mod:`dtm_mpi.sharding.redistribute` for the exact rules)."""

    sent: int
    received: int
    staging: int


def _leading_contiguous(extents: list[int], dim: int) -> bool:
    """Whether blocks along ``dim`` are contiguous runs of a C-order array of ``extents``."""
    return _numel(extents[:dim]) <= 1


# The formulas, in bytes of one member, shared by the planner (below) and by every
# communicator's own accounting (dtm_mpi.comm.interface re-exports them).


def allgather_traffic(in_nbytes: int, out_nbytes: int, group_size: int) -> tuple[int, int]:
    """ALLGATHER (sent, received): its block to every other member; every other member's
    block."""
    return (group_size - 1) * in_nbytes, out_nbytes - in_nbytes


def reduce_scatter_traffic(in_nbytes: int, out_nbytes: int, group_size: int) -> tuple[int, int]:
    """REDUCE_SCATTER (sent, received): every piece but its own, to its owner; its piece from
    every other member."""
    return in_nbytes - out_nbytes, (group_size - 1) * out_nbytes


def allreduce_moved_items(count: int, group_size: int, position: int) -> int:
    """ALLREDUCE: the items one member sends (= receives), counted as a reduce-scatter of the
    flat array in §5 pieces, then an allgather of the reduced pieces."""
    k, m = group_size, count
    b = -(-m // k) if k else 0
    own = max(0, min(b, m - position * b))
    return (m - own) + (k - 1) * own


def exchange_traffic(spec: ExchangeSpec, rank: int, itemsize: int) -> tuple[int, int]:
    """ALL_TO_ALL, EXCHANGE (sent, received): the transfers to and from other ranks (a rank's
    copy to itself moves nothing)."""
    sent = sum(t.count for t in spec.sends if t.peer != rank)
    received = sum(t.count for t in spec.recvs if t.peer != rank)
    return sent * itemsize, received * itemsize


def _traffic_local(step: RedistStep, mesh: MeshShape, rank: int) -> StepTraffic:
    return StepTraffic(0, 0, 0)


def _extents(t: TensorType, mesh: MeshShape, rank: int) -> list[int]:
    return [n for _, n in block_bounds(t, mesh, rank)]


def _traffic_gather_scatter(step: RedistStep, mesh: MeshShape, rank: int) -> StepTraffic:
    """Allgather and reduce-scatter along one dim: the bytes by the kind's formula; the block
    of the full side (the allgather's output, the reduce-scatter's input) is staged through a
    packed buffer unless its pieces along ``dim`` are contiguous."""
    item = held_itemsize(step.in_type.dtype)
    in_ext, out_ext = _extents(step.in_type, mesh, rank), _extents(step.out_type, mesh, rank)
    k = mesh.group_size(step.axes)
    dim = _require(step.dim, "dim", step)
    gather = step.kind is StepKind.ALLGATHER
    full = out_ext if gather else in_ext
    staging = 0 if _leading_contiguous(full, dim) else _numel(full)
    formula = allgather_traffic if gather else reduce_scatter_traffic
    sent, received = formula(_numel(in_ext) * item, _numel(out_ext) * item, k)
    return StepTraffic(sent, received, staging * item)


def _traffic_allreduce(step: RedistStep, mesh: MeshShape, rank: int) -> StepTraffic:
    item = held_itemsize(step.in_type.dtype)
    k = mesh.group_size(step.axes)
    m = _numel(_extents(step.in_type, mesh, rank))
    moved = allreduce_moved_items(m, k, mesh.index_along(rank, step.axes))
    return StepTraffic(moved * item, moved * item, 0)


@functools.lru_cache(maxsize=64)
def _every_block(t: TensorType, mesh: MeshShape) -> tuple[Any, Any]:
    """``(starts, ends)`` ``[ranks, dims]`` of every rank's block of ``t`` (:func:`block_bounds`)."""
    bounds = np.array([block_bounds(t, mesh, r) for r in range(mesh.size)], dtype=np.int64)
    bounds = bounds.reshape(mesh.size, t.rank, 2)
    return bounds[:, :, 0], bounds[:, :, 0] + bounds[:, :, 1]


@functools.lru_cache(maxsize=16)
def _every_coord(mesh: MeshShape) -> Any:
    return np.array([mesh.coords(r) for r in range(mesh.size)], dtype=np.int64).reshape(
        mesh.size, len(mesh.axes)
    )


def _overlaps(lo: Any, hi: Any, los: Any, his: Any) -> Any:
    """The elements the box ``[lo, hi)`` shares with each box ``[los[i], his[i])``."""
    return np.prod(np.maximum(0, np.minimum(hi, his) - np.maximum(lo, los)), axis=1)


def _traffic_exchange(step: RedistStep, mesh: MeshShape, rank: int) -> StepTraffic:
    """The transfers of :func:`_transfers` (what :func:`exchange_traffic` counts of the rank's
    spec), counted for the whole group at once: the peers that agree with ``rank`` off the
    group's axes and on the group's axes its input is not split over."""
    coords = _every_coord(mesh)
    split_in = set(step.in_type.layout.sharded_axes)
    fixed = [i for i, (a, _) in enumerate(mesh.axes) if a not in step.axes or a not in split_in]
    peers = np.all(coords[:, fixed] == coords[rank, fixed], axis=1)
    peers[rank] = False  # a rank's copy to itself moves nothing
    in_lo, in_hi = _every_block(step.in_type, mesh)
    out_lo, out_hi = _every_block(step.out_type, mesh)
    item = held_itemsize(step.in_type.dtype)
    sent = int(_overlaps(in_lo[rank], in_hi[rank], out_lo[peers], out_hi[peers]).sum()) * item
    received = int(_overlaps(out_lo[rank], out_hi[rank], in_lo[peers], in_hi[peers]).sum()) * item
    return StepTraffic(sent, received, sent + received)


def step_traffic(step: RedistStep, mesh: MeshShape, rank: int) -> StepTraffic:
    """The bytes ``rank`` sends, receives and stages in ``step`` (the traffic formula of the
    step kind's :data:`STEP_KINDS` entry)."""
    return STEP_KINDS[step.kind].traffic(step, mesh, rank)


def step_volume(step: RedistStep, mesh: MeshShape) -> int:
    """The bytes all ranks together receive in ``step`` (= together send), computed without
    enumerating peers: a rank receives what its output holds beyond what it keeps."""
    if step.kind not in (StepKind.ALL_TO_ALL, StepKind.EXCHANGE):
        return sum(step_traffic(step, mesh, r).received for r in range(mesh.size))
    total = 0
    for r in range(mesh.size):
        src, dst = block_bounds(step.in_type, mesh, r), block_bounds(step.out_type, mesh, r)
        own = _intersect(src, dst)
        total += _numel([n for _, n in dst]) - (_numel([n for _, n in own]) if own else 0)
    return total * held_itemsize(step.in_type.dtype)


# --- the step-kind table ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepRule:
    """Everything about one :class:`StepKind`, in one place (:data:`STEP_KINDS`).

    * ``spec``: the class of its per-rank specs; ``build``: the builder (:func:`rank_spec`);
    * ``traffic``: its accounting (:func:`step_traffic`; the rules of
      :mod:`dtm_mpi.sharding.redistribute`);
    * ``reference``: its reference semantics, the name of a function of
      :mod:`dtm_mpi.sharding.collectives` taking ``(step, mesh, group, members, specs)`` (the
      arrays and specs of one group's members in group order; a single rank for local kinds)
      and returning each member's output (``apply_step`` calls it);
    * ``method``, ``args``: its implementation. For a collective kind, the method of every
      communicator (the ``Comm`` protocol of ``dtm_mpi.comm.interface``: the simulator,
      ``MpiComm``, ``DeviceComm``) the executor calls as ``method(x, axes, spec, *args)``; for
      a local kind, the function of :mod:`dtm_mpi.sharding.collectives` every rank runs alone
      as ``method(x, spec, full)`` (``full``: the array module's ``full``)."""

    kind: StepKind
    spec: type[StepSpec]
    build: Callable[[RedistStep, MeshShape, int], StepSpec]
    traffic: Callable[[RedistStep, MeshShape, int], StepTraffic]
    reference: str
    method: str
    args: tuple[str, ...] = ()


STEP_KINDS: Mapping[StepKind, StepRule] = MappingProxyType(
    {
        r.kind: r
        for r in (
            StepRule(
                StepKind.SLICE,
                SliceSpec,
                _spec_slice,
                _traffic_local,
                "reference_local",
                "slice_block",
            ),
            StepRule(
                StepKind.RELABEL,
                RelabelSpec,
                _spec_relabel,
                _traffic_local,
                "reference_local",
                "relabel",
            ),
            StepRule(
                StepKind.MAKE_PARTIAL,
                MakePartialSpec,
                _spec_make_partial,
                _traffic_local,
                "reference_local",
                "make_partial",
            ),
            StepRule(
                StepKind.ALLGATHER,
                AllgatherSpec,
                _spec_allgather,
                _traffic_gather_scatter,
                "reference_allgather",
                "allgather",
            ),
            StepRule(
                StepKind.ALLREDUCE,
                AllreduceSpec,
                _spec_allreduce,
                _traffic_allreduce,
                "reference_allreduce",
                "allreduce",
            ),
            StepRule(
                StepKind.REDUCE_SCATTER,
                ReduceScatterSpec,
                _spec_reduce_scatter,
                _traffic_gather_scatter,
                "reference_reduce_scatter",
                "reduce_scatter",
            ),
            StepRule(
                StepKind.ALL_TO_ALL,
                ExchangeSpec,
                _exchange,
                _traffic_exchange,
                "reference_all_to_all",
                "exchange",
                ("all_to_all",),
            ),
            StepRule(
                StepKind.EXCHANGE,
                ExchangeSpec,
                _exchange,
                _traffic_exchange,
                "reference_exchange",
                "exchange",
                ("exchange",),
            ),
        )
    }
)
"""The step-kind table: one :class:`StepRule` per :class:`StepKind`."""
