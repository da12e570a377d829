"""Failure reporting under real ``mpirun``: whatever fails, on whichever rank and in whichever
phase, every rank that is still alive prints one line, the same line, naming the failed
rank(s) and the phase; nothing hangs; no traceback.

Timing is never asserted beyond generous bounds (the machine may be loaded): the tests assert
on what is printed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.mpi_env import mpirun_env

ROOT = Path(__file__).parent.parent
TP_MLP = str(ROOT / "examples" / "tp_mlp.dtm")
pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
MESH = {2: "dp=1,tp=2", 3: "dp=1,tp=3", 4: "dp=2,tp=2"}


def _env(extra: dict[str, str]) -> dict[str, str]:
    full = mpirun_env(
        PYTHONUNBUFFERED="1",
        # the launcher's SIGKILL follows its SIGTERM after this many seconds (default 1): the
        # survivors' lines must not depend on a loaded 2-core machine answering within one
        OMPI_MCA_odls_base_sigkill_timeout="3",
    )
    full.update(extra)
    return full


def launch(
    ranks: int, args: list[str], env: dict[str, str], *, command: str = "run",
    mpmd: list[list[str]] | None = None, during: Callable[[], None] | None = None,
) -> tuple[int, str, float]:  # fmt: skip
    """Run ``dtm COMMAND`` under mpirun; ``during()`` runs while the job does (it may stop or
    kill ranks). Returns the exit code, stdout+stderr and the seconds it took."""
    prog = [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", command]
    cmd = ["mpirun", "--timeout", "100", "--bind-to", "none"]
    if mpmd:
        for i, extra in enumerate(mpmd):
            cmd += ([":"] if i else []) + ["-n", "1", *prog, *extra]
    else:
        cmd += ["-n", str(ranks), *prog, *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(env)
    )
    try:
        if during is not None:
            during()
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:  # pragma: no cover  (the test failed: leave nothing behind)
            proc.kill()
            proc.communicate()
    return proc.returncode, out, time.monotonic() - start


def rank_pid(marker: str, rank: int, wait_s: float = 60.0) -> int:
    """The pid of MPI rank ``rank`` of the job whose command line holds ``marker``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            ours = marker.encode() in cmdline and b"mpirun" not in cmdline.split(b"\0")[0]
            if ours and f"OMPI_COMM_WORLD_RANK={rank}\0".encode() in environ + b"\0":
                return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} of the job with {marker} never started")


def survivors(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True, check=False)
    return [ln for ln in ps.stdout.splitlines() if marker in ln and "ps -eo" not in ln]


def kill_leftovers(marker: str) -> None:
    for line in survivors(marker):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def error_lines(text: str, label: str = "dtm run") -> dict[int, list[str]]:
    """Each rank's error lines (without the ``[rank N]`` prefix)."""
    got: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.match(rf"\[rank (\d+)\] ({re.escape(label)}: .*)$", line)
        if m:
            got.setdefault(int(m.group(1)), []).append(m.group(2))
    return got


def assert_one_agreed_line(text: str, ranks: set[int], label: str = "dtm run") -> str:
    """Every rank of ``ranks`` printed exactly one error line, all the same; no other rank
    printed one that differs, no traceback. Returns the line."""
    lines = error_lines(text, label)
    assert set(lines) >= ranks, f"ranks {sorted(ranks - set(lines))} printed nothing\n{text}"
    assert all(len(v) == 1 for v in lines.values()), text
    distinct = {v[0] for v in lines.values()}
    assert len(distinct) == 1, "the ranks disagree:\n" + "\n".join(sorted(distinct))
    assert "Traceback" not in text, text
    return distinct.pop()


@pytest.fixture
def marker(tmp_path: Path) -> object:
    mark = str(tmp_path / "never.npz")  # unique in the process table
    yield mark
    time.sleep(0.5)
    left = survivors(mark)
    kill_leftovers(mark)
    assert left == [], "processes survived the job"


