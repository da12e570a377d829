"""Bounded agreement on rank-local outcomes: every rank learns which ranks failed, and no rank
waits forever for a peer that will never arrive. The messages are wire frames (``io/WIRE.md``:
OUTCOME, VIEW): an outcome that arrives damaged is a failure of its sender, named with the
check that caught it; a damaged view adds nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dtm_mpi.comm.framed import isend_frame, take_decoded
from dtm_mpi.comm.frames import MessageType, encode_frame
from dtm_mpi.errors import CommTimeoutError, ProtocolError, RankFailure, RemoteFailureError
from dtm_mpi.log import log_debug

__all__ = [
    "active_wait",
    "agree_or_raise",
    "agree_outcome",
    "exchange_without_session",
    "wait_bounded",
]

_ACTIVE: dict[int, str] = {}  # thread id -> the bounded wait it is in


def active_wait() -> str:
    """The bounded wait some thread of this rank is in ("" if none): a liveness answer
    that says this rank is communicating, not hung."""
    for what in list(_ACTIVE.values()):
        return what
    return ""


def wait_bounded(request: Any, *, timeout_s: float, op: str, phase: str, rank: int) -> None:
    """Poll an MPI request until it completes or ``timeout_s`` passes.

    Raises :class:`CommTimeoutError` naming ``op`` and ``phase`` on expiry; the request is left
    pending (the caller is expected to poison its session or abort the job).
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    me = threading.get_ident()
    _ACTIVE[me] = f"{op} ({phase})"
    try:
        while not request.Test():
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"{op} did not complete within {timeout_s:g} s on rank {rank} in phase "
                    f"{phase!r}",
                    op=op,
                    rank=rank,
                    phase=phase,
                )
            time.sleep(pause)
            pause = min(0.001, pause + 0.00005)
    finally:
        _ACTIVE.pop(me, None)


AGREE_TAG = 32766
"""The point-to-point tag of agreements run without a session (one message to each peer)."""

VIEW_TAG = 32765
"""The tag of the second round of such an agreement: what each arrived rank heard."""


def _collect(
    comm: Any, tag: int, want: set[int], deadline: float, kind: MessageType
) -> dict[int, dict[str, Any] | ProtocolError]:
    """Receive one frame of ``kind`` with ``tag`` from each rank of ``want`` until
    ``deadline`` (monotonic); returns what came, by source: its fields, or the error saying
    how it arrived damaged."""
    from mpi4py import MPI

    got: dict[int, dict[str, Any] | ProtocolError] = {}
    status = MPI.Status()
    pause = 0.0
    while want - set(got):
        # one message per source: a fast peer's message of the next phase stays queued
        for source in sorted(want - set(got)):
            taken = take_decoded(comm, MPI, source, tag, status, kind)
            if taken is not None:
                got[source] = taken[1]
        if not want - set(got) or time.monotonic() > deadline:
            break
        time.sleep(pause)
        pause = min(0.002, pause + 0.0001)
    return got


EXCHANGE_TAG = 32764
"""The tag of :func:`exchange_without_session` (apart from the agreements': an exchange and
the agreement after it never take each other's messages)."""

EXCHANGE_VIEW_TAG = 32763


def exchange_without_session(comm: Any, text: str, *, phase: str, timeout_s: float) -> list[str]:
    """Collective: call on all ranks. Every rank's ``text``, in rank order, exchanged point to
    point within ``timeout_s`` as the agreements before a session are (on tags of its own): a
    rank that does not arrive is named by every rank that did (the same
    :class:`CommTimeoutError`)."""
    outcomes = _exchange(comm, True, text, phase, timeout_s, (EXCHANGE_TAG, EXCHANGE_VIEW_TAG))
    return [outcomes[r][1] for r in range(int(comm.Get_size()))]


