"""A command's presence in the job, from its first line to its last: before a session exists
(phases ``load``, ``backend``, ``plan``) and while one runs.

Under ``mpirun`` a rank that dies makes the launcher end the job: about a second later every
other rank gets SIGTERM, and about a second after that SIGKILL. A surviving rank must say in
that second which rank is gone, and all survivors must say the same. So from the start each
rank runs a small thread that answers liveness pings on ``MPI.COMM_WORLD`` (tags of its own;
no collective, so nothing here can block on a dead peer) and watches the signal wakeup
descriptor. On SIGTERM it pings every peer, names the ones that do not answer within
``SURVEY_S``, prints one line, and keeps answering pings until it is killed: the survivors
all answer every survey, so they all name the same ranks.

A pre-session phase whose agreement names ranks that never arrived ends the job through
:meth:`Presence.end_job`: one line, a moment for the peers to print theirs, then an abort.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from dtm_mpi.comm.abort import STOP_SIGNALS, StopRequests, claim_ending, end_on_term
from dtm_mpi.comm.control import Control
from dtm_mpi.console import write_line

__all__ = [
    "LINGER_S",
    "STOP_SIGNALS",
    "SURVEY_S",
    "Presence",
    "current",
    "survey_after_term",
    "terminated_line",
]

SURVEY_S = 0.5
"""Seconds a rank that got the launcher's SIGTERM waits for its peers' answers (the launcher
sends SIGKILL about a second after SIGTERM)."""

LINGER_S = 3.0
"""Seconds a rank that printed its last line keeps answering pings before it exits (it is
normally killed before)."""

_CURRENT: list[Presence] = []


def current() -> Presence | None:
    """The running presence of this process, if any."""
    return _CURRENT[0] if _CURRENT else None


Survey = tuple[tuple[int, ...], str, "str | None"]
"""What a rank learns after the launcher's SIGTERM: the peers that do not answer, the furthest
phase, and the error a peer announced as it ended the job (if any)."""


def survey_after_term(control: Control) -> Survey:
    """The peers that do not answer a ping on ``control`` within ``SURVEY_S``, the furthest
    phase, and the end a peer announced (then no survey is needed)."""
    try:
        announced = control.ended()
        if announced is not None:
            return (), control.phase, announced
        gone, phase = control.gone(SURVEY_S)
        return gone, phase, control.ended()  # an end may come while surveying
    except Exception:  # pragma: no cover  (the MPI library may already be torn down)
        return (), control.phase, None


def terminated_line(label: str, control: Control, signum: int, survey: Survey | None = None) -> str:
    """A rank's line when the launcher ends the job: the error a peer announced as it ended
    the job (this rank is collateral: hung, or it had not noticed yet), else the peers that do
    not answer a ping on ``control`` within ``SURVEY_S`` and the furthest phase."""
    gone, phase, announced = survey if survey is not None else survey_after_term(control)
    if announced is not None:
        return announced
    if gone:
        what = f"rank(s) {', '.join(map(str, gone))} exited or stopped answering"
    else:
        what = "no rank reported a failure"
    return f"{label}: {phase} failed: {what}; the launcher is ending the job (signal {signum})"


class Presence:
    """Start on every rank at the start of a command (not collective); :meth:`stop` at its
    end. ``label`` starts this rank's error line (``dtm run``, ``dtm bench comm``)."""

    def __init__(self, world: Any, label: str) -> None:
        from mpi4py import MPI

        self.world = world
        self.label = label
        self.rank = int(world.Get_rank())
        self.size = int(world.Get_size())
        self.control = Control(MPI, world, self.rank, self.size, self._doing)
        self.control.phase = "start"
        self.waiting: str = ""  # the agreement this rank waits in ("" = none)
        self._stop = threading.Event()
        self.stops = StopRequests(f"[rank {self.rank}] {label}", lambda: self.phase)
        self.stoppable = False  # the command can stop at a step boundary and save (set by it)
        self._old_stop: dict[int, Any] = {}
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._old_handler: Any = None
        self._old_fd = -1
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old_stop[int(sig)] = signal.signal(sig, self._on_stop_signal)
        if threading.current_thread() is threading.main_thread() and self.size > 1:
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                r, w = os.pipe()
                os.set_blocking(r, False)
                os.set_blocking(w, False)
                self._fd, self._wfd = r, w
                self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
                self._thread = threading.Thread(
                    target=self._run, name=f"dtm-presence-{self.rank}", daemon=True
                )
                self._thread.start()
        _CURRENT[:] = [self]
        from dtm_mpi.comm.abort import take_early_stop, take_early_term

        stop = take_early_stop()
        if stop is not None:  # a stop was asked for while this rank was starting
            self.request_stop(stop)
        early = take_early_term() if self.size > 1 else None
        if early is not None:  # a peer died while this rank was starting
            self.report_terminated(early)

    def _doing(self) -> str:
        return self.waiting

    @property
    def phase(self) -> str:
        return self.control.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.control.phase = value

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self._thread is None:  # no thread to do it: report from the main thread
            self._sigterm(signum)
        # else: the thread saw the wakeup byte and reports (the main thread may be inside MPI)

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self.request_stop(signum)

    @property
    def stop_signal(self) -> int | None:
        """The signal that asked the command to stop (the first such), if any."""
        return self.stops.signal

    def request_stop(self, signum: int) -> None:
        """A stop was asked for (``signum``): the command stops at its next step boundary,
        agreed with every rank, and saves (:class:`~dtm_mpi.comm.abort.StopRequests`)."""
        self.stops.request(signum)

    def _sigterm(self, signum: int) -> None:
        """The launcher's (or a scheduler's) SIGTERM: a peer is gone (report it and end), or,
        every peer answering and the command able to stop, a stop request."""
        survey = survey_after_term(self.control) if self.size > 1 else ((), self.phase, None)
        gone, _, announced = survey
        if self.stoppable and not gone and announced is None:
            self.request_stop(signum)
            return
        self.report_terminated(signum, survey)

    def _run(self) -> None:
        assert self._fd is not None
        while not self._stop.wait(0.01):
            try:
                data = os.read(self._fd, 64)
            except BlockingIOError:
                data = b""
            except OSError:  # pragma: no cover  (closed at stop)
                return
            if int(signal.SIGTERM) in data:
                self._sigterm(int(signal.SIGTERM))
                if self.stop_signal is not None:  # taken as a stop request: keep answering
                    continue
                return
            try:
                with self.control.lock:
                    self.control._answer()
            except Exception:  # pragma: no cover  (MPI finalised under us)
                return

    def report_terminated(self, signum: int, survey: Survey | None = None) -> None:
        """The launcher is ending the job: print one line naming the peers that are gone and
        the phase, keep answering pings, then exit."""
        claim_ending()  # else another thread of this rank is ending the job
        write_line(
            f"[rank {self.rank}] {terminated_line(self.label, self.control, signum, survey)}"
        )
        self.control.linger(LINGER_S)
        os._exit(1)

    def end_job(self, code: int, message: str) -> None:
        """Print ``message`` (rank-prefixed), answer pings a moment so the peers print theirs,
        then abort the job."""
        claim_ending()  # else another thread of this rank is ending the job
        write_line("\n".join(f"[rank {self.rank}] {ln}" for ln in message.splitlines()))
        self.control.announce_end(message)
        end_on_term()
        self.control.linger(1.0)
        self.world.Abort(code)
        os._exit(code)  # pragma: no cover  (Abort does not return)

    def stop(self) -> None:
        """End the thread and restore the signal handling (at the command's normal end)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        if threading.current_thread() is threading.main_thread() and self.size > 1:
            if self._fd is not None:
                signal.set_wakeup_fd(self._old_fd)
                os.close(self._fd)
                os.close(self._wfd)
            signal.signal(signal.SIGTERM, self._old_handler or signal.SIG_DFL)
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_stop.items():
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if _CURRENT and _CURRENT[0] is self:
            _CURRENT.clear()
