"""Live mesh resize under real ``mpirun`` (``dtm run --resize-at STEP:MESH``): 4 -> 3 -> 4 ranks
while the job runs, with 2 and 3 ranks along an axis (the state moved in memory; the leaving
rank waits out the job and exits 0; the joining one spawned, in the handshake, given its
shards), async checkpoints written on every mesh; the result equals, bit for bit, the
checkpoint-and-relaunch path over the same meshes and the uninterrupted run (deterministic
mode). And the arguments: a bad schedule is one agreed error before anything runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import UsageError
from dtm_mpi.runtime.request import RunRequest, parse_resize
from dtm_mpi.runtime.simulate import run_simulated
from tests.test_mpi_run import EXAMPLES, load, mpirun

MLP = str(EXAMPLES / "tp_mlp.dtm")
DET = {"DTM_TIMEOUT": "60", "DTM_DETERMINISTIC": "1"}
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")


def ranks(mesh: str) -> int:
    n = 1
    for kv in mesh.split(","):
        n *= int(kv.split("=")[1])
    return n


@needs_mpirun
@pytest.mark.slow
@pytest.mark.parametrize("meshes", [("dp=2,tp=2", "dp=1,tp=3", "dp=2,tp=2"), ("dp=2,tp=2", "dp=3,tp=1", "dp=2,tp=2")],
                         ids=["tp3", "dp3"])  # fmt: skip
def test_4_to_3_to_4_live_equals_checkpoint_and_relaunch(meshes: tuple[str, str, str], tmp_path: Path) -> None:  # fmt: skip
    a, b, c = meshes
    live_store, out = tmp_path / "live", tmp_path / "live.npz"
    code, text, _ = mpirun(
        4, MLP, "--mesh", a, "--steps", "6", "--resize-at", f"2:{b}", "--resize-at", f"4:{c}",
        "--store", str(live_store), "--checkpoint-every", "1", "--checkpoint-async", "-o", str(out), env=DET,
    )  # fmt: skip
    assert code == 0, text
    assert f"resized after step 2: 4 -> 3 rank(s), mesh [{b.replace(',', ', ')}]" in text, text
    assert f"resized after step 4: 3 -> 4 rank(s), mesh [{c.replace(',', ', ')}]" in text, text
    ls = subprocess.run([sys.executable, "-m", "dtm_mpi", "ckpt", "ls", str(live_store)], capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    meshes_saved = re.findall(r"^\s*(\d+)\s+committed.*\s(\S+)$", ls.stdout, re.M)
    assert meshes_saved == [("1", a), ("2", a), ("3", b), ("4", b), ("5", c), ("6", c)], ls.stdout
    # the same meshes by checkpoint and relaunch
    store = tmp_path / "relaunch"
    for n, mesh, steps, more in ((4, a, 2, ()), (3, b, 4, ("--resume",)), (4, c, 6, ("--resume",))):
        code, text, _ = mpirun(
            n, MLP, "--mesh", mesh, "--steps", str(steps), "--store", str(store), "--checkpoint-every", "2", *more,
            "-o", str(tmp_path / "relaunched.npz"), env=DET,
        )  # fmt: skip
        assert code == 0, text
    live, relaunched = np.load(out), np.load(tmp_path / "relaunched.npz")
    straight = run_simulated(load("tp_mlp"), 1, steps=6, deterministic=True).outputs()
    assert sorted(live.files) == sorted(straight)
    for key, value in straight.items():
        assert live[key].tobytes() == relaunched[key].tobytes() == value.tobytes(), key


@needs_mpirun
@pytest.mark.slow
def test_a_schedule_that_does_not_fit_the_module_is_one_agreed_error(tmp_path: Path) -> None:
    """Every mesh of the schedule is planned before the first step: one rank would need more
    than --max-bytes-per-rank on the mesh of the resize."""
    code, text, _ = mpirun(2, MLP, "--mesh", "dp=1,tp=2", "--steps", "3", "--max-bytes-per-rank", "4M", "--resize-at", "1:dp=1,tp=1", env=DET)  # fmt: skip
    assert code != 0
    lines = [ln for ln in text.splitlines() if "dtm: error: plan failed" in ln]
    assert len(lines) == 2 and all("--resize-at 1:" in ln and "max-bytes-per-rank" in ln for ln in lines), text
    assert "Traceback" not in text, text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"resize_at": ((3, {"dp": 1, "tp": 3}),)}, "resizes come after steps 1 .. 2"),
    ({"resize_at": ((2, {"dp": 1, "tp": 3}), (1, {"dp": 2, "tp": 2}))}, "in increasing order"),
    ({"resize_at": ((1, {"tp": 3}),)}, "bind the same axes at every resize"),
    ({"resize_at": ((1, {"dp": 1, "tp": 3}),), "sim": 2}, "--resize-at needs the MPI runtime"),
    ({"join_at": 2, "resize_at": ((1, {"dp": 1, "tp": 3}),)}, "--join-at 2 is not a step of --resize-at"),
])  # fmt: skip
def test_bad_schedules_are_usage_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        RunRequest(MLP, {"dp": 2, "tp": 2}, steps=3, **kwargs)  # type: ignore[arg-type]


def test_parse_resize() -> None:
    assert parse_resize("4:dp=1,tp=3") == (4, {"dp": 1, "tp": 3})
    for bad in ("dp=1", "x:dp=1", "4:"):
        with pytest.raises(UsageError):
            parse_resize(bad)
