"""Moving tensors between meshes under real MPI (the MPI suite at 2, 3 and 4 ranks): the job's
state on a mesh of every rank moves to a mesh of one rank fewer (shrink) and back (grow), in
memory, and every rank's new blocks are exactly the global arrays' blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.runtime.remesh import move_blocks
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.remesh import plan_remesh

pytestmark = pytest.mark.mpi(min_size=2)


def two_d(n: int) -> MeshShape:
    return (
        MeshShape((("dp", 2), ("tp", n // 2))) if n % 2 == 0 else MeshShape((("dp", 1), ("tp", n)))
    )


def test_state_shrinks_by_one_rank_and_grows_back(comm: Any) -> None:
    size = comm.Get_size()
    rank = comm.Get_rank()
    big, small = two_d(size), two_d(size - 1)
    rng = np.random.default_rng(7)
    g = [rng.standard_normal((9, 10)).astype(np.float32), rng.standard_normal(11)]
    on_big = [
        TensorType(DType.F32, (9, 10), Layout((("dp",), ("tp",)))),
        TensorType(DType.F64, (11,), Layout((("tp",),))),
    ]
    on_small = [
        TensorType(DType.F32, (9, 10), Layout((("tp",), ()))),
        TensorType(DType.F64, (11,), Layout(((),))),
    ]
    session = MpiSession(MeshShape((("u", size),)), timeout_s=30, world=comm, join=False)
    try:
        session.join_mesh([])
        mc = MpiComm(session)
        mine = [
            x[local_block(t.shape, t.layout, big, rank)].copy()
            for x, t in zip(g, on_big, strict=True)
        ]
        down = move_blocks(plan_remesh(on_big, big, on_small, small), rank, mine, mc)
        if rank == size - 1:
            assert down is None
        else:
            assert down is not None
            for x, t, got in zip(g, on_small, down, strict=True):
                assert np.array_equal(got, x[local_block(t.shape, t.layout, small, rank)])
        up = move_blocks(plan_remesh(on_small, small, on_big, big), rank, down, mc)
        assert up is not None
        for a, b in zip(up, mine, strict=True):
            assert a.tobytes() == b.tobytes()
    finally:
        session.close()
