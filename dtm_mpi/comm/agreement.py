"""Bounded agreement on rank-local outcomes: every rank learns which ranks failed, and no rank
waits forever for a peer that will never arrive."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dtm_mpi.errors import CommTimeoutError, RankFailure, RemoteFailureError

__all__ = ["agree_or_raise", "agree_outcome", "wait_bounded"]


def wait_bounded(request: Any, *, timeout_s: float, op: str, phase: str, rank: int) -> None:
    """Poll an MPI request until it completes or ``timeout_s`` passes.

    Raises :class:`CommTimeoutError` naming ``op`` and ``phase`` on expiry; the request is left
    pending (the caller is expected to poison its session or abort the job).
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not request.Test():
        if time.monotonic() > deadline:
            raise CommTimeoutError(
                f"{op} did not complete within {timeout_s:g} s on rank {rank} in phase "
                f"{phase!r}: a peer has failed or is stuck",
                op=op,
                rank=rank,
                phase=phase,
            )
        time.sleep(pause)
        pause = min(0.001, pause + 0.00005)


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
    ``timeout_s``; on expiry raises :class:`CommTimeoutError` on this rank. ``wait`` (a
    session's bounded wait, which also watches failure notices) replaces the plain poll.
    """
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    mine = np.array([0 if ok else 1], dtype=np.int32)
    everyone = np.zeros(size, dtype=np.int32)
    request = comm.Iallgather(mine, everyone)
    if wait is not None:
        wait(request, "agreement")
    else:
        wait_bounded(request, timeout_s=timeout_s, op="agreement", phase=phase, rank=rank)
    failed = [r for r in range(size) if everyone[r]]
    if not failed:
        return ()
    # Every rank has reached this point (the allgather completed), so this cannot block on a
    # dead peer: it only moves the failure messages.
    messages = comm.allgather("" if ok else message)
    return tuple(RankFailure(r, phase, str(messages[r])) for r in failed)


def agree_or_raise(
    comm: Any,
    *,
    phase: str,
    error: BaseException | None,
    timeout_s: float,
    wait: Callable[[Any, str], None] | None = None,
) -> None:
    """Collective: call on all ranks. End ``phase``: if any rank failed it (``error`` is its
    own failure, or None), every rank raises the same :class:`RemoteFailureError` listing each
    failed rank and its message."""
    message = "" if error is None else (str(error) or type(error).__name__)
    failures = agree_outcome(
        comm, ok=error is None, message=message, phase=phase, timeout_s=timeout_s, wait=wait
    )
    if failures:
        raise RemoteFailureError(phase, failures)
