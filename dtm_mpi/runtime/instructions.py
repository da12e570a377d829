"""The executor's instructions: each op of a function plan as one prepared call, and the facts
the one loop of :class:`~dtm_mpi.runtime.executor.Executor` needs around it.

An instruction is ``(op, operand names, result names, names freed after it, call, schedule)``:
the loop reads the operands from its environment, calls ``call`` with their arrays, stores the
results and drops the freed names. Every feature is an instruction or a schedule, never a
second loop:

* a fused elementwise chain (:mod:`dtm_mpi.plan.fusion`) is one call at its root, its other
  ops skipped (a generated kernel on a GPU backend; chunks of rows on the CPU);
* overlapped allreduces (:mod:`dtm_mpi.plan.overlap`) are a :class:`Sched`: the buckets
  completed and started before an op, and whether the op is a bucket's member;
* deterministic mode's exact sums are calls (:func:`resolve_pending`), and turning a resolved
  pending sum back into its plain form is an instruction of its own;
* an injected fault (``DTM_FAULT``) is an instruction before its op.

This module holds the pure parts: :func:`fused_frees`, :func:`hold_bucket_operands` and
:func:`resolve_pending` are functions of the plan alone, the same on every rank (what differs
by rank -- the prepared calls, who holds ``-0.0`` -- is the executor's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtm_mpi.kernels.dispatch import PreparedKernel
from dtm_mpi.kernels.exact import applies
from dtm_mpi.plan.fusion import FusedGroup
from dtm_mpi.plan.overlap import Bucket
from dtm_mpi.plan.program import FunctionPlan, OpKind, PlanOp

__all__ = [
    "BucketStart",
    "Instr",
    "Resolution",
    "Sched",
    "buckets_starting",
    "fused_frees",
    "hold_bucket_operands",
    "resolve_pending",
    "without_resolved",
]


@dataclass(frozen=True, slots=True)
class BucketStart:
    """A bucket started before an op: the operands dropped once packed, and per member whether
    this rank packs ``-0.0`` instead of its operand (a resolved pending sum on a rank other
    than its group's first: :func:`resolve_pending`)."""

    bucket: Bucket
    drops: tuple[str, ...]
    zeroed: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class Sched:
    """Overlapped allreduces at one instruction: buckets to complete and to start before it,
    and whether the op is skipped (a bucket's member, its result coming with the bucket, or
    a fused chain's member, computed at the chain's root)."""

    finish: tuple[Bucket, ...]
    start: tuple[BucketStart, ...]
    skip: bool


Instr = tuple[
    PlanOp, tuple[str, ...], tuple[str, ...], tuple[str, ...], PreparedKernel, "Sched | None"
]
"""One instruction (module doc): op, operands, results, frees, call, schedule."""


def fused_frees(fp: FunctionPlan, groups: Sequence[FusedGroup]) -> list[tuple[str, ...]]:
    """What each op frees when groups run at their roots: a root frees what its members
    freed, and an input of a group is never freed before the group's root reads it (an op
    between a member and the root that was its last other user no longer frees it; the
    root does)."""
    frees = {i: list(p.frees) for i, p in enumerate(fp.ops)}
    for g in sorted(groups, key=lambda g: g.root):
        members = set(g.members)
        frees[g.root] = [n for m in g.members for n in fp.ops[m].frees]
        for m in g.members:
            if m != g.root:
                frees[m] = []
        inputs = set(g.inputs)
        for j in range(min(members), g.root):
            if j in members:
                continue
            moved = [n for n in frees[j] if n in inputs]
            if moved:
                frees[j] = [n for n in frees[j] if n not in inputs]
                frees[g.root] += moved
    return [tuple(dict.fromkeys(frees[i])) for i in range(len(fp.ops))]


def buckets_starting(buckets: Sequence[Bucket]) -> dict[int, list[Bucket]]:
    """``buckets`` by the op before which each starts."""
    out: dict[int, list[Bucket]] = {}
    for b in buckets:
        out.setdefault(b.start, []).append(b)
    return out


def hold_bucket_operands(
    fp: FunctionPlan, frees_of: Sequence[tuple[str, ...]]
) -> tuple[list[tuple[str, ...]], dict[Bucket, tuple[str, ...]]]:
    """Each op's frees (``frees_of``) when ``fp``'s buckets overlap: a member's operand stays
    until its bucket has packed it (no op before the bucket's start frees it); and per bucket
    the operands it drops once packed (those an op before its start would have freed)."""
    held: dict[int, set[str]] = {}
    drops: dict[Bucket, tuple[str, ...]] = {}
    for b in fp.buckets:
        names = {fp.ops[m].op.operands[0] for m in b.members}
        drops[b] = tuple(sorted({n for j in range(b.start) for n in frees_of[j] if n in names}))
        for j in range(b.start):
            held.setdefault(j, set()).update(names)
    frees = [
        tuple(n for n in f if n not in held[j]) if j in held else f for j, f in enumerate(frees_of)
    ]
    return frees, drops


@dataclass(frozen=True, slots=True)
class Resolution:
    """Where deterministic mode's exact sums keep pending sums *resolved* (whole on every rank
    of their group) and where they turn back into the plain form (the group's first rank
    whole, the others ``-0.0``) before anything else reads them.

    An op with an exact form (:func:`~dtm_mpi.kernels.exact.applies`) computes its pending
    result whole on every rank of the group (:mod:`dtm_mpi.kernels.exact_ranks`); a local op
    whose pending operands are all resolved and whose result is pending over the same axes
    computes the whole value too. Any other reader needs the plain form."""

    exact: frozenset[int]
    """The ops run in their exact form."""
    operand_resolved: dict[int, tuple[bool, ...]]
    """Per exact op: which operands are resolved when it runs."""
    plain_before: dict[int, tuple[str, ...]]
    """Per op: the resolved names turned plain before it runs."""
    plain_at_return: tuple[str, ...]
    """Resolved names the function returns: turned plain at its end."""
    bucket_resolved: dict[Bucket, tuple[bool, ...]]
    """Per overlapped bucket: which members' operands are resolved when it starts (the
    bucket packs their plain form; the names stay resolved)."""
    resolved: frozenset[str]
    """Every name ever held resolved."""


def _keeps_resolved(p: PlanOp, resolved: set[str]) -> bool:
    if p.kind is not OpKind.LOCAL:
        return False
    if applies(p.op):
        return True
    pending = [
        (n, t)
        for n, t in zip(p.op.operands, p.operand_types, strict=True)
        if t.layout.partial is not None
    ]
    result = p.op.result_types[0].layout.partial if len(p.op.result_types) == 1 else None
    return bool(pending) and all(n in resolved and t.layout.partial == result for n, t in pending)


def resolve_pending(fp: FunctionPlan, buckets: Sequence[Bucket]) -> Resolution:
    """The :class:`Resolution` of ``fp`` in deterministic mode, its ``buckets`` overlapped.

    Pure: the same on every rank (which rank packs or holds ``-0.0`` is the executor's)."""
    starts = buckets_starting(buckets)
    members = {m for b in buckets for m in b.members}
    resolved: set[str] = set()
    ever: set[str] = set()
    exact: set[int] = set()
    operand_resolved: dict[int, tuple[bool, ...]] = {}
    plain_before: dict[int, tuple[str, ...]] = {}
    bucket_resolved: dict[Bucket, tuple[bool, ...]] = {}
    for i, p in enumerate(fp.ops):
        for b in starts.get(i, ()):
            bucket_resolved[b] = tuple(fp.ops[m].op.operands[0] in resolved for m in b.members)
        if i in members:  # run with its bucket: its result is plain, its operand unchanged
            continue
        op = p.op
        keeps = _keeps_resolved(p, resolved)
        if not keeps:
            plain = tuple(n for n in dict.fromkeys(op.operands) if n in resolved)
            if plain:
                plain_before[i] = plain
                resolved.difference_update(plain)
        if p.kind is OpKind.LOCAL and applies(op):
            exact.add(i)
            operand_resolved[i] = tuple(n in resolved for n in op.operands)
        if keeps:
            for r, t in zip(op.results, op.result_types, strict=True):
                if t.layout.partial is not None:
                    resolved.add(r)
                    ever.add(r)
    at_return = tuple(r for r in dict.fromkeys(fp.function.returns) if r in resolved)
    return Resolution(
        frozenset(exact),
        operand_resolved,
        plain_before,
        at_return,
        bucket_resolved,
        frozenset(ever),
    )


def without_resolved(
    groups: Sequence[FusedGroup], fp: FunctionPlan, res: Resolution
) -> list[FusedGroup]:
    """The fused groups deterministic mode runs: none that reads a resolved name or makes a
    pending sum (its ops run one by one, keeping pending sums resolved)."""
    out = []
    for g in groups:
        if any(n in res.resolved for n in g.inputs):
            continue
        if any(t.layout.partial is not None for m in g.members for t in fp.ops[m].op.result_types):
            continue
        out.append(g)
    return out
