"""The session watchdog: bounded completion for blocking MPI calls.

With ``MPI_THREAD_MULTIPLE``, :class:`~dtm_mpi.comm.mpi_comm.MpiComm` uses MPI's blocking
collectives (the fastest paths of the MPI library) and this thread keeps every guarantee of the
bounded waits: every few milliseconds it answers liveness pings, watches for failure notices
and checks the deadline of the operation the main thread is in. On a notice or an expired
deadline it prints the job's one error line for this rank and ends the job (the main thread is
inside MPI and cannot be interrupted).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtm_mpi.comm.mpi_session import MpiSession

__all__ = ["Watchdog"]

PERIOD_S = 0.01
"""How often the watchdog looks (failure notices reach a blocked rank within this)."""

MAIN_GRACE_S = 1.0
"""How long a main thread that computes when a peer's failure notice arrives may take to end
the job itself (see :meth:`Watchdog._main_ends_itself`)."""


class Watchdog(threading.Thread):
    def __init__(self, session: MpiSession) -> None:
        super().__init__(name=f"dtm-watchdog-{session.rank}", daemon=True)
        self.session = session
        self._stop_event = threading.Event()
        self.signal_fd: int | None = None  # the read end of the signal wakeup pipe

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=1.0)

    def _terminated(self) -> bool:
        assert self.signal_fd is not None
        try:
            data = os.read(self.signal_fd, 64)
        except BlockingIOError:
            return False
        return int(signal.SIGTERM) in data

    def _main_ends_itself(self, remote: BaseException) -> bool:
        """A peer failed while the main thread computes (in no communication): poison the
        session and give the main thread up to ``MAIN_GRACE_S`` to end the job itself, at its
        next communication (with the peer's failure) or with a failure of its own in the same
        step, which its peers then hear of before this rank says it is ending. True if it
        did; False (the watchdog ends the job) if it is still computing (hung, or slow) or
        the peers named this rank itself."""
        from dtm_mpi.comm.abort import ENDING

        s = self.session
        if s.rank in s.control.known:  # the peers named this rank (hung?): it ends now
            return False
        if s.poisoned is None:
            s.poisoned = remote
        until = time.monotonic() + min(MAIN_GRACE_S, s.timeout_s / 4)
        while time.monotonic() < until:
            if ENDING.locked():
                return True
            if s.current is not None:  # blocked in MPI: it cannot end itself
                return False
            s.control.poll()  # answers pings meanwhile
            time.sleep(PERIOD_S)
        return ENDING.locked()

    def run(self) -> None:
        s = self.session
        while not self._stop_event.wait(PERIOD_S):
            try:
                if self.signal_fd is not None and self._terminated():
                    s.report_terminated(s.terminated_error(signal.SIGTERM))
                    return
                remote = s.control.poll()
                if remote is not None:
                    if s.current is None and self._main_ends_itself(remote):
                        return
                    s.end_from_watchdog(s.control.error() or remote)
                    return
                current = s.current
                if current is not None and time.monotonic() > current[2]:
                    op, axes, _ = current
                    s.end_from_watchdog(s.fail(s.expired(op, axes)))
                    return
            except Exception as exc:  # pragma: no cover  (MPI torn down under us)
                if self._stop_event.is_set():
                    return
                s.end_from_watchdog(exc)
                return
