"""What the job looks like from MPI: ranks, hosts, node-local ranks."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["Communicator", "describe_world", "finalize_world", "node_local_rank", "world_comm"]

Communicator: TypeAlias = "MPI.Intracomm"
"""An MPI intra-communicator (the world, a resize's merged or split one): the type the layers
above ``comm`` name without importing MPI."""


def describe_world() -> str:
    """Collective: call on all ranks. Gathers each rank's host, node-local rank and pid, checks
    that a sum over all ranks is right, and returns a report on rank 0 ("" elsewhere)."""
    import h5py
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    total = world.allreduce(rank + 1, op=MPI.SUM)
    rows = world.gather((rank, socket.gethostname(), local_rank, local_size, os.getpid()))
    if rank != 0:
        return ""
    assert rows is not None
    expect = size * (size + 1) // 2
    lines = [
        f"MPI: {MPI.Get_library_version().splitlines()[0].strip()} (standard {MPI.Get_version()})",
        f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, "
        f"parallel: {bool(h5py.get_config().mpi)}",
        f"ranks: {size}; allreduce check: {total} (expected {expect}) "
        + ("ok" if total == expect else "WRONG"),
    ]
    lines += [
        f"  rank {r}: host {host}, node-local {lr}/{ls}, pid {pid}" for r, host, lr, ls, pid in rows
    ]
    return "\n".join(lines)


def world_comm() -> Any:
    """``MPI.COMM_WORLD`` (initialising MPI on first use), for code outside ``dtm_mpi.comm``
    to hand to the functions here without importing mpi4py itself."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def node_local_rank(comm: Any, *, phase: str, timeout_s: float) -> tuple[int, int]:
    """This rank's index among the ranks of ``comm`` on its node, and how many there are
    (what binds a rank to a GPU): the ranks' processor names exchanged point to point within
    ``timeout_s``, so a rank that is gone is named by every other
    (``MPI_Comm_split_type`` would wait for it for ever).

    Collective: call on all ranks."""
    from mpi4py import MPI

    from dtm_mpi.comm.agreement import exchange_without_session

    names = exchange_without_session(
        comm, MPI.Get_processor_name(), phase=phase, timeout_s=timeout_s
    )
    here = [r for r, n in enumerate(names) if n == names[int(comm.Get_rank())]]
    return here.index(int(comm.Get_rank())), len(here)


def finalize_world() -> None:
    """End MPI in this process now (collective over the world: every rank calls it), so that
    a chosen non-zero exit code (a run stopped after saving) reaches the launcher as it is,
    not as an abort (``python -m mpi4py`` aborts the job on a non-zero exit with MPI still
    initialised)."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
