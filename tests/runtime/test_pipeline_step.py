"""A pipelined training step on simulated ranks (dtm_mpi.runtime.pipeline_step): stages over a
``pp`` axis with dp and tp, every schedule, run by the one interpreter with sends and receives
along pp; the loss the same bits on every rank and the gradients those of the unpipelined step
(to float64 rounding)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.comm.sim import run_ranks
from dtm_mpi.config import get_config
from dtm_mpi.errors import RemoteFailureError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.frontend.stage_split import step_stages_of
from dtm_mpi.plan.schedule import (
    PipelineShape,
    Recv,
    ScheduleKind,
    StageCosts,
    plan_schedule,
    time_schedule,
)
from dtm_mpi.runtime.pipeline_step import PipelineRank, StepOutcome
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.sharding.mesh import MeshShape
from tests.pipeline_case import assembled, gpt, lm_loss, token_batch, token_inputs, unpipelined

BATCH = 8
INPUTS = token_inputs(BATCH)
_model, _loss = gpt, lm_loss


def _batch() -> dict[str, np.ndarray]:
    return token_batch(BATCH, 7)


def _step(rank: PipelineRank, batch: dict[str, np.ndarray]) -> StepOutcome:
    """One step of ``rank`` on its blocks of the global ``batch``."""
    return rank.step(rank.batch_blocks(batch))


def _unpipelined(mesh: dtm.Mesh) -> tuple[float, dict[str, np.ndarray]]:
    return unpipelined(_model(), _loss, mesh, INPUTS, _batch())


def _same_state(
    final: dict[str, np.ndarray],
    blocks: list[dict[str, np.ndarray]],
    stages: object,
    shape: MeshShape,
    inputs: object,
) -> None:
    """The ranks' blocks of every parameter and optimizer state, put together, are the
    unpipelined run's final values (to float64 rounding)."""
    types = {p.name: p.type for p in stages.params}  # type: ignore[attr-defined]
    for name, want in final.items():
        if name[1:] in inputs:  # type: ignore[operator]
            continue
        got = assembled(blocks, name, want, types[name].layout, shape)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=name)


CASES = [
    ("pp2", {"pp": 2}, ["blocks.2"], ScheduleKind.ONE_F_ONE_B, 1),
    ("pp4", {"pp": 4}, ["blocks.1", "blocks.2", "blocks.3"], ScheduleKind.ONE_F_ONE_B, 1),
    ("dp2xpp2", {"pp": 2, "dp": 2}, ["blocks.2"], ScheduleKind.GPIPE, 1),
    ("tp2xpp2", {"pp": 2, "tp": 2}, ["blocks.2"], ScheduleKind.ZB_H1, 1),
    ("pp2x2chunks", {"pp": 2}, ["blocks.1", "blocks.2", "blocks.3"], ScheduleKind.INTERLEAVED, 2),
]


