"""Ending a whole MPI job from one rank: an unhandled error on any rank must not leave the
other ranks waiting forever in a collective."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from dtm_mpi.errors import DtmError, UsageError

__all__ = [
    "ENDING",
    "abort_job",
    "claim_ending",
    "keep_early_term",
    "mpi_world",
    "report",
    "run_or_abort",
    "write_line",
]


ENDING = threading.Lock()
"""Held by the thread that prints this rank's last error line and ends the job: a rank prints
one such line, whichever of its threads (main, watchdog, presence) finds the failure first."""


def claim_ending() -> None:
    """Take this rank's one last line (:data:`ENDING`); a thread that finds another thread of
    the rank already ending the job parks here until the process ends."""
    if not ENDING.acquire(blocking=False):
        while True:
            time.sleep(3600)


def mpi_world() -> Any | None:
    """``MPI.COMM_WORLD`` if MPI is initialised and not finalised in this process, else None.

    Never initialises MPI itself: only looks at an mpi4py that someone already imported.
    """
    mod = sys.modules.get("mpi4py.MPI")
    if mod is None:
        return None
    mpi: Any = mod
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD


def _multi_rank() -> bool:
    world = mpi_world()
    return world is not None and int(world.Get_size()) > 1


def write_line(text: str) -> None:
    """Write ``text`` and a newline to stderr in one call: the launcher forwards each rank's
    output in chunks, and two writes (text, then newline) interleave with other ranks'."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def report(message: str) -> None:
    """Print ``message`` to stderr, each line prefixed with this rank under multi-rank MPI."""
    world = mpi_world()
    prefix = f"[rank {world.Get_rank()}] " if world is not None and _multi_rank() else ""
    text = "\n".join(prefix + line for line in message.rstrip("\n").splitlines())
    write_line(text)


def abort_job(code: int, message: str) -> None:
    """Print ``message`` (rank-prefixed), then abort every rank of the job.

    Outside MPI, or with a single rank, this only prints; the caller then exits normally.
    """
    report(message)
    world = mpi_world()
    if world is not None and _multi_rank():
        sys.stdout.flush()
        world.Abort(code)


EARLY_TERM: list[int] = []
"""The launcher's SIGTERM, when it came before the command's presence existed (a peer died
while this rank was still starting): the presence reports it as soon as it starts."""


EARLY_TERM_GRACE_S = 2.0
"""How long a kept SIGTERM waits for a presence to report it; then it terminates the process
as usual (commands without a presence, e.g. ``dtm bench ckpt``, are not left running)."""


def _early_term(signum: int, frame: object) -> None:
    if _multi_rank():
        EARLY_TERM.append(signum)  # the presence names the gone peers when it starts
        timer = threading.Timer(EARLY_TERM_GRACE_S, _terminate_unless_taken, args=(signum,))
        timer.daemon = True
        timer.start()
        return
    _terminate(signum)  # not a job of several ranks: terminate as usual


def _terminate_unless_taken(signum: int) -> None:
    if EARLY_TERM:  # no presence took it
        _terminate(signum)


def _terminate(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def take_early_term() -> int | None:
    """The SIGTERM kept before the command's presence existed, if any (taken: it will not
    also terminate the process)."""
    if not EARLY_TERM:
        return None
    signum = EARLY_TERM[0]
    EARLY_TERM.clear()
    return signum


def keep_early_term() -> None:
    """Under MPI with several ranks, keep the launcher's SIGTERM until the command's presence
    reports it (:data:`EARLY_TERM`). Called first thing by ``python -m dtm_mpi`` (where MPI is
    already initialised, as under ``python -m mpi4py`` with eager initialisation) and again
    by :func:`run_or_abort`; a handler someone else installed is left alone."""
    if (
        _multi_rank()
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _early_term)


def run_or_abort(main: Callable[[], int]) -> int:
    """Run ``main`` and turn errors into exit codes: 2 for usage errors, 1 for other
    :class:`DtmError`, 1 with a traceback for anything else (a bug).

    Under MPI with several ranks, an error not known to be raised identically on every rank
    (``DtmError.agreed``) aborts the whole job, so no peer is left blocked in a collective;
    the launcher's SIGTERM before the command is under way is kept for it to report.
    """
    keep_early_term()
    try:
        return main()
    except SystemExit:
        raise
    except DtmError as err:
        code = 2 if isinstance(err, UsageError) else 1
        if err.agreed or not _multi_rank():
            report(f"dtm: error: {err}")
        else:
            abort_job(
                code, f"dtm: error: {err}\ndtm: aborting the job (not every rank raised this)"
            )
        return code
    except KeyboardInterrupt:
        abort_job(130, "dtm: interrupted")
        return 130
    except Exception:
        abort_job(1, "dtm: internal error (a bug in dtm_mpi):\n" + traceback.format_exc())
        return 1
