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
from dtm_mpi.runtime.policies import ResizePolicy
from dtm_mpi.runtime.request import RunRequest, parse_resize
from dtm_mpi.runtime.simulate import run_simulated
from tests.cli_entry import dtm
from tests.mpi_env import mpirun_env
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
@pytest.mark.parametrize("meshes", [("dp=2,tp=2", "dp=1,tp=3", "dp=2,tp=2")], ids=["tp3"])
def test_4_to_3_to_4_live_equals_checkpoint_and_relaunch(
    meshes: tuple[str, str, str], tmp_path: Path
) -> None:
    a, b, c = meshes
    live_store, out = tmp_path / "live", tmp_path / "live.npz"
    code, text, _ = mpirun(
        4,
        MLP,
        "--mesh",
        a,
        "--steps",
        "6",
        "--resize-at",
        f"2:{b}",
        "--resize-at",
        f"4:{c}",
        "--store",
        str(live_store),
        "--checkpoint-every",
        "1",
        "--checkpoint-async",
        "-o",
        str(out),
        env=DET,
    )
    assert code == 0, text
    assert f"resized after step 2: 4 -> 3 rank(s), mesh [{b.replace(',', ', ')}]" in text, text
    assert f"resized after step 4: 3 -> 4 rank(s), mesh [{c.replace(',', ', ')}]" in text, text
    ls = dtm("ckpt", "ls", str(live_store))
    meshes_saved = re.findall(r"^\s*(\d+)\s+committed.*\s(\S+)$", ls.stdout, re.M)
    assert meshes_saved == [("1", a), ("2", a), ("3", b), ("4", b), ("5", c), ("6", c)], ls.stdout
    # the same meshes by checkpoint and relaunch
    store = tmp_path / "relaunch"
    for n, mesh, steps, more in ((4, a, 2, ()), (3, b, 4, ("--resume",)), (4, c, 6, ("--resume",))):
        code, text, _ = mpirun(
            n,
            MLP,
            "--mesh",
            mesh,
            "--steps",
            str(steps),
            "--store",
            str(store),
            "--checkpoint-every",
            "2",
            *more,
            "-o",
            str(tmp_path / "relaunched.npz"),
            env=DET,
        )
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
    code, text, _ = mpirun(
        2,
        MLP,
        "--mesh",
        "dp=1,tp=2",
        "--steps",
        "3",
        "--max-bytes-per-rank",
        "4M",
        "--resize-at",
        "1:dp=1,tp=1",
        env=DET,
    )
    assert code != 0
    lines = [ln for ln in text.splitlines() if "dtm: error: plan failed" in ln]
    assert len(lines) == 2 and all(
        "--resize-at 1:" in ln and "max-bytes-per-rank" in ln for ln in lines
    ), text
    assert "Traceback" not in text, text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resize": ResizePolicy(((3, {"dp": 1, "tp": 3}),))}, "resizes come after steps 1 .. 2"),
        (
            {"resize": ResizePolicy(((2, {"dp": 1, "tp": 3}), (1, {"dp": 2, "tp": 2})))},
            "in increasing order",
        ),
        ({"resize": ResizePolicy(((1, {"tp": 3}),))}, "bind the same axes at every resize"),
        (
            {"resize": ResizePolicy(((1, {"dp": 1, "tp": 3}),)), "sim": 2},
            "--resize-at and --resize-file need the MPI runtime",
        ),
        (
            {"resize": ResizePolicy(file="req"), "sim": 2},
            "--resize-at and --resize-file need the MPI runtime",
        ),
    ],
)
def test_bad_schedules_are_usage_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        RunRequest(MLP, {"dp": 2, "tp": 2}, steps=3, **kwargs)  # type: ignore[arg-type]


def test_parse_resize() -> None:
    assert parse_resize("4:dp=1,tp=3") == (4, {"dp": 1, "tp": 3})
    for bad in ("dp=1", "x:dp=1", "4:"):
        with pytest.raises(UsageError):
            parse_resize(bad)


