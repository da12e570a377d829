"""Bounded agreement on rank-local outcomes, under real MPI."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dtm_mpi.comm.agreement import AGREE_TAG, EXCHANGE_TAG, agree_outcome, wait_bounded
from dtm_mpi.errors import CommTimeoutError


def _drain(comm, source: int, tag: int) -> None:  # type: ignore[no-untyped-def]
    """Take the frame ``source`` sent with ``tag`` (so nothing stays queued for later tests)."""
    from mpi4py import MPI

    from dtm_mpi.comm.framed import recv_frame

    status = MPI.Status()
    comm.Probe(source=source, tag=tag, status=status)
    recv_frame(comm, MPI, status)


pytestmark = pytest.mark.mpi(min_size=2)


def test_all_ok_agrees_on_nothing(comm) -> None:
    assert agree_outcome(comm, ok=True, message="", phase="p", timeout_s=30) == ()


@pytest.mark.parametrize("bad_rank_from_end", [0, 1])
def test_every_rank_sees_the_same_failures(comm, bad_rank_from_end: int) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = size - 1 - bad_rank_from_end
    failures = agree_outcome(
        comm, ok=rank != bad, message=f"boom on {rank}", phase="compute", timeout_s=30
    )
    assert [f.rank for f in failures] == [bad]
    assert failures[0].message == f"boom on {bad}"
    assert failures[0].phase == "compute"
    everyone = comm.allgather(failures)
    assert all(f == failures for f in everyone)


def test_wait_is_bounded_when_a_peer_never_arrives(comm) -> None:
    import numpy as np

    rank = comm.Get_rank()
    sub = comm.Split(0 if rank == 0 else 1, rank)
    try:
        if rank == 0 and sub.Get_size() == 1:
            # rank 0 alone in its group with a peer-less receive: nobody ever sends
            buf = np.zeros(1)
            req = comm.Irecv(buf, source=comm.Get_size() - 1, tag=4242)
            with pytest.raises(CommTimeoutError, match=r"within 0\.2 s on rank 0"):
                wait_bounded(req, timeout_s=0.2, op="recv", phase="test", rank=0)
            req.Cancel()
            req.Wait()
    finally:
        sub.Free()
    comm.Barrier()


def test_without_a_session_every_arrived_rank_names_the_missing_one(comm) -> None:
    """The agreement before a session exists: a rank that never arrives is named, alike, by
    every rank that did (none of them waits for it beyond the deadline)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    missing = size - 1
    if rank != missing:
        with pytest.raises(CommTimeoutError) as info:
            agree_outcome(comm, ok=rank != 0, message=f"bad {rank}", phase="load", timeout_s=1.0)
        text = str(info.value)
        assert info.value.silent == (missing,)
        assert f"phase 'load' did not end within 1 s: rank(s) {missing} did not arrive" in text
        assert "rank 0 (load): bad 0" in text  # what the arrived ranks said is kept
    else:  # late: take the outcomes the others sent, so nothing stays queued for later tests
        time.sleep(3.0)
        for r in range(size - 1):
            _drain(comm, r, AGREE_TAG)
    texts = comm.allgather(None if rank == missing else text)
    assert len({t for t in texts if t is not None}) == 1  # one agreed error


def test_without_a_session_all_arrived_is_agreed(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    for phase in ("load", "backend", "plan"):  # back to back: no phase's message is mistaken
        failures = agree_outcome(comm, ok=rank != size - 1, message="x", phase=phase, timeout_s=30)
        assert [(f.rank, f.phase) for f in failures] == [(size - 1, phase)]


def test_node_local_rank_is_bounded_and_names_a_missing_rank(comm) -> None:
    """What binds a rank to its GPU: on one host every rank is node-local; a rank that never
    comes is named by every other, within the deadline (a Split_type would wait for ever)."""
    from dtm_mpi.comm.world import node_local_rank

    rank, size = comm.Get_rank(), comm.Get_size()
    assert node_local_rank(comm, phase="backend", timeout_s=30) == (rank, size)
    missing = size - 1
    if rank != missing:
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            node_local_rank(comm, phase="backend", timeout_s=1.0)
        assert time.monotonic() - start < 10
        assert info.value.silent == (missing,)
        assert f"phase 'backend' did not end within 1 s: rank(s) {missing} did not arrive" in str(
            info.value
        )
    else:
        time.sleep(3.0)
        for r in range(size - 1):
            _drain(comm, r, EXCHANGE_TAG)
    comm.Barrier()


def test_a_damaged_outcome_frame_is_a_failure_of_its_sender(comm) -> None:  # type: ignore[no-untyped-def]
    """One bit of the last rank's OUTCOME frame flipped in flight (after its CRC): every other
    rank's agreement names it, and the check that caught it, instead of reading it."""
    import dtm_mpi.comm.agreement as agreement

    rank, size = comm.Get_rank(), comm.Get_size()
    sender = size - 1
    real = agreement.encode_frame

    def flipped(*args, **kw):  # type: ignore[no-untyped-def]
        frame = bytearray(real(*args, **kw))
        frame[-7] ^= 0x20
        return bytes(frame)

    if rank == sender:
        agreement.encode_frame = flipped  # type: ignore[assignment]
    try:
        failures = agree_outcome(comm, ok=True, message="", phase="step 3", timeout_s=30)
    finally:
        agreement.encode_frame = real  # type: ignore[assignment]
    if rank == sender:
        assert failures == ()  # it heard every other rank intact
    else:
        assert [(f.rank, f.phase) for f in failures] == [(sender, "step 3")]
        assert failures[0].message == (
            f"its agreement message arrived corrupt at rank {rank} (wrong: crc)"
        )
    comm.Barrier()


def test_the_benchmarks_workers_agree_one_gemm_choice(
    comm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs without a handshake (the benchmarks' workers) exchange their GEMM choices: the
    common one where all agree, else numpy's on every rank."""
    from dtm_mpi.comm.handshake import agree_gemm
    from dtm_mpi.kernels import gemm

    rank, size = comm.Get_rank(), comm.Get_size()
    mkl = "float32:small=numpy,medium=numpy,large=mkl;float64:small=numpy,medium=numpy,large=numpy"
    for odd in (None, size - 1):
        own = "" if rank == odd and size > 1 else mkl
        monkeypatch.setattr(
            gemm,
            "active_choice",
            lambda setting, own_text=own, **kw: gemm.parse_gemm_choice(own_text),
        )
        try:
            agree_gemm(comm, "auto", timeout_s=30)
            got = gemm._agreed[0]
        finally:
            gemm.use_choice(None)
        want = gemm.Provider.MKL if odd is None or size == 1 else gemm.Provider.NUMPY
        assert got.provider("float32", "large") is want
