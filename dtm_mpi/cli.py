"""The ``dtm`` command line: argument parsing only; the work is done by the layers below.

Exit codes: 0 success, 1 a dtm error (diagnostics, failed checks, runtime failures), 2 bad
usage or an unreadable input file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dtm_mpi._version import __version__
from dtm_mpi.comm.abort import run_or_abort
from dtm_mpi.errors import UsageError

__all__ = ["build_parser", "main", "run"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dtm", description="Distributed Tensor Machine on MPI (dtm_mpi).")
    parser.add_argument("--version", action="version", version=f"dtm_mpi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    info = sub.add_parser("info", help="report the runtime: MPI, parallel HDF5, ranks (collective)")
    info.set_defaults(func=_cmd_info)
    return parser


def _cmd_info(args: argparse.Namespace) -> int:
    from dtm_mpi.comm.world import describe_world

    report = describe_world()
    if report:
        print(report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; raises :class:`~dtm_mpi.errors.DtmError`."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


def run(argv: Sequence[str] | None = None) -> int:
    """The console entry point: errors become exit codes (and abort the job under MPI)."""
    return run_or_abort(lambda: main(argv))


if __name__ == "__main__":
    sys.exit(run())