def _exchange(
    comm: Any,
    ok: bool,
    message: str,
    phase: str,
    timeout_s: float,
    tags: tuple[int, int] = (AGREE_TAG, VIEW_TAG),
) -> dict[int, tuple[bool, str]]:
    """Every rank sends (``ok``, ``message``) to every other rank and waits, within
    ``timeout_s``, for all of theirs; so every rank that arrives knows by itself which ranks
    did. If some did not arrive, the arrived ranks exchange what they heard (a second bounded
    round among them) and take the union: every arrived rank names the same missing ranks and
    raises the same :class:`CommTimeoutError`. Point-to-point only: nothing here can block on
    a rank that is dead or stopped."""
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    start = time.monotonic()
    tag, view_tag = tags
    log_debug(rank, f"waiting for every rank to end phase {phase}")
    from mpi4py import MPI

    mine = encode_frame(MessageType.OUTCOME, {"phase": phase, "ok": ok, "message": message})
    sends = [isend_frame(comm, MPI, mine, r, tag) for r in range(size) if r != rank]
    got = _collect(comm, tag, set(range(size)) - {rank}, start + timeout_s, MessageType.OUTCOME)
    outcomes: dict[int, tuple[bool, str]] = {
        r: (
            (False, f"its agreement message arrived corrupt at rank {rank} (wrong: {v.field})")
            if isinstance(v, ProtocolError)
            else (bool(v["ok"]), str(v["message"]))
        )
        for r, v in got.items()
    }
    outcomes[rank] = (ok, message)
    missing = [r for r in range(size) if r not in outcomes]
    if missing:
        # a rank that arrived late for me arrived in time for another: exchange the views
        arrived = sorted(outcomes)
        view = encode_frame(
            MessageType.VIEW,
            {
                "ranks": tuple(outcomes),
                "oks": tuple(int(o[0]) for o in outcomes.values()),
                "messages": tuple(o[1] for o in outcomes.values()),
            },
        )
        sends += [isend_frame(comm, MPI, view, r, view_tag) for r in arrived if r != rank]
        # a peer that arrived just before my deadline reaches its own up to timeout_s later
        views = _collect(
            comm,
            view_tag,
            set(arrived) - {rank},
            time.monotonic() + timeout_s + 1.0,
            MessageType.VIEW,
        )
        for v in views.values():
            if isinstance(v, ProtocolError) or not len(v["ranks"]) == len(v["oks"]) == len(
                v["messages"]
            ):
                continue  # a damaged view adds nothing
            for r, good, said in zip(v["ranks"], v["oks"], v["messages"], strict=True):
                outcomes.setdefault(int(r), (bool(good), str(said)))
        missing = [r for r in range(size) if r not in outcomes]
        failures = tuple(
            RankFailure(r, phase, outcomes[r][1]) for r in sorted(outcomes) if not outcomes[r][0]
        )
        listed = f"; {'; '.join(str(f) for f in failures)}" if failures else ""
        err = CommTimeoutError(
            f"phase {phase!r} did not end within {timeout_s:g} s: rank(s) "
            f"{', '.join(map(str, missing))} did not arrive (hung, dead or still working)"
            f"{listed}",
            op="agreement",
            rank=rank,
            phase=phase,
        )
        err.silent = tuple(missing)
        raise err
    for req, _ in sends:  # every peer arrived and receives: small messages complete at once
        wait_bounded(req, timeout_s=timeout_s, op="agreement", phase=phase, rank=rank)
    return outcomes


def agree_outcome(
    comm: Any,
    *,
    ok: bool,
    message: str,
    phase: str,
    timeout_s: float,
    wait: Callable[[Any, str], None] | None = None,
) -> tuple[RankFailure, ...]:
    """Collective: call on all ranks. Agree on which ranks failed ``phase``.

    Each rank says whether it succeeded (and, if not, why); every rank returns the same tuple of
    failures, in rank order (empty when all succeeded). The wait for peers is bounded by
    ``timeout_s``. ``wait`` (a session's bounded wait, which also watches failure notices and
    names silent peers on expiry) runs the agreement as one non-blocking allgather. Without a
    session (before the mesh is known) every rank sends its outcome to every other, so a rank
    that never arrives is named: every rank that did arrive raises the same
    :class:`CommTimeoutError` listing the missing ranks."""
    failures, _ = agree_outcome_flagged(
        comm, ok=ok, message=message, phase=phase, timeout_s=timeout_s, wait=wait
    )
    return failures


