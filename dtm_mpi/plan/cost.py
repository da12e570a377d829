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

from dtm_mpi.ir.types import TensorType
from dtm_mpi.plan.overlap import Bucket
from dtm_mpi.plan.program import ExecPlan, FunctionPlan, OpKind, PlanOp
from dtm_mpi.sharding.blocks import local_shape
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.retention import keeps_gather_of, kept_bytes
from dtm_mpi.sharding.steps import StepKind, allreduce_moved_items

__all__ = ["FunctionCost", "OpCost", "function_cost", "local_bytes"]


def local_bytes(t: TensorType, mesh: MeshShape, rank: int) -> int:
    n = t.dtype.itemsize
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


def _kept(t: TensorType, mesh: MeshShape, rank: int) -> int:
    """The bytes the MPI path keeps for reuse after a collective with output ``t``."""
    return kept_bytes(local_bytes(t, mesh, rank))


def _retained(p: PlanOp, plan: ExecPlan, rank: int, fp: FunctionPlan) -> int:
    if p.kind is OpKind.REDIST and p.redist is not None:
        if not keeps_gather_of(p.op.operands[0], fp.function):
            return 0
        steps = p.redist.steps
        return sum(_kept(s.out_type, plan.mesh, rank) for s in steps if s.kind.is_collective)
    if p.kind is OpKind.BROADCAST:
        return sum(_kept(t, plan.mesh, rank) for t in p.op.result_types)
    if p.kind is OpKind.CALL:
        return function_cost(plan, plan.function(str(p.op.attr("callee")))).retained[rank]
    return 0


def _comm_of(p: PlanOp, plan: ExecPlan) -> tuple[str, ...]:
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
        callee = function_cost(plan, plan.function(name))
        return tuple(f"{c} (in @{name})" for oc in callee.ops for c in oc.comm)
    return ()


def _traffic(p: PlanOp, plan: ExecPlan, rank: int, operand: TensorType | None) -> tuple[int, int]:
    mesh = plan.mesh
    if p.kind is OpKind.REDIST and p.redist is not None:
        return p.redist.bytes_sent(rank), p.redist.bytes_received(rank)
    if p.kind is OpKind.BROADCAST and operand is not None:
        k = mesh.group_size(p.axes)
        size = local_bytes(operand, mesh, rank)
        root = mesh.index_along(rank, p.axes) == p.root
        return ((k - 1) * size, 0) if root else (0, size if k > 1 else 0)
    if p.kind is OpKind.SEND and operand is not None:
        here = mesh.index_along(rank, p.axes) == p.root
        return (local_bytes(operand, mesh, rank) if here else 0), 0
    if p.kind is OpKind.RECV:
        here = mesh.index_along(rank, p.axes) == p.dst
        return 0, (local_bytes(p.op.result_types[0], mesh, rank) if here else 0)
    if p.kind is OpKind.CALL:
        callee = function_cost(plan, plan.function(str(p.op.attr("callee"))))
        return callee.sent[rank], callee.received[rank]
    return 0, 0


def _bucket_traffic(b: Bucket, fp: FunctionPlan, plan: ExecPlan, rank: int) -> tuple[int, int]:
    """A bucket's allreduce on ``rank``: its members' blocks as one flat message."""
    mesh = plan.mesh
    types = [fp.ops[m].op.result_types[0] for m in b.members]
    count = sum(local_bytes(t, mesh, rank) for t in types) // types[0].dtype.itemsize
    group = mesh.group_of(rank, b.axes)
    moved = allreduce_moved_items(count, len(group), group.index(rank)) * types[0].dtype.itemsize
    return moved, moved


def _extra(p: PlanOp, plan: ExecPlan, rank: int) -> int:
    if p.kind is OpKind.REDIST and p.redist is not None:
        return p.redist.peak_extra_bytes(rank)
    if p.kind is OpKind.CALL:
        fp = plan.function(str(p.op.attr("callee")))
        params = sum(local_bytes(q.type, plan.mesh, rank) for q in fp.function.params)
        return max(0, function_cost(plan, fp).peak[rank] - params)
    return 0


def function_cost(plan: ExecPlan, fp: FunctionPlan) -> FunctionCost:
    """Every op's figures on every rank, and the function's totals."""
    mesh = plan.mesh
    ranks = range(mesh.size)
    types: dict[str, TensorType] = {q.name: q.type for q in fp.function.params}
    params = set(types)
    live = [sum(local_bytes(q.type, mesh, r) for q in fp.function.params) for r in ranks]
    peak = list(live)
    sent = [0] * mesh.size
    received = [0] * mesh.size
    counts: dict[str, int] = {}
    retained = [0] * mesh.size
    ops: list[OpCost] = []
    in_bucket = {m: b for b in fp.buckets if b.kind is StepKind.ALLREDUCE for m in b.members}
    prefetched = {b.members[0]: b for b in fp.buckets if b.kind is StepKind.ALLGATHER}
    starting: dict[int, list[Bucket]] = {}
    for b in prefetched.values():
        starting.setdefault(b.start, []).append(b)
    for p in fp.ops:
        for b in starting.get(len(ops), ()):  # its result allocated from the gather's start
            member = fp.ops[b.members[0]]
            t = member.op.result_types[0]
            for r in ranks:
                live[r] += local_bytes(t, mesh, r)
                peak[r] = max(peak[r], live[r] + _extra(member, plan, r))
        op = p.op
        operand = p.operand_types[0] if p.operand_types else None
        shapes = tuple(
            tuple(local_shape(t.shape, t.layout, mesh, r) for t in op.result_types) for r in ranks
        )
        bucket = in_bucket.get(len(ops))
        if bucket is None:
            traffic = [_traffic(p, plan, r, operand) for r in ranks]
        else:  # the bucket's one message, at its first member
            traffic = [
                _bucket_traffic(bucket, fp, plan, r) if len(ops) == min(bucket.members) else (0, 0)
                for r in ranks
            ]
        during = []
        fetched = prefetched.get(len(ops))  # (its result counted where it started)
        for r in ranks:
            new, extra = (
                (0, 0)
                if fetched is not None
                else (sum(local_bytes(t, mesh, r) for t in op.result_types), _extra(p, plan, r))
            )
            during.append(live[r] + new + extra)
            peak[r] = max(peak[r], during[r])
            live[r] += new
            sent[r] += traffic[r][0]
            received[r] += traffic[r][1]
            retained[r] += _retained(p, plan, r, fp)
        for name, t in zip(op.results, op.result_types, strict=True):
            types[name] = t
        for name in p.frees:
            freed = types.get(name)
            if freed is not None and name not in params:
                for r in ranks:
                    live[r] -= local_bytes(freed, mesh, r)
        comm = _comm_of(p, plan)
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
                shapes,
                comm,
                tuple(t[0] for t in traffic),
                tuple(t[1] for t in traffic),
                tuple(during),
            )
        )
    return FunctionCost(
        tuple(ops),
        tuple(peak),
        tuple(sent),
        tuple(received),
        tuple(sorted(counts.items())),
        tuple(retained),
    )
