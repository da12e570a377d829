"""Communicator handles for the layers above ``comm/`` (``io/``, ``runtime/``, the store CLI).

Those layers never import mpi4py: they receive the communicators they work on from their
caller (as mpi4py's own utilities take ``comm``) and make the few derived ones they need
through the functions here -- a duplicate for a background writer, a split into the groups of
ranks that share a data file -- and free them here. The self communicator (one process, e.g.
HDF5's MPI-IO driver for a file only this rank reads, or the serial store tools) and the
thread-level query come from here too.

Nothing here initialises MPI at import time; the first call does (as mpi4py does).
"""

from __future__ import annotations

from typing import Any

from dtm_mpi.comm.world import world_comm  # the one definition (re-exported here)

__all__ = [
    "dup",
    "free",
    "self_comm",
    "split",
    "thread_multiple",
    "world_comm",
    "world_rank",
    "world_size",
]


def self_comm() -> Any:
    """``MPI.COMM_SELF``: this process alone."""
    from mpi4py import MPI

    return MPI.COMM_SELF


def world_size() -> int:
    """How many processes the job has (1 for a program started without a launcher)."""
    return int(world_comm().Get_size())


def world_rank() -> int:
    """This process's rank in the job (0 for a program started without a launcher)."""
    return int(world_comm().Get_rank())


def thread_multiple() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py's default), which a
    thread doing MPI calls beside the main thread needs."""
    from mpi4py import MPI

    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


def dup(comm: Any) -> Any:
    """Collective on ``comm``: a duplicate (its own message space; free it with :func:`free`)."""
    return comm.Dup()


def split(comm: Any, color: int | None, key: int) -> Any:
    """Collective on ``comm``: the communicator of the ranks passing the same ``color``,
    ordered by ``key`` (free it with :func:`free`); None for a rank passing ``color=None``
    (in no group)."""
    if color is None:
        from mpi4py import MPI

        comm.Split(MPI.UNDEFINED, key)
        return None
    return comm.Split(color, key)


def free(comm: Any) -> None:
    """Free a communicator made by :func:`dup` or :func:`split` (never the world or self
    communicator: those are left alone)."""
    from mpi4py import MPI

    if comm is None or comm in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
        return
    comm.Free()