def agree_outcome_flagged(
    comm: Any,
    *,
    ok: bool,
    message: str,
    phase: str,
    timeout_s: float,
    wait: Callable[[Any, str], None] | None = None,
    flag: int = 0,
) -> tuple[tuple[RankFailure, ...], int]:
    """:func:`agree_outcome`, and the flags (bits: e.g. a stop request, a resize request) any
    rank raised, OR-ed, agreed in the same exchange (the same answer on every rank)."""
    if wait is None:
        outcomes = _exchange(comm, ok, message if not ok else str(int(flag)), phase, timeout_s)
        failures = tuple(
            RankFailure(r, phase, m) for r, (k, m) in sorted(outcomes.items()) if not k
        )
        flags = int(flag)
        for k, m in outcomes.values():
            if k and m.isdigit():
                flags |= int(m)
        return failures, flags
    size = int(comm.Get_size())
    log_debug(int(comm.Get_rank()), f"waiting for every rank to end phase {phase}")
    mine = np.array([(0 if ok else 1) | (int(flag) << 1)], dtype=np.int32)
    everyone = np.zeros(size, dtype=np.int32)
    wait(comm.Iallgather(mine, everyone), "agreement")
    failed = [r for r in range(size) if everyone[r] & 1]
    flagged = int(np.bitwise_or.reduce(everyone >> 1)) if size else 0
    if not failed:
        return (), flagged
    # Every rank has reached this point (the allgather completed), so this cannot block on a
    # dead peer: it only moves the failure messages (OBJECT frames: a damaged one is named).
    messages = _gather_messages(comm, "" if ok else message, phase, wait)
    return tuple(RankFailure(r, phase, str(messages[r])) for r in failed), flagged


def _gather_messages(
    comm: Any, message: str, phase: str, wait: Callable[[Any, str], None]
) -> list[Any]:
    """Every rank's ``message``, each sent as an OBJECT frame (``io/WIRE.md``), in rank order."""
    from dtm_mpi.comm.framed import object_frame, object_of

    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    what = "a failure message"
    data = object_frame(message, what, rank)
    sizes = np.zeros(size, dtype=np.int64)
    wait(comm.Iallgather(np.array([data.size], np.int64), sizes), "agreement")
    counts = [int(c) for c in sizes]
    displs = [0, *np.cumsum(counts[:-1]).tolist()]
    out = np.empty(sum(counts), dtype=np.uint8)
    wait(comm.Iallgatherv(data, [out, (counts, displs)]), "agreement")
    return [
        object_of(out[d : d + c], j, rank, what, phase)
        for j, (d, c) in enumerate(zip(displs, counts, strict=True))
    ]


def agree_or_raise(
    comm: Any,
    *,
    phase: str,
    error: BaseException | None,
    timeout_s: float,
    wait: Callable[[Any, str], None] | None = None,
    flag: int = 0,
) -> int:
    """Collective: call on all ranks. End ``phase``: if any rank failed it (``error`` is its
    own failure, or None), every rank raises the same :class:`RemoteFailureError` listing each
    failed rank and its message. Returns the flag bits any rank raised, OR-ed (the same on
    every rank)."""
    message = "" if error is None else (str(error) or type(error).__name__)
    failures, flagged = agree_outcome_flagged(
        comm,
        ok=error is None,
        message=message,
        phase=phase,
        timeout_s=timeout_s,
        wait=wait,
        flag=flag,
    )
    if failures:
        raise RemoteFailureError(phase, failures)
    return flagged
