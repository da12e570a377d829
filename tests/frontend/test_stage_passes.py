"""The passes of a training step's pipeline stages (dtm_mpi.ir.stages.step_stages): per stage
a forward, an input-gradient and a weight-gradient function, verified IR, which -- run for
each microbatch in the order a schedule gives (evaluated by the single-process reference, on
global values) -- give the loss and gradients of the unpipelined step: bit for bit with one
microbatch, to float64 rounding with more."""

from __future__ import annotations

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.frontend.stage_split import step_stages_of
from dtm_mpi.ir.stages import StagePass, StepStages, pass_module
from dtm_mpi.plan.schedule import PipelineShape, ScheduleKind, Work, plan_schedule, time_schedule
from dtm_mpi.runtime.reference import evaluate_function
from dtm_mpi.runtime.values import init_global
from tests.pipeline_case import T, gpt, lm_loss, token_batch, token_inputs, unpipelined

BATCH = 8
INPUTS = token_inputs(BATCH)
MESH = dtm.Mesh(dp=1, tp=1)
_model, _loss = gpt, lm_loss


def _data() -> dict[str, np.ndarray]:
    return token_batch(BATCH, 5)


def _unpipelined(mesh: dtm.Mesh = MESH) -> tuple[float, dict[str, np.ndarray]]:
    return unpipelined(_model(), _loss, mesh, INPUTS, _data())


def _pipelined(
    stages: StepStages, kind: ScheduleKind, m: int, chunks: int, mesh: dtm.Mesh = MESH
) -> tuple[float, dict[str, np.ndarray]]:
    """Every microbatch through every stage's passes, in the order the schedule's predicted
    time-line gives (one environment per microbatch carries the routed values)."""
    passes = stages.passes
    modules = {
        id(f): pass_module(f.function, mesh.ir(), f.function.name)  # each pass verified
        for p in passes
        for f in (p.forward, p.input_grad, p.weight_grad)
    }
    params = {p.name: init_global(p) for p in stages.params if p.name[1:] not in INPUTS}
    data, b = _data(), BATCH // m
    env = [{**{f"%{k}": v[i * b : (i + 1) * b] for k, v in data.items()}} for i in range(m)]
    grads: dict[str, np.ndarray] = {}
    loss = 0.0
    schedule = plan_schedule(kind, PipelineShape(len(passes) // chunks, m, chunks))
    timing = time_schedule(schedule)
    order = sorted(
        (s for row in timing.spans for s in row), key=lambda s: (s.start, s.compute.stage)
    )

    def run(f: StagePass, i: int) -> None:
        nonlocal loss
        vals = {**params, **env[i]}
        module = modules[id(f)]
        g = module.functions[0]
        out = evaluate_function(module, g, tuple(vals[p.name] for p in g.params), 0)
        for name, v in zip(f.carries, out, strict=True):
            env[i][name] = v
            if name == stages.loss:
                loss += float(v)

    for span in order:
        c = span.compute
        p = passes[c.stage]
        if c.work is Work.F:
            run(p.forward, c.microbatch)
        if c.work in (Work.B, Work.I):
            run(p.input_grad, c.microbatch)
        if c.work in (Work.B, Work.W):
            run(p.weight_grad, c.microbatch)
            for name, g in zip(p.params, p.weight_grad.carries, strict=True):
                grads[name] = (
                    grads[name] + env[c.microbatch][g] if name in grads else env[c.microbatch][g]
                )
    return loss, grads


@pytest.mark.parametrize(
    ("kind", "splits", "chunks"),
    [
        (ScheduleKind.GPIPE, ["blocks.2"], 1),
        (ScheduleKind.ONE_F_ONE_B, ["blocks.1", "blocks.2", "blocks.3"], 1),
        (ScheduleKind.ZB_H1, ["blocks.1", "blocks.3"], 1),
        (ScheduleKind.INTERLEAVED, ["blocks.1", "blocks.2", "blocks.3"], 2),
    ],
    ids=["gpipe-2", "1f1b-4", "zb-h1-3", "interleaved-2x2"],
)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_stage_passes_in_schedule_order_give_the_unpipelined_loss_and_gradients(
    kind: ScheduleKind, splits: list[str], chunks: int, m: int
) -> None:
    if kind is ScheduleKind.INTERLEAVED and m % 2:
        pytest.skip("the interleaved schedule takes microbatches in multiples of its ranks")
    stages = step_stages_of(
        _model(), _loss, mesh=MESH, inputs=INPUTS, splits=splits, microbatches=m
    )
    want_loss, want = _unpipelined()
    loss, grads = _pipelined(stages, kind, m, chunks)
    assert set(grads) == set(want)
    if m == 1:  # the same ops on the same values
        assert loss == want_loss
        for k, g in want.items():
            assert grads[k].tobytes() == g.tobytes(), k
    else:
        np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
        for k, g in want.items():
            np.testing.assert_allclose(grads[k], g, rtol=1e-10, atol=1e-14, err_msg=k)


def test_each_stage_sends_the_residual_stream_forward_and_its_gradient_back() -> None:
    stages = step_stages_of(
        _model(), _loss, mesh=MESH, inputs=INPUTS, splits=["blocks.2"], microbatches=2
    )
    (act,) = stages.partition.routes
    (grad,) = stages.grad_routes
    assert (act.src, act.dst, grad.src, grad.dst) == (0, (1,), 1, (0,))
    assert grad.type.shape == act.type.shape == (BATCH // 2, T, 12)
    first, last = stages.passes
    assert first.input_grad.function.body == ()  # nothing before stage 0 waits for a gradient
    assert last.input_grad.carries[0] == grad.value
    assert stages.loss in last.forward.carries and stages.loss not in first.forward.carries


def test_on_a_dp_x_tp_mesh_pending_sums_cross_passes_complete_and_the_step_is_the_same() -> None:
    """Over tp the reverse pass keeps cotangents pending (partial(sum: tp)); a pass hands such
    a value on complete and the next one makes it pending again: every pass still verifies,
    and the global values are the unpipelined step's."""
    mesh = dtm.Mesh(dp=2, tp=2)
    stages = step_stages_of(
        _model(), _loss, mesh=mesh, inputs=INPUTS, splits=["blocks.1", "blocks.3"], microbatches=2
    )
    pending = [
        p.name
        for s in stages.passes
        for f in (s.input_grad, s.weight_grad)
        for p in f.function.params
        if any(op.name == "redistribute" and p.name in op.operands for op in f.function.body)
    ]
    assert pending, "no pending value crossed a pass: the test lost its subject"
    want_loss, want = _unpipelined(mesh)
    loss, grads = _pipelined(stages, ScheduleKind.ONE_F_ONE_B, 2, 1, mesh)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
    for k, g in want.items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-10, atol=1e-14, err_msg=k)
