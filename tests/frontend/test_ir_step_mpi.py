"""Pipeline stages from an IR file under real ``mpirun`` at 2, 3 and 4 ranks: ``dtm run
examples/mlp_train.dtm --train ...`` over a pp axis, every schedule, pp alone and with dp,
trains as gradient accumulation on one simulated stage does; its parallel-HDF5 checkpoint
resumes without a pipeline on another mesh; a stage failing mid-schedule and a bad --split
are named on every rank."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.mpi_env import dtm_run as run_job
from tests.mpi_env import mpirun_env, named_on_every_rank
from tests.shared_runs import OUT, shared_run

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp_train.dtm")
TRAIN = ("--train", "sgd:lr=0.1,momentum=0.9", "--microbatches", "4")
# Outside deterministic mode the bits depend on the GEMM provider, and DTM_GEMM=auto picks one
# per process: the measured one where numpy's BLAS runs one thread (an mpirun rank), numpy's
# where it runs more (the one-process reference). The bitwise comparison pins one provider.
ONE_GEMM = {"DTM_GEMM": "numpy"}

# ranks -> (mesh, schedule, extra options, mesh it resumes on without a pipeline)
CASES = {
    "2-1f1b": (2, "pp=2,dp=1", "1f1b", ("--split", "%a1"), "pp=1,dp=2"),
    "2-interleaved": (2, "pp=2,dp=1", "interleaved", ("--chunks", "2"), "pp=1,dp=1"),
    "3-gpipe": (3, "pp=3,dp=1", "gpipe", (), "pp=1,dp=3"),
    "4-zb-h1-dp": (4, "pp=2,dp=2", "zb-h1", (), "pp=1,dp=4"),
}


def dtm_run(ranks: int, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_job(ranks, MLP, *args, **{**ONE_GEMM, **env})


def reference(shared: Path, path: Path, steps: int) -> dict[str, np.ndarray]:
    """Gradient accumulation over the 4 microbatches on one simulated rank (one stage; run
    once per session: :func:`~tests.shared_runs.shared_run`)."""
    cmd = [sys.executable, "-m", "dtm_mpi", "run", MLP, "--sim", "1", *TRAIN]
    shared_run(shared, [*cmd, "--steps", str(steps), "-o", OUT], path, **ONE_GEMM)
    return dict(np.load(path))


def same(got: Path, want: dict[str, np.ndarray], exact: bool) -> None:
    a = dict(np.load(got))
    assert sorted(a) == sorted(want)
    for k, w in want.items():
        if exact:
            assert a[k].tobytes() == w.tobytes(), k
        else:  # the dp sums in another order: float32 rounding
            np.testing.assert_allclose(a[k], w, rtol=2e-5, atol=2e-6, err_msg=k)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ir_stages_under_mpirun_train_as_one_stage_and_resume_without_a_pipeline(
    case: str, tmp_path: Path, shared_tmp: Path
) -> None:
    ranks, mesh, schedule, extra, plain = CASES[case]
    store = str(tmp_path / "store")
    piped = tmp_path / "piped.npz"
    proc = dtm_run(
        ranks,
        *TRAIN,
        *("--mesh", mesh, "--schedule", schedule, *extra, "--steps", "3"),
        *("--store", store, "--checkpoint-every", "3", "-o", str(piped)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    same(piped, reference(shared_tmp, tmp_path / "ref3.npz", 3), exact="dp=1" in mesh)
    # the stages' ranks wrote the checkpoint; a run without a pipeline on another mesh resumes
    resumed = tmp_path / "resumed.npz"
    proc = dtm_run(
        int(np.prod([int(a.split("=")[1]) for a in plain.split(",")])),
        *TRAIN,
        *("--mesh", plain, "--steps", "5", "--store", store, "--resume", "-o", str(resumed)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    same(resumed, reference(shared_tmp, tmp_path / "ref5.npz", 5), exact=False)


@pytest.mark.parametrize(("ranks", "mesh"), [(2, "pp=2,dp=1"), (3, "pp=3,dp=1"), (4, "pp=2,dp=2")])
def test_an_ir_stage_failing_mid_schedule_is_named_on_every_rank(ranks: int, mesh: str) -> None:
    proc = dtm_run(
        ranks,
        *TRAIN,
        *("--mesh", mesh, "--steps", "2"),
        DTM_TIMEOUT="30",
        DTM_FAULT="1:recv:raise",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    want = "step 0 failed on rank(s) 1: rank 1 (step 0): injected failure (DTM_FAULT=1:recv:raise)"
    assert named_on_every_rank(out, want, ranks), out


def test_a_bad_split_is_named_on_every_rank() -> None:
    proc = dtm_run(2, *TRAIN, "--mesh", "pp=2,dp=1", "--split", "%nope", DTM_TIMEOUT="30")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    lines = [ln for ln in out.splitlines() if "--split %nope: @loss makes no value %nope" in ln]
    assert sorted(ln.split("]")[0] for ln in lines) == ["[rank 0", "[rank 1"], out
    assert "Traceback" not in out, out


@pytest.mark.parametrize(("ranks", "mesh"), [(2, "pp=2,dp=1"), (3, "pp=3,dp=1"), (4, "pp=2,dp=2")])
def test_in_deterministic_mode_ir_stages_under_mpirun_have_one_ranks_bits(
    ranks: int, mesh: str, tmp_path: Path
) -> None:
    out = tmp_path / "piped.npz"
    proc = dtm_run(
        ranks, *TRAIN, "--mesh", mesh, "--steps", "3", "-o", str(out), DTM_DETERMINISTIC="1"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cmd = [sys.executable, "-m", "dtm_mpi", "run", MLP, "--sim", "1", *TRAIN]
    ref = subprocess.run(
        [*cmd, "--steps", "3", "-o", str(tmp_path / "one.npz")],
        capture_output=True,
        text=True,
        timeout=150,
        env=mpirun_env(DTM_DETERMINISTIC="1"),
        check=False,
    )
    assert ref.returncode == 0, ref.stdout + ref.stderr
    same(out, dict(np.load(tmp_path / "one.npz")), exact=True)
