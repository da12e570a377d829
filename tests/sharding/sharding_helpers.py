"""Helpers shared by the sharding tests: layouts to try, per-rank source arrays built from a
global array (with random contributions for pending values), the check of a plan's result, a
spec-driven simulator (what an MPI executor does with :func:`rank_spec`), and the IR's own type
rule for a structured step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import permutations

import numpy as np

from dtm_mpi.ir.nodes import MeshDecl, Module, Op
from dtm_mpi.ir.registry import OpContext, lookup_op
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.sharding import (
    AllgatherSpec,
    AllreduceSpec,
    ExchangeSpec,
    MakePartialSpec,
    MeshShape,
    RedistPlan,
    ReduceScatterSpec,
    RelabelSpec,
    SliceSpec,
    StepKind,
    apply_plan,
    local_block,
    rank_spec,
    reduce_arrays,
    reduction_identity,
    step_traffic,
    step_volume,
)

MESHES = {
    "1": MeshShape((("dp", 1),)),
    "2": MeshShape((("dp", 2),)),
    "3": MeshShape((("dp", 3),)),
    "4": MeshShape((("dp", 4),)),
    "2x2": MeshShape((("dp", 2), ("tp", 2))),
}
SHAPES = ((5, 7), (10,), (3, 1, 4), (2,), ())


def entries(axes: Sequence[str]) -> list[tuple[str, ...]]:
    """Every dim entry over one axis or an ordered pair of axes."""
    out: list[tuple[str, ...]] = [(a,) for a in axes]
    out += [p for p in permutations(axes, 2)]
    return out


def layouts(axes: Sequence[str], rank: int) -> list[Layout]:
    """Replicated; each dim over each axis and each ordered pair; two dims over two axes;
    partial sum/max over each axis and ordered pair (replicated dims), and partial over one
    axis with a dim split over another."""
    rep: tuple[tuple[str, ...], ...] = ((),) * rank
    out = [Layout(rep)]
    for d in range(rank):
        for e in entries(axes):
            out.append(Layout((*rep[:d], e, *rep[d + 1 :])))
    for a, b in permutations(axes, 2):
        for d0 in range(rank):
            for d1 in range(rank):
                if d0 != d1:
                    dims = list(rep)
                    dims[d0], dims[d1] = (a,), (b,)
                    out.append(Layout(tuple(dims)))
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        for e in entries(axes):
            out.append(Layout(rep, Partial(op, e)))
        for a, b in permutations(axes, 2):
            for d in range(rank):
                out.append(Layout((*rep[:d], (b,), *rep[d + 1 :]), Partial(op, (a,))))
    return out


def allowed(src: Layout, dst: Layout) -> bool:
    """The IR's redistribute rule (§8.13.1)."""
    if src.partial is not None and dst.partial is not None:
        return src.partial.op is dst.partial.op
    return dst.partial is None or dst.partial.op is ReduceOp.SUM


def source_locals(
    g: np.ndarray, t: TensorType, mesh: MeshShape, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each rank's local array of ``g`` in type ``t``; pending values get random contributions
    whose reduction is ``g``'s block (sum: a random split; max/min: the block at one random
    member, strictly smaller/larger values elsewhere; prod: the block at one member, ones
    elsewhere)."""
    out = [g[local_block(t.shape, t.layout, mesh, r)].copy() for r in range(mesh.size)]
    p = t.layout.partial
    if p is None:
        return out
    for group in mesh.groups(p.axes):
        block = out[group[0]]
        keeper = group[int(rng.integers(len(group)))]
        rest = [r for r in group if r != keeper]
        for r in rest:
            noise = rng.integers(1, 6, size=block.shape).astype(block.dtype)
            if p.op is ReduceOp.SUM:
                out[r] = rng.integers(-9, 10, size=block.shape).astype(block.dtype)
            elif p.op is ReduceOp.MAX:
                out[r] = block - noise
            elif p.op is ReduceOp.MIN:
                out[r] = block + noise
            else:
                out[r] = np.ones_like(block)
        if p.op is ReduceOp.SUM:
            out[keeper] = block - sum((out[r] for r in rest), np.zeros_like(block))
    return out


def check_locals(
    g: np.ndarray, t: TensorType, mesh: MeshShape, arrays: Sequence[np.ndarray]
) -> None:
    """Assert that ``arrays`` are valid local arrays of ``g`` in type ``t`` (§7.1), exactly."""
    p = t.layout.partial
    for r in range(mesh.size):
        want = g[local_block(t.shape, t.layout, mesh, r)]
        if p is None:
            got = arrays[r]
        else:
            got = reduce_arrays([arrays[q] for q in mesh.group_of(r, p.axes)], p.op)
        assert got.shape == want.shape, (r, t, got.shape, want.shape)
        assert got.dtype == want.dtype
        assert np.array_equal(got, want), (r, t, got, want)


def run_specs(plan: RedistPlan, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Execute ``plan`` from per-rank specs only, as an MPI executor would: each rank knows its
    own spec; messages are the regions/pieces the specs name."""
    mesh, cur = plan.mesh, list(arrays)
    for step in plan.steps:
        specs = [rank_spec(step, mesh, r) for r in range(mesh.size)]
        nxt: list[np.ndarray] = []
        for r, spec in enumerate(specs):
            a = cur[r]
            if isinstance(spec, RelabelSpec):
                nxt.append(a)
            elif isinstance(spec, SliceSpec):
                nxt.append(a[spec.region].copy())
            elif isinstance(spec, MakePartialSpec):
                out = np.full(spec.out_shape, reduction_identity(spec.op, a.dtype), dtype=a.dtype)
                if spec.keep:
                    out[spec.region] = a
                nxt.append(out)
            elif isinstance(spec, AllgatherSpec):
                parts = [cur[q] for q in spec.group]
                assert [p.shape[spec.dim] for p in parts] == list(spec.extents)
                assert [p.size for p in parts] == list(spec.counts)
                nxt.append(np.concatenate(parts, axis=spec.dim))
            elif isinstance(spec, AllreduceSpec):
                assert all(cur[q].size == spec.count for q in spec.group)
                nxt.append(reduce_arrays([cur[q] for q in spec.group], spec.op))
            elif isinstance(spec, ReduceScatterSpec):
                s, n = spec.pieces[spec.position]
                idx = [slice(None)] * a.ndim
                idx[spec.dim] = slice(s, s + n)
                piece = reduce_arrays([cur[q][tuple(idx)] for q in spec.group], spec.op)
                assert piece.size == spec.counts[spec.position]
                nxt.append(piece)
            elif isinstance(spec, ExchangeSpec):
                out = np.full(spec.out_shape, np.nan if a.dtype.kind == "f" else 0, dtype=a.dtype)
                seen = np.zeros(spec.out_shape, dtype=np.int64)
                for recv in spec.recvs:
                    theirs = specs[recv.peer]
                    assert isinstance(theirs, ExchangeSpec)
                    (send,) = [s for s in theirs.sends if s.peer == r]
                    assert send.count == recv.count
                    out[recv.region] = cur[recv.peer][send.region]
                    seen[recv.region] += 1
                assert np.all(seen == 1), "exchange receives must tile the output exactly"
                nxt.append(out)
            else:  # pragma: no cover
                raise AssertionError(spec)
        cur = nxt
    return cur