@pytest.mark.parametrize(
    ("sizes", "splits", "kind", "chunks"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("m", [2, 4])
def test_a_pipelined_step_gives_the_unpipelined_gradients_and_one_loss_everywhere(
    sizes: dict[str, int], splits: list[str], kind: ScheduleKind, chunks: int, m: int
) -> None:
    full = {"pp": 1, "dp": 1, "tp": 1, **sizes}
    mesh = dtm.Mesh(**full)
    shape = MeshShape(tuple(full.items()))
    stages = step_stages_of(
        _model(), _loss, mesh=mesh, inputs=INPUTS, splits=splits, microbatches=m
    )
    schedule = plan_schedule(kind, PipelineShape(full["pp"], m, chunks))
    batch = _batch()
    outcomes: list[StepOutcome] = run_ranks(
        shape,
        lambda comm: _step(PipelineRank(stages, schedule, mesh.ir(), shape, comm), batch),
        timeout_s=60,
    )
    want_loss, want = _unpipelined(mesh)
    assert len({o.loss.hex() for o in outcomes}) == 1  # the same bits on every rank
    np.testing.assert_allclose(outcomes[0].loss, want_loss, rtol=1e-13)
    types = {p.name: p.type for p in stages.params}
    for name, g in want.items():  # (replicas over dp hold the same blocks)
        got = assembled([o.grads for o in outcomes], name, g, types[name].layout, shape)
        np.testing.assert_allclose(got, g, rtol=1e-10, atol=1e-14, err_msg=name)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("nothing", r"deterministic mode runs a pipeline.s weight passes on the whole batch"),
        ("stages only", r"give the whole-batch stages and their plans together"),
    ],
)
def test_deterministic_mode_without_the_whole_batch_stages_is_refused(
    monkeypatch: pytest.MonkeyPatch, given: str, message: str
) -> None:
    """(With ``microbatch_sums=True`` each microbatch's passes run exact sums instead: an IR
    forward's pipeline, tests/frontend/test_ir_step.py.)"""
    monkeypatch.setenv("DTM_DETERMINISTIC", "1")
    get_config.cache_clear()
    try:
        mesh = dtm.Mesh(pp=2, dp=1, tp=1)
        shape = MeshShape((("pp", 2), ("dp", 1), ("tp", 1)))
        stages = step_stages_of(
            _model(), _loss, mesh=mesh, inputs=INPUTS, splits=["blocks.2"], microbatches=2
        )
        schedule = plan_schedule(ScheduleKind.ONE_F_ONE_B, PipelineShape(2, 2))
        whole = stages if given == "stages only" else None
        with pytest.raises(RemoteFailureError, match=message):
            run_ranks(
                shape,
                lambda comm: PipelineRank(stages, schedule, mesh.ir(), shape, comm, whole=whole),
                timeout_s=30,
            )
    finally:
        monkeypatch.delenv("DTM_DETERMINISTIC")
        get_config.cache_clear()


@pytest.mark.parametrize(
    ("sizes", "splits", "kind", "chunks", "clip"),
    [
        ({"pp": 2, "tp": 2}, ["blocks.2"], ScheduleKind.ONE_F_ONE_B, 1, None),
        ({"pp": 4}, ["blocks.1", "blocks.2", "blocks.3"], ScheduleKind.ZB_H1, 1, None),
        (
            {"pp": 2, "dp": 2},
            ["blocks.1", "blocks.2", "blocks.3"],
            ScheduleKind.INTERLEAVED,
            2,
            None,
        ),
        ({"pp": 2, "tp": 2}, ["blocks.2"], ScheduleKind.ZB_H1, 1, 0.05),
        (
            {"pp": 2, "dp": 2},
            ["blocks.1", "blocks.2", "blocks.3"],
            ScheduleKind.INTERLEAVED,
            2,
            0.05,
        ),
    ],
    ids=[
        "tp2xpp2-1f1b",
        "pp4-zb-h1",
        "dp2xpp2-interleaved",
        "tp2xpp2-zb-h1-clipped",
        "dp2xpp2-interleaved-clipped",
    ],
)
def test_pipelined_training_steps_follow_the_unpipelined_training(
    sizes: dict[str, int], splits: list[str], kind: ScheduleKind, chunks: int, clip: float | None
) -> None:
    """Three AdamW steps: the optimizer runs once per step on each stage's summed gradients
    (clipped by their global norm: each stage's square sum added over pp); the parameters and
    the optimizer's state end where train_step's do (float64 rounding)."""
    full = {"pp": 1, "dp": 1, "tp": 1, **sizes}
    mesh = dtm.Mesh(**full)
    shape = MeshShape(tuple(full.items()))
    opt = dtm.optim.AdamW(lr=1e-2)
    stages = step_stages_of(
        _model(),
        _loss,
        mesh=mesh,
        inputs=INPUTS,
        splits=splits,
        microbatches=4,
        optimizer=opt,
        clip_norm=clip,
    )
    schedule = plan_schedule(kind, PipelineShape(full["pp"], 4, chunks))
    batch = _batch()

    def train(comm: object) -> tuple[list[float], dict[str, np.ndarray]]:
        rank = PipelineRank(stages, schedule, mesh.ir(), shape, comm)  # type: ignore[arg-type]
        losses = [rank.step(rank.batch_blocks(batch), i).loss for i in range(3)]
        return losses, rank.blocks

    outcomes = run_ranks(shape, train, timeout_s=60)
    step = dtm.train_step(_model(), _loss, mesh=mesh, inputs=INPUTS, optimizer=opt, clip_norm=clip)
    final, history = run_reference(step.module, batch, steps=3)
    want_losses = [float(h[0]) for h in history]
    for losses, _ in outcomes:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    names = {p.name for p in stages.params}
    assert names - {f"%{k}" for k in INPUTS} == set(final) - {f"%{k}" for k in INPUTS}
    _same_state(final, [b for _, b in outcomes], stages, shape, INPUTS)
    if clip is not None:  # the clip acted: unclipped training ends elsewhere
        unclipped = dtm.train_step(_model(), _loss, mesh=mesh, inputs=INPUTS, optimizer=opt)
        free, _ = run_reference(unclipped.module, batch, steps=3)
        assert not np.allclose(free["%head.weight"], final["%head.weight"], rtol=1e-6)