@needs_mpirun
@pytest.mark.slow
def test_a_resize_asked_for_in_a_file_while_the_run_goes_on(tmp_path: Path) -> None:
    """--resize-file: the operator writes a mesh into the file; rank 0 sees it at a step's
    commit, every rank resizes after that step; a request that does not fit is said and
    ignored. Shrink, a bad request, then grow, and the result is the uninterrupted run's."""
    request, out = tmp_path / "resize.req", tmp_path / "out.npz"
    steps = 30
    cmd = [
        "mpirun",
        "--timeout",
        "150",
        "--bind-to",
        "none",
        "-n",
        "4",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "run",
        MLP,
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        str(steps),
        "--resize-file",
        str(request),
        "--log-every",
        "1",
        "-o",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=mpirun_env(PYTHONUNBUFFERED="1", **DET),
    )
    assert proc.stdout is not None
    asks = iter(["dp=1,tp=3", "dp=1,tp=3,pp=2", "dp=2,tp=2"])
    lines: list[str] = []
    pending = None
    seen = 0
    for line in proc.stdout:
        lines.append(line)
        if pending is None and re.match(rf"step \d+/{steps}: ", line):
            pending = next(asks, None)
            if pending is not None:
                tmp = tmp_path / "req.tmp"
                tmp.write_text(pending + "\n")
                tmp.rename(request)  # appears whole
        elif "resized after step" in line or "ignored:" in line:
            seen += 1
            pending = None
    proc.wait(timeout=150)
    text = "".join(lines)
    assert proc.returncode == 0 and seen == 3, text
    assert re.search(r"resized after step \d+: 4 -> 3 rank\(s\), mesh \[dp=1, tp=3\]", text), text
    assert re.search(
        r"resize request \S+ after step \d+ ignored: it binds dp, pp, tp; the run's mesh has dp, tp",
        text,
    ), text
    assert re.search(r"resized after step \d+: 3 -> 4 rank\(s\), mesh \[dp=2, tp=2\]", text), text
    assert not request.exists()
    got, want = (
        np.load(out),
        run_simulated(load("tp_mlp"), 1, steps=steps, deterministic=True).outputs(),
    )
    assert all(got[k].tobytes() == v.tobytes() for k, v in want.items())


@needs_mpirun
@pytest.mark.slow
def test_a_stop_after_a_shrink_saves_and_exits_75_with_the_parked_rank(tmp_path: Path) -> None:
    """The rank that left is parked (idle, still in the job): a stop signal forwarded to it
    does not end it with the signal; rank 0 releases it after the save, and the job exits 75."""
    import os
    import signal

    store, out = tmp_path / "store", tmp_path / "never.npz"
    cmd = [
        "mpirun",
        "--timeout",
        "150",
        "--bind-to",
        "none",
        "-n",
        "4",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "run",
        MLP,
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "100000",
        "--resize-at",
        "2:dp=1,tp=3",
        "--store",
        str(store),
        "--log-every",
        "1",
        "-o",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=mpirun_env(PYTHONUNBUFFERED="1", **DET),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    resized = False
    for line in proc.stdout:
        lines.append(line)
        resized = resized or "resized after step 2: 4 -> 3" in line
        if resized and re.match(r"step ([4-9]|\d\d+)/100000: ", line):
            os.kill(proc.pid, signal.SIGUSR1)
            break
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == 75, text
    m = re.search(r"stopped by SIGUSR1 after step (\d+): checkpoint", text)
    assert m is not None and "exited on signal" not in text, text
    verify = dtm("ckpt", "verify", str(store))
    assert verify.returncode == 0 and f"ckpt-{int(m.group(1)):08d}" in verify.stdout, (
        verify.stdout + verify.stderr
    )


@needs_mpirun
@pytest.mark.slow
def test_growing_past_the_launched_ranks_spawns_them(tmp_path: Path) -> None:
    """Launched with 3 ranks, the run grows to 4 after step 2: the fourth is spawned
    (MPI_Comm_spawn), joins the handshake and gets its shards; then the run shrinks back to 3
    (the spawned rank leaves). The result is the uninterrupted run's."""
    out = tmp_path / "out.npz"
    code, text, _ = mpirun(
        3,
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "6",
        "--resize-at",
        "2:dp=2,tp=2",
        "--resize-at",
        "4:dp=1,tp=3",
        "-o",
        str(out),
        env=DET,
    )
    assert code == 0, text
    assert (
        "resized after step 2: 3 -> 4 rank(s)" in text
        and "resized after step 4: 4 -> 3 rank(s)" in text
    ), text
    got, want = (
        np.load(out),
        run_simulated(load("tp_mlp"), 1, steps=6, deterministic=True).outputs(),
    )
    assert all(got[k].tobytes() == v.tobytes() for k, v in want.items())
