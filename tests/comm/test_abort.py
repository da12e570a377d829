"""Errors become exit codes outside MPI; nothing aborts a single-process run."""

from __future__ import annotations

import pytest

from dtm_mpi.comm.abort import mpi_world, run_or_abort
from dtm_mpi.errors import ConfigError, UsageError


def test_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_or_abort(lambda: 0) == 0
    assert run_or_abort(lambda: 3) == 3

    def usage() -> int:
        raise UsageError("x.dtm: no such file")

    def config() -> int:
        raise ConfigError("DTM_TIMEOUT: expected a number of seconds, got 'soon'")

    def bug() -> int:
        raise KeyError("oops")

    assert run_or_abort(usage) == 2
    assert run_or_abort(config) == 1
    assert run_or_abort(bug) == 1
    err = capsys.readouterr().err
    assert "dtm: error: x.dtm: no such file" in err
    assert "dtm: error: DTM_TIMEOUT" in err
    assert "internal error" in err and "KeyError: 'oops'" in err


def test_mpi_world_is_none_without_mpi() -> None:
    import sys

    if "mpi4py.MPI" not in sys.modules:
        assert mpi_world() is None


_EARLY_STOP = r"""
import os, signal, sys, time
from dtm_mpi.comm.abort import EARLY_TERM_GRACE_S, keep_early_term, take_early_stop
keep_early_term()
os.kill(os.getpid(), signal.SIGUSR1)  # a scheduler's stop signal while the command starts
time.sleep(0.2)
if sys.argv[1] == "taken":  # as the command's presence takes it when it starts
    print("taken", int(take_early_stop()), flush=True)
time.sleep(EARLY_TERM_GRACE_S + 1.0)
print("still running", flush=True)
"""


@pytest.mark.parametrize("taken", [True, False])
def test_a_stop_signal_while_a_command_starts_is_kept_for_it(taken: bool) -> None:
    """A SIGUSR1 that comes before the command's presence exists is kept: the presence takes
    it as a stop request (the run stops at a step boundary and saves); a command that never
    takes it ends as the signal would have ended it (exit 128+10), not left running."""
    import signal
    import subprocess
    import sys

    got = subprocess.run(
        [sys.executable, "-c", _EARLY_STOP, "taken" if taken else "left"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if taken:
        assert got.returncode == 0, got.stderr
        assert got.stdout.splitlines() == [f"taken {int(signal.SIGUSR1)}", "still running"]
    else:
        assert got.returncode == 128 + int(signal.SIGUSR1), got.stdout + got.stderr
        assert got.stdout == "" and "Traceback" not in got.stderr
