"""Pipelined training steps under real MPI (the MPI suite at 2, 3 and 4 ranks): the stages of a
GPT over a pp axis (with tp at 4 ranks), every schedule, boundary blocks sent and received
between ranks; the loss the same bits on every rank and the parameters after two AdamW steps
those of the unpipelined train_step (to float64 rounding)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.frontend.stage_split import step_stages_of
from dtm_mpi.plan.pipeline import stage_plans
from dtm_mpi.plan.schedule import PipelineShape, ScheduleKind, plan_schedule
from dtm_mpi.runtime.mpirun import pipeline_groups
from dtm_mpi.runtime.pipeline_step import PipelineRank
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape
from tests.pipeline_case import gpt, lm_loss, token_batch, token_inputs

pytestmark = pytest.mark.mpi(min_size=2)

BATCH = 12
INPUTS = token_inputs(BATCH)
SPLITS = {2: ["blocks.2"], 3: ["blocks.1", "blocks.3"], 4: ["blocks.1", "blocks.2", "blocks.3"]}
_model, _loss = gpt, lm_loss


def _sizes(n: int) -> dict[str, int]:
    """All ranks on pp at 2 and 3 ranks; pp=2 x tp=2 at 4."""
    return {"pp": 2, "dp": 1, "tp": 2} if n == 4 else {"pp": n, "dp": 1, "tp": 1}


@pytest.mark.parametrize(
    "kind",
    [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1, ScheduleKind.INTERLEAVED],
)
def test_pipelined_training_under_mpi_follows_the_unpipelined_training(
    kind: ScheduleKind, comm: Any
) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    sizes = _sizes(size)
    pp = sizes["pp"]
    chunks = 2 if kind is ScheduleKind.INTERLEAVED else 1
    if chunks * pp > 4:
        pytest.skip("4 blocks make at most 4 stages")
    splits = SPLITS[pp * chunks] if pp * chunks > 1 else []
    mesh = dtm.Mesh(**sizes)
    shape = MeshShape(tuple(sizes.items()))
    opt = dtm.optim.AdamW(lr=1e-2)
    clip = 0.05 if kind is ScheduleKind.ZB_H1 else None  # (clipped across the stages)
    m = 2 * pp  # (a multiple of pp: the interleaved schedule's groups)
    stages = step_stages_of(
        _model(),
        _loss,
        mesh=mesh,
        inputs=INPUTS,
        splits=splits,
        microbatches=m,
        optimizer=opt,
        clip_norm=clip,
    )
    schedule = plan_schedule(kind, PipelineShape(pp, m, chunks))
    batch = token_batch(BATCH, 11)
    session = MpiSession(shape, timeout_s=60, world=comm, join=False)
    try:
        plans = stage_plans(stages, mesh.ir(), shape)  # (every stage's: the groups need all)
        session.join_mesh(pipeline_groups(plans))
        runner = PipelineRank(stages, schedule, mesh.ir(), shape, MpiComm(session), plans=plans)
        losses = [runner.step(runner.batch_blocks(batch), i).loss for i in range(2)]
    finally:
        session.close()
    every = comm.allgather([x.hex() for x in losses])
    assert all(e == every[0] for e in every), every  # the same bits on every rank
    step = dtm.train_step(_model(), _loss, mesh=mesh, inputs=INPUTS, optimizer=opt, clip_norm=clip)
    final, history = run_reference(step.module, batch, steps=2)
    np.testing.assert_allclose(losses, [float(h[0]) for h in history], rtol=1e-12)
    types = {p.name: p.type for p in stages.params}
    for name in sorted(runner.blocks):
        want = final[name][local_block(final[name].shape, types[name].layout, shape, rank)]
        np.testing.assert_allclose(runner.blocks[name], want, rtol=1e-9, atol=1e-12, err_msg=name)
    owned = comm.allgather(sorted(runner.blocks))
    held = {n for names in owned for n in names}
    assert held == {n for n in final if n[1:] not in INPUTS}  # every parameter on some stage
