"""``dtm ARGS`` through the console entry point (:func:`dtm_mpi.cli.run`) in this process: what
``python -m dtm_mpi ARGS`` would print and return, without starting an interpreter (about half a
second each). For tests whose subject is what a command reports, not its process; the command's
own process is tested end to end where it is the subject (tests/test_cli_store.py, the
``mpirun`` tests)."""

from __future__ import annotations

import contextlib
import io
import subprocess

from dtm_mpi.cli import run

__all__ = ["dtm"]


def dtm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``dtm ARGS`` here; its exit code, stdout and stderr as a finished process's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run(list(args))
        except SystemExit as exc:  # argparse's --help / --version
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["dtm", *args], code, out.getvalue(), err.getvalue())
