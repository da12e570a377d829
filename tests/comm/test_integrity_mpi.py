"""Payload integrity mode under real MPI, at every job size: hundreds of bits flipped in flight
at seeded positions, in point-to-point payloads and in collective results; every one is
caught, named with its route on the ranks that must know, and the communicator goes on working
(the next, clean, transfer arrives intact)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import dtm_mpi.comm.mpi_comm as mpi_comm_module
import dtm_mpi.faults as faults
from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.config import FaultKind, FaultSpec, get_config
from dtm_mpi.errors import PayloadIntegrityError
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import AllreduceSpec

pytestmark = pytest.mark.mpi(min_size=2)

FLIPS = 120  # per step kind: seeded positions, the same on every rank


def _session(comm: Any) -> MpiSession:
    size = int(comm.Get_size())
    session = MpiSession(MeshShape((("x", size),)), [("x",)], timeout_s=30, world=comm)
    session.join_mesh([("x",)])
    return session


def _integrity_mode(
    comm: Any, monkeypatch: Any, *, overlap: bool = False
) -> tuple[_Flip, dict[str, Any], MpiSession, MpiComm]:
    """Integrity mode switched on through a configuration the test changes
    (``config["now"]``: its faults say where ``flip`` flips), and the communicator."""
    flip = _Flip()
    monkeypatch.setattr(faults, "corrupt_in_place", flip)
    config = {"now": replace(get_config(), integrity=True, overlap=overlap)}
    monkeypatch.setattr(mpi_comm_module, "get_config", lambda: config["now"])
    monkeypatch.setattr(faults, "get_config", lambda: config["now"])
    session = _session(comm)
    return flip, config, session, MpiComm(session)


class _Flip:
    """Flips bit ``bit`` of what the rank sends (or holds) where a fault is injected."""

    bit = 0

    def __call__(self, rank: int, where: str, buf: np.ndarray) -> bool:
        raw = buf.reshape(-1).view(np.uint8)
        raw[self.bit // 8] ^= np.uint8(1 << (self.bit % 8))
        return True


def test_every_bit_flipped_in_a_point_to_point_payload_is_caught(
    comm: Any, monkeypatch: Any
) -> None:
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    flip = _Flip()
    monkeypatch.setattr(faults, "corrupt_in_place", lambda r, w, b: False)
    session = _session(comm)
    mc = MpiComm(session, integrity=True)
    rng = np.random.default_rng(7)
    payload = rng.standard_normal(300).astype(np.float32)
    caught = 0
    for k, bit in enumerate(rng.integers(0, payload.nbytes * 8, FLIPS)):
        sender, receiver = k % size, (k + 1) % size
        flip.bit = int(bit)
        if rank == sender:
            monkeypatch.setattr(faults, "corrupt_in_place", flip)
            mc.send(payload, receiver, tag=k)
            monkeypatch.setattr(faults, "corrupt_in_place", lambda r, w, b: False)
            mc.send(payload, receiver, tag=10_000 + k)  # then a clean one
        if rank == receiver:
            with pytest.raises(PayloadIntegrityError) as err:
                mc.recv(payload.shape, payload.dtype, sender, tag=k)
            assert f"send/recv from rank {sender} to rank {receiver} tag {k}:" in str(err.value)
            caught += 1
            again = mc.recv(payload.shape, payload.dtype, sender, tag=10_000 + k)
            assert np.array_equal(again, payload)
        mc.flush()
    assert caught == sum(1 for k in range(FLIPS) if (k + 1) % size == rank)
    session.close()


SIDE_THREAD = {"overlapped": "allreduce", "prefetched": "allgather"}
"""The collectives run on the side thread (``DTM_OVERLAP``) and compared when waited for."""


@pytest.mark.parametrize("op", ["allreduce", "overlapped", "allgather", "prefetched", "broadcast"])
def test_every_bit_flipped_in_a_collective_result_is_named_on_every_rank(
    comm: Any, monkeypatch: Any, op: str
) -> None:
    """(``overlapped``: an allreduce run on the side thread, ``DTM_OVERLAP``, compared when
    waited for; ``prefetched``: an allgather run there.)"""
    from dtm_mpi.sharding.steps import AllgatherSpec

    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    flip, config, session, mc = _integrity_mode(comm, monkeypatch, overlap=op in SIDE_THREAD)
    assert mc.integrity and mc.side_thread == (op in SIDE_THREAD)
    name = SIDE_THREAD.get(op, op)
    rng = np.random.default_rng(11)
    x = np.full(64, rank + 1.0, dtype=np.float64)
    allreduce = AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, 64)
    allgather = AllgatherSpec(tuple(range(size)), rank, 0, (64,) * size, (64,) * size)

    def run() -> np.ndarray:
        if op == "overlapped":
            handle = mc.start_allreduce(x, ("x",), allreduce)
            assert type(handle).__name__ == "_CheckedCall"  # (the side thread's)
            return handle.wait()
        if op == "prefetched":
            handle = mc.start_allgather(x, ("x",), allgather)
            assert type(handle).__name__ == "_CheckedCall"  # (the side thread's)
            return handle.wait()
        if op == "allreduce":
            return mc.allreduce(x, ("x",), allreduce)
        if op == "allgather":
            return mc.allgather(x, ("x",), allgather)
        return mc.broadcast(x, ("x",), 0)

    out_bits = 64 * 8 * (size if name == "allgather" else 1) * 8
    for k, bit in enumerate(rng.integers(0, out_bits, FLIPS)):
        victim = k % size
        flip.bit = int(bit)
        faulty = (FaultSpec(victim, name, FaultKind.CORRUPT),)
        config["now"] = replace(config["now"], faults=faulty)
        with pytest.raises(PayloadIntegrityError) as err:
            run()
        text = str(err.value)
        assert f"{name} over x: the members' results differ" in text, text
        if size > 2:
            assert f"rank(s) {victim} hold other bytes than the rest" in text, text
        else:
            assert f"rank(s) {victim}: CRC32C" in text, text
        config["now"] = replace(config["now"], faults=())
        run()  # a clean call right after: no alarm
    session.close()


@pytest.mark.parametrize("what", ["all_to_all", "exchange", "reduce_scatter"])
def test_every_bit_flipped_in_an_exchanged_piece_is_named_by_its_receiver(
    comm: Any, monkeypatch: Any, what: str
) -> None:
    """All-to-all, redistribution exchanges and reduce-scatter move each member's pieces
    unchanged (a reduce-scatter folds them on receipt): every piece carries its sender's
    CRC32C, and the member a damaged piece went to names its sender; the others get their
    results intact, and the next, clean, call is intact everywhere."""
    from dtm_mpi.sharding.steps import ExchangeSpec, ReduceScatterSpec, Transfer

    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    flip, config, session, mc = _integrity_mode(comm, monkeypatch)
    per, group = 40, tuple(range(size))
    x = np.arange(per * size, dtype=np.float32) + 1000 * rank

    def region(j: int) -> tuple[slice, ...]:
        return (slice(j * per, (j + 1) * per),)

    moves = tuple(Transfer(j, region(j), per) for j in range(size))
    ex = ExchangeSpec(group, rank, moves, moves, (per * size,), per, per)
    pieces = tuple((j * per, per) for j in range(size))
    rs = ReduceScatterSpec(group, rank, ReduceOp.SUM, 0, pieces, (per,) * size)

    def run() -> np.ndarray:
        if what == "reduce_scatter":
            return mc.reduce_scatter(x, ("x",), rs)
        return mc.exchange(x, ("x",), ex, what)

    want = run()
    if what == "reduce_scatter":
        expect = sum(
            np.arange(per * size, dtype=np.float32)[region(rank)] + 1000 * j for j in group
        )
    else:
        expect = np.concatenate([np.arange(per) + rank * per + 1000 * j for j in group])
    assert np.array_equal(want, np.asarray(expect, dtype=np.float32))
    rng = np.random.default_rng(13)
    bits = rng.integers(0, x.nbytes * 8, FLIPS)
    caught = 0
    for k, bit in enumerate(bits):
        victim, hit = k % size, int(bit) // 8 // (per * 4)  # the member the damaged piece goes to
        flip.bit = int(bit)
        config["now"] = replace(config["now"], faults=(FaultSpec(victim, what, FaultKind.CORRUPT),))
        if rank == hit:
            with pytest.raises(PayloadIntegrityError) as err:
                run()
            text = str(err.value)
            assert (
                f"{what} over x from rank {victim} to rank {hit}: the piece ({per * 4} bytes)"
                in text
            )
            caught += 1
        else:
            assert run().tobytes() == want.tobytes()
        config["now"] = replace(config["now"], faults=())
        assert run().tobytes() == want.tobytes()  # a clean call right after: intact
    assert caught == sum(1 for b in bits if int(b) // 8 // (per * 4) == rank)
    session.close()
