"""``dtm run --store DIR --checkpoint-every N --resume`` under real ``mpirun``: a run resumed on
another mesh gives the uninterrupted run's result; on the same mesh in deterministic mode,
bitwise; a rank killed during a save leaves ``latest`` loadable and verified and the partial
file reported as incomplete; a checkpoint of another program is refused on every rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.runtime.session import run_simulated
from tests.test_mpi_run import EXAMPLES, _survivors, load, mpirun

pytestmark = [pytest.mark.slow]
MLP = str(EXAMPLES / "tp_mlp.dtm")


def dtm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dtm_mpi", *args], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("first", "then"),
    [((4, "dp=2,tp=2"), (3, "dp=1,tp=3")), ((2, "dp=2,tp=1"), (4, "dp=2,tp=2"))],
    ids=["2x2->1x3", "2x1->2x2"],
)
def test_resume_on_another_mesh_equals_the_uninterrupted_run(
    first: tuple[int, str], then: tuple[int, str], tmp_path: Path
) -> None:
    store, out = str(tmp_path / "store"), tmp_path / "resumed.npz"
    code, text, _ = mpirun(first[0], MLP, "--mesh", first[1], "--steps", "2",
                           "--checkpoint-every", "1", "--store", store, env={"DTM_TIMEOUT": "60"})  # fmt: skip
    assert code == 0, text
    assert "checkpoint" in text and "after step 2" in text, text
    code, text, _ = mpirun(then[0], MLP, "--mesh", then[1], "--steps", "4", "--resume",
                           "--store", store, "-o", str(out), env={"DTM_TIMEOUT": "60"})  # fmt: skip
    assert code == 0, text
    assert "resumed from" in text and "after step 2" in text, text
    sizes = dict(kv.split("=") for kv in first[1].split(","))
    want = run_simulated(load("tp_mlp"), first[0], binding={k: int(v) for k, v in sizes.items()}, steps=4).outputs()  # fmt: skip
    got = np.load(out)
    assert sorted(got.files) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_resume_on_the_same_mesh_is_bitwise(tmp_path: Path) -> None:
    store, out = str(tmp_path / "store"), tmp_path / "resumed.npz"
    env = {"DTM_TIMEOUT": "60", "DTM_DETERMINISTIC": "1"}
    code, text, _ = mpirun(2, MLP, "--steps", "3", "--checkpoint-every", "3", "--store", store, env=env)  # fmt: skip
    assert code == 0, text
    code, text, _ = mpirun(2, MLP, "--steps", "5", "--resume", "--store", store, "-o", str(out), env=env)  # fmt: skip
    assert code == 0, text
    want = run_simulated(load("tp_mlp"), 2, steps=5).outputs()
    got = np.load(out)
    for key, value in want.items():
        assert got[key].tobytes() == value.tobytes(), f"{key} differs bitwise"


def test_rank_killed_during_a_save_leaves_latest_loadable(tmp_path: Path) -> None:
    store = tmp_path / "store"
    code, text, _ = mpirun(3, MLP, "--mesh", "dp=1,tp=3", "--steps", "2", "--checkpoint-every", "2",
                           "--store", str(store), env={"DTM_TIMEOUT": "60"})  # fmt: skip
    assert code == 0, text
    marker = str(tmp_path / "killed.npz")
    code, text, elapsed = mpirun(
        3, MLP, "--mesh", "dp=1,tp=3", "--steps", "4", "--checkpoint-every", "2", "--resume",
        "--store", str(store), "-o", marker,
        env={"DTM_TIMEOUT": "5", "DTM_FAULT": "1:ckpt_write:exit"},
    )  # fmt: skip
    assert code != 0, text
    assert elapsed < 40, f"took {elapsed:.1f} s"
    partial = [p.name for p in store.iterdir() if ".partial-" in p.name]
    assert partial and all(p.startswith("ckpt-00000004.h5") for p in partial), sorted(store.iterdir())  # fmt: skip
    assert (store / "latest").read_text().strip() == "ckpt-00000002.h5"
    listing = dtm("ckpt", "ls", str(store))
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"INCOMPLETE", listing.stdout) and "ckpt-00000004" in listing.stdout, listing.stdout  # fmt: skip
    verify = dtm("ckpt", "verify", str(store))
    assert verify.returncode == 0 and "ok" in verify.stdout, verify.stdout + verify.stderr
    assert _survivors(marker) == [], "processes survived the job"
    # the run resumes from step 2 as if nothing happened
    out = tmp_path / "out.npz"
    code, text, _ = mpirun(3, MLP, "--mesh", "dp=1,tp=3", "--steps", "4", "--resume",
                           "--store", str(store), "-o", str(out), env={"DTM_TIMEOUT": "60"})  # fmt: skip
    assert code == 0 and "after step 2" in text, text


def test_resume_refuses_another_programs_checkpoint(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    code, text, _ = mpirun(2, MLP, "--steps", "1", "--checkpoint-every", "1", "--store", store)
    assert code == 0, text
    other = tmp_path / "other.dtm"
    other.write_text(Path(MLP).read_text().replace("seed=1, std=0.02", "seed=9, std=0.02"))
    code, text, _ = mpirun(2, str(other), "--steps", "3", "--resume", "--store", store)
    assert code != 0
    lines = [ln for ln in text.splitlines() if "refusing to resume" in ln]
    assert sorted(ln.split("]")[0] for ln in lines) == ["[rank 0", "[rank 1"], text


def test_a_rank_failing_inside_a_save_ends_the_job_at_once(tmp_path: Path) -> None:
    """Its peers wait inside collective HDF5 calls (holding the interpreter lock): the failing
    rank ends the job with its own error instead of leaving them to the deadline."""
    code, text, elapsed = mpirun(
        2, MLP, "--steps", "2", "--checkpoint-every", "1", "--store", str(tmp_path / "s"),
        env={"DTM_TIMEOUT": "60", "DTM_FAULT": "1:ckpt_write:raise"},
    )  # fmt: skip
    assert code != 0
    assert elapsed < 30, f"took {elapsed:.1f} s (the deadline is 60 s)\n{text}"
    assert re.search(r"\[rank 1\] dtm: error: rank 1 failed during checkpoint 1 .*injected failure", text), text  # fmt: skip


def test_resume_needs_no_inputs_for_parameters_without_init(tmp_path: Path) -> None:
    """Every entry parameter is in the checkpoint: one given with -i on the first run (it has
    no init) comes back from the store on --resume."""
    src = (EXAMPLES / "dp_step.dtm").read_text()
    prog = tmp_path / "noinit.dtm"
    prog.write_text(re.sub(r"(%w_true: f32\[32,8\]) init normal\([^)]*\)", r"\1", src))
    w_true = tmp_path / "w_true.npy"
    np.save(w_true, np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    store = str(tmp_path / "store")
    code, text, _ = mpirun(2, str(prog), "-i", str(w_true), "--steps", "2", "--checkpoint-every", "1", "--store", store)  # fmt: skip
    assert code == 0, text
    out = tmp_path / "out.npz"
    code, text, _ = mpirun(2, str(prog), "--steps", "3", "--resume", "--store", store, "-o", str(out))  # fmt: skip
    assert code == 0 and "after step 2" in text, text
    assert np.array_equal(np.load(out)["w_true"], np.load(w_true))