# -- several ranks failing in the same step ------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("where", ["step", "allreduce"])
def test_ranks_failing_together_are_all_named_alike(ranks: int, where: str, marker: str) -> None:
    failed = [0, ranks - 1]
    fault = ",".join(f"{r}:{where}:raise" for r in failed)
    code, text, _ = launch(
        ranks, [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {"DTM_TIMEOUT": "20", "DTM_FAULT": fault},
    )  # fmt: skip
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)))
    assert f"failed on rank(s) {', '.join(map(str, failed))}:" in line, line
    assert "step 0" in line, line


# -- a rank that dies or hangs before the session exists -----------------------------------------


# every phase at 3 ranks; one phase each at 2 and 4 (the same code at every size)
EARLY = [(3, p) for p in ("arguments", "load", "backend", "plan")] + [(2, "load"), (4, "arguments")]


@pytest.mark.parametrize(("ranks", "phase"), EARLY, ids=[f"{p}-{r}" for r, p in EARLY])
def test_a_rank_dying_before_the_session_is_named_by_every_survivor(
    ranks: int, phase: str, marker: str
) -> None:
    failed = 1
    code, text, _ = launch(
        ranks, [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {"DTM_TIMEOUT": "60", "DTM_FAULT": f"{failed}:{phase}:exit"},
    )  # fmt: skip
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed})
    assert failed not in error_lines(text), text
    assert line.startswith(f"dtm run: {phase} failed: rank(s) {failed} exited"), line


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_rank_killed_right_after_start_is_named(ranks: int, marker: str) -> None:
    """SIGKILL soon after the start, while the ranks are in phase load (rank 1 held there by
    a hang). A kill in the first second or so, while the others still import Python modules,
    cannot be reported by them: the launcher's SIGKILL comes a second after its SIGTERM."""
    failed = 1

    def kill() -> None:
        pid = rank_pid(marker, failed)
        time.sleep(6.0)  # the others reach the load agreement, even on a loaded machine
        os.kill(pid, signal.SIGKILL)

    code, text, _ = launch(
        ranks, [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {"DTM_TIMEOUT": "60", "DTM_FAULT": f"{failed}:load:hang"}, during=kill,
    )  # fmt: skip
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed})
    # the phase is load unless the machine is so slow that a rank is not there yet
    assert re.match(rf"dtm run: [a-z ]+ failed: rank\(s\) {failed} exited", line), line


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_rank_killed_inside_a_run_is_named_by_every_survivor(ranks: int, marker: str) -> None:
    failed = ranks - 2

    def kill() -> None:
        pid = rank_pid(marker, failed)
        time.sleep(8.0)  # inside step 0 (the rank hangs there; the timeout is far)
        os.kill(pid, signal.SIGKILL)

    code, text, _ = launch(
        ranks, [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {"DTM_TIMEOUT": "60", "DTM_FAULT": f"{failed}:allreduce:hang"}, during=kill,
    )  # fmt: skip
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed})
    assert re.match(rf"dtm run: [a-z0-9 ]+ failed: rank\(s\) {failed} exited", line), line


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize(("phase", "failed"), [("load", 0), ("plan", -1)])
def test_every_arrived_rank_names_a_rank_hung_before_the_session(
    ranks: int, phase: str, failed: int, marker: str
) -> None:
    failed %= ranks
    code, text, elapsed = launch(
        ranks, [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {"DTM_TIMEOUT": "4", "DTM_FAULT": f"{failed}:{phase}:hang"},
    )  # fmt: skip
    assert code != 0, text
    assert elapsed < 60, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed})
    assert f"phase {phase!r} did not end within 4 s: rank(s) {failed} did not arrive" in line


@pytest.mark.parametrize("ranks", [2, 3])
def test_one_rank_alone_on_another_backend_is_named_by_every_other(ranks: int, marker: str) -> None:
    args = [TP_MLP, "--mesh", MESH[ranks], "-o", marker]
    mpmd = [args + (["--backend", "cuda"] if r == ranks - 1 else []) for r in range(ranks)]
    code, text, _ = launch(ranks, [], {"DTM_TIMEOUT": "4"}, mpmd=mpmd)
    assert code != 0, text
    # every rank takes part in the GPU binding's exchange, so the lone rank is not missing:
    # its failure to open the GPU backend (no CuPy or no GPU here) is agreed by all
    line = assert_one_agreed_line(text, set(range(ranks)), label="dtm")
    assert line.startswith(f"dtm: error: backend failed on rank(s) {ranks - 1}: rank {ranks - 1} (backend): "), line  # fmt: skip


