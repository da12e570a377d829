"""The plan of a pipelined run (dtm_mpi.plan.pipeline): stages placed on the pp axis, each
piece of state pinned to its stage's ranks, what each stage holds, the explanation ``dtm
explain`` prints; and ``dtm explain SCRIPT.py`` for a Python program's fit()."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.stage_split import step_stages_of
from dtm_mpi.plan.pipeline import explain_pipeline, plan_pipeline, stage_memory
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.plan.schedule import PipelineShape, ScheduleKind
from dtm_mpi.sharding.blocks import local_shape
from tests.pipeline_case import gpt, lm_loss, token_inputs

ROOT = Path(__file__).resolve().parents[2]
INPUTS = token_inputs(8)
MESH = dtm.Mesh(pp=1, dp=1, tp=1)
SIZES = {"pp": 2, "tp": 2}
OPT = dtm.optim.AdamW(lr=1e-2)


def _planned(kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B, m: int = 2, chunks: int = 1):  # type: ignore[no-untyped-def]
    step = dtm.train_step(gpt(), lm_loss, mesh=MESH, inputs=INPUTS, optimizer=OPT)
    plan = compile_plan(step.module, mesh_for(step.module, 4, SIZES))
    n = 2 * chunks
    splits = [f"blocks.{k * 4 // n}" for k in range(1, n)]
    stages = step_stages_of(
        gpt(), lm_loss, mesh=MESH, inputs=INPUTS, splits=splits, microbatches=m, optimizer=OPT
    )
    entry = plan.entry_plan.function
    pplan = plan_pipeline(
        entry, stages, kind, PipelineShape(2, m, chunks), MESH.ir(), plan.mesh, fed=step.inputs
    )
    return step, plan, pplan


def test_every_piece_of_state_is_pinned_to_its_stages_pp_coordinate() -> None:
    step, plan, pplan = _planned(ScheduleKind.INTERLEAVED, 2, 2)
    state = [p.name[1:] for p in plan.entry_plan.function.params if p.name[1:] not in step.inputs]
    assert sorted(pplan.pins) == sorted(state)  # every parameter and optimizer state, once
    assert pplan.pin_of("tok.weight") == ("pp", 0)  # stage 0
    assert pplan.pin_of("blocks.1.attn.wq") == ("pp", 1)  # stage 1
    assert pplan.pin_of("blocks.2.attn.wq") == ("pp", 0)  # stage 2: interleaved, rank 0
    assert pplan.pin_of("opt.m.head.weight") == ("pp", 1)  # stage 3 (its optimizer state too)
    assert pplan.pin_of("ids") is None  # the fed inputs are every rank's


def test_what_a_stage_holds_is_its_blocks_bytes() -> None:
    _, plan, pplan = _planned()
    types = {p.name: p.type for p in pplan.stages.params}
    for s in pplan.stages.passes:
        for rank in (0, 1):
            mem = stage_memory(pplan.stages, s.index, plan.mesh, rank)
            want = sum(
                math.prod(local_shape(types[n].shape, types[n].layout, plan.mesh, rank)) * 8
                for n in s.params
            )
            assert mem.params == mem.grads == want > 0  # float64
            assert mem.optimizer == 2 * want  # AdamW: two moments per parameter
            assert mem.held > 0


def test_the_explanation_shows_each_stage_each_ranks_memory_and_the_time_line() -> None:
    _, plan, pplan = _planned(ScheduleKind.ZB_H1, 4)
    text = explain_pipeline(pplan, plan.mesh)
    assert "pipeline over pp=2: 2 stage(s), 4 microbatch(es) per step, schedule zb-h1" in text
    assert "tok .. blocks.1" in text and "blocks.2 .. head" in text
    assert "pp=0 (rank 0): state" in text and "pp=1 (rank 2): state" in text
    assert "predicted bubble" in text
    lines = text.splitlines()
    assert any(ln.startswith("rank 0 | F0") for ln in lines)
    assert any(ln.startswith("rank 1 | .") for ln in lines)  # rank 1 waits for F0


def test_state_laid_out_over_the_pipeline_axis_is_refused() -> None:
    step = dtm.train_step(
        gpt(), lm_loss, mesh=dtm.Mesh(pp=1, dp=1, tp=1), inputs=INPUTS, optimizer=OPT
    )
    plan = compile_plan(step.module, mesh_for(step.module, 4, SIZES))
    stages = step_stages_of(
        gpt(), lm_loss, mesh=MESH, inputs=INPUTS, splits=["blocks.2"], optimizer=OPT
    )
    with pytest.raises(UsageError, match="the model is cut into 2 stage"):
        plan_pipeline(
            plan.entry_plan.function,
            stages,
            ScheduleKind.GPIPE,
            PipelineShape(2, 1, 2),
            MESH.ir(),
            plan.mesh,
            fed=step.inputs,
        )
    with pytest.raises(UsageError, match="has no pipeline axis 'stage'"):
        plan_pipeline(
            plan.entry_plan.function,
            stages,
            ScheduleKind.GPIPE,
            PipelineShape(2, 1),
            MESH.ir(),
            plan.mesh,
            axis="stage",
        )


def _dtm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dtm_mpi", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def test_dtm_explain_of_a_script_prints_its_first_fits_plan_without_running_it() -> None:
    job = str(ROOT / "tests" / "pipeline_fit_job.py")
    done = _dtm("explain", job, "--", "--mesh", "pp=2,tp=2", "--schedule", "1f1b")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "module train on mesh [pp=2, dp=1, tp=2] (4 ranks), pipelined" in done.stdout
    assert "pipeline schedule 1f1b: 2 rank(s)" in done.stdout
    assert "losses" not in done.stdout + done.stderr  # nothing ran
    plain = _dtm("explain", job, "--", "--mesh", "dp=2")
    assert plain.returncode == 0 and "totals per step" in plain.stdout, plain.stderr


def test_dtm_explain_of_a_script_without_fit_is_one_error(tmp_path: Path) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("print('hello')\n")
    done = _dtm("explain", str(script))
    assert done.returncode != 0
    assert "ended without calling fit(): nothing to explain" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_pipeline_signature_names_each_boundary_value_and_the_handshake_compares_it() -> None:
    from dtm_mpi.comm.handshake import Hello, compare_hellos
    from dtm_mpi.errors import HandshakeError
    from dtm_mpi.plan.pipeline import pipeline_signature

    _, _, pplan = _planned()
    lines = pipeline_signature(pplan)
    assert lines[0] == "schedule 1f1b over pp=2: 2 stages, 2 microbatches"
    assert any(ln.startswith("stage 0 -> 1 act: %") and "pipeline_case.py:" in ln for ln in lines)
    assert any(ln.startswith("stage 1 -> 0 grad: %") for ln in lines)
    hello = Hello(1, "v", "h", "m", (), "numpy", False, pipeline=lines)
    compare_hellos([hello, hello])  # the same plan: no error
    other = Hello(
        1, "v", "h", "m", (), "numpy", False, pipeline=(*lines[:1], "stage 0 -> 1 act: %x")
    )
    with pytest.raises(
        HandshakeError,
        match=r"pipeline plans differ .* at line 2: rank\(s\) 0: stage 0 -> 1 act: %",
    ):
        compare_hellos([hello, other])
