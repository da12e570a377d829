"""The control channel of an MPI session: failure notices and liveness pings.

A private duplicate of the world communicator carries only small control messages, as wire
frames (``io/WIRE.md``: FAILURES, PING, PONG, END), never data. A frame that arrives damaged
is never read: a damaged failure notice is itself a failure of its sender, named with the check
that caught it. A rank that fails sends a *notice* (rank, phase, message) to every peer; a rank
whose wait expired sends *pings* and learns from the *pongs* which peers are alive and what
each is doing (the communication it is in, or none). Every use goes through one lock, so the
session's watchdog thread and the main thread never receive the same message twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtm_mpi.comm.framed import isend_frame, take_decoded
from dtm_mpi.comm.frames import MessageType, encode_frame
from dtm_mpi.errors import ProtocolError, RankFailure, RemoteFailureError
from dtm_mpi.log import info_enabled, log_info

__all__ = ["Control", "Liveness"]

TAG_FAIL = 71
TAG_PING = 72
TAG_PONG = 73
TAG_END = 74


@dataclass(frozen=True, slots=True)
class Liveness:
    """The answer to a liveness round: peers that did not answer, and peers that answered
    but are in no communication (hung, or still computing) with their phase."""

    silent: tuple[int, ...]
    idle: tuple[tuple[int, str], ...]

    @property
    def suspects(self) -> tuple[int, ...]:
        return tuple(sorted((*self.silent, *(r for r, _ in self.idle))))

    def describe(self) -> str:
        parts = []
        if self.silent:
            parts.append(f"rank(s) {', '.join(map(str, self.silent))} did not answer (dead?)")
        for r, phase in self.idle:
            parts.append(
                f"rank {r} is in no communication (in phase {phase!r}: hung or still computing)"
            )
        return "; ".join(parts)


_LOGGED: list[tuple[int, str]] = []  # the last phase logged in this process (rank, phase)


def _log_phase(rank: int, phase: str) -> None:
    """Log ``phase`` once, though a rank's session and presence each enter it."""
    if info_enabled() and _LOGGED[-1:] != [(rank, phase)]:
        _LOGGED[:] = [(rank, phase)]
        log_info(rank, f"phase {phase}")


