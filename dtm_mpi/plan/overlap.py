"""Which collectives overlap computation (pure: every rank computes the same): allreduces in
buckets started as soon as their values are ready and completed just before their results are
first needed, and the gathers of parameters stored sharded prefetched one ahead.

A candidate is a ``REDIST`` op whose redistribution is one ``ALLREDUCE`` step of a float value
(the data-parallel gradient completions the reverse pass emits, a tensor-parallel pending sum
completed before its use). Its operand is *ready* after the op that defines it; its result is
*needed* at its first use (the function's end for a returned value). In ready order, candidates
over the same axes, reduction and dtype are packed into a **bucket** of at most
``bucket_bytes`` (DDP's buckets: one message for many small gradients): the bucket *starts*
after the last member's operand is ready and *completes* before the first member's result is
needed. A bucket that would complete where it starts overlaps nothing and is not formed: its
members run where they stand. What runs between a bucket's start and completion is what the
allreduce overlaps; ``dtm explain`` lists every bucket with it.

**Prefetched gathers** (ZeRO-3, FSDP: :func:`prefetch_gathers`): a ``REDIST`` op whose
redistribution is one ``ALLGATHER`` step of a state parameter of the function (a parameter
stored sharded, gathered for its layer) is a bucket of its own. In the order their results are first needed,
each gather starts where the one before it is first used (that one completed just before:
FSDP's forward and backward prefetch, one gather ahead, so at most one gathered parameter
beyond those in use is held) -- never later than where it stood -- and completes before its
own first use. The first starts where it stood.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtm_mpi.ir.registry import OpKind
from dtm_mpi.ir.types import DType, ReduceOp
from dtm_mpi.sharding.steps import StepKind

if TYPE_CHECKING:  # the plan holds the buckets: compile_plan calls this module
    from dtm_mpi.plan.program import FunctionPlan

__all__ = ["BUCKET_BYTES", "Bucket", "overlap_buckets", "prefetch_gathers"]

BUCKET_BYTES = 25 * 2**20
"""The default bucket size (DDP's default, 25 MiB)."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """Collectives sent as one message: ``members`` (op indices, in ready order), started
    after op ``start - 1`` (before op ``start``) and completed before op ``finish``. ``kind``
    ``ALLREDUCE`` (``op`` its reduction) or ``ALLGATHER`` (one prefetched gather, ``op``
    None)."""

    members: tuple[int, ...]
    axes: tuple[str, ...]
    op: ReduceOp | None
    start: int
    finish: int
    nbytes: int  # global bytes of the members (each rank sends its blocks: at most this)
    kind: StepKind = StepKind.ALLREDUCE

    @property
    def overlapped(self) -> range:
        """The op indices that run while the bucket is in flight."""
        return range(self.start, self.finish)


def _candidate(fp: FunctionPlan, i: int) -> tuple[tuple[str, ...], ReduceOp, str] | None:
    p = fp.ops[i]
    if p.kind is not OpKind.REDIST or p.redist is None or len(p.redist.steps) != 1:
        return None
    step = p.redist.steps[0]
    t = p.op.result_types[0]
    # bf16 is not: its reduction is rounded to bf16 afterwards, op by op
    if (
        step.kind is not StepKind.ALLREDUCE
        or step.op is None
        or not t.dtype.is_float
        or t.dtype is DType.BF16
    ):
        return None
    return step.axes, step.op, t.dtype.value


def _first_uses(fp: FunctionPlan) -> dict[str, int]:
    """Each value's first reader: the index of the first op that takes it."""
    first_use: dict[str, int] = {}
    for i, p in enumerate(fp.ops):
        for n in p.op.operands:
            first_use.setdefault(n, i)
    return first_use


def overlap_buckets(fp: FunctionPlan, bucket_bytes: int = BUCKET_BYTES) -> tuple[Bucket, ...]:
    """The buckets of ``fp`` (module doc), in start order."""
    ops = fp.ops
    defined: dict[str, int] = {p.name: -1 for p in fp.function.params}
    for i, p in enumerate(ops):
        for r in p.op.results:
            defined[r] = i
    first_use = _first_uses(fp)
    end = len(ops)
    cands = []
    needed_of: dict[str, int] = {}  # a candidate's result: where it is surely there
    for i, p in enumerate(ops):
        key = _candidate(fp, i)
        if key is None:
            continue
        operand = p.op.operands[0]
        ready = defined.get(operand, -1) + 1
        if operand in needed_of:  # the result of another candidate: it arrives with that
            ready = max(ready, needed_of[operand])  # one's bucket, by its first use at most
        needed = first_use.get(p.op.results[0], end)
        needed_of[p.op.results[0]] = needed
        t = p.op.result_types[0]
        cands.append((ready, i, needed, key, t.nbytes))
    cands.sort()
    buckets: list[Bucket] = []
    open_: list[tuple[int, int, int, tuple[tuple[str, ...], ReduceOp, str], int]] = []

    def close() -> None:
        if open_:
            start = max(c[0] for c in open_)
            finish = min(c[2] for c in open_)
            members = tuple(c[1] for c in open_)
            # worth it where something runs in between other than the members themselves
            if any(j not in members for j in range(start, finish)):
                key = open_[0][3]
                buckets.append(
                    Bucket(members, key[0], key[1], start, finish, sum(c[4] for c in open_))
                )
            open_.clear()

    for c in cands:
        if open_:
            same = c[3] == open_[0][3]
            fits = sum(x[4] for x in open_) + c[4] <= bucket_bytes
            # the bucket would start after this one's operand: it must still finish later
            keeps = max(c[0], *(x[0] for x in open_)) < min(c[2], *(x[2] for x in open_))
            # nor may it reduce what a member gives (that arrives with the bucket)
            chained = ops[c[1]].op.operands[0] in {ops[x[1]].op.results[0] for x in open_}
            if not (same and fits and keeps) or chained:
                close()
        open_.append(c)
    close()
    return tuple(sorted(buckets, key=lambda b: (b.start, b.members)))


def _gather_candidate(fp: FunctionPlan, i: int, params: frozenset[str]) -> tuple[str, ...] | None:
    p = fp.ops[i]
    if p.kind is not OpKind.REDIST or p.redist is None or len(p.redist.steps) != 1:
        return None
    step = p.redist.steps[0]
    if step.kind is not StepKind.ALLGATHER or p.op.operands[0] not in params:
        return None
    return step.axes


def prefetch_gathers(fp: FunctionPlan) -> tuple[Bucket, ...]:
    """The prefetched gathers of ``fp`` (module doc), each a bucket of one, in start order."""
    params = frozenset(q.name for q in fp.function.params if q.state)
    first_use = _first_uses(fp)
    end = len(fp.ops)
    gathers = []
    for i in range(end):
        axes = _gather_candidate(fp, i, params)
        if axes is not None:
            gathers.append((first_use.get(fp.ops[i].op.results[0], end), i, axes))
    gathers.sort()
    at = {i for _, i, _ in gathers}
    out = []
    previous_use: int | None = None
    for needed, i, axes in gathers:
        start = i if previous_use is None else min(i, previous_use)
        previous_use = needed
        if any(j not in at for j in range(start, needed)):  # something runs meanwhile
            t = fp.ops[i].op.result_types[0]
            out.append(Bucket((i,), axes, None, start, needed, t.nbytes, StepKind.ALLGATHER))
    return tuple(sorted(out, key=lambda b: (b.start, b.members)))
