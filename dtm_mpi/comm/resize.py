"""The communicators of a live resize (the MPI side; the runtime decides when and what moves).

* **Shrink**: the first ``n`` ranks stay (keeping their numbers), the others leave the
  computation. A process of the launched job is *parked*: it keeps its place in the pool
  communicator (a duplicate of the world every launched process keeps), waits idle for rank
  0's call (:func:`wait_for_call`), and takes part in each later split of the pool
  (:func:`split_pool`): a grow calls it back, the end of the run releases it. (Once ranks
  were spawned, the leaving ones leave by :func:`split_first` and wait on the communicator
  they left for the end of the run: in one MPI job, processes end together.)
* **Grow**: parked ranks are called back first; beyond them, the ranks of a session spawn ``k``
  new processes (``MPI_Comm_spawn``, running this program with the arguments given) and merge
  with them: the old ranks keep their numbers, the new ones follow. A spawned process finds its
  parents, and what it joins, with :func:`join_parents`.

Each is a blocking collective, bounded like the session's own creation (a peer that does not
arrive ends the job with a line naming the step).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtm_mpi.comm.objects import io_deadline

__all__ = [
    "call_parked",
    "join_parents",
    "pool_comm",
    "spawn_and_merge",
    "split_first",
    "split_pool",
    "wait_for_call",
]


def split_first(comm: Any, n: int, rank: int, timeout_s: float, phase: str) -> Any | None:
    """A communicator of the first ``n`` ranks of ``comm`` (their numbers kept), or None on
    the others. Collective: call on every rank of ``comm``."""
    from mpi4py import MPI

    with io_deadline("splitting the job's communicator", phase, rank, timeout_s):
        new = comm.Split(0 if rank < n else MPI.UNDEFINED, key=rank)
    return None if new == MPI.COMM_NULL else new


def spawn_and_merge(
    comm: Any,
    count: int,
    argv: Sequence[str],
    message: Any,
    rank: int,
    timeout_s: float,
    phase: str,
) -> Any:
    """Spawn ``count`` processes running ``python argv`` and merge with them: the returned
    communicator holds ``comm``'s ranks first (their numbers kept), then the new ones, which
    are given rank 0's ``message`` (what they join: :func:`join_parents`). Collective: call
    on every rank of ``comm``."""
    from dtm_mpi.comm.objects import bcast_obj

    with io_deadline("spawning the joining ranks", phase, rank, timeout_s):
        inter = comm.Spawn(sys.executable, args=list(argv), maxprocs=count, root=0)
        merged = inter.Merge(high=False)
    inter.Free()
    bcast_obj(
        merged, message, 0, timeout_s=timeout_s, what="what the joining ranks join", phase=phase
    )
    return merged


def join_parents(rank: int, timeout_s: float) -> tuple[Any, Any] | None:
    """In a process started by :func:`spawn_and_merge`: the merged communicator (the parents
    first) and the parents' message; None in a process nobody spawned."""
    from mpi4py import MPI

    from dtm_mpi.comm.objects import bcast_obj

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    phase = "joining a resized run"
    with io_deadline("joining the running job", phase, rank, timeout_s):
        merged = parent.Merge(high=True)
    parent.Free()
    message = bcast_obj(
        merged, None, 0, timeout_s=timeout_s, what="what this rank joins", phase=phase
    )
    return merged, message


# --- parked ranks: the ranks of the job that left at a shrink, waiting to be called back ------

PARK_TAG = 32761
"""The tag of rank 0's calls to parked ranks (on the pool communicator)."""

PARK_CALL = "the call to a parked rank"
"""What the OBJECT frame of a call to a parked rank carries (its ``what``)."""

PARK_POLL_S = 0.02
"""How often a parked rank looks for a call (it is idle in between)."""


def pool_comm(world: Any, rank: int, timeout_s: float) -> Any:
    """A duplicate of ``world`` that every process of the job keeps for the run's resizes (a
    shrink or a grow splits it; parked ranks wait on it). Collective over ``world``."""
    with io_deadline("creating the resize communicator", "plan", rank, timeout_s):
        return world.Dup()


def split_pool(pool: Any, key: int | None, rank: int, timeout_s: float, phase: str) -> Any | None:
    """The communicator of the pool's ranks given a ``key`` (their number in it), None on the
    others. Collective over ``pool``: the running ranks and every parked one."""
    from mpi4py import MPI

    with io_deadline("splitting the job's communicator", phase, rank, timeout_s):
        new = pool.Split(0 if key is not None else MPI.UNDEFINED, key=key if key is not None else 0)
    return None if new == MPI.COMM_NULL else new


def call_parked(
    pool: Any, ranks: Sequence[int], message: Any, timeout_s: float, phase: str
) -> None:
    """Rank 0: send ``message`` to every parked rank in ``ranks`` (an OBJECT frame; bounded)."""
    from mpi4py import MPI

    from dtm_mpi.comm.agreement import wait_bounded
    from dtm_mpi.comm.framed import object_frame

    frame = object_frame(message, PARK_CALL, 0)
    for request in [pool.Isend([frame, MPI.BYTE], dest=r, tag=PARK_TAG) for r in ranks]:
        wait_bounded(
            request, timeout_s=timeout_s, op="calling the parked ranks", phase=phase, rank=0
        )


def wait_for_call(pool: Any) -> Any:
    """A parked rank: the next message rank 0 sends it (waits, idle, as long as the job runs;
    a job that fails meanwhile is ended by its launcher). A damaged call is a
    :class:`~dtm_mpi.errors.CommError` naming rank 0 and the check that caught it."""
    from mpi4py import MPI

    from dtm_mpi.comm.framed import object_of

    status = MPI.Status()
    while not pool.Iprobe(source=0, tag=PARK_TAG, status=status):
        time.sleep(PARK_POLL_S)
    frame = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
    pool.Recv([frame, MPI.BYTE], source=0, tag=PARK_TAG)
    rank = int(pool.Get_rank())
    return object_of(frame, 0, rank, PARK_CALL, "parked, waiting for a call")