class _Skip(dtm.nn.Module):
    """Three layers; the first one's output is added after the last (a skip connection over
    the middle stage, relayed through it), tensor-parallel in the middle."""

    def __init__(self) -> None:
        self.a = dtm.nn.Linear(8, 16, dtype="f64")
        self.b = dtm.nn.Sequential(
            dtm.nn.ColumnParallelLinear(16, 32, dtype="f64"),
            fn.gelu,
            dtm.nn.RowParallelLinear(32, 16, dtype="f64"),
        )
        self.c = dtm.nn.Linear(16, 16, dtype="f64")

    def forward(self, x: dtm.Tensor) -> dtm.Tensor:
        h = fn.gelu(self.a(x))
        out: dtm.Tensor = self.c(fn.gelu(self.b(h))) + h
        return out


def _cls_loss(m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
    return fn.cross_entropy(m(x), y)


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1])
def test_a_skip_connection_over_a_stage_is_relayed_and_trains_as_unpipelined(
    kind: ScheduleKind,
) -> None:
    inputs = {"x": dtm.Input((12, 8), "f64", ("dp", None)), "y": dtm.Input((12,), "i32", ("dp",))}
    mesh = dtm.Mesh(pp=3, dp=1, tp=2)
    shape = MeshShape((("pp", 3), ("dp", 1), ("tp", 2)))
    opt = dtm.optim.SGD(lr=0.1, momentum=0.9)
    stages = step_stages_of(
        _Skip(),
        _cls_loss,
        mesh=mesh,
        inputs=inputs,
        splits=["b", "c"],
        microbatches=3,
        optimizer=opt,
    )
    assert any(r.dst == (1, 2) for r in stages.partition.routes)  # the skip connection
    rng = np.random.default_rng(3)
    batch = {"x": rng.standard_normal((12, 8)), "y": rng.integers(0, 16, 12).astype(np.int32)}
    schedule = plan_schedule(kind, PipelineShape(3, 3))

    def train(comm: object) -> tuple[list[float], dict[str, np.ndarray]]:
        rank = PipelineRank(stages, schedule, mesh.ir(), shape, comm)  # type: ignore[arg-type]
        return [rank.step(rank.batch_blocks(batch), i).loss for i in range(3)], rank.blocks

    outcomes = run_ranks(shape, train, timeout_s=60)
    step = dtm.train_step(_Skip(), _cls_loss, mesh=mesh, inputs=inputs, optimizer=opt)
    final, history = run_reference(step.module, batch, steps=3)
    np.testing.assert_allclose(outcomes[0][0], [float(h[0]) for h in history], rtol=1e-12)
    _same_state(final, [b for _, b in outcomes], stages, shape, inputs)


