"""Failure reporting under real ``mpirun``: whatever fails, on whichever rank and in whichever
phase, every rank that is still alive prints one line, the same line, naming the failed
rank(s) and the phase; nothing hangs; no traceback.

Timing is never asserted beyond generous bounds (the machine may be loaded): the tests assert
on what is printed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.mpi_env import Job, gone, kill_leftovers, mpirun_env, rank_pid

ROOT = Path(__file__).parent.parent
TP_MLP = str(ROOT / "examples" / "tp_mlp.dtm")
pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
MESH = {2: "dp=1,tp=2", 3: "dp=1,tp=3", 4: "dp=2,tp=2"}


SIGKILL_AFTER_TERM_S = "3"
"""For jobs whose survivors report after the launcher's SIGTERM (a rank died or was killed):
the launcher's SIGKILL follows its SIGTERM after this many seconds (Open MPI's default is 1),
so the survivors' lines do not depend on a loaded 2-core machine answering within one. Other
jobs keep the default: the launcher waits this long after every abort."""


def _env(extra: dict[str, str]) -> dict[str, str]:
    full = mpirun_env(PYTHONUNBUFFERED="1")
    full.update(extra)
    return full


def launch(
    ranks: int,
    args: list[str],
    env: dict[str, str],
    *,
    command: str = "run",
    mpmd: list[list[str]] | None = None,
    during: Callable[[Job], None] | None = None,
) -> tuple[int, str, float]:
    """Run ``dtm COMMAND`` under mpirun; ``during(job)`` runs while the job does (it may wait
    for lines, stop or kill ranks). Returns the exit code, stdout+stderr and the seconds it
    took."""
    prog = [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", command]
    cmd = ["mpirun", "--timeout", "100", "--bind-to", "none"]
    if mpmd:
        for i, extra in enumerate(mpmd):
            cmd += ([":"] if i else []) + ["-n", "1", *prog, *extra]
    else:
        cmd += ["-n", str(ranks), *prog, *args]
    start = time.monotonic()
    job = Job(cmd, _env(env))
    try:
        if during is not None:
            during(job)
    finally:
        code, out = job.finish(150)
    return code, out, time.monotonic() - start


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
    assert gone(mark) == [], "processes survived the job"


# -- several ranks failing in the same step ------------------------------------------------------


# Each case below at one or two sizes, the sizes spread over the cases: what is asserted is the
# same code at every size (the in-process MPI suite runs every check at 2, 3 and 4 ranks).
@pytest.mark.parametrize(
    ("ranks", "where"), [(2, "step"), (3, "allreduce"), (4, "step"), (4, "allreduce")]
)
def test_ranks_failing_together_are_all_named_alike(ranks: int, where: str, marker: str) -> None:
    failed = [0, ranks - 1]
    fault = ",".join(f"{r}:{where}:raise" for r in failed)
    code, text, _ = launch(
        ranks,
        [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {"DTM_TIMEOUT": "20", "DTM_FAULT": fault},
    )
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
        ranks,
        [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {
            "DTM_TIMEOUT": "60",
            "DTM_FAULT": f"{failed}:{phase}:exit",
            "OMPI_MCA_odls_base_sigkill_timeout": SIGKILL_AFTER_TERM_S,
        },
    )
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed})
    assert failed not in error_lines(text), text
    assert line.startswith(f"dtm run: {phase} failed: rank(s) {failed} exited"), line


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_rank_killed_right_after_start_is_named(ranks: int, marker: str) -> None:
    """SIGKILL soon after the start, while the ranks are in phase load (rank 1 held there by
    a hang), once every other rank waits in the load agreement (their logged lines say so).
    A kill while the others still import Python modules cannot be reported by them."""
    failed = 1

    def kill(job: Job) -> None:
        pid = rank_pid(marker, failed)
        job.wait_for(rf"^\[rank {failed}\] dtm: DTM_FAULT=\S+: injecting hang at load")
        for r in set(range(ranks)) - {failed}:
            job.wait_for(rf"^\[rank {r}\] dtm: waiting for every rank to end phase load")
        os.kill(pid, signal.SIGKILL)

    code, text, _ = launch(
        ranks,
        [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {
            "DTM_TIMEOUT": "60",
            "DTM_FAULT": f"{failed}:load:hang",
            "DTM_LOG": "debug",
            "OMPI_MCA_odls_base_sigkill_timeout": SIGKILL_AFTER_TERM_S,
        },
        during=kill,
    )
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed})
    # the phase is load unless the machine is so slow that a rank is not there yet
    assert re.match(rf"dtm run: [a-z ]+ failed: rank\(s\) {failed} exited", line), line


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_rank_killed_inside_a_run_is_named_by_every_survivor(ranks: int, marker: str) -> None:
    failed = ranks - 2

    def kill(job: Job) -> None:
        pid = rank_pid(marker, failed)
        # inside step 0: the rank hangs there (the timeout is far), the others wait for it
        job.wait_for(rf"^\[rank {failed}\] dtm: DTM_FAULT=\S+: injecting hang at allreduce")
        for r in set(range(ranks)) - {failed}:
            job.wait_for(rf"^\[rank {r}\] dtm: phase step 0$")
        time.sleep(0.2)  # (no line says "inside the allreduce": a guarded MPI call logs none)
        os.kill(pid, signal.SIGKILL)

    code, text, _ = launch(
        ranks,
        [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {
            "DTM_TIMEOUT": "60",
            "DTM_FAULT": f"{failed}:allreduce:hang",
            "DTM_LOG": "info",
            "OMPI_MCA_odls_base_sigkill_timeout": SIGKILL_AFTER_TERM_S,
        },
        during=kill,
    )
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)) - {failed})
    assert re.match(rf"dtm run: [a-z0-9 ]+ failed: rank\(s\) {failed} exited", line), line


@pytest.mark.parametrize(
    ("ranks", "phase", "failed"), [(2, "plan", -1), (3, "load", 0), (4, "plan", -1)]
)
def test_every_arrived_rank_names_a_rank_hung_before_the_session(
    ranks: int, phase: str, failed: int, marker: str
) -> None:
    failed %= ranks
    code, text, elapsed = launch(
        ranks,
        [TP_MLP, "--mesh", MESH[ranks], "-o", marker],
        {"DTM_TIMEOUT": "4", "DTM_FAULT": f"{failed}:{phase}:hang"},
    )
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
    assert line.startswith(
        f"dtm: error: backend failed on rank(s) {ranks - 1}: rank {ranks - 1} (backend): "
    ), line


# -- checkpoints: a rank hung or stopped while saving ---------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "where", "failed"),
    [(2, "ckpt_commit", 0), (3, "ckpt_write", 1), (4, "ckpt_commit", 0)],
)
def test_a_save_names_the_rank_that_does_not_answer(
    ranks: int, where: str, failed: int, marker: str, tmp_path: Path
) -> None:
    code, text, _ = launch(
        ranks,
        [
            TP_MLP,
            "--mesh",
            MESH[ranks],
            "-o",
            marker,
            "--steps",
            "2",
            "--checkpoint-every",
            "1",
            "--store",
            str(tmp_path / "store"),
        ],
        {"DTM_TIMEOUT": "5", "DTM_FAULT": f"{failed}:{where}:hang"},
    )
    assert code != 0, text
    line = assert_one_agreed_line(text, set(range(ranks)))
    assert (
        f"checkpoint 1 failed on rank(s) {failed}: rank {failed} (checkpoint 1): in no communication"
        in line
    )
    assert "launcher is ending" not in text, text


@pytest.mark.parametrize("ranks", [4])  # (3 ranks: the same code; CI time)
def test_a_rank_stopped_while_saving_is_named(ranks: int, marker: str, tmp_path: Path) -> None:
    failed = 1

    def stop(job: Job) -> None:
        pid = rank_pid(marker, failed)
        job.wait_for(rf"^\[rank {failed}\] dtm: DTM_FAULT=\S+: injecting hang at ckpt_write")
        os.kill(pid, signal.SIGSTOP)  # the save has begun: rank 1 hangs in it, now stopped

    code, text, _ = launch(
        ranks,
        [
            TP_MLP,
            "--mesh",
            MESH[ranks],
            "-o",
            marker,
            "--steps",
            "2",
            "--checkpoint-every",
            "1",
            "--store",
            str(tmp_path / "store"),
        ],
        {"DTM_TIMEOUT": "5", "DTM_FAULT": f"{failed}:ckpt_write:hang", "DTM_LOG": "info"},
        during=stop,
    )
    assert code != 0, text
    others = set(range(ranks)) - {failed}
    line = assert_one_agreed_line(text, others)
    assert (
        f"checkpoint 1 failed on rank(s) {failed}: rank {failed} (checkpoint 1): did not answer"
        in line
    )
    assert "launcher is ending" not in text and "Exception ignored" not in text, text


# -- dtm bench comm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [3])  # (2 and 4 ranks: the same code; CI time)
def test_a_rank_stopped_during_bench_comm_is_named(ranks: int, tmp_path: Path) -> None:
    csv = str(tmp_path / "never.csv")
    failed = ranks - 1

    def stop(job: Job) -> None:
        pid = rank_pid(csv, failed)
        job.wait_for(rf"^\[rank {failed}\] dtm: phase \w+ \d+ B$")  # in the timed blocks
        time.sleep(0.2)  # (the run lasts minutes)
        os.kill(pid, signal.SIGSTOP)

    try:
        code, text, elapsed = launch(
            ranks,
            ["comm", "--sizes", "8", "--repeat", "1000000", "--csv", csv],
            {"DTM_TIMEOUT": "5", "DTM_LOG": "info"},
            command="bench",
            during=stop,
        )
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
