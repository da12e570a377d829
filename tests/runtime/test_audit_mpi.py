"""The replica audit under real MPI, at every job size: hundreds of bits flipped at seeded
positions in one rank's blocks of replicated state tensors; every one is caught by the next
audit on every rank, with the odd rank named by majority (both ranks where there are two
replicas), and a clean audit right after passes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.errors import ReplicaDivergenceError
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.runtime.audit import ReplicaAudit
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape

pytestmark = pytest.mark.mpi(min_size=2)

FLIPS = 120  # seeded positions, the same on every rank


def _mesh(size: int) -> MeshShape:
    return MeshShape((("dp", 2), ("tp", 2)) if size == 4 else (("dp", size), ("tp", 1)))


def test_every_bit_flipped_in_a_replica_is_caught_and_named(comm: Any) -> None:
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    mesh = _mesh(size)
    text = f"""dtm 1.0
module a
mesh @m = [dp={mesh.axis_size("dp")}, tp={mesh.axis_size("tp")}]
entry func @f(state %w: f32[24,8] init zeros, state %c: f64[6,10]{{-,tp}} init zeros)
    -> f32[24,8] updates %w on @m {{
  return %w
}}
"""
    module = parse_module(text, "a.dtm")
    verify_module(module)
    assert module.entry is not None
    session = MpiSession(mesh, [mesh.axis_names], timeout_s=30, world=comm)
    session.join_mesh([mesh.axis_names])
    audit = ReplicaAudit(MpiComm(session), module.entry, every=1)
    rng = np.random.default_rng(5)
    values = [rng.standard_normal((24, 8)).astype(np.float32), rng.standard_normal((6, 10))]
    types = [p.type for p in module.entry.params]
    clean = [
        np.ascontiguousarray(v[local_block(t.shape, t.layout, mesh, rank)])
        for v, t in zip(values, types, strict=True)
    ]
    caught = 0
    for k in range(FLIPS):
        victim, which = int(rng.integers(size)), k % 2
        blocks = [b.copy() for b in clean]
        if rank == victim:
            raw = blocks[which].reshape(-1).view(np.uint8)
            raw[int(rng.integers(raw.size))] ^= np.uint8(1 << int(rng.integers(8)))
        else:
            rng.integers(blocks[which].nbytes), rng.integers(8)  # (the same draws everywhere)
        with pytest.raises(ReplicaDivergenceError) as err:
            audit.check(k + 1, blocks)
        msg = str(err.value)
        name = ("w", "c")[which]
        assert msg.startswith(f"replica audit after step {k + 1}: {name} "), msg
        group = [r for r in range(size) if which == 0 or r % 2 == victim % 2 or size < 4]
        if len(group) > 2:
            assert (
                f"{name} on rank(s) {victim} differs from its replicas on ranks {', '.join(map(str, group))}"
                in msg
            ), msg
        else:
            assert (
                f"{name} differs across its replicas on ranks {', '.join(map(str, group))} (no majority"
                in msg
            ), msg
        caught += 1
        audit.check(k + 1, clean)  # a clean audit right after: no alarm
    assert caught == FLIPS
    session.close()