def test_more_messages_than_tags_is_refused_before_any_step() -> None:
    """Every boundary message of a step has its own tag below the runtime's reserved ones: a
    schedule that would need more is one error naming the fix, on every rank."""
    mesh = dtm.Mesh(pp=2, dp=1, tp=1)
    shape = MeshShape((("pp", 2), ("dp", 1), ("tp", 1)))
    stages = step_stages_of(
        _model(), _loss, mesh=mesh, inputs=INPUTS, splits=["blocks.2"], microbatches=2
    )
    schedule = plan_schedule(ScheduleKind.GPIPE, PipelineShape(2, 8200))
    with pytest.raises(
        RemoteFailureError,
        match=r"need more than 32761 message tags \(fewer microbatches or stages\)",
    ):
        run_ranks(
            shape, lambda comm: PipelineRank(stages, schedule, mesh.ir(), shape, comm), timeout_s=60
        )


class _Clocked:
    """A simulated rank's comm with a clock of the cost model's time: a send stamps its
    message's arrival (the sender's time plus the transfer time), a receive waits for it and
    then takes its receiving time, a pass (:class:`_TimedRank`) adds its cost."""

    def __init__(
        self, inner: Any, costs: list[StageCosts], arrivals: dict[tuple[int, int, int], float]
    ) -> None:
        self.inner, self.costs, self.arrivals = inner, costs, arrivals
        self.clock = self.busy = 0.0
        self.receives = 0
        self.spans: list[tuple[float, float, Any]] = []  # each pass: start, end, action

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, x: np.ndarray, peer: int, tag: int) -> None:
        self.arrivals[(self.inner.rank, peer, tag)] = self.clock + self.costs[0].transfer
        self.inner.send(x, peer, tag)  # (stamped first: the receiver finds the stamp)

    def recv(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], peer: int, tag: int
    ) -> np.ndarray:
        out = self.inner.recv(shape, dtype, peer, tag)
        arrival = self.arrivals[(peer, self.inner.rank, tag)]
        self.clock = max(self.clock, arrival) + self.costs[0].receive
        self.receives += 1
        return out  # type: ignore[no-any-return]


class _TimedRank(PipelineRank):
    """A pipeline rank whose passes advance its comm's clock by their cost-model time."""

    def _compute(self, c: Any, env: Any, grads: Any, loss: Any, step: int) -> Any:
        out = super()._compute(c, env, grads, loss, step)
        clocked = self.comm
        assert isinstance(clocked, _Clocked)
        cost = clocked.costs[c.stage].of(c.work)
        clocked.spans.append((clocked.clock, clocked.clock + cost, c))
        clocked.clock += cost
        clocked.busy += cost
        return out


TIMED = [
    (p, kind, 2 if kind is ScheduleKind.INTERLEAVED else 1, 2 * p)
    for p in (2, 3, 4)
    for kind in ScheduleKind
]


