"""Ending a whole MPI job from one rank: an unhandled error on any rank must not leave the
other ranks waiting forever in a collective."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dtm_mpi.console import write_line
from dtm_mpi.errors import DtmError, UsageError

__all__ = [
    "ENDING",
    "STOP_SIGNALS",
    "StopRequests",
    "abort_job",
    "claim_ending",
    "end_on_term",
    "keep_early_term",
    "mpi_world",
    "report",
    "run_or_abort",
    "stop_signals_caught",
    "take_early_stop",
    "take_early_term",
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


def end_on_term() -> None:
    """Let the launcher's SIGTERM end this rank at once: called when the rank has printed its
    last line and is ending the job. The abort that follows makes the launcher signal every
    rank, and a rank inside ``MPI_Abort`` never runs a Python handler: with one, each would
    wait for the launcher's SIGKILL (seconds later) instead. Main thread only (elsewhere a
    no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


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


STOP_SIGNALS = (signal.SIGUSR1,)
"""Signals that ask a run to stop at the next step boundary and save (Slurm:
``#SBATCH --signal=USR1@120``, ``scancel --signal=USR1``); mpirun and srun forward them to
every rank. A SIGTERM while every peer answers is taken as the same request (a scheduler's
time limit or preemption) where the command can stop (see :mod:`dtm_mpi.comm.presence`)."""

EARLY_TERM: list[int] = []
"""The launcher's SIGTERM, when it came before the command's presence existed (a peer died
while this rank was still starting): the presence reports it as soon as it starts."""

EARLY_STOP: list[int] = []
"""A stop signal (SIGUSR1: a scheduler's preemption notice, ``scancel --signal=USR1``) that
came before the command's presence existed: the presence takes it as its first stop request,
so a run signalled while it starts stops at its first step boundary and saves (exit 75)
instead of dying of the signal."""

EARLY_TERM_GRACE_S = 2.0
"""How long a kept signal waits for a presence to take it; then it ends the process as the
signal would have (commands without a presence, e.g. ``dtm bench ckpt``, are not left
running)."""


DUPLICATE_S = 2.0
"""A second stop signal this soon after the first is the same signal delivered twice (a
scheduler signalling every task, and the launcher forwarding it too), not a second request."""


class StopRequests:
    """A command's stop requests (a stop signal, or a scheduler's SIGTERM taken as one): the
    first asks it to stop at its next step boundary, agreed with every rank, and save
    (:meth:`asked` is its signal); the same signal delivered twice is one request; a later one
    ends this process now, without saving (a save in progress is never committed half-written:
    the store keeps its last checkpoint). ``who`` starts the line that says so; ``phase`` (if
    given) says where the command was."""

    def __init__(self, who: str, phase: Callable[[], str] | None = None) -> None:
        self.who, self.phase = who, phase
        self.signal: int | None = None
        self._at = 0.0

    def asked(self) -> int | None:
        return self.signal

    def request(self, signum: int) -> None:
        if self.signal is None:
            self.signal, self._at = signum, time.monotonic()
            return
        if time.monotonic() - self._at < DUPLICATE_S:  # one signal delivered twice
            return
        claim_ending()
        name = signal.Signals(signum).name
        where = f" in phase {self.phase()}" if self.phase is not None else ""
        write_line(
            f"{self.who}: a second stop signal ({name}){where}: ending now without saving; the store keeps its last committed checkpoint"
        )
        os._exit(128 + signum)


@contextmanager
def stop_signals_caught(who: str) -> Iterator[StopRequests | None]:
    """In a process that runs every rank itself (the simulator): while the block runs, a stop
    signal (:data:`STOP_SIGNALS`) or a SIGTERM (a scheduler's time limit or preemption) is a
    stop request of the yielded :class:`StopRequests` (one kept while the command started
    included); the previous handlers are restored after. Yields None off the main thread,
    where no handler can be installed (the run then ends as the signal says)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    requests = StopRequests(who)

    def handler(signum: int, frame: object) -> None:
        requests.request(signum)

    old = {sig: signal.signal(sig, handler) for sig in (*STOP_SIGNALS, signal.SIGTERM)}
    early = take_early_stop()
    if early is not None:  # asked for while the command started
        requests.request(early)
    try:
        yield requests
    finally:
        for sig, was in old.items():
            signal.signal(sig, was if was is not None else signal.SIG_DFL)


def _early_term(signum: int, frame: object) -> None:
    if _multi_rank():
        _keep(EARLY_TERM, signum)  # the presence names the gone peers when it starts
        return
    _terminate(signum)  # not a job of several ranks: terminate as usual


def _early_stop(signum: int, frame: object) -> None:
    _keep(EARLY_STOP, signum)


def _keep(kept: list[int], signum: int) -> None:
    kept.append(signum)
    timer = threading.Timer(EARLY_TERM_GRACE_S, _end_unless_taken, args=(kept, signum))
    timer.daemon = True
    timer.start()


def _end_unless_taken(kept: list[int], signum: int) -> None:
    if kept:  # no presence took it; this is not the main thread, which alone may reset it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)


def _terminate(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _take(kept: list[int]) -> int | None:
    if not kept:
        return None
    signum = kept[0]
    kept.clear()
    return signum


def take_early_term() -> int | None:
    """The SIGTERM kept before the command's presence existed, if any (taken: it will not
    also end the process)."""
    return _take(EARLY_TERM)


def take_early_stop() -> int | None:
    """The stop signal kept before the command's presence existed, if any (taken: it will
    not also end the process)."""
    return _take(EARLY_STOP)


def keep_early_term() -> None:
    """Keep the signals that come while a command starts until its presence takes them: under
    MPI with several ranks the launcher's SIGTERM (:data:`EARLY_TERM`), and a stop signal
    (:data:`EARLY_STOP`). Called first thing by ``python -m dtm_mpi`` (where MPI is already
    initialised, as under ``python -m mpi4py`` with eager initialisation) and again by
    :func:`run_or_abort`; a handler someone else installed is left alone. (A signal before
    this runs, while the interpreter starts and imports MPI, still ends the process.)"""
    if threading.current_thread() is not threading.main_thread():
        return
    if _multi_rank() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _early_term)
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _early_stop)


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
