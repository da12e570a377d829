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

    def run(self) -> None:
        s = self.session
        while not self._stop_event.wait(PERIOD_S):
            try:
                if self.signal_fd is not None and self._terminated():
                    s.report_terminated(s.terminated_error(signal.SIGTERM))
                    return
                remote = s.control.poll()
                if remote is not None:
                    s.end_from_watchdog(remote)
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