def ir_infer(
    step_kind: StepKind, mesh: MeshShape, operand: TensorType, **attrs: object
) -> TensorType:
    """The result type the IR's op rule infers for a structured step."""
    name = step_kind.value
    op = Op(name, ("%y",), (operand,), ("%x",), tuple(attrs.items()))
    ir_mesh = MeshDecl("m", mesh.axes)
    module = Module((1, 0), "t", (ir_mesh,), ())
    opdef = lookup_op(name)
    assert opdef is not None
    (out,) = opdef.infer(OpContext(op, [operand], [operand], ir_mesh, module))
    return out


def tensor(shape: tuple[int, ...], layout: Layout, dtype: DType = DType.F64) -> TensorType:
    return TensorType(dtype, shape, layout)


def iter_cases() -> Iterator[tuple[str, tuple[int, ...], Layout, Layout]]:
    for mesh_name, mesh in MESHES.items():
        for shape in SHAPES:
            ls = layouts(mesh.axis_names, len(shape))
            for s in ls:
                for d in ls:
                    yield mesh_name, shape, s, d


IR_ATTRS = {
    StepKind.ALLGATHER: lambda s: {"axes": s.axes},
    StepKind.ALLREDUCE: lambda s: {"op": s.op.value, "axes": s.axes},
    StepKind.REDUCE_SCATTER: lambda s: {"op": s.op.value, "axes": s.axes, "dim": s.dim},
    StepKind.ALL_TO_ALL: lambda s: {"axes": s.axes, "src": s.dim, "dst": s.dst_dim},
}


def check_plan(plan: RedistPlan, rng: np.random.Generator, dtype: type = np.float64) -> None:
    """Everything a plan must satisfy: a chain from src to dst; IR types for IR collectives;
    the reference run and the spec-driven run both give valid local arrays of the same random
    global array; bytes sent == bytes received in total, per step as well."""
    mesh = plan.mesh
    types = [plan.src] + [s.out_type for s in plan.steps]
    assert [s.in_type for s in plan.steps] == types[:-1]
    assert types[-1] == plan.dst
    for step in plan.steps:
        attrs = IR_ATTRS.get(step.kind)
        if attrs is not None:
            assert ir_infer(step.kind, mesh, step.in_type, **attrs(step)) == step.out_type, step
        if step.kind in (
            StepKind.ALLGATHER,
            StepKind.ALL_TO_ALL,
            StepKind.REDUCE_SCATTER,
            StepKind.ALLREDUCE,
        ):
            assert mesh.group_size(step.axes) > 1, f"a collective over one rank: {step}"
        received = sum(step_traffic(step, mesh, r).received for r in range(mesh.size))
        sent = sum(step_traffic(step, mesh, r).sent for r in range(mesh.size))
        assert sent == received == step_volume(step, mesh), step
    ranks = range(mesh.size)
    assert sum(plan.bytes_sent(r) for r in ranks) == sum(plan.bytes_received(r) for r in ranks)
    assert all(plan.peak_extra_bytes(r) >= 0 for r in ranks)
    g = rng.integers(-40, 40, size=plan.src.shape).astype(dtype)
    src = source_locals(g, plan.src, mesh, rng)
    check_locals(g, plan.src, mesh, src)
    check_locals(g, plan.dst, mesh, apply_plan(plan, mesh, src))
    check_locals(g, plan.dst, mesh, run_specs(plan, src))
