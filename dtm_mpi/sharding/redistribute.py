"""The redistribution planner: a chain of steps from one layout of a value to another.

:func:`plan_redistribute` (pure, cached) returns a :class:`RedistPlan` whose steps
(:class:`~dtm_mpi.sharding.steps.RedistStep`) form a chain ``src -> … -> dst``; every step keeps
the global value (docs/spec/ir.md §7.1) and is exact under the uneven-split convention (§5).
The allowed conversions are those of the IR's ``redistribute`` (§8.13.1): dims may change
freely; a pending reduction may be completed, kept, or moved to other axes with the same op; a
value that is not pending may become a pending ``sum``.

**How a plan is built** (``R``: pending axes to complete, ``N``: axes to become pending).
Up to four strategies are planned and the one moving the fewest bytes in total wins (then the
fewest collectives, then the fewest steps; ties keep the earlier strategy):

* *Embed first* (optional): MAKE_PARTIAL over the axes of ``N`` that are innermost axes of a
  dim entry (where the splits nest) — local, and they need no gathering later.
* *Dims first* (optional, when ``R`` is not empty): change the dims (as in 2. below) to the
  target entries cut before their first axis of ``R``, so that 1. can reduce-scatter into them.

1. *Shrink and reduce.* Repeatedly: SLICE every dim whose current entry is a prefix of its
   target entry by the next target axes that the value does not use yet (local, free); then
   REDUCE_SCATTER over the next target axes of a dim that are pending axes in ``R``. Each is
   taken only where the finer split nests in the current one (:func:`splits_nest` with the
   bound sizes); the axes of ``R`` left over are completed by one ALLREDUCE.
2. *Dims.* A structured path is tried: free SLICEs, then ALL_TO_ALL (innermost axes of a dim
   that another dim wants next), then ALLGATHER (innermost axes no target dim wants). It is
   used only if it reaches the target dims, every step nests, and no SLICE follows a
   communicating step (that would discard received data). Otherwise one step goes straight to
   the target dims: SLICE when every rank's new block lies inside its old one, else EXCHANGE
   over the axes of the dims that change (moves exactly the intersections of old and new
   blocks; correct whether or not the splits nest, e.g. ``{(B,A)} -> {B}`` with ``n=10``).
3. *Pending.* MAKE_PARTIAL over the rest of ``N``. A step that leaves every rank's block as
   it is (a collective over a group of size 1, a new order of the pending axes) is a RELABEL,
   folded into the step before it when that one is not an IR collective.

The types of ALLGATHER, ALLREDUCE, REDUCE_SCATTER and ALL_TO_ALL steps are exactly what the IR
ops ``allgather``, ``allreduce``, ``reduce_scatter`` and ``all_to_all`` infer.

**Accounting** (per rank, in bytes of the dtype; pure functions of plan and rank). *Sent* and
*received* count the logical volume of array data a rank hands to or takes from **other** ranks
if every transfer went directly from the rank holding the data to the rank needing it,
independent of the MPI algorithm; data a rank keeps or copies locally is not counted, so local
steps move 0 bytes and, summed over all ranks, sent == received. With ``k`` the group size,
``in``/``out`` the rank's local input/output element counts:

* ALLGATHER: sent ``(k-1)·in``; received ``out - in`` (the other members' blocks).
* REDUCE_SCATTER: sent ``in - out`` (every piece but its own, to its owner); received
  ``(k-1)·out`` (its piece from every other member).
* ALLREDUCE: counted as a reduce-scatter of the flattened local array (``m = in`` elements) in
  §5 pieces followed by an allgather of the reduced pieces: with ``p`` the rank's piece, sent =
  received = ``(m - p) + (k-1)·p`` (about ``2(k-1)/k·m``).
* ALL_TO_ALL, EXCHANGE: the sizes of the transfers to (from) the other ranks of the group.

*Peak extra* is the most memory the plan needs at once beyond its input and output arrays:
over the steps, the intermediate arrays alive during the step (its input unless that is the
plan's input, its output unless that is the plan's output; RELABEL reuses its input) plus the
step's staging buffers: ALLGATHER stages ``out`` unless the gathered dim is the first dim with
a local extent above 1 (blocks land in place); REDUCE_SCATTER stages ``in`` (packed in member
order) under the same condition; ALL_TO_ALL and EXCHANGE stage what they send and receive;
ALLREDUCE and the local steps stage nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from dtm_mpi.errors import LayoutError, PlanError
from dtm_mpi.ir.dtypes import held_itemsize
from dtm_mpi.ir.types import Layout, Partial, ReduceOp, TensorType
from dtm_mpi.sharding.blocks import check_layout, splits_nest
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import (
    RedistStep,
    StepKind,
    StepSpec,
    block_bounds,
    rank_spec,
    step_traffic,
    step_volume,
)

__all__ = ["RedistPlan", "plan_redistribute"]

Dims = tuple[tuple[str, ...], ...]
_FOLDABLE = frozenset({StepKind.RELABEL, StepKind.SLICE, StepKind.MAKE_PARTIAL, StepKind.EXCHANGE})


@dataclass(frozen=True, slots=True)
class RedistPlan:
    """Steps taking a value of type ``src`` to type ``dst`` on ``mesh`` (a chain: the first
    step's input is ``src``, each step's output is the next one's input, the last output is
    ``dst``; no steps when ``src == dst``)."""

    src: TensorType
    dst: TensorType
    mesh: MeshShape
    steps: tuple[RedistStep, ...]

    def rank_specs(self, rank: int) -> tuple[StepSpec, ...]:
        """What ``rank`` needs to execute each step."""
        return tuple(rank_spec(s, self.mesh, rank) for s in self.steps)

    def bytes_sent(self, rank: int) -> int:
        return sum(step_traffic(s, self.mesh, rank).sent for s in self.steps)

    def bytes_received(self, rank: int) -> int:
        return sum(step_traffic(s, self.mesh, rank).received for s in self.steps)

    def rank_figures(self, rank: int) -> tuple[int, int, int]:
        """(:meth:`bytes_sent`, :meth:`bytes_received`, :meth:`peak_extra_bytes`) of
        ``rank``, each step's traffic computed once."""
        traffic = [step_traffic(s, self.mesh, rank) for s in self.steps]
        sent = sum(t.sent for t in traffic)
        return (
            sent,
            sum(t.received for t in traffic),
            self._peak(rank, [t.staging for t in traffic]),
        )

    def peak_extra_bytes(self, rank: int) -> int:
        """The most bytes of intermediate arrays and staging buffers alive at once (module
        doc); MAKE_PARTIAL is counted as making a new array."""
        return self._peak(rank, [step_traffic(s, self.mesh, rank).staging for s in self.steps])

    def _peak(self, rank: int, staging: list[int]) -> int:
        buffers = [0]
        for i, s in enumerate(self.steps):
            buffers.append(buffers[-1] if s.kind is StepKind.RELABEL else i + 1)
        final, peak = buffers[-1], 0
        for i, s in enumerate(self.steps):
            src_buf, dst_buf = buffers[i], buffers[i + 1]
            alive = staging[i]
            if src_buf not in (0, final):
                alive += _local_bytes(s.in_type, self.mesh, rank)
            if dst_buf not in (src_buf, 0, final):
                alive += _local_bytes(s.out_type, self.mesh, rank)
            peak = max(peak, alive)
        return peak

    def collective_counts(self, rank: int) -> dict[StepKind, int]:
        """How many collectives of each kind ``rank`` takes part in (every rank is in one group
        of every collective step, so this is the same on every rank)."""
        self.mesh.coords(rank)  # range check
        out: dict[StepKind, int] = {}
        for s in self.steps:
            if s.kind.is_collective:
                out[s.kind] = out.get(s.kind, 0) + 1
        return out

    def __str__(self) -> str:
        head = f"redistribute {self.src} -> {self.dst} on {self.mesh}"
        return "\n".join([head, *(f"  {s}" for s in self.steps)])


