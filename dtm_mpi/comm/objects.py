"""Bounded collectives for the storage layer: small Python objects (manifest pieces, shard
hashes, verdicts; each travels as an OBJECT frame of ``io/WIRE.md``, checked before it is
unpickled) and one byte exchange, plus a deadline for blocking calls that cannot be
polled (parallel HDF5's collective I/O).

Every wait here is bounded by ``timeout_s``: the non-blocking MPI call is polled until done
(:func:`~dtm_mpi.comm.agreement.wait_bounded`), and a blocking call runs under
:func:`io_deadline`, which ends the whole job with one error line naming the rank, the
operation and the phase if the call is still running at its deadline. h5py keeps the
interpreter lock inside HDF5 calls, so a Python thread cannot always run at the deadline: a
backstop in C (``faulthandler``, which needs no interpreter lock) then ends the process
``BACKSTOP_S`` later, printing where every thread was, and the launcher ends the job.
"""

from __future__ import annotations

import faulthandler
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from dtm_mpi.comm.abort import claim_ending
from dtm_mpi.comm.agreement import wait_bounded
from dtm_mpi.comm.framed import object_frame, object_of
from dtm_mpi.console import write_line

__all__ = ["allgather_obj", "alltoallv_bytes", "bcast_obj", "io_deadline"]

BACKSTOP_S = 2.0
"""Seconds after a deadline at which the C-level backstop ends a process stuck with the
interpreter lock held."""


def _wait(request: Any, timeout_s: float, what: str, phase: str, rank: int) -> None:
    wait_bounded(request, timeout_s=timeout_s, op=what, phase=phase, rank=rank)


def bcast_obj(comm: Any, obj: Any, root: int, *, timeout_s: float, what: str, phase: str) -> Any:
    """Collective: call on all ranks. ``obj`` from ``root`` on every rank (an OBJECT frame:
    a damaged one is an error naming ``root`` on every rank, the root included)."""
    rank = int(comm.Get_rank())
    data = object_frame(obj, what, rank) if rank == root else np.empty(0, np.uint8)
    size = np.array([data.size], dtype=np.int64)
    _wait(comm.Ibcast(size, root=root), timeout_s, what, phase, rank)
    buf = data if rank == root else np.empty(int(size[0]), np.uint8)
    _wait(comm.Ibcast(buf, root=root), timeout_s, what, phase, rank)
    return object_of(buf, root, rank, what, phase)  # (the root too: every rank alike)


def allgather_obj(comm: Any, obj: Any, *, timeout_s: float, what: str, phase: str) -> list[Any]:
    """Collective: call on all ranks. Every rank's ``obj``, in rank order (each an OBJECT
    frame: a damaged one is an error naming its sender, on every rank)."""
    rank, n = int(comm.Get_rank()), int(comm.Get_size())
    data = object_frame(obj, what, rank)
    sizes = np.zeros(n, dtype=np.int64)
    _wait(comm.Iallgather(np.array([data.size], np.int64), sizes), timeout_s, what, phase, rank)
    counts = [int(c) for c in sizes]
    displs = [0, *np.cumsum(counts[:-1]).tolist()]
    out = np.empty(sum(counts), dtype=np.uint8)
    _wait(comm.Iallgatherv(data, [out, (counts, displs)]), timeout_s, what, phase, rank)
    return [  # (this rank's own too: a frame damaged on its way out fails every rank alike)
        object_of(out[d : d + c], j, rank, what, phase)
        for j, (d, c) in enumerate(zip(displs, counts, strict=True))
    ]


def alltoallv_bytes(
    comm: Any,
    send: np.ndarray,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    *,
    timeout_s: float,
    what: str,
    phase: str,
) -> np.ndarray:
    """Collective: call on all ranks. ``send`` holds, in rank order, ``send_counts[j]`` bytes
    for rank ``j``; returns what every rank sent here, in rank order (counts are known to both
    sides from a shared plan: no sizes move). Bulk data: MPI's blocking call (non-blocking
    collectives only progress while polled) under :func:`io_deadline`."""
    rank = int(comm.Get_rank())
    if max([*send_counts, *recv_counts, 0]) >= 2**31:
        raise ValueError(f"{what}: a per-rank count of 2**31 bytes or more; use smaller rounds")
    sd = [0, *np.cumsum(list(send_counts)[:-1]).tolist()]
    rd = [0, *np.cumsum(list(recv_counts)[:-1]).tolist()]
    out = np.empty(sum(recv_counts), dtype=np.uint8)
    with io_deadline(what, phase, rank, timeout_s):
        comm.Alltoallv([send, (list(send_counts), sd)], [out, (list(recv_counts), rd)])
    return out


class _Deadlines(threading.Thread):
    """One daemon thread watching the deadlines of the blocking calls in progress (one per
    thread: an async save's writer and the main thread may both be in one)."""

    def __init__(self) -> None:
        super().__init__(name="dtm-io-deadline", daemon=True)
        self.current: dict[int, tuple[str, str, int, float, float]] = {}

    def run(self) -> None:  # pragma: no cover  (ends the process when it fires)
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            for what, phase, rank, deadline, timeout_s in list(self.current.values()):
                if now <= deadline:
                    continue
                _end_job(
                    rank,
                    f"dtm: error: {what} did not complete within {timeout_s:g} s on rank "
                    f"{rank} in phase {phase!r}: a peer has failed or is stuck; aborting the job",
                )


def _end_job(rank: int, message: str) -> None:  # pragma: no cover  (ends the process)
    """This rank's one line (unless another thread of it is already ending the job), told to
    the peers through the command's presence where one runs (a rank the abort kills then
    prints this line, not a wrong culprit), then the abort."""
    from mpi4py import MPI

    from dtm_mpi.comm.presence import current

    claim_ending()  # else another thread of this rank is ending the job
    write_line(f"[rank {rank}] {message}")
    presence = current()
    if presence is not None:
        presence.control.announce_end(message)
        presence.control.linger(1.0)
    MPI.COMM_WORLD.Abort(1)


_WATCH: list[_Deadlines] = []  # started on first use (no thread at import time)


@contextmanager
def io_deadline(what: str, phase: str, rank: int, timeout_s: float) -> Iterator[None]:
    """Run the block (a blocking collective call, e.g. parallel HDF5 I/O) within
    ``timeout_s``; at the deadline the job is aborted with one error line. Not nested within
    one thread."""
    if not _WATCH:
        _WATCH.append(_Deadlines())
        _WATCH[0].start()
    watch, me = _WATCH[0], threading.get_ident()
    with _ARMING:
        watch.current[me] = (what, phase, rank, time.monotonic() + timeout_s, timeout_s)
        _arm_backstop(watch)
    try:
        yield
    finally:
        with _ARMING:
            watch.current.pop(me, None)
            _arm_backstop(watch)


_ARMING = threading.Lock()


def _arm_backstop(watch: _Deadlines) -> None:
    """Point the process-wide C timer at the soonest deadline (plus ``BACKSTOP_S``)."""
    if not watch.current:
        faulthandler.cancel_dump_traceback_later()
        return
    soonest = min(entry[3] for entry in watch.current.values())
    delay = max(0.05, soonest - time.monotonic() + BACKSTOP_S)
    # fd 2, not sys.stderr: it works also when stderr is captured (tests, tools)
    faulthandler.dump_traceback_later(delay, exit=True, file=2)
