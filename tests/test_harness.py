"""The MPI test harness ends a failing job quickly, names the failing rank, and never hangs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpi_env import mpirun_env

CASES = Path(__file__).parent / "harness_cases"
pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")


def _mpirun(case: str, ranks: int) -> tuple[int, str, float]:
    env = mpirun_env(DTM_TEST_AGREE_TIMEOUT="3")
    cmd = [
        "mpirun",
        "--timeout",
        "90",
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "pytest",
        "-q",
        "--with-mpi",
        "-m",
        "mpi",
        "-p",
        "no:cacheprovider",
        "--color=no",
        "--rootdir",
        str(CASES.parent),
        "-c",
        str(CASES.parent.parent / "pyproject.toml"),
        str(CASES / case),
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.slow
def test_agreed_failure_fails_every_rank_and_names_it() -> None:
    code, out, elapsed = _mpirun("case_one_rank_fails.py", 3)
    assert code != 0, out
    assert elapsed < 60, f"took {elapsed:.1f} s"
    assert "failed on rank(s) 1 of 3" in out, out
    assert "[rank 1]" in out and "rank 1 disagrees on purpose" in out, out
    # the job went on to the next test and rank 0 printed one summary line
    assert "1 failed, 1 passed" in out, out
    assert "[rank 2]" not in out, out


@pytest.mark.slow
def test_rank_failing_outside_a_collective_aborts_the_job() -> None:
    code, out, elapsed = _mpirun("case_one_rank_raises_before_collective.py", 3)
    assert code != 0, out
    assert elapsed < 60, f"took {elapsed:.1f} s"
    assert "[rank 1]" in out and "rank 1 broke before the allreduce" in out, out
    assert "aborting the whole job" in out, out
