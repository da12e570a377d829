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


AGREE_TAG = 32766
"""The point-to-point tag of agreements run without a session (one message each way)."""


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
    session (before the mesh is known) rank 0 collects every rank's outcome and sends back
    the verdict, so a rank that never arrives is named: every rank that did arrive raises the
    same :class:`CommTimeoutError` listing the missing ranks (rank 0 itself missing is named
    by the others' longer deadline)."""
    if wait is None:
        return _agree_via_root(comm, ok, message, phase, timeout_s)
    size = int(comm.Get_size())
    mine = np.array([0 if ok else 1], dtype=np.int32)
    everyone = np.zeros(size, dtype=np.int32)
    wait(comm.Iallgather(mine, everyone), "agreement")
    failed = [r for r in range(size) if everyone[r]]
    if not failed:
        return ()
    # Every rank has reached this point (the allgather completed), so this cannot block on a
    # dead peer: it only moves the failure messages.
    messages = comm.allgather("" if ok else message)
    return tuple(RankFailure(r, phase, str(messages[r])) for r in failed)


def _poll(probe: Callable[[], Any], deadline: float) -> Any:
    """``probe()`` until it returns something or ``deadline`` (monotonic) passes (None)."""
    pause = 0.0
    while True:
        got = probe()
        if got is not None or time.monotonic() > deadline:
            return got
        time.sleep(pause)
        pause = min(0.002, pause + 0.0001)


def _agree_via_root(
    comm: Any, ok: bool, message: str, phase: str, timeout_s: float
) -> tuple[RankFailure, ...]:
    from mpi4py import MPI

    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    start = time.monotonic()
    if rank != 0:
        request = comm.isend((ok, message), dest=0, tag=AGREE_TAG)
        # longer than the root's deadline, so the root's verdict on missing ranks arrives
        grace = max(1.0, timeout_s / 4)
        probe = _poll(lambda: comm.improbe(source=0, tag=AGREE_TAG), start + timeout_s + grace)
        if probe is None:
            raise CommTimeoutError(
                f"agreement in phase {phase!r} did not complete within {timeout_s + grace:g} s "
                f"on rank {rank}: rank 0 (which collects the outcomes) did not answer; it has "
                "failed or is stuck",
                op="agreement", rank=rank, phase=phase,
            )  # fmt: skip
        failures, missing = probe.recv()
        request.wait()  # the root received it: complete
    else:
        outcomes: dict[int, tuple[bool, str]] = {0: (ok, message)}
        status = MPI.Status()
        deadline = start + timeout_s
        while len(outcomes) < size:
            got = _poll(
                lambda: comm.improbe(source=MPI.ANY_SOURCE, tag=AGREE_TAG, status=status),
                deadline,
            )
            if got is None:
                break
            outcomes[int(status.Get_source())] = got.recv()
        failures = tuple(
            RankFailure(r, phase, str(outcomes[r][1])) for r in sorted(outcomes)
            if not outcomes[r][0]
        )  # fmt: skip
        missing = tuple(r for r in range(size) if r not in outcomes)
        sends = [comm.isend((failures, missing), dest=r, tag=AGREE_TAG)
                 for r in sorted(outcomes) if r != 0]  # fmt: skip
        for req in sends:  # small messages to ranks that are waiting for them
            wait_bounded(req, timeout_s=timeout_s, op="agreement", phase=phase, rank=rank)
    if missing:
        listed = f"; {'; '.join(str(f) for f in failures)}" if failures else ""
        err = CommTimeoutError(
            f"phase {phase!r} did not end within {timeout_s:g} s: rank(s) "
            f"{', '.join(map(str, missing))} did not arrive (hung, dead or still working)"
            f"{listed}",
            op="agreement", rank=rank, phase=phase,
        )  # fmt: skip
        err.silent = tuple(missing)
        raise err
    return tuple(failures)


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
