"""Moving a rank's tensors to another mesh in memory: the thin execution of a
:class:`~dtm_mpi.sharding.remesh.RemeshPlan` over the communication interface.

Every rank of the communicator holding both meshes calls :func:`move_blocks` with its old
blocks (none on a rank the old mesh does not have): it posts its sends, copies what it keeps,
receives the rest, and waits for its sends (bounded, like every transfer). A rank the new mesh
does not have gets no blocks back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.comm.interface import Comm
from dtm_mpi.errors import PlanError
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.sharding.blocks import local_offsets, local_shape
from dtm_mpi.sharding.remesh import Piece, RemeshPlan

__all__ = ["REMESH_TAG", "move_blocks"]

REMESH_TAG = 32762
"""The point-to-point tag of a remesh's messages (between two ranks, at most one per tensor,
sent and received in tensor order: MPI keeps their order)."""


def _local(region: tuple[slice, ...], offsets: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(s.start - o, s.stop - o) for s, o in zip(region, offsets, strict=True))


def move_blocks(
    plan: RemeshPlan, rank: int, blocks: Sequence[np.ndarray | None] | None, comm: Comm
) -> list[np.ndarray | None] | None:
    """This rank's blocks on the new mesh (None if the new mesh does not have it) from its
    blocks on the old one (``blocks``; None if the old mesh does not have it); a tensor the
    plan pins to other ranks is None in both.

    Collective: call on every rank of ``comm`` (which holds both meshes)."""
    if (blocks is None) != (rank >= plan.old.size):
        raise PlanError(
            f"remesh: rank {rank} {'has' if blocks is not None else 'lacks'} blocks on the old mesh of {plan.old.size} rank(s)"
        )
    old_off = (
        [local_offsets(t.shape, t.layout, plan.old, rank) for t in plan.types_old]
        if blocks is not None
        else []
    )

    def piece_of(p: Piece) -> np.ndarray:
        assert blocks is not None
        block = blocks[p.tensor]
        assert block is not None, f"rank {rank} sends from a block it does not hold"
        return block[_local(p.region, old_off[p.tensor])]

    for p in plan.sends(rank):
        comm.send(np.array(piece_of(p), order="C"), p.dst, REMESH_TAG)  # (0-d stays 0-d)
    out: list[np.ndarray | None] | None = None
    if rank < plan.new.size:
        out = [
            np.empty(local_shape(t.shape, t.layout, plan.new, rank), dtype=np_dtype(t.dtype))
            if plan.holds_new(i, rank)
            else None
            for i, t in enumerate(plan.types_new)
        ]
        new_off = [local_offsets(t.shape, t.layout, plan.new, rank) for t in plan.types_new]

        def put(p: Piece, value: np.ndarray) -> None:
            assert out is not None
            target = out[p.tensor]
            assert target is not None
            target[_local(p.region, new_off[p.tensor])] = value

        for p in plan.local(rank):
            put(p, piece_of(p))
        for p in plan.receives(rank):
            shape = tuple(s.stop - s.start for s in p.region)
            dtype = np.dtype(np_dtype(plan.types_new[p.tensor].dtype))
            put(p, comm.recv(shape, dtype, p.src, REMESH_TAG))
    comm.flush()
    return out
