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
