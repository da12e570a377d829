"""The step-kind table: every :class:`StepKind` has its one entry in ``STEP_KINDS`` -- spec
builder, traffic formula, reference semantics in ``sharding.collectives`` -- and an
implementation on every communicator (or, for a local kind, a per-rank function), and the
executor runs each kind through the table."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from dtm_mpi.comm.device import DeviceComm
from dtm_mpi.comm.interface import Comm
from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.sim import SimComm, run_ranks
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.runtime.executor import STEP_RUNNERS, run_redistribution
from dtm_mpi.sharding import collectives
from dtm_mpi.sharding.blocks import local_shape
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import RedistPlan, plan_redistribute
from dtm_mpi.sharding.steps import STEP_KINDS, StepKind, rank_spec, step_traffic

COMMUNICATORS = (Comm, SimComm, MpiComm, DeviceComm)


@pytest.mark.parametrize("kind", list(StepKind), ids=str)
def test_every_kind_has_its_entry(kind: StepKind) -> None:
    rule = STEP_KINDS.get(kind)
    assert rule is not None, f"StepKind.{kind.name} has no STEP_KINDS entry"
    assert rule.kind is kind
    assert callable(rule.build) and callable(rule.traffic)
    reference = getattr(collectives, rule.reference, None)
    assert callable(reference), f"{kind}: no reference {rule.reference!r} in collectives"
    assert kind in STEP_RUNNERS


@pytest.mark.parametrize("kind", list(StepKind), ids=str)
def test_every_kind_has_an_implementation(kind: StepKind) -> None:
    rule = STEP_KINDS[kind]
    if not kind.is_collective:
        local = getattr(collectives, rule.method, None)
        assert callable(local), f"{kind}: no local function {rule.method!r} in collectives"
        inspect.signature(local).bind(np.zeros(1), object(), np.full)
        return
    assert not rule.method.startswith("_")
    for cls in COMMUNICATORS:
        method = getattr(cls, rule.method, None)
        assert callable(method), f"{kind}: {cls.__name__} has no method {rule.method!r}"
        # the executor calls method(x, axes, spec, *args)
        inspect.signature(method).bind(object(), np.zeros(1), ("a",), object(), *rule.args)


def test_table_has_no_other_keys() -> None:
    assert set(STEP_KINDS) == set(StepKind)
    assert set(STEP_RUNNERS) == set(StepKind)


F32 = DType.F32
MESH = MeshShape((("a", 2), ("b", 2)))
SUM_A = Partial(ReduceOp.SUM, ("a",))
R2: tuple[tuple[str, ...], ...] = ((), ())

CASES = [  # (src, dst layout): together they take every step kind
    (Layout((("a",), ())), Layout(R2)),  # allgather
    (Layout(R2, SUM_A), Layout(R2)),  # allreduce
    (Layout(R2, SUM_A), Layout((("a",), ()))),  # reduce_scatter
    (Layout(R2), Layout((("a",), ()))),  # slice
    (Layout((("a",), ())), Layout(((), ("a",)))),  # all_to_all
    (Layout((("a", "b"), ())), Layout((("b",), ()))),  # exchange
    (Layout(R2), Layout(R2, SUM_A)),  # make_partial
    (Layout((("a",), ())), Layout((("b",), ()))),
]


def test_specs_and_runners_follow_the_table() -> None:
    """Each planned step's spec is of its entry's class, its traffic is the entry's formula,
    and every rank running the plan through the table (the simulator) matches the reference."""
    seen: set[StepKind] = set()
    rng = np.random.default_rng(0)
    for src_layout, dst in CASES:
        src = TensorType(F32, (7, 5), src_layout)
        plan = plan_redistribute(src, dst, MESH)
        for step in plan.steps:
            seen.add(step.kind)
            rule = STEP_KINDS[step.kind]
            for r in range(MESH.size):
                assert isinstance(rank_spec(step, MESH, r), rule.spec)
                assert step_traffic(step, MESH, r) == rule.traffic(step, MESH, r)
        blocks = [
            rng.integers(-9, 10, size=local_shape(src.shape, src.layout, MESH, r)).astype(
                np.float32
            )
            for r in range(MESH.size)
        ]
        want = collectives.apply_plan(plan, MESH, blocks)

        def body(
            comm: SimComm, plan: RedistPlan = plan, blocks: list[np.ndarray] = blocks
        ) -> np.ndarray:
            r = comm.rank
            return run_redistribution(plan, plan.rank_specs(r), blocks[r], comm)

        got = run_ranks(MESH, body, timeout_s=20)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert set(StepKind) - {StepKind.RELABEL} <= seen, seen
