"""The replica audit in ``dtm run`` under real ``mpirun`` at 2, 3 and 4 ranks: a bit flipped
in one rank's state (``DTM_FAULT=RANK:state:flip``) is caught at the next audit, one error on
every rank naming the tensor, the step and the odd rank; no checkpoint takes the diverged
state, and ``--resume`` continues from the newest checkpoint that verifies to the bits of the
uninterrupted run. A pipelined run audits each stage's replicas."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.io.store import list_checkpoints
from tests.mpi_env import dtm_run

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
ROOT = Path(__file__).resolve().parents[2]
DP_STEP = str(ROOT / "examples" / "dp_step.dtm")
MLP = str(ROOT / "examples" / "mlp_train.dtm")


def errors(out: str, text: str) -> list[str]:
    return sorted(ln.split("]")[0] for ln in out.splitlines() if text in ln)


@pytest.mark.parametrize("ranks", [2, 3])  # (4 ranks: the same code; CI time)
def test_a_flipped_state_bit_is_named_on_every_rank_and_resume_takes_the_last_good_checkpoint(
    ranks: int, tmp_path: Path
) -> None:
    mesh = ("--mesh", f"dp={ranks}")
    store = str(tmp_path / "store")
    ckpt = ("--store", store, "--checkpoint-every", "2", "--audit-every", "3")
    clean = dtm_run(ranks, DP_STEP, *mesh, "--steps", "4", *ckpt)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    victim = ranks - 1
    hit = dtm_run(
        ranks, DP_STEP, *mesh, "--steps", "8", "--resume", *ckpt, DTM_FAULT=f"{victim}:state:flip"
    )
    out = hit.stdout + hit.stderr
    assert hit.returncode != 0, out
    # the flip after step 4 (the first step of this run); the checkpoint due after step 6 audits first
    said = errors(out, "replica audit after step 6: ")
    assert said == [f"[rank {r}" for r in range(ranks)] and "Traceback" not in out, out
    if ranks > 2:
        assert f"on rank(s) {victim} differs from its replicas on ranks" in out, out
    else:
        assert "differs across its replicas on ranks 0, 1 (no majority" in out, out
    assert [c.step for c in list_checkpoints(Path(store))] == [2, 4]
    resumed = dtm_run(
        ranks, DP_STEP, *mesh, "--steps", "8", "--resume", *ckpt, "-o", str(tmp_path / "r.npz")
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    whole = dtm_run(ranks, DP_STEP, *mesh, "--steps", "8", "-o", str(tmp_path / "w.npz"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    a, b = np.load(tmp_path / "r.npz"), np.load(tmp_path / "w.npz")
    assert sorted(a.files) == sorted(b.files)
    assert all(a[k].tobytes() == b[k].tobytes() for k in b.files)


def test_a_pipelined_run_audits_each_stages_replicas(tmp_path: Path) -> None:
    """pp=2 x dp=2 from the IR file: rank 3 (stage 1's second dp replica) flips a bit; the
    audit names it among stage 1's ranks only."""
    proc = dtm_run(
        4, MLP, "--train", "sgd:lr=0.1", "--mesh", "pp=2,dp=2", "--microbatches", "2",
        "--steps", "3", "--audit-every", "1", DTM_FAULT="3:state:flip",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert errors(out, "replica audit after step 1: ") == [f"[rank {r}" for r in range(4)], out
    assert "differs across its replicas on ranks 2, 3 (no majority" in out, out


def test_the_audit_runs_before_a_live_resize_moves_the_state() -> None:
    """A resize moves each block from one replica: the audit runs first (here its period is
    longer than the run), so a flipped bit is named instead of becoming the only copy."""
    proc = dtm_run(
        4, DP_STEP, "--mesh", "dp=4", "--steps", "6", "--resize-at", "2:dp=2",
        "--audit-every", "100", DTM_FAULT="3:state:flip",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert errors(out, "replica audit after step 2: ") == [f"[rank {r}" for r in range(4)], out
    assert "on rank(s) 3 differs from its replicas on ranks 0, 1, 2, 3" in out, out
    assert "resized after step 2" not in out, out


def test_the_audit_runs_after_the_last_step() -> None:
    """The outputs are taken from one replica each: the audit runs after the last step too."""
    proc = dtm_run(
        3, DP_STEP, "--mesh", "dp=3", "--steps", "1", "--audit-every", "100",
        DTM_FAULT="2:state:flip",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert errors(out, "replica audit after step 1: ") == [f"[rank {r}" for r in range(3)], out