# -- checkpoints: a rank hung or stopped while saving ---------------------------------------------


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize(("where", "failed"), [("ckpt_write", 1), ("ckpt_commit", 0)])
def test_a_save_names_the_rank_that_does_not_answer(
    ranks: int, where: str, failed: int, marker: str, tmp_path: Path
) -> None:
    code, text, _ = launch(
        ranks, [TP_MLP, "--mesh", MESH[ranks], "-o", marker, "--steps", "2",
                "--checkpoint-every", "1", "--store", str(tmp_path / "store")],
        {"DTM_TIMEOUT": "5", "DTM_FAULT": f"{failed}:{where}:hang"},
    )  # fmt: skip
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)))
    assert f"checkpoint 1 failed on rank(s) {failed}: rank {failed} (checkpoint 1): in no communication" in line  # fmt: skip
    assert "launcher is ending" not in text, text


@pytest.mark.parametrize("ranks", [4])  # (3 ranks: the same code; CI time)
def test_a_rank_stopped_while_saving_is_named(ranks: int, marker: str, tmp_path: Path) -> None:
    failed = 1

    def stop() -> None:
        pid = rank_pid(marker, failed)
        deadline = time.monotonic() + 60
        while not list((tmp_path / "store").glob("*partial*")) and time.monotonic() < deadline:
            time.sleep(0.1)  # the save has begun: rank 1 hangs in it
        time.sleep(1.0)
        os.kill(pid, signal.SIGSTOP)

    code, text, _ = launch(
        ranks, [TP_MLP, "--mesh", MESH[ranks], "-o", marker, "--steps", "2",
                "--checkpoint-every", "1", "--store", str(tmp_path / "store")],
        {"DTM_TIMEOUT": "10", "DTM_FAULT": f"{failed}:ckpt_write:hang"}, during=stop,
    )  # fmt: skip
    assert code != 0, text
    others = set(range(ranks)) - {failed}
    line = assert_one_agreed_line(text, others)
    assert f"checkpoint 1 failed on rank(s) {failed}: rank {failed} (checkpoint 1): did not answer" in line  # fmt: skip
    assert "launcher is ending" not in text and "Exception ignored" not in text, text


# -- dtm bench comm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [3])  # (2 and 4 ranks: the same code; CI time)
def test_a_rank_stopped_during_bench_comm_is_named(ranks: int, tmp_path: Path) -> None:
    csv = str(tmp_path / "never.csv")
    failed = ranks - 1

    def stop() -> None:
        pid = rank_pid(csv, failed)
        time.sleep(5.0)  # inside the timed blocks (the run lasts minutes)
        os.kill(pid, signal.SIGSTOP)

    try:
        code, text, elapsed = launch(
            ranks, ["comm", "--sizes", "8", "--repeat", "1000000", "--csv", csv],
            {"DTM_TIMEOUT": "5"}, command="bench", during=stop,
        )  # fmt: skip
    finally:
        kill_leftovers(csv)
    assert code != 0, text
    assert elapsed < 90, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed}, label="dtm bench comm")
    assert f"failed on rank(s) {failed}: rank {failed} " in line and "did not answer" in line
    assert "dtm run" not in text, text


# -- the handshake: ranks given different --steps ---------------------------------------------------


def test_ranks_given_different_steps_name_the_disagreement(marker: str) -> None:
    args = [TP_MLP, "--mesh", MESH[3], "-o", marker]
    mpmd = [[*args, "--steps", "3" if r == 1 else "2"] for r in range(3)]
    code, text, _ = launch(3, [], {"DTM_TIMEOUT": "20"}, mpmd=mpmd)
    assert code != 0, text
    line = assert_one_agreed_line(text, {0, 1, 2})
    assert "steps differs (rank(s) 0,2: 2; rank(s) 1: 3)" in line, line