def _local_bytes(t: TensorType, mesh: MeshShape, rank: int) -> int:
    n = held_itemsize(t.dtype)
    for _, length in block_bounds(t, mesh, rank):
        n *= length
    return n


# --- the planner -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def plan_redistribute(src: TensorType, dst: Layout, mesh: MeshShape) -> RedistPlan:
    """Plan turning a value of type ``src`` into layout ``dst`` on ``mesh`` (see module doc).

    Raises :class:`LayoutError` if a layout does not fit the shape or the mesh, and
    :class:`PlanError` for a conversion the IR's ``redistribute`` forbids.
    """
    for what, layout in (("source", src.layout), ("target", dst)):
        try:
            check_layout(src.shape, layout, mesh)
        except LayoutError as err:
            raise LayoutError(f"cannot redistribute {src} to {dst}: {what}: {err}") from None
    target = src.with_layout(dst)
    sp, tp = src.layout.partial, dst.partial
    if sp is not None and tp is not None and sp.op is not tp.op:
        raise PlanError(
            f"cannot redistribute {src} to {target}: a pending reduction keeps its op; "
            f"got {sp.op} and {tp.op}"
        )
    if sp is None and tp is not None and tp.op is not ReduceOp.SUM:
        raise PlanError(
            f"cannot redistribute {src} to {target}: a value that is not pending can only "
            f"become partial(sum: ...); got {tp}"
        )
    best: tuple[tuple[int, int, int], tuple[RedistStep, ...]] | None = None
    for embed in (False, True):
        for dims_first in (False, True):
            steps = _Planner(src, target, mesh).plan(dims_first=dims_first, embed=embed)
            if steps is not None:
                cost = _cost(steps, mesh)
                if best is None or cost < best[0]:
                    best = cost, steps
    if best is None:  # pragma: no cover - the first strategy always applies
        raise PlanError(f"internal: no plan for {src} -> {target}")
    return RedistPlan(src, target, mesh, best[1])


