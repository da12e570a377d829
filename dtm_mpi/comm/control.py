"""The control channel of an MPI session: failure notices and liveness pings.

A private duplicate of the world communicator carries only small pickled control messages,
never data. A rank that fails sends a *notice* (rank, phase, message) to every peer; a rank
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

from dtm_mpi.errors import RankFailure, RemoteFailureError

__all__ = ["Control", "Liveness"]

TAG_FAIL = 71
TAG_PING = 72
TAG_PONG = 73


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
        self.phase: str = "session"

    def notify(self, failures: tuple[RankFailure, ...]) -> None:
        """Tell every peer about ``failures`` (this rank's own, or peers it found hung or
        dead); does not wait."""
        payload = [(f.rank, f.phase, f.message) for f in failures]
        with self.lock:
            for r in range(self.size):
                if r != self.rank:
                    self._pending.append(self.ctrl.isend(payload, dest=r, tag=TAG_FAIL))

    def poll(self) -> RemoteFailureError | None:
        """Answer pending pings; return the failure notices received, if any (after a short
        grace, to collect simultaneous failures)."""
        with self.lock:
            self._answer()
            if not self.ctrl.Iprobe(self.MPI.ANY_SOURCE, TAG_FAIL, self._status):
                return None
            failures: dict[int, RankFailure] = {}
            grace = time.monotonic() + 0.2
            while True:
                while self.ctrl.Iprobe(self.MPI.ANY_SOURCE, TAG_FAIL, self._status):
                    payload = self.ctrl.recv(source=self._status.Get_source(), tag=TAG_FAIL)
                    for rank, phase, message in payload:
                        failures.setdefault(
                            int(rank), RankFailure(int(rank), str(phase), str(message))
                        )
                if time.monotonic() > grace:
                    break
                time.sleep(0.01)
        ordered = tuple(failures[r] for r in sorted(failures))
        return RemoteFailureError(ordered[0].phase, ordered)

    def _answer(self) -> None:
        while self.ctrl.Iprobe(self.MPI.ANY_SOURCE, TAG_PING, self._status):
            source = self._status.Get_source()
            self.ctrl.recv(source=source, tag=TAG_PING)
            answer = (self.rank, self.doing(), self.phase)
            self._pending.append(self.ctrl.isend(answer, dest=source, tag=TAG_PONG))

    def liveness(self, bound: float) -> Liveness:
        """Ping every peer and wait ``bound`` seconds for the answers."""
        peers = [r for r in range(self.size) if r != self.rank]
        heard: dict[int, tuple[str, str]] = {}
        with self.lock:
            for r in peers:
                self._pending.append(self.ctrl.isend(self.rank, dest=r, tag=TAG_PING))
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and len(heard) < len(peers):
            with self.lock:
                self._answer()
                while self.ctrl.Iprobe(self.MPI.ANY_SOURCE, TAG_PONG, self._status):
                    rank, doing, phase = self.ctrl.recv(
                        source=self._status.Get_source(), tag=TAG_PONG
                    )
                    heard[int(rank)] = (str(doing), str(phase))
            time.sleep(0.005)
        silent = tuple(r for r in peers if r not in heard)
        idle = tuple((r, heard[r][1]) for r in sorted(heard) if not heard[r][0])
        return Liveness(silent, idle)
