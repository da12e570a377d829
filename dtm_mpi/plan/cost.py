"""Per-rank figures of an execution plan: local shapes, communication, bytes and memory.

Pure functions of (plan, rank); ``dtm explain`` prints them and ``--max-bytes-per-rank``
refuses a plan by them. Bytes sent/received are the logical volumes of the redistribution
planner (``dtm_mpi.sharding.redistribute``); ``broadcast`` counts ``(k-1)`` blocks sent by the
root and one block received by every other member; ``send``/``recv`` one block each.

Memory: the bytes of the local arrays alive on a rank. Entry parameters are alive throughout;
an op's results are allocated while its operands are still alive, plus the redistribution's
temporaries (its peak extra bytes) or, for a call, the callee's own peak; values are freed
after their last use (:attr:`PlanOp.frees`); a prefetched gather's result
(:func:`~dtm_mpi.plan.overlap.prefetch_gathers`) is allocated where the gather starts. On the
MPI path each repeated collective also keeps its last output buffer for reuse when it is 64
KiB or more (:mod:`dtm_mpi.sharding.retention`): :attr:`FunctionCost.retained` bounds that
memory, which is not in any value's lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dtm_mpi.ir.dtypes import held_itemsize
from dtm_mpi.ir.types import TensorType
from dtm_mpi.plan.overlap import Bucket
from dtm_mpi.plan.program import ExecPlan, FunctionPlan, OpKind, PlanOp
from dtm_mpi.sharding.blocks import check_layout, local_shape
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import RedistPlan
from dtm_mpi.sharding.retention import keeps_gather_of, kept_bytes
from dtm_mpi.sharding.steps import StepKind, allreduce_moved_items

__all__ = ["FunctionCost", "OpCost", "function_cost", "function_costs", "local_bytes"]

Ints = Any  # a 1-D int64 numpy array, one entry per rank


def local_bytes(t: TensorType, mesh: MeshShape, rank: int) -> int:
    n = held_itemsize(t.dtype)
    for s in local_shape(t.shape, t.layout, mesh, rank):
        n *= s
    return n


@dataclass(frozen=True, slots=True)
class OpCost:
    """One op on every rank (tuples indexed by rank)."""

    plan_op: PlanOp
    local_shapes: tuple[tuple[tuple[int, ...], ...], ...]  # [rank][result]
    comm: tuple[str, ...]  # the communication steps, in order
    sent: tuple[int, ...]
    received: tuple[int, ...]
    live: tuple[int, ...]  # bytes alive while the op runs (its peak)


@dataclass(frozen=True, slots=True)
class FunctionCost:
    ops: tuple[OpCost, ...]
    peak: tuple[int, ...]  # per rank
    sent: tuple[int, ...]
    received: tuple[int, ...]
    collectives: tuple[tuple[str, int], ...]  # (kind, count) per rank alike, sorted
    retained: tuple[int, ...]  # per rank: at most this many bytes of kept collective outputs


def function_cost(plan: ExecPlan, fp: FunctionPlan) -> FunctionCost:
    """Every op's figures on every rank, and the function's totals."""
    return _Costing(plan).function(fp)


def function_costs(plan: ExecPlan) -> dict[str, FunctionCost]:
    """:func:`function_cost` of every function of ``plan`` by name (each callee costed once)."""
    costing = _Costing(plan)
    return {name: costing.function(fp) for name, fp in plan.functions}


def _ints(values: Ints) -> tuple[int, ...]:
    return tuple(values.tolist())


class _Costing:
    """The figures of one plan, each computed once and for every rank at a time: the local
    shapes and bytes of each distinct tensor type, the traffic of each distinct
    redistribution, the cost of each function (a call's callee is costed once)."""

    def __init__(self, plan: ExecPlan) -> None:
        self.plan, self.mesh = plan, plan.mesh
        n = self.mesh.size
        self.ranks = range(n)
        self.coords = np.array([self.mesh.coords(r) for r in self.ranks], dtype=np.int64)
        self.coords = self.coords.reshape(n, len(self.mesh.axes))
        self.zeros = np.zeros(n, dtype=np.int64)
        self._index: dict[tuple[str, ...], Ints] = {}
        self._shapes: dict[TensorType, Ints] = {}
        self._bytes: dict[TensorType, Ints] = {}
        self._kept: dict[TensorType, Ints] = {}
        self._results: dict[tuple[TensorType, ...], tuple[tuple[tuple[int, ...], ...], ...]] = {}
        self._redist: dict[RedistPlan, tuple[Ints, Ints, Ints, Ints]] = {}
        self._functions: dict[str, FunctionCost] = {}

    # -- per tensor type --------------------------------------------------------------------
    def index_along(self, axes: tuple[str, ...]) -> Ints:
        """Every rank's :meth:`MeshShape.index_along` ``axes``."""
        got = self._index.get(axes)
        if got is None:
            got = self.zeros.copy()
            self.mesh.group_size(axes)  # the axes' check
            for a in axes:
                got = got * self.mesh.axis_size(a) + self.coords[:, self.mesh.axis_position(a)]
            self._index[axes] = got
        return got

    def shapes(self, t: TensorType) -> Ints:
        """Every rank's local shape of ``t``: ``[ranks, t.rank]`` (``local_shape``'s §5 split)."""
        got = self._shapes.get(t)
        if got is None:
            check_layout(t.shape, t.layout, self.mesh)
            cols = []
            for n, axes in zip(t.shape, t.layout.dims, strict=True):
                k = self.mesh.group_size(axes)
                b = -(-n // k)
                start = self.index_along(axes) * b
                cols.append(np.maximum(0, np.minimum(b, n - start)))
            got = np.stack(cols, axis=1) if cols else np.zeros((len(self.ranks), 0), np.int64)
            self._shapes[t] = got
        return got

    def nbytes(self, t: TensorType) -> Ints:
        got = self._bytes.get(t)
        if got is None:
            got = np.prod(self.shapes(t), axis=1, dtype=np.int64) * held_itemsize(t.dtype)
            self._bytes[t] = got
        return got

    def result_shapes(
        self, types: tuple[TensorType, ...]
    ) -> tuple[tuple[tuple[int, ...], ...], ...]:
        got = self._results.get(types)
        if got is None:
            per = [[tuple(s) for s in self.shapes(t).tolist()] for t in types]
            got = tuple(tuple(col[r] for col in per) for r in self.ranks)
            self._results[types] = got
        return got

    def kept(self, t: TensorType) -> Ints:
        """The bytes the MPI path keeps for reuse after a collective with output ``t``
        (:func:`~dtm_mpi.sharding.retention.kept_bytes` on every rank)."""
        got = self._kept.get(t)
        if got is None:
            got = np.array([kept_bytes(b) for b in self.nbytes(t).tolist()], dtype=np.int64)
            self._kept[t] = got
        return got

    # -- per op -----------------------------------------------------------------------------
    def redist(self, r: RedistPlan) -> tuple[Ints, Ints, Ints, Ints]:
        """(sent, received, peak extra bytes, kept output bytes) of ``r`` on every rank."""
        got = self._redist.get(r)
        if got is None:
            figures = np.array([r.rank_figures(k) for k in self.ranks], dtype=np.int64)
            sent, recv, extra = figures[:, 0], figures[:, 1], figures[:, 2]
            kept = sum((self.kept(s.out_type) for s in r.steps if s.kind.is_collective), self.zeros)
            got = (sent, recv, extra, kept)
            self._redist[r] = got
        return got

    def callee(self, p: PlanOp) -> FunctionCost:
        return self.function(self.plan.function(str(p.op.attr("callee"))))

    def retained(self, p: PlanOp, fp: FunctionPlan) -> Ints:
        if p.kind is OpKind.REDIST and p.redist is not None:
            if not keeps_gather_of(p.op.operands[0], fp.function):
                return self.zeros
            return self.redist(p.redist)[3]
        if p.kind is OpKind.BROADCAST:
            return sum((self.kept(t) for t in p.op.result_types), self.zeros)
        if p.kind is OpKind.CALL:
            return np.array(self.callee(p).retained, dtype=np.int64)
        return self.zeros

    def comm(self, p: PlanOp) -> tuple[str, ...]:
        if p.kind is OpKind.REDIST and p.redist is not None:
            out = []
            for s in p.redist.steps:
                if s.kind.is_collective:
                    op = f" {s.op.value}" if s.op is not None else ""
                    out.append(f"{s.kind.value}{op} on {','.join(s.axes)}")
            return tuple(out)
        if p.kind is OpKind.BROADCAST:
            return (f"broadcast on {','.join(p.axes)} root {p.root}",)
        if p.kind is OpKind.SEND:
            return (f"send on {','.join(p.axes)} {p.root}->{p.dst}",)
        if p.kind is OpKind.RECV:
            return (f"recv on {','.join(p.axes)} {p.root}->{p.dst}",)
        if p.kind is OpKind.CALL:
            name = str(p.op.attr("callee"))
            return tuple(f"{c} (in @{name})" for oc in self.callee(p).ops for c in oc.comm)
        return ()

    def traffic(self, p: PlanOp, operand: TensorType | None) -> tuple[Ints, Ints]:
        if p.kind is OpKind.REDIST and p.redist is not None:
            sent, recv, _, _ = self.redist(p.redist)
            return sent, recv
        if p.kind is OpKind.BROADCAST and operand is not None:
            k = self.mesh.group_size(p.axes)
            size = self.nbytes(operand)
            root = self.index_along(p.axes) == p.root
            return np.where(root, (k - 1) * size, 0), np.where(root | (k <= 1), 0, size)
        if p.kind is OpKind.SEND and operand is not None:
            here = self.index_along(p.axes) == p.root
            return np.where(here, self.nbytes(operand), 0), self.zeros
        if p.kind is OpKind.RECV:
            here = self.index_along(p.axes) == p.dst
            return self.zeros, np.where(here, self.nbytes(p.op.result_types[0]), 0)
        if p.kind is OpKind.CALL:
            callee = self.callee(p)
            return np.array(callee.sent, np.int64), np.array(callee.received, np.int64)
        return self.zeros, self.zeros

    def bucket_traffic(self, b: Bucket, fp: FunctionPlan) -> Ints:
        """A bucket's allreduce on every rank (sent = received): its members' blocks as one
        flat message."""
        types = [fp.ops[m].op.result_types[0] for m in b.members]
        item = held_itemsize(types[0].dtype)
        counts = sum((self.nbytes(t) for t in types), self.zeros) // item
        k = self.mesh.group_size(b.axes)
        index = self.index_along(b.axes)
        return np.array(
            [
                allreduce_moved_items(c, k, i) * item
                for c, i in zip(counts.tolist(), index.tolist(), strict=True)
            ],
            dtype=np.int64,
        )

    def extra(self, p: PlanOp) -> Ints:
        if p.kind is OpKind.REDIST and p.redist is not None:
            return self.redist(p.redist)[2]
        if p.kind is OpKind.CALL:
            fp = self.plan.function(str(p.op.attr("callee")))
            params = sum((self.nbytes(q.type) for q in fp.function.params), self.zeros)
            return np.maximum(0, np.array(self.callee(p).peak, np.int64) - params)
        return self.zeros

    # -- per function -----------------------------------------------------------------------
    def function(self, fp: FunctionPlan) -> FunctionCost:
        got = self._functions.get(fp.function.name)
        if got is None:
            got = self._function(fp)
            self._functions[fp.function.name] = got
        return got

    def _function(self, fp: FunctionPlan) -> FunctionCost:
        types: dict[str, TensorType] = {q.name: q.type for q in fp.function.params}
        params = set(types)
        live = sum((self.nbytes(q.type) for q in fp.function.params), self.zeros)
        peak = live.copy()
        sent, received, retained = self.zeros.copy(), self.zeros.copy(), self.zeros.copy()
        counts: dict[str, int] = {}
        ops: list[OpCost] = []
        in_bucket = {m: b for b in fp.buckets if b.kind is StepKind.ALLREDUCE for m in b.members}
        prefetched = {b.members[0]: b for b in fp.buckets if b.kind is StepKind.ALLGATHER}
        starting: dict[int, list[Bucket]] = {}
        for b in prefetched.values():
            starting.setdefault(b.start, []).append(b)
        for p in fp.ops:
            for b in starting.get(len(ops), ()):  # its result allocated from the gather's start
                member = fp.ops[b.members[0]]
                live = live + self.nbytes(member.op.result_types[0])
                peak = np.maximum(peak, live + self.extra(member))
            op = p.op
            operand = p.operand_types[0] if p.operand_types else None
            bucket = in_bucket.get(len(ops))
            if bucket is None:
                out, into = self.traffic(p, operand)
            elif len(ops) == min(bucket.members):  # the bucket's one message, at its first member
                out = into = self.bucket_traffic(bucket, fp)
            else:
                out = into = self.zeros
            fetched = prefetched.get(len(ops))  # (its result counted where it started)
            if fetched is None:
                new = sum((self.nbytes(t) for t in op.result_types), self.zeros)
                during = live + new + self.extra(p)
                live = live + new
            else:
                during = live
            peak = np.maximum(peak, during)
            sent, received = sent + out, received + into
            retained = retained + self.retained(p, fp)
            for name, t in zip(op.results, op.result_types, strict=True):
                types[name] = t
            for name in p.frees:
                freed = types.get(name)
                if freed is not None and name not in params:
                    live = live - self.nbytes(freed)
            comm = self.comm(p)
            if bucket is not None:  # one allreduce for the bucket, at its first member
                comm = tuple(
                    f"{c} (bucket of {len(bucket.members)}: ops {', '.join(map(str, bucket.members))}; in flight over ops {bucket.start}-{bucket.finish - 1})"
                    for c in comm
                )
            if fetched is not None:
                comm = tuple(
                    f"{c} (prefetched: in flight over ops {fetched.start}-{fetched.finish - 1})"
                    for c in comm
                )
            for c in comm:
                kind = c.split(" ")[0]
                if bucket is None or len(ops) == min(bucket.members):
                    counts[kind] = counts.get(kind, 0) + 1
            ops.append(
                OpCost(
                    p,
                    self.result_shapes(tuple(op.result_types)),
                    comm,
                    _ints(out),
                    _ints(into),
                    _ints(during),
                )
            )
        return FunctionCost(
            tuple(ops),
            _ints(peak),
            _ints(sent),
            _ints(received),
            tuple(sorted(counts.items())),
            _ints(retained),
        )