class Control:
    """The control channel over communicator ``ctrl`` (this rank is ``rank`` of ``size``)."""

    def __init__(self, mpi: Any, ctrl: Any, rank: int, size: int, doing: Callable[[], str]) -> None:
        self.MPI = mpi
        self.ctrl = ctrl
        self.rank = rank
        self.size = size
        self.lock = threading.Lock()
        self._pending: list[Any] = []  # isend requests and their payloads stay alive here
        self._status = mpi.Status()
        self.doing = doing  # what this rank is communicating now ("" = nothing)
        # (phase, phases entered so far: every rank runs the same sequence of phases), one
        # value so that the other thread never reads a new phase with the old count
        self._where: tuple[str, int] = ("session", 0)
        # failed rank -> (reporter, phase, message): the failures this rank knows of
        self.known: dict[int, tuple[int, str, str]] = {}
        self._ends: dict[int, str] = {}  # peers that printed their last line: the error
        self._heard: set[int] = set()  # peers that sent a failure notice (they are ending)
        self._closed = False  # this rank said it is ending: it reports nothing more

    @property
    def phase(self) -> str:
        return self._where[0]

    @phase.setter
    def phase(self, value: str) -> None:
        self._where = (value, self._where[1] + 1)
        _log_phase(self.rank, value)

    @property
    def seq(self) -> int:
        return self._where[1]

    def _merge(self, reporter: int, failures: list[tuple[int, str, str]]) -> None:
        """Add ``failures`` as reported by ``reporter``. For a rank reported more than once,
        its own report wins, then the lowest reporter's: every rank that holds the same reports
        keeps the same message, whatever order they arrived in."""
        for who, phase, message in failures:
            rank = int(who)
            old = self.known.get(rank)
            if old is None or (reporter != rank, reporter) < (old[0] != rank, old[0]):
                self.known[rank] = (reporter, str(phase), str(message))

    def error(self) -> RemoteFailureError | None:
        """The failures known here as one error (None when none are)."""
        if not self.known:
            return None
        ordered = tuple(RankFailure(r, ph, msg) for r, (_, ph, msg) in sorted(self.known.items()))
        return RemoteFailureError(ordered[0].phase, ordered)

    def notify(self, failures: tuple[RankFailure, ...]) -> None:
        """Tell every peer about ``failures`` (this rank's own, or peers it found hung or
        dead), or, with none, that this rank is ending (after which it reports nothing
        more); does not wait."""
        frame = encode_frame(
            MessageType.FAILURES,
            {
                "reporter": self.rank,
                "ranks": tuple(f.rank for f in failures),
                "phases": tuple(f.phase for f in failures),
                "messages": tuple(f.message for f in failures),
            },
        )
        with self.lock:
            if self._closed:  # its peers print what they heard before it said it is ending
                return
            self._merge(self.rank, [(f.rank, f.phase, f.message) for f in failures])
            self._closed = not failures
            for r in range(self.size):
                if r != self.rank:
                    self._send(frame, r, TAG_FAIL)

    def _send(self, frame: bytes, dest: int, tag: int) -> None:
        self._pending.append(isend_frame(self.ctrl, self.MPI, frame, dest, tag))

    def _take(
        self, tag: int, kind: MessageType
    ) -> tuple[int, dict[str, Any] | ProtocolError] | None:
        """The next ``kind`` frame waiting with ``tag`` from any peer (:func:`take_decoded`)."""
        return take_decoded(self.ctrl, self.MPI, self.MPI.ANY_SOURCE, tag, self._status, kind)

    def _receive(self) -> bool:
        """Take every failure notice waiting here (under the lock); True if there was one."""
        got = False
        while (taken := self._take(TAG_FAIL, MessageType.FAILURES)) is not None:
            source, v = taken
            self._heard.add(source)
            if isinstance(v, ProtocolError):
                damaged = (
                    f"its failure notice arrived corrupt at rank {self.rank} (wrong: {v.field})"
                )
                self._merge(self.rank, [(source, self.phase, damaged)])
            elif not len(v["ranks"]) == len(v["phases"]) == len(v["messages"]):
                self._merge(self.rank, [(source, self.phase, "its failure notice is malformed")])
            else:
                failures = list(zip(v["ranks"], v["phases"], v["messages"], strict=True))
                self._merge(int(v["reporter"]), failures)
            got = True
        return got

    def poll(self) -> RemoteFailureError | None:
        """Answer pending pings; return the failures known here if a notice has arrived
        (after a short grace, to collect simultaneous failures)."""
        with self.lock:
            self._answer()
            if not self._receive():
                return None
            grace = time.monotonic() + 0.2
            while time.monotonic() < grace:
                time.sleep(0.01)
                self._answer()
                self._receive()
        return self.error()

    def settle(self, bound: float) -> RemoteFailureError | None:
        """Agree, in bounded time, on the failures to print: tell every peer that this rank
        is ending (a FAILURES notice that names no failure), then keep taking notices (and
        answering pings) until every peer has sent one (a failure of its own, peers it found
        dead or hung, or its end) or is known to have failed, at most ``bound`` seconds. A
        rank's notices travel on one channel in order, so once every peer has been heard,
        every failure of its own a peer reported is known here: ranks that fail in the same
        step all print the same list, however late a notice travels on a busy machine.
        Returns the failures known here."""
        self.notify(())
        deadline = time.monotonic() + bound
        pause = 0.001
        while time.monotonic() < deadline:
            with self.lock:
                self._answer()
                self._receive()
                waiting = set(range(self.size)) - {self.rank} - self._heard - set(self.known)
            if not waiting - set(self._ended_peers()):
                break
            time.sleep(pause)
            pause = min(0.01, pause * 2)
        return self.error()

    def _ended_peers(self) -> tuple[int, ...]:
        self.ended()
        return tuple(self._ends)

    def announce_end(self, error: str) -> None:
        """Tell every peer that this rank printed ``error`` (its last line, without the rank
        prefix) and is ending the job; does not wait."""
        frame = encode_frame(MessageType.END, {"error": error})
        with self.lock:
            for r in range(self.size):
                if r != self.rank:
                    self._send(frame, r, TAG_END)

    def ended(self) -> str | None:
        """The error a peer announced when it ended the job (the lowest such rank's), if
        any: a rank killed by that end (a hung one, or one that had not yet noticed) prints
        the same error instead of naming the peers the end has already killed."""
        with self.lock:
            while (taken := self._take(TAG_END, MessageType.END)) is not None:
                source, v = taken
                self._ends[source] = (
                    f"rank {source} ended the job (its last line arrived corrupt: wrong {v.field})"
                    if isinstance(v, ProtocolError)
                    else str(v["error"])
                )
        return self._ends[min(self._ends)] if self._ends else None

    def all_ended(self) -> bool:
        """Whether every peer has announced its end (each has printed its last line)."""
        self.ended()
        return len(self._ends) >= self.size - 1

    def linger(self, seconds: float) -> None:
        """Answer liveness pings for ``seconds`` (a rank that has printed its last line stays
        visible while its peers still ask who is alive), or until every peer has announced
        its own end (none is left to ask)."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            try:
                with self.lock:
                    self._answer()
                if self.all_ended():
                    return
            except Exception:  # pragma: no cover  (MPI torn down under us)
                return
            time.sleep(0.01)

    def _answer(self) -> None:
        while (taken := self._take(TAG_PING, MessageType.PING)) is not None:
            source = taken[0]  # (a damaged ping is answered too: its sender is known)
            phase, seq = self._where
            answer = encode_frame(
                MessageType.PONG,
                {"rank": self.rank, "doing": self.doing(), "phase": phase, "seq": seq},
            )
            self._send(answer, source, TAG_PONG)

    def liveness(self, bound: float) -> Liveness:
        """Ping every peer and wait up to ``bound`` seconds for all the answers."""
        heard = self.survey(bound)
        peers = [r for r in range(self.size) if r != self.rank]
        silent = tuple(r for r in peers if r not in heard)
        idle = tuple((r, heard[r][1]) for r in sorted(heard) if not heard[r][0])
        return Liveness(silent, idle)

    def survey(self, bound: float) -> dict[int, tuple[str, str, int]]:
        """Ping every peer; the answers that came within ``bound`` seconds (stops as soon as
        every peer answered): rank -> (what it communicates, its phase, its phase count)."""
        peers = [r for r in range(self.size) if r != self.rank]
        heard: dict[int, tuple[str, str, int]] = {}
        ping = encode_frame(MessageType.PING, {"rank": self.rank})
        with self.lock:
            for r in peers:
                self._send(ping, r, TAG_PING)
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and len(heard) < len(peers):
            with self.lock:
                self._answer()
                while (taken := self._take(TAG_PONG, MessageType.PONG)) is not None:
                    source, v = taken
                    heard[source] = (
                        (f"a corrupt answer (wrong: {v.field})", "?", 0)
                        if isinstance(v, ProtocolError)
                        else (str(v["doing"]), str(v["phase"]), int(v["seq"]))
                    )
            time.sleep(0.005)
        return heard

    def gone(self, bound: float) -> tuple[tuple[int, ...], str]:
        """After the launcher's SIGTERM: the peers that do not answer a ping within
        ``bound`` seconds, and the furthest phase this rank and the peers that answered are
        in. Every surviving rank answers (and stays to answer, :meth:`linger`) until it is
        killed, so the survivors name the same ranks."""
        heard = self.survey(bound)
        silent = tuple(r for r in range(self.size) if r != self.rank and r not in heard)
        phase, seq = self._where
        phases = [(seq, phase), *((s, ph) for _, ph, s in heard.values())]
        return silent, max(phases)[1]
