"""The communicators of a live resize (the MPI side; the runtime decides when and what moves).

* **Shrink**: the ranks of a session split its communicator; the first ``n`` stay (keeping their
  numbers), the others get none back: they leave the computation. (In one MPI job, processes
  end together: a leaving rank's process waits in ``MPI_Finalize``, idle and holding no state,
  until the job ends.)
* **Grow**: the ranks of a session spawn ``k`` new processes (``MPI_Comm_spawn``, running this
  program with the arguments given) and merge with them: the old ranks keep their numbers, the
  new ones follow. A spawned process finds its parents with :func:`join_parents`.

Each is a blocking collective, bounded like the session's own creation (a peer that does not
arrive ends the job with a line naming the step).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from dtm_mpi.comm.objects import io_deadline

__all__ = ["join_parents", "spawn_and_merge", "split_first"]


def split_first(comm: Any, n: int, rank: int, timeout_s: float, phase: str) -> Any | None:
    """A communicator of the first ``n`` ranks of ``comm`` (their numbers kept), or None on
    the others. Collective: call on every rank of ``comm``."""
    from mpi4py import MPI

    with io_deadline("splitting the job's communicator", phase, rank, timeout_s):
        new = comm.Split(0 if rank < n else MPI.UNDEFINED, key=rank)
    return None if new == MPI.COMM_NULL else new


def spawn_and_merge(comm: Any, count: int, argv: Sequence[str], rank: int, timeout_s: float, phase: str) -> Any:  # fmt: skip
    """Spawn ``count`` processes running ``python argv`` and merge with them: the returned
    communicator holds ``comm``'s ranks first (their numbers kept), then the new ones.
    Collective: call on every rank of ``comm``."""
    with io_deadline("spawning the joining ranks", phase, rank, timeout_s):
        inter = comm.Spawn(sys.executable, args=list(argv), maxprocs=count, root=0)
        merged = inter.Merge(high=False)
    inter.Free()
    return merged


def join_parents(rank: int, timeout_s: float, phase: str) -> Any | None:
    """In a process started by :func:`spawn_and_merge`: the merged communicator (the parents
    first); None in a process nobody spawned."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    with io_deadline("joining the running job", phase, rank, timeout_s):
        merged = parent.Merge(high=True)
    parent.Free()
    return merged