@pytest.mark.parametrize(
    ("p", "kind", "chunks", "m"), TIMED, ids=[f"pp{c[0]}-{c[1].value}-m{c[3]}" for c in TIMED]
)
def test_the_runtime_idles_as_the_plan_predicts_under_the_cost_model(
    p: int, kind: ScheduleKind, chunks: int, m: int
) -> None:
    """Beyond the cores at hand, the bubble is measured by the cost model: each simulated
    rank runs the real pipelined step (its passes, sends and receives in the runtime's order)
    on a clock of cost-model time; its idle time is exactly the plan's predicted time-line,
    so the runtime waits for no message the plan does not (at 3 and 4 ranks too)."""
    n_stages = p * chunks
    layers = n_stages  # a block per stage
    splits = [f"blocks.{k}" for k in range(1, n_stages)]
    mesh = dtm.Mesh(pp=p, dp=1, tp=1)
    shape = MeshShape((("pp", p), ("dp", 1), ("tp", 1)))
    model = dtm.nn.GPT(11, 6, 12, 6, layers, dtype="f64")
    inputs = token_inputs(2 * m)  # microbatches of 2 rows
    stages = step_stages_of(model, _loss, mesh=mesh, inputs=inputs, splits=splits, microbatches=m)
    # uneven stages: the first and the last cost more (embedding, loss head)
    costs = [
        StageCosts(1.0 + 0.25 * (s in (0, n_stages - 1)), 1.5, 0.75, transfer=0.3, receive=0.1)
        for s in range(n_stages)
    ]
    schedule = plan_schedule(kind, PipelineShape(p, m, chunks), costs)
    arrivals: dict[tuple[int, int, int], float] = {}
    batch = token_batch(2 * m, 3)

    def rank_fn(comm: Any) -> tuple[float, float, int, list[tuple[float, float, Any]]]:
        clocked = _Clocked(comm, costs, arrivals)
        runner = _TimedRank(stages, schedule, mesh.ir(), shape, clocked)
        # the step's sends and receives are the schedule's; the loss's publication after
        # it is not (the clock stops at the schedule's end)
        clocked.clock = clocked.busy = 0.0
        outcome = runner.step(runner.batch_blocks(batch))
        assert np.isfinite(outcome.loss)
        return clocked.clock, clocked.busy, clocked.receives, clocked.spans

    ends = run_ranks(shape, rank_fn, timeout_s=60)
    timing = time_schedule(schedule, costs)
    recvs = [sum(isinstance(a, Recv) for a in acts) for acts in schedule.actions]
    assert [e[2] for e in ends] == recvs  # one message per boundary here
    for r, (_, _, _, spans) in enumerate(ends):  # every pass where the time-line has it
        want = [(s.start, s.end, s.compute) for s in timing.spans[r]]
        assert [a for _, _, a in spans] == [a for _, _, a in want], r
        assert [(a, b) for a, b, _ in spans] == pytest.approx([(a, b) for a, b, _ in want])
    makespan = max(e[0] for e in ends)
    assert makespan == pytest.approx(timing.makespan, rel=1e-12)
    assert [e[1] for e in ends] == pytest.approx(list(timing.busy), rel=1e-12)
    bubble = 1 - sum(e[1] for e in ends) / (p * makespan)
    assert bubble == pytest.approx(timing.bubble, rel=1e-12) and bubble > 0


def test_the_gradients_data_parallel_sums_run_once_per_step_whatever_the_microbatches() -> None:
    """dp=2 x pp=2: each weight pass returns its gradients pending, the microbatches' local
    sums are added, and each stage's reduce pass sums them over dp once per step: a step's
    allreduces are ``m A + P`` for ``m`` microbatches (``A`` those inside the passes, per
    microbatch), where ``P`` is the stage's gradients, not ``m (A + P)``."""
    full = {"pp": 2, "dp": 2, "tp": 1}
    mesh = dtm.Mesh(**full)
    shape = MeshShape(tuple(full.items()))
    batch = _batch()

    def calls(m: int) -> list[int]:
        stages = step_stages_of(
            _model(),
            _loss,
            mesh=mesh,
            inputs=INPUTS,
            splits=["blocks.1"],
            microbatches=m,
            optimizer=dtm.optim.AdamW(lr=1e-2),
        )
        for s in stages.passes:
            w = s.weight_grad.function
            assert all(r.type.layout.partial is not None for r in w.results), s.index
            assert s.reduce_grads is not None and s.reduce_grads.carries == s.params
        schedule = plan_schedule(ScheduleKind.ONE_F_ONE_B, PipelineShape(2, m, 1))

        def train(comm: Any) -> int:
            rank = PipelineRank(stages, schedule, mesh.ir(), shape, comm)
            rank.step(rank.batch_blocks(batch), 0)
            before = comm.stats.settle().calls["allreduce"]
            rank.step(rank.batch_blocks(batch), 1)
            return int(comm.stats.settle().calls["allreduce"]) - before

        return list(run_ranks(shape, train, timeout_s=60))

    c1, c2, c4 = calls(1), calls(2), calls(4)
    stages = step_stages_of(
        _model(), _loss, mesh=mesh, inputs=INPUTS, splits=["blocks.1"], microbatches=1
    )
    for rank in range(shape.size):
        per_micro, per_step = c2[rank] - c1[rank], 2 * c1[rank] - c2[rank]
        stage = shape.index_along(rank, ("pp",))
        assert per_step == len(stages.passes[stage].params), (rank, c1, c2)
        assert c4[rank] == 4 * per_micro + per_step, (rank, c1, c2, c4)
