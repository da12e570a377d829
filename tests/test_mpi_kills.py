"""Kills and stop signals at random moments of long runs under real ``mpirun`` (deterministic
mode, async checkpoints): SIGKILL of one rank at random moments (the elastic launcher
relaunches, losing only the steps since the last checkpoint), and of every rank while a save is
being written (the last committed checkpoint stays ``latest`` and verifies, the partial one is
marked incomplete and never loaded), each ending bit for bit where an uninterrupted run ends;
SIGUSR1/SIGTERM at a random step or during a save (exit 75, the step reached saved, nothing
partial). The moments are drawn from a seed printed with every assertion (``DTM_KILL_SEED``
replays one)."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.runtime.simulate import run_simulated
from tests.cli_entry import dtm
from tests.mpi_env import Job, mpirun_env, rank_pid
from tests.test_mpi_long_runs import resumed_equals_uninterrupted
from tests.test_mpi_run import EXAMPLES, load

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
MLP = str(EXAMPLES / "tp_mlp.dtm")
DET = {"DTM_TIMEOUT": "60", "DTM_DETERMINISTIC": "1"}
SEED = int(os.environ.get("DTM_KILL_SEED", time.time_ns() % 2**31))


def store_is_sound(store: Path, last: int, why: str) -> None:
    """``dtm ckpt ls`` names checkpoint ``last`` as latest, and ``dtm ckpt verify`` passes."""
    ls = dtm("ckpt", "ls", str(store))
    assert ls.returncode == 0, why + ls.stdout + ls.stderr
    latest = re.search(r"^\s*(\d+)\s+committed, latest\s", ls.stdout, re.M)
    assert latest is not None and int(latest.group(1)) == last, why + ls.stdout
    verify = dtm("ckpt", "verify", str(store))
    assert verify.returncode == 0 and verify.stdout.startswith("ok "), (
        why + verify.stdout + verify.stderr
    )


def uninterrupted(steps: int) -> dict[str, np.ndarray]:
    return run_simulated(
        load("tp_mlp"), 3, binding={"dp": 1, "tp": 3}, steps=steps, deterministic=True
    ).outputs()


def test_a_rank_killed_at_random_moments_of_an_async_run_costs_only_the_steps_since_the_last_save(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    why = f"(DTM_KILL_SEED={SEED}) "
    store, out = tmp_path / "store", tmp_path / "launched.npz"
    steps, every = 24, 3
    cmd = [
        sys.executable,
        "-m",
        "dtm_mpi",
        "launch",
        "--max-restarts",
        "3",
        "--mpirun-args",
        "--bind-to none",
        "--",
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        str(steps),
        "--store",
        str(store),
        "--checkpoint-async",
        "--checkpoint-every",
        str(every),
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
    deadline = time.monotonic() + 200
    kills: list[tuple[int, int]] = []  # (step reached, rank)
    attempt, at = 1, rng.randint(2, 10)
    for line in proc.stdout:
        lines.append(line)
        assert time.monotonic() < deadline, why + "".join(lines)
        if line.startswith(f"dtm launch: attempt {attempt + 1}:"):
            attempt += 1
            at = rng.randint(2, 10)  # steps into this attempt
            continue
        m = re.match(rf"step (\d+)/{steps}: ", line)
        if m is None or len(kills) >= 2 or len(kills) >= attempt:
            continue
        at -= 1
        if at == 0:
            time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside a step (and maybe a save)
            rank = rng.randrange(3)
            kills.append((int(m.group(1)), rank))
            os.kill(rank_pid(str(out), rank), signal.SIGKILL)
    rest, _ = proc.communicate(timeout=300)
    text = "".join(lines) + rest
    why += f"kills {kills}: "
    assert proc.returncode == 0 and len(kills) == 2, why + text
    # a relaunch resumes once a checkpoint is committed; it loses the steps since then: at most
    # 2 * every (a save is committed while the next steps run). The step a kill interrupted is
    # the last one its attempt printed (rank 0 prints a step before saving it; the kill may land
    # a step or two after the line the test read, while the pipe lags on a loaded machine).
    resumed = iter(
        int(s) for s in re.findall(r"resumed from \S+ckpt-\d+ \(after step (\d+)\)", text)
    )
    attempts = re.split(r"^dtm launch: attempt \d+: .*$", text, flags=re.M)[1:]
    for n in range(2, len(kills) + 2):
        if re.search(rf"^dtm launch: attempt {n}: .*\(resuming\)$", text, re.M):
            reached = max(
                int(s) for s in re.findall(rf"^step (\d+)/{steps}: ", attempts[n - 2], re.M)
            )
            r = next(resumed, None)
            assert r is not None and r % every == 0 and reached - 2 * every <= r <= reached, (
                why + text
            )
    assert next(resumed, None) is None, why + text
    store_is_sound(store, steps, why)
    got, want = np.load(out), uninterrupted(steps)
    assert all(got[k].tobytes() == v.tobytes() for k, v in want.items()), (
        why + "final weights differ"
    )


def test_every_rank_killed_while_a_save_is_written_leaves_the_last_committed_checkpoint(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED + 1)
    why = f"(DTM_KILL_SEED={SEED}) "
    store, marker = tmp_path / "store", str(tmp_path / "killed.npz")
    cmd = [
        "mpirun",
        "--timeout",
        "150",
        "--bind-to",
        "none",
        "-n",
        "3",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "run",
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "100000",
        "--store",
        str(store),
        "--checkpoint-async",
        "--checkpoint-every",
        "2",
        "-o",
        marker,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=mpirun_env(PYTHONUNBUFFERED="1", **DET),
    )
    try:
        pids = [rank_pid(marker, r) for r in range(3)]
        wanted = rng.randint(2, 5)  # a save after this many committed ones
        deadline = time.monotonic() + 120
        partial = None
        while partial is None:
            assert time.monotonic() < deadline and proc.poll() is None, (
                why + "no save seen in progress"
            )
            names = [p.name for p in store.iterdir()] if store.exists() else []
            committed = [n for n in names if re.fullmatch(r"ckpt-\d+", n)]
            if len(committed) >= wanted:
                partial = next((n for n in names if ".partial-" in n), None)
            if partial is None:
                time.sleep(0.001)
        for pid in pids:  # every rank, mid-save
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    killed_at = int(partial.split(".")[0].removeprefix("ckpt-"))
    why += f"killed while writing {partial}: "
    committed = sorted(
        int(p.name.removeprefix("ckpt-"))
        for p in store.iterdir()
        if re.fullmatch(r"ckpt-\d+", p.name)
    )
    last = max(committed)
    assert last <= killed_at, why  # (that save may have committed just before the kill)
    store_is_sound(store, last, why)
    ls = dtm("ckpt", "ls", str(store)).stdout
    if any(".partial-" in p.name for p in store.iterdir()):
        assert re.search(r"INCOMPLETE\s+ckpt-\d+\.partial-", ls), why + ls
    out = tmp_path / "resumed.npz"
    done = subprocess.run(
        [
            "mpirun",
            "--timeout",
            "150",
            "--bind-to",
            "none",
            "-n",
            "3",
            sys.executable,
            "-m",
            "mpi4py",
            "-m",
            "dtm_mpi",
            "run",
            MLP,
            "--mesh",
            "dp=1,tp=3",
            "--steps",
            str(last + 2),
            "--store",
            str(store),
            "--resume",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=mpirun_env(**DET),
        check=False,
    )
    assert done.returncode == 0 and f"(after step {last})" in done.stdout, (
        why + done.stdout + done.stderr
    )
    got, want = np.load(out), uninterrupted(last + 2)
    assert all(got[k].tobytes() == v.tobytes() for k, v in want.items()), (
        why + "resumed weights differ"
    )


@pytest.mark.parametrize(("how", "when"), [("USR1", "step"), ("TERM", "save")])
def test_a_stop_signal_at_a_random_moment_saves_the_step_reached_and_leaves_no_partial(
    how: str, when: str, tmp_path: Path
) -> None:
    """SIGUSR1 to mpirun (forwarded to every rank), or a scheduler's SIGTERM to every rank;
    at a random step, or while an async save is being written: exit 75, the checkpoint of the
    step reached committed, latest and verified, nothing partial left."""
    rng = random.Random(SEED + 2)
    why = f"(DTM_KILL_SEED={SEED}) "
    store, marker = tmp_path / "store", str(tmp_path / "stopped.npz")
    cmd = [
        "mpirun",
        "--timeout",
        "150",
        "--bind-to",
        "none",
        "-n",
        "3",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "run",
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "100000",
        "--store",
        str(store),
        "--checkpoint-async",
        "--checkpoint-every",
        "2",
        "--log-every",
        "1",
        "-o",
        marker,
    ]
    job = Job(cmd, mpirun_env(PYTHONUNBUFFERED="1", **DET))
    try:
        pids = [rank_pid(marker, r) for r in range(3)]
        deadline = time.monotonic() + 120
        if when == "save":
            wanted = rng.randint(1, 4)
            while True:
                assert time.monotonic() < deadline and job.proc.poll() is None, why + "no save seen"
                names = [p.name for p in store.iterdir()] if store.exists() else []
                if sum(1 for n in names if re.fullmatch(r"ckpt-\d+", n)) >= wanted and any(
                    ".partial-" in n for n in names
                ):
                    break
                time.sleep(0.001)
        else:  # a random moment of the run, once it is under way (however long start-up took)
            job.wait_for(r"^step 1/100000: ", 120)
            time.sleep(rng.uniform(0.0, 2.0))
        if how == "USR1":
            os.kill(job.proc.pid, signal.SIGUSR1)
        else:
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
    except BaseException:
        job.proc.kill()
        raise
    code, out = job.finish(120)
    assert code == 75, why + out
    m = re.search(
        rf"^dtm run: stopped by SIG{how} after step (\d+): checkpoint \S+ saved", out, re.M
    )
    assert m is not None and "Traceback" not in out, why + out
    store_is_sound(store, int(m.group(1)), why)
    assert not [p for p in store.iterdir() if ".partial-" in p.name], (
        why + "a partial checkpoint is left"
    )
    if how == "USR1":  # and the run resumes from it to the uninterrupted run's bits
        resumed_equals_uninterrupted(3, store, int(m.group(1)), tmp_path)
