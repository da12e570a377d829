"""The redistribution planner: every layout pair on small meshes with sizes that do not divide,
expected step kinds and collective counts, byte accounting, errors, and a property test."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sharding_helpers import MESHES, SHAPES, allowed, check_plan, layouts, tensor

from dtm_mpi.errors import LayoutError, PlanError
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.sharding import MeshShape, StepKind, plan_redistribute, step_traffic
from tests.depth import examples

K = StepKind
SUM, MAX = ReduceOp.SUM, ReduceOp.MAX
M22 = MESHES["2x2"]


def L(
    *dims: str | tuple[str, ...], partial: tuple[ReduceOp, tuple[str, ...]] | None = None
) -> Layout:
    """``L("dp", "-", ("tp","dp"))`` -> {dp,-,(tp,dp)}."""
    entries = tuple(() if d == "-" else (d,) if isinstance(d, str) else d for d in dims)
    return Layout(entries, Partial(*partial) if partial else None)


def kinds(src: TensorType, dst: Layout, mesh: MeshShape) -> list[StepKind]:
    return [s.kind for s in plan_redistribute(src, dst, mesh).steps]


# --- the acceptance test: every pair --------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_every_layout_pair(mesh_name: str, shape: tuple[int, ...]) -> None:
    mesh = MESHES[mesh_name]
    ls = layouts(mesh.axis_names, len(shape))
    rng = np.random.default_rng(len(shape) * 100 + mesh.size)
    planned = refused = 0
    for s in ls:
        for d in ls:
            src = tensor(shape, s)
            if not allowed(s, d):
                with pytest.raises(PlanError, match="cannot redistribute"):
                    plan_redistribute(src, d, mesh)
                refused += 1
                continue
            plan = plan_redistribute(src, d, mesh)
            check_plan(plan, rng)
            if s == d:
                assert plan.steps == ()
            planned += 1
    assert planned > 0 and refused > 0


# --- which steps, how many collectives -----------------------------------------------------


F = DType.F64


@pytest.mark.parametrize(
    ("mesh", "shape", "src", "dst", "want"),
    [
        # replicate -> shard is local
        ("4", (10,), L("-"), L("dp"), [K.SLICE]),
        ("2x2", (5, 7), L("-", "-"), L(("tp", "dp"), "-"), [K.SLICE]),
        # shard -> replicate: one allgather, divisible or not
        ("4", (8,), L("dp"), L("-"), [K.ALLGATHER]),
        ("4", (10,), L("dp"), L("-"), [K.ALLGATHER]),
        ("2x2", (10,), L(("tp", "dp")), L("-"), [K.ALLGATHER]),
        # pending -> replicated / sharded
        ("3", (10,), L("-", partial=(SUM, ("dp",))), L("-"), [K.ALLREDUCE]),
        ("3", (10,), L("-", partial=(MAX, ("dp",))), L("dp"), [K.REDUCE_SCATTER]),
        ("2x2", (8,), L("-", partial=(SUM, ("dp", "tp"))), L(("tp", "dp")), [K.REDUCE_SCATTER]),
        (
            "2x2",
            (8,),
            L("-", partial=(SUM, ("dp", "tp"))),
            L("tp", partial=(SUM, ("dp",))),
            [K.REDUCE_SCATTER],
        ),
        # moving a split between dims
        ("4", (8, 6), L("dp", "-"), L("-", "dp"), [K.ALL_TO_ALL]),
        ("2x2", (8, 4), L(("dp", "tp"), "-"), L("dp", "tp"), [K.ALL_TO_ALL]),
        ("2x2", (8, 4), L("-", "tp"), L("-", ("dp", "tp")), [K.EXCHANGE]),
        ("2x2", (8, 4), L("dp", "tp"), L("tp", "dp"), [K.EXCHANGE]),
        ("2x2", (8,), L(("dp", "tp")), L(("tp", "dp")), [K.EXCHANGE]),
        # nesting holds (n=8): the cheap structured step; it does not (n=10): exact fallback
        ("2x2", (8,), L(("dp", "tp")), L("dp"), [K.ALLGATHER]),
        ("2x2", (10,), L(("dp", "tp")), L("dp"), [K.EXCHANGE]),
        ("2x2", (8,), L("dp"), L(("dp", "tp")), [K.SLICE]),
        ("2x2", (10,), L("dp"), L(("dp", "tp")), [K.EXCHANGE]),
        ("2x2", (8, 4), L(("dp", "tp"), "-"), L("dp", "tp"), [K.ALL_TO_ALL]),
        ("2x2", (10, 4), L(("dp", "tp"), "-"), L("dp", "tp"), [K.EXCHANGE]),
        ("2x2", (8,), L("dp", partial=(SUM, ("tp",))), L(("dp", "tp")), [K.REDUCE_SCATTER]),
        ("2x2", (10,), L("dp", partial=(SUM, ("tp",))), L(("dp", "tp")), [K.ALLREDUCE, K.EXCHANGE]),
        # becoming pending: local, sharded axes are embedded without communication
        ("2x2", (5,), L("-"), L("-", partial=(SUM, ("tp", "dp"))), [K.MAKE_PARTIAL]),
        ("2x2", (5,), L("dp"), L("-", partial=(SUM, ("dp", "tp"))), [K.MAKE_PARTIAL]),
        ("2x2", (5,), L("dp"), L("tp", partial=(SUM, ("dp",))), [K.MAKE_PARTIAL, K.SLICE]),
        (
            "2x2",
            (5,),
            L("-", partial=(MAX, ("dp",))),
            L("-", partial=(MAX, ("dp", "tp"))),
            [K.MAKE_PARTIAL],
        ),
        # pending over other axes, same op
        (
            "2x2",
            (5,),
            L("-", partial=(SUM, ("dp",))),
            L("-", partial=(SUM, ("tp",))),
            [K.ALLREDUCE, K.MAKE_PARTIAL],
        ),
        (
            "2x2",
            (5,),
            L("-", partial=(SUM, ("dp", "tp"))),
            L("-", partial=(SUM, ("tp", "dp"))),
            [K.RELABEL],
        ),
        # reduce where the data is small: slice first, then reduce
        ("2x2", (5, 7), L("-", "-", partial=(SUM, ("tp",))), L("dp", "-"), [K.SLICE, K.ALLREDUCE]),
        # move the contributions, then reduce-scatter
        (
            "2x2",
            (8, 8),
            L("-", "dp", partial=(SUM, ("tp",))),
            L("dp", "tp"),
            [K.ALL_TO_ALL, K.REDUCE_SCATTER],
        ),
        # groups of one rank move nothing
        ("1", (5,), L("dp"), L("-"), [K.RELABEL]),
        ("1", (5,), L("-", partial=(SUM, ("dp",))), L("-"), [K.RELABEL]),
        ("2x2", (5,), L("dp"), L("dp"), []),
    ],
)
def test_planned_steps(
    mesh: str, shape: tuple[int, ...], src: Layout, dst: Layout, want: Sequence[StepKind]
) -> None:
    m = MESHES[mesh]
    plan = plan_redistribute(tensor(shape, src), dst, m)
    assert [s.kind for s in plan.steps] == list(want), str(plan)
    counts = {k: list(want).count(k) for k in want if k.is_collective}
    assert all(plan.collective_counts(r) == counts for r in range(m.size))
    check_plan(plan, np.random.default_rng(0))


def test_replicate_to_shard_moves_nothing() -> None:
    for mesh in MESHES.values():
        plan = plan_redistribute(tensor((5, 7), L("-", "-")), L("dp", "-"), mesh)
        for r in range(mesh.size):
            assert plan.collective_counts(r) == {}
            assert plan.bytes_sent(r) == plan.bytes_received(r) == plan.peak_extra_bytes(r) == 0


# --- accounting -------------------------------------------------------------------------------


def test_allgather_bytes() -> None:
    mesh = MESHES["4"]
    plan = plan_redistribute(tensor((10, 2), L("dp", "-"), DType.F32), L("-", "-"), mesh)
    own = [3, 3, 3, 1]  # rows per rank
    for r in range(4):
        assert plan.bytes_sent(r) == 3 * own[r] * 2 * 4
        assert plan.bytes_received(r) == (10 - own[r]) * 2 * 4
        assert plan.peak_extra_bytes(r) == 0  # dim 0: received blocks land in place
    plan = plan_redistribute(tensor((2, 10), L("-", "dp"), DType.F32), L("-", "-"), mesh)
    assert plan.peak_extra_bytes(0) == 2 * 10 * 4  # a staging buffer for the rearrangement


def test_allreduce_and_reduce_scatter_bytes() -> None:
    mesh = MESHES["4"]
    pending = tensor((8,), L("-", partial=(SUM, ("dp",))))
    plan = plan_redistribute(pending, L("-"), mesh)
    # m = 8 elements, k = 4, piece p = 2: (m - p) + (k - 1) * p = 12 elements each way
    assert [plan.bytes_sent(r) for r in range(4)] == [12 * 8] * 4
    assert [plan.bytes_received(r) for r in range(4)] == [12 * 8] * 4
    plan = plan_redistribute(tensor((10,), L("-", partial=(SUM, ("dp",)))), L("dp"), mesh)
    own = [3, 3, 3, 1]
    assert [plan.bytes_sent(r) for r in range(4)] == [(10 - o) * 8 for o in own]
    assert [plan.bytes_received(r) for r in range(4)] == [3 * o * 8 for o in own]


def test_exchange_bytes_and_staging() -> None:
    plan = plan_redistribute(tensor((8, 4), L("dp", "tp")), L("tp", "dp"), M22)
    # ranks (0,0) and (1,1) already hold their new block; the others swap 4x2 blocks
    assert [plan.bytes_sent(r) for r in range(4)] == [0, 64, 64, 0]
    assert [plan.bytes_received(r) for r in range(4)] == [0, 64, 64, 0]
    assert [plan.peak_extra_bytes(r) for r in range(4)] == [0, 128, 128, 0]


def test_intermediate_arrays_count_toward_peak() -> None:
    plan = plan_redistribute(tensor((10,), L("dp", partial=(SUM, ("tp",)))), L(("dp", "tp")), M22)
    assert [s.kind for s in plan.steps] == [K.ALLREDUCE, K.EXCHANGE]
    for r in range(4):
        # the allreduce result (5 elements) lives between the steps, plus exchange buffers
        t = step_traffic(plan.steps[1], M22, r)
        assert plan.peak_extra_bytes(r) == 5 * 8 + t.staging


# --- errors -----------------------------------------------------------------------------------


def test_refused_conversions_name_both_types() -> None:
    src = tensor((4,), L("-", partial=(MAX, ("dp",))))
    with pytest.raises(
        PlanError, match=r"f64\[4\] partial\(max: dp\) to f64\[4\] partial\(sum: dp\).*keeps its op"
    ):
        plan_redistribute(src, L("-", partial=(SUM, ("dp",))), M22)
    with pytest.raises(PlanError, match=r"can only become partial\(sum"):
        plan_redistribute(tensor((4,), L("-")), L("-", partial=(MAX, ("dp",))), M22)


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        (L("ep"), L("-"), "source: .*no axis 'ep'"),
        (L("-"), L(("dp", "dp")), "target: .*'dp' is used more than once"),
        (L("-"), L("-", "-"), "target: .*one entry per dimension"),
        (L("dp", partial=(SUM, ("dp",))), L("-"), "source: .*'dp' is used more than once"),
    ],
)
def test_bad_layouts(src: Layout, dst: Layout, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        plan_redistribute(tensor((4,), src), dst, M22)


def test_plans_are_cached_and_printable() -> None:
    src = tensor((6,), L("dp"))
    a = plan_redistribute(src, L("-"), M22)
    assert plan_redistribute(src, L("-"), M22) is a
    assert str(a).splitlines() == [
        "redistribute f64[6]{dp} -> f64[6] on [dp=2, tp=2]",
        "  allgather on dp dim 0: f64[6]{dp} -> f64[6]",
    ]


# --- property test ----------------------------------------------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> tuple[TensorType, Layout, MeshShape]:
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    mesh = MeshShape(
        tuple((name, n) for name, n in zip(("x", "y", "z")[: len(sizes)], sizes, strict=True))
    )
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    dtype = draw(st.sampled_from([DType.F64, DType.I32]))

    def layout(op: ReduceOp | None) -> Layout:
        dims: list[tuple[str, ...]] = [()] * len(shape)
        pending: list[str] = []
        for axis in draw(st.permutations(mesh.axis_names)):
            role = draw(st.integers(-2, len(shape) - 1))
            if role >= 0:
                dims[role] = dims[role] + (axis,)
            elif role == -2 and op is not None:
                pending.append(axis)
        return Layout(tuple(dims), Partial(op, tuple(pending)) if pending else None)

    src_op = draw(st.sampled_from([None, SUM, MAX, ReduceOp.MIN]))
    src = layout(src_op)
    dst_op = src.partial.op if src.partial else SUM
    dst = layout(draw(st.sampled_from([None, dst_op])))
    return TensorType(dtype, shape, src), dst, mesh


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 2**32 - 1))
def test_random_layouts(case: tuple[TensorType, Layout, MeshShape], seed: int) -> None:
    src, dst, mesh = case
    plan = plan_redistribute(src, dst, mesh)
    dtype = np.float64 if src.dtype is DType.F64 else np.int32
    check_plan(plan, np.random.default_rng(seed), dtype)


@pytest.mark.parametrize("mesh_name", ["3", "2x2"])
def test_exchange_traffic_counted_for_the_group_at_once_is_each_ranks_spec(
    mesh_name: str,
) -> None:
    # step_traffic counts an exchange's transfers for all peers at once (numpy); the rank's
    # own exchange spec (what the runtime sends) must give the same bytes, on every pair
    from dtm_mpi.sharding.steps import ExchangeSpec, exchange_traffic, rank_spec

    mesh = MESHES[mesh_name]
    seen = 0
    for shape in SHAPES:
        ls = layouts(mesh.axis_names, len(shape))
        for s in ls:
            for d in ls:
                if not allowed(s, d):
                    continue
                for step in plan_redistribute(tensor(shape, s), d, mesh).steps:
                    if step.kind not in (K.EXCHANGE, K.ALL_TO_ALL):
                        continue
                    for r in range(mesh.size):
                        spec = rank_spec(step, mesh, r)
                        assert isinstance(spec, ExchangeSpec)
                        want = exchange_traffic(spec, r, step.in_type.dtype.itemsize)
                        got = step_traffic(step, mesh, r)
                        assert (got.sent, got.received) == want, (shape, s, d, r)
                        seen += 1
    assert seen > 0
