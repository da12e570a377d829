"""The environment every test that starts ``mpirun`` gives it (one definition), and a job whose
output a test reads while it runs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path


def mpirun_env(**extra: str) -> dict[str, str]:
    """This process's environment, with Open MPI allowed to run as root (CI runs as root) and
    to oversubscribe (more ranks than the 2 cores), plus ``extra``."""
    return {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        **extra,
    }


def dtm_run(ranks: int, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``dtm run ARGS`` on ``ranks`` ranks of ``mpirun`` (:func:`dtm_job`)."""
    return dtm_job(ranks, "run", *args, **env)


def dtm_job(ranks: int, *words: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``dtm WORDS`` on ``ranks`` ranks of ``mpirun`` (bounded: a hang fails the test), with
    ``env`` over :func:`mpirun_env`'s (``DTM_TIMEOUT`` 60 s unless given)."""
    import sys

    cmd = ["mpirun", "--timeout", "120", "--bind-to", "none", "-n", str(ranks)]
    cmd += [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", *words]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=150,
        env=mpirun_env(**{"PYTHONUNBUFFERED": "1", "DTM_TIMEOUT": "60", **env}),
        check=False,
    )


def named_on_every_rank(out: str, text: str, ranks: int) -> bool:
    """Whether every rank of ``ranks`` printed a line holding ``text`` (``[rank R] ...``) and
    no traceback came out."""
    named = sorted({ln.split("]")[0] for ln in out.splitlines() if text in ln})
    return named == [f"[rank {r}" for r in range(ranks)] and "Traceback" not in out


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
    """The ``ps`` lines of the processes whose command line holds ``marker``."""
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True, check=False)
    return [ln for ln in ps.stdout.splitlines() if marker in ln and "ps -eo" not in ln]


def kill_leftovers(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker``."""
    for line in survivors(marker):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def gone(marker: str, wait_s: float = 10.0) -> list[str]:
    """The processes of the job with ``marker`` still there after at most ``wait_s`` seconds
    (an ended job's ranks may take a moment to be reaped); the survivors are killed."""
    deadline = time.monotonic() + wait_s
    while (left := survivors(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_leftovers(marker)
    return left


class Job:
    """A running ``mpirun`` job whose merged output is read as it comes (a thread), so a test
    can wait for a moment of the run (a logged line) instead of sleeping."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came (monotonic)
        self.ended = 0.0  # when the job ended (monotonic; set by finish)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.times.append(time.monotonic())
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        """The first line matching ``pattern``, waited for (the job's output so far is in the
        assertion when it does not come)."""
        return self.line(pattern, timeout_s)[0]

    def line(self, pattern: str, timeout_s: float = 60.0) -> tuple[re.Match[str], float]:
        """:meth:`wait_for`, and when that line came (monotonic)."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for i in range(seen, len(self.lines)):
                m = re.search(pattern, self.lines[i])
                if m is not None:
                    return m, self.times[i]
            seen = len(self.lines)
            assert self.proc.poll() is None or self._reader.is_alive(), (
                f"the job ended before {pattern!r}:\n{self.text()}"
            )
            assert time.monotonic() < deadline, (
                f"no line {pattern!r} within {timeout_s} s:\n{self.text()}"
            )
            time.sleep(0.02)

    def text(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout_s: float) -> tuple[int, str]:
        """Wait for the job to end (killed after ``timeout_s``: the test failed, and nothing
        is left behind); its exit code and output."""
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.ended = time.monotonic()
        self._reader.join(timeout=30)
        return self.proc.returncode, self.text()