def _cost(steps: tuple[RedistStep, ...], mesh: MeshShape) -> tuple[int, int, int]:
    """Total bytes moved, then collectives, then steps: smaller is better."""
    volume = sum(step_volume(s, mesh) for s in steps)
    return volume, sum(s.kind.is_collective for s in steps), len(steps)


def _prefix_len(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return b[: len(a)] == a


class _Planner:
    def __init__(self, src: TensorType, dst: TensorType, mesh: MeshShape) -> None:
        self.src, self.dst, self.mesh = src, dst, mesh
        self.cur = src
        self.steps: list[RedistStep] = []

    # -- helpers ----------------------------------------------------------------------------

    def k(self, axes: Iterable[str]) -> int:
        return self.mesh.group_size(tuple(axes))

    def nests(self, n: int, outer: Iterable[str], inner: Iterable[str]) -> bool:
        return splits_nest(n, self.k(outer), self.k(inner))

    def emit(self, step: RedistStep) -> None:
        """Append ``step``; a step that leaves every block as it is becomes a RELABEL, which
        is folded into a preceding step that is not an IR op (its output type is ours to
        choose); consecutive MAKE_PARTIAL steps merge."""
        if step.kind is not StepKind.RELABEL and self._same_blocks(step):
            step = RedistStep(StepKind.RELABEL, step.in_type, step.out_type)
        prev = self.steps[-1] if self.steps else None
        if prev is not None and step.kind is StepKind.RELABEL and prev.kind in _FOLDABLE:
            self.steps[-1] = replace(prev, out_type=step.out_type)
        elif prev is not None and step.kind is prev.kind is StepKind.MAKE_PARTIAL:
            self.steps[-1] = replace(prev, out_type=step.out_type, axes=prev.axes + step.axes)
        else:
            self.steps.append(step)
        self.cur = step.out_type

    def _same_blocks(self, step: RedistStep) -> bool:
        """A step whose group has one rank leaves every local array as it is."""
        if step.kind is StepKind.SLICE:
            return all(
                block_bounds(step.in_type, self.mesh, r)
                == block_bounds(step.out_type, self.mesh, r)
                for r in range(self.mesh.size)
            )
        return self.k(step.axes) == 1

    def with_dims(self, t: TensorType, dims: Dims) -> TensorType:
        return t.with_layout(t.layout.with_dims(dims))

    def free_slice(self, t: TensorType, target: Dims) -> Dims | None:
        """Extend each dim whose entry is a prefix of its target by the next target axes that
        ``t`` does not use, as far as the splits nest; None if no dim changes."""
        used = set(t.layout.used_axes)
        dims, changed = list(t.layout.dims), False
        for d, (ec, et) in enumerate(zip(t.layout.dims, target, strict=True)):
            if not _is_prefix(ec, et):
                continue
            run: list[str] = []
            for a in et[len(ec) :]:
                if a in used:
                    break
                run.append(a)
            for m in range(len(run), 0, -1):
                if self.nests(t.shape[d], ec, run[:m]):
                    dims[d], changed = ec + tuple(run[:m]), True
                    break
        return tuple(dims) if changed else None

    # -- phase 1: shrink and reduce ----------------------------------------------------------

    def reduce_scatter_candidate(
        self, target: Dims, todo: set[str]
    ) -> tuple[int, tuple[str, ...]] | None:
        t = self.cur
        for d, (ec, et) in enumerate(zip(t.layout.dims, target, strict=True)):
            if not _is_prefix(ec, et):
                continue
            run: list[str] = []
            for a in et[len(ec) :]:
                if a not in todo:
                    break
                run.append(a)
            for m in range(len(run), 0, -1):
                if self.nests(t.shape[d], ec, run[:m]):
                    return d, tuple(run[:m])
        return None

    def shrink_and_reduce(self) -> None:
        target = self.dst.layout.dims
        keep = set(self.dst.layout.partial.axes) if self.dst.layout.partial else set()
        while True:
            dims = self.free_slice(self.cur, target)
            if dims is not None:
                self.emit(RedistStep(StepKind.SLICE, self.cur, self.with_dims(self.cur, dims)))
                continue
            p = self.cur.layout.partial
            todo = {a for a in p.axes if a not in keep} if p else set()
            cand = self.reduce_scatter_candidate(target, todo)
            if cand is None or p is None:
                break
            d, axes = cand
            dims_l = list(self.cur.layout.dims)
            dims_l[d] = dims_l[d] + axes
            out = self.cur.with_layout(Layout(tuple(dims_l), p.without(axes)))
            self.emit(RedistStep(StepKind.REDUCE_SCATTER, self.cur, out, axes, dim=d, op=p.op))
        p = self.cur.layout.partial
        if p is not None:
            rest = tuple(a for a in p.axes if a not in keep)
            if rest:
                out = self.cur.with_layout(self.cur.layout.with_partial(p.without(rest)))
                self.emit(RedistStep(StepKind.ALLREDUCE, self.cur, out, rest, op=p.op))

    # -- phase 2: dims -----------------------------------------------------------------------

    def all_to_all_candidate(self, t: TensorType, target: Dims) -> RedistStep | None:
        dims = t.layout.dims
        for i, (ec, et) in enumerate(zip(dims, target, strict=True)):
            if _is_prefix(ec, et):
                continue
            s = ec[_prefix_len(ec, et) :]
            for j, (fc, ft) in enumerate(zip(dims, target, strict=True)):
                if j == i or not _is_prefix(fc, ft):
                    continue
                want = ft[len(fc) :]
                for m in range(min(len(s), len(want)), 0, -1):
                    moved = s[len(s) - m :]
                    if moved != want[:m]:
                        continue
                    if self.nests(t.shape[i], ec[: len(ec) - m], moved) and self.nests(
                        t.shape[j], fc, moved
                    ):
                        new = list(dims)
                        new[i], new[j] = ec[: len(ec) - m], fc + moved
                        out = self.with_dims(t, tuple(new))
                        return RedistStep(StepKind.ALL_TO_ALL, t, out, moved, dim=i, dst_dim=j)
        return None

    def allgather_candidate(self, t: TensorType, target: Dims) -> RedistStep | None:
        wanted = {a for entry in target for a in entry}
        dims = t.layout.dims
        for i, (ec, et) in enumerate(zip(dims, target, strict=True)):
            if _is_prefix(ec, et):
                continue
            s = ec[_prefix_len(ec, et) :]
            m = 0
            while m < len(s) and s[len(s) - 1 - m] not in wanted:
                m += 1
            if m and self.nests(t.shape[i], ec[: len(ec) - m], ec[len(ec) - m :]):
                new = list(dims)
                new[i] = ec[: len(ec) - m]
                out = self.with_dims(t, tuple(new))
                return RedistStep(StepKind.ALLGATHER, t, out, ec[len(ec) - m :], dim=i)
        return None

    def structured_dims(self, target: Dims) -> list[RedistStep] | None:
        t, communicated = self.cur, False
        steps: list[RedistStep] = []
        for _ in range(4 * (len(self.mesh.axes) + 1) * (len(target) + 1)):
            if t.layout.dims == target:
                return steps
            dims = self.free_slice(t, target)
            if dims is not None:
                if communicated:
                    return None
                step = RedistStep(StepKind.SLICE, t, self.with_dims(t, dims))
            else:
                cand = self.all_to_all_candidate(t, target) or self.allgather_candidate(t, target)
                if cand is None:
                    return None
                step, communicated = cand, True
            steps.append(step)
            t = step.out_type
        return None  # pragma: no cover - every step makes progress

    def change_dims(self, target: Dims) -> None:
        if self.cur.layout.dims == target:
            return
        steps = self.structured_dims(target)
        if steps is not None:
            for s in steps:
                self.emit(s)
            return
        out = self.with_dims(self.cur, target)
        if self._inside(self.cur, out):
            self.emit(RedistStep(StepKind.SLICE, self.cur, out))
            return
        changed = {
            a
            for ec, et in zip(self.cur.layout.dims, target, strict=True)
            if ec != et
            for a in ec + et
        }
        axes = tuple(a for a in self.mesh.axis_names if a in changed)
        self.emit(RedistStep(StepKind.EXCHANGE, self.cur, out, axes))

    def _inside(self, src: TensorType, dst: TensorType) -> bool:
        for r in range(self.mesh.size):
            for (s1, n1), (s2, n2) in zip(
                block_bounds(src, self.mesh, r), block_bounds(dst, self.mesh, r), strict=True
            ):
                if n2 and not (s1 <= s2 and s2 + n2 <= s1 + n1):
                    return False
        return True

    # -- phase 3: pending --------------------------------------------------------------------

    def make_partial(self) -> None:
        want = self.dst.layout.partial
        if want is None:
            return
        have = self.cur.layout.partial
        new = tuple(a for a in want.axes if have is None or a not in have.axes)
        if new:
            partial = Partial(want.op, (have.axes if have else ()) + new)
            out = self.cur.with_layout(self.cur.layout.with_partial(partial))
            self.emit(RedistStep(StepKind.MAKE_PARTIAL, self.cur, out, new, op=want.op))

    def finish(self) -> tuple[RedistStep, ...]:
        self.make_partial()
        if self.cur != self.dst:
            if not self._equivalent(self.cur, self.dst):
                raise PlanError(  # pragma: no cover - a planner bug
                    f"internal: plan for {self.src} -> {self.dst} ends at {self.cur}"
                )
            self.emit(RedistStep(StepKind.RELABEL, self.cur, self.dst))
        return tuple(self.steps)

    def embed(self) -> bool:
        """MAKE_PARTIAL over the target's new pending axes that are innermost axes of a dim
        entry (where the splits nest): free, and they need no gathering later."""
        want, have = self.dst.layout.partial, self.cur.layout.partial
        if want is None:
            return False
        new = {a for a in want.axes if have is None or a not in have.axes}
        dims, moved = list(self.cur.layout.dims), set[str]()
        for d, entry in enumerate(dims):
            m = 0
            while m < len(entry) and entry[len(entry) - 1 - m] in new:
                m += 1
            for mm in range(m, 0, -1):
                if self.nests(
                    self.cur.shape[d], entry[: len(entry) - mm], entry[len(entry) - mm :]
                ):
                    moved.update(entry[len(entry) - mm :])
                    dims[d] = entry[: len(entry) - mm]
                    break
        if not moved:
            return False
        axes = tuple(a for a in want.axes if a in moved)
        partial = Partial(want.op, (have.axes if have else ()) + axes)
        out = self.cur.with_layout(Layout(tuple(dims), partial))
        self.emit(RedistStep(StepKind.MAKE_PARTIAL, self.cur, out, axes, op=want.op))
        return True

    def cut_dims(self) -> Dims | None:
        """The target dims cut before their first axis that is still to be reduced (None when
        nothing is to be reduced or the cut changes nothing)."""
        p, keep = self.cur.layout.partial, self.dst.layout.partial
        todo = {a for a in p.axes if keep is None or a not in keep.axes} if p else set()
        if not todo:
            return None
        cut = []
        for entry in self.dst.layout.dims:
            n = 0
            while n < len(entry) and entry[n] not in todo:
                n += 1
            cut.append(entry[:n])
        return None if tuple(cut) == self.cur.layout.dims else tuple(cut)

    def plan(self, *, dims_first: bool, embed: bool) -> tuple[RedistStep, ...] | None:
        """One strategy (None if it does not apply): optionally embed new pending axes first;
        optionally move the contributions to the cut target dims before reducing; then shrink
        and reduce, change dims, make the rest pending."""
        if embed and not self.embed():
            return None
        if dims_first:
            cut = self.cut_dims()
            if cut is None:
                return None
            self.change_dims(cut)
        self.shrink_and_reduce()
        self.change_dims(self.dst.layout.dims)
        return self.finish()

    def _equivalent(self, a: TensorType, b: TensorType) -> bool:
        pa, pb = a.layout.partial, b.layout.partial
        big_a = {x for x in (pa.axes if pa else ()) if self.k((x,)) > 1}
        big_b = {x for x in (pb.axes if pb else ()) if self.k((x,)) > 1}
        same_op = pa is None or pb is None or pa.op is pb.op
        return a.layout.dims == b.layout.dims and big_a == big_b and same_op
