"""The device communication layer in one process: the GPU-aware decision (layer precedence,
vendor queries answered by fake MPI functions, the probe's child), and DeviceComm over the
simulator on fake device arrays: every op equal to the host op, a synchronisation before
each, staging buffers reused and never aliased by results, host arrays passed through, the
one-time log line, the required-GPU-aware error; the pinned pool; the handshake field."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.comm.device import NOT_AWARE, DeviceComm, PinnedPool
from dtm_mpi.comm.gpu_aware import (
    Answer,
    GpuAwareness,
    combine_gpu_aware,
    decide_gpu_aware,
    detect_gpu_aware,
    mpi_vendor,
    parse_gpu_aware_mode,
    probe_env,
    probe_gpu_aware,
    query_vendor,
    read_probe,
    setting_answer,
)
from dtm_mpi.comm.handshake import Hello, compare_hellos
from dtm_mpi.comm.sim import SimComm, SimWorld, run_ranks
from dtm_mpi.config import GpuAwareMode, load_config
from dtm_mpi.errors import CommError, GpuAwareMpiError, HandshakeError, UsageError
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding import MeshShape
from dtm_mpi.sharding.steps import AllreduceSpec
from tests.comm.fake_device import (
    FakeDeviceOps,
    dev,
    fake_cupy_environ,
    run_spec,
    same,
    step_input,
    steps_for,
)

KS = [1, 2, 3, 4]
NO = GpuAwareness(False, "setting", "--gpu-aware-mpi no")
YES = GpuAwareness(True, "setting", "--gpu-aware-mpi yes")
OMPI4 = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"
MPICH = "MPICH Version:\t4.1.2\nMPICH Release date:\tWed Jun  7 15:22:45 CDT 2023\n"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS\n"


def line(k: int) -> MeshShape:
    return MeshShape((("x", k),))


# --- the decision -----------------------------------------------------------------------------


def test_first_layer_that_answers_wins() -> None:
    yes, no, unknown = Answer(True, "y"), Answer(False, "n"), Answer(None, "?")
    assert decide_gpu_aware(yes, no, no) == GpuAwareness(True, "setting", "y")
    assert decide_gpu_aware(no, yes, yes) == GpuAwareness(False, "setting", "n")
    assert decide_gpu_aware(unknown, no, yes) == GpuAwareness(False, "vendor query", "n")
    assert decide_gpu_aware(unknown, yes, no) == GpuAwareness(True, "vendor query", "y")
    assert decide_gpu_aware(unknown, unknown, yes) == GpuAwareness(True, "probe", "y")
    assert decide_gpu_aware(unknown, None, no) == GpuAwareness(False, "probe", "n")
    got = decide_gpu_aware(Answer(None, "auto"), Answer(None, "no symbol"), Answer(None, "no cupy"))
    assert not got.aware and got.source == "default"
    assert "auto" in got.detail and "no symbol" in got.detail and "no cupy" in got.detail
    assert str(got) == "no (default)" and got.describe().startswith("no (default: no layer")


def test_detect_runs_only_the_layers_it_needs() -> None:
    calls: list[str] = []

    def vendor(answer: bool | None) -> Any:
        return lambda b: calls.append(f"vendor {b}") or Answer(answer, "v")

    def probe(b: str) -> Answer:
        calls.append(f"probe {b}")
        return Answer(True, "p")

    auto = load_config({})
    got = detect_gpu_aware("yes", "cuda", config=auto, vendor_query=vendor(False), probe=probe)
    assert got == GpuAwareness(True, "setting", "--gpu-aware-mpi yes") and calls == []
    got = detect_gpu_aware(None, "cuda", config=auto, vendor_query=vendor(False), probe=probe)
    assert got.source == "vendor query" and not got.aware and calls == ["vendor cuda"]
    calls.clear()
    got = detect_gpu_aware("auto", "hip", config=auto, vendor_query=vendor(None), probe=probe)
    assert got == GpuAwareness(True, "probe", "p") and calls == ["vendor hip", "probe hip"]
    env_no = load_config({"DTM_GPU_AWARE_MPI": "no"})
    got = detect_gpu_aware(None, "cuda", config=env_no, vendor_query=vendor(True), probe=probe)
    assert got == GpuAwareness(False, "setting", "DTM_GPU_AWARE_MPI=no")
    got = detect_gpu_aware("yes", "cuda", config=env_no, vendor_query=vendor(True), probe=probe)
    assert got.aware and got.detail == "--gpu-aware-mpi yes"  # the command line wins


def test_setting_words() -> None:
    for word, mode in [
        ("yes", GpuAwareMode.YES),
        ("1", GpuAwareMode.YES),
        ("ON", GpuAwareMode.YES),
        ("no", GpuAwareMode.NO),
        ("0", GpuAwareMode.NO),
        ("false", GpuAwareMode.NO),
        (" auto ", GpuAwareMode.AUTO),
    ]:
        assert parse_gpu_aware_mode(word) is mode
    with pytest.raises(UsageError, match=r"--gpu-aware-mpi: expected yes, no or auto, got 'maybe'"):
        parse_gpu_aware_mode("maybe")
    assert setting_answer(GpuAwareMode.AUTO) == Answer(None, "--gpu-aware-mpi auto")


def test_vendor_names() -> None:
    assert mpi_vendor(OMPI4) == "openmpi" and mpi_vendor(MPICH) == "mpich"
    assert mpi_vendor(INTEL) == "intel" and mpi_vendor("MVAPICH Version: 3.0") == "mvapich"
    assert mpi_vendor("MPI VERSION    : CRAY MPICH version 8.1.28") == "cray"
    assert mpi_vendor("Microsoft MPI 10.1") == "unknown"
    assert mpi_vendor(MPICH + "MPICH CC: icc -O2\nconfigure: --prefix=/opt/intel\n") == "mpich"


def fake_lookup(**fns: Any) -> Any:
    return fns.get


def test_open_mpi_query() -> None:
    def q(backend: str, **fns: Any) -> Answer:
        return query_vendor(backend, library_version=OMPI4, lookup=fake_lookup(**fns))

    assert q("cuda", MPIX_Query_cuda_support=lambda: 0) == Answer(
        False, "Open MPI v4.1.4: MPIX_Query_cuda_support() returned 0"
    )  # a definite no
    # Open MPI 4 answers how it was built (CUDA may be off at run time): a 1 is not trusted
    assert q("cuda", MPIX_Query_cuda_support=lambda: 1).aware is None
    assert q("cuda").aware is None  # a missing symbol is unknown, not no
    assert q("hip", MPIX_Query_cuda_support=lambda: 1).aware is None  # Open MPI 4: no rocm query
    assert q("hip", MPIX_Query_rocm_support=lambda: 1).aware is None
    assert q("fake", MPIX_Query_cuda_support=lambda: 1).aware is None

    def q5(backend: str, **fns: Any) -> Answer:
        five = OMPI4.replace("v4.1.4", "v5.0.6")
        return query_vendor(backend, library_version=five, lookup=fake_lookup(**fns))

    # Open MPI 5 checks at run time, but a CUDA-aware build may say 0 before CUDA starts
    assert q5("cuda", MPIX_Query_cuda_support=lambda: 1).aware is True
    assert q5("hip", MPIX_Query_rocm_support=lambda: 1).aware is True
    assert q5("cuda", MPIX_Query_cuda_support=lambda: 0).aware is None


def test_failing_layers_do_not_know_and_the_probe_gets_the_device() -> None:
    seen: list[tuple[str, int | None]] = []

    def boom(backend: str) -> Answer:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    got = detect_gpu_aware("auto", "cuda", vendor_query=boom, probe=boom)
    assert got.aware is False and got.source == "default"
    assert (
        "the vendor query failed: UnicodeDecodeError" in got.detail
        and "the probe failed" in got.detail
    )
    import dtm_mpi.comm.gpu_aware as ga

    saved = ga.probe_gpu_aware
    try:
        ga.probe_gpu_aware = lambda backend, **kw: (
            seen.append((backend, kw.get("device"))) or Answer(True, "ok")
        )  # type: ignore[assignment,func-returns-value]
        ga._PROBED.clear()
        got = detect_gpu_aware("auto", "cuda", vendor_query=lambda b: Answer(None, "?"), device=3)
    finally:
        ga.probe_gpu_aware = saved
        ga._PROBED.clear()
    assert got.aware is True and got.source == "probe" and seen == [("cuda", 3)]


def test_real_time_signals_and_undecodable_output_are_read() -> None:
    got = read_probe(-37, "stage: transfer\n", "\ufffd garbage", False, 30.0)
    assert got.aware is False and "died with signal 37" in got.detail


def test_mpich_family_query() -> None:
    seen: list[int] = []

    def gpu_query(supported: set[int], rc: int = 0) -> Any:
        def fn(gpu_type: ctypes.c_int, ok: Any) -> int:
            seen.append(gpu_type.value)
            ok.contents.value = int(gpu_type.value in supported)
            return rc

        return fn

    def q(backend: str, version: str, fn: Any) -> Answer:
        return query_vendor(
            backend, library_version=version, lookup=fake_lookup(MPIX_GPU_query_support=fn)
        )

    got = q("cuda", MPICH, gpu_query({0}))
    assert got.aware is True and "MPICH Version: 4.1.2" in got.detail
    assert "MPIX_GPU_SUPPORT_CUDA" in got.detail and seen == [0]
    assert q("hip", MPICH, gpu_query({2})).aware is True and seen[-1] == 2
    assert q("hip", MPICH, gpu_query({0})).aware is False  # MPICH itself: a no
    assert q("cuda", MPICH, gpu_query({0}, rc=12)).aware is None  # an error code: unknown
    assert q("cuda", MPICH, None).aware is None  # MPICH < 4.0: no symbol
    got = q("cuda", INTEL, gpu_query(set()))
    assert got.aware is None and "intel" in got.detail  # derivatives: a 0 is not a no
    assert q("cuda", INTEL, gpu_query({0})).aware is True
    assert q("cuda", "Microsoft MPI 10.1", gpu_query({0})).aware is None


# --- the probe --------------------------------------------------------------------------------


def test_probe_outcomes() -> None:
    assert read_probe(0, "stage: mpi\nstage: transfer\nresult: yes\n", "", False, 30).aware
    got = read_probe(0, "stage: mpi\nstage: transfer\nresult: no: bytes differ\n", "", False, 30)
    assert got == Answer(False, "bytes differ")
    got = read_probe(0, "unknown: no usable device: ImportError\n", "", False, 30)
    assert got.aware is None and "no usable device" in got.detail
    got = read_probe(-11, "stage: mpi\nstage: transfer\n", "Segmentation fault\n", False, 30)
    assert got.aware is False and "SIGSEGV" in got.detail and "device buffer" in got.detail
    got = read_probe(-9, "stage: mpi\nstage: transfer\n", "", True, 30)
    assert got.aware is False and "hung for 30 s" in got.detail
    got = read_probe(1, "stage: mpi\n", "MPI_Init failed\n", False, 30)
    assert got.aware is None and "starting MPI alone" in got.detail and "MPI_Init" in got.detail
    assert read_probe(1, "", "boom", False, 30).aware is None


def test_probe_environment_is_a_singleton() -> None:
    env = probe_env(
        {
            "PATH": "/bin",
            "OMPI_COMM_WORLD_RANK": "1",
            "PMIX_RANK": "1",
            "PMI_RANK": "1",
            "SLURM_PROCID": "1",
            "OMPI_MCA_ess_base_jobid": "7",
            "OMPI_MCA_pml": "ucx",
            "OMPI_MCA_opal_cuda_support": "1",
            "HYDRA_CONTROL_FD": "3",
            "CUDA_VISIBLE_DEVICES": "2",
        }
    )
    assert env == {
        "PATH": "/bin",
        "OMPI_MCA_pml": "ucx",
        "OMPI_MCA_opal_cuda_support": "1",
        "CUDA_VISIBLE_DEVICES": "2",
        "OMPI_MCA_ess_singleton_isolated": "1",
    }


def fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_probe_child_crash_and_hang_mean_no(tmp_path: Path) -> None:
    crash = fake_python(tmp_path, 'echo "stage: mpi"; echo "stage: transfer"; kill -SEGV $$')
    got = probe_gpu_aware("cuda", python=crash)
    assert got.aware is False and "SIGSEGV" in got.detail
    hang = fake_python(tmp_path, 'echo "stage: mpi"; echo "stage: transfer"; exec sleep 60')
    start = time.monotonic()
    got = probe_gpu_aware("cuda", python=hang, timeout_s=0.5)
    assert got.aware is False and "hung for 0.5 s" in got.detail
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("mode", ["host", "unmapped"])
def test_probe_child_end_to_end(tmp_path: Path, mode: str) -> None:
    """The real child with a fake CuPy: MPI initialised alone, a "device" buffer sent to
    itself; where the buffer is unmapped memory MPI crashes the child, never this process."""
    got = probe_gpu_aware("cuda", environ=fake_cupy_environ(str(tmp_path), mode), timeout_s=60)
    if mode == "host":
        assert got == Answer(True, "a device buffer sent to itself on COMM_SELF arrived intact")
    else:
        assert (
            got.aware is False and "died with SIGSEGV while MPI moved a device buffer" in got.detail
        )
    hip = probe_gpu_aware("hip", environ=fake_cupy_environ(str(tmp_path), mode), timeout_s=60)
    assert hip == Answer(None, "probe: CuPy is built for cuda, not hip")


def test_probe_without_a_device_is_unknown() -> None:
    """The real child on a machine without CuPy: it cannot say."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the probe may find a device and answer")
    got = probe_gpu_aware("cuda", environ=dict(os.environ))
    assert got.aware is None, got
    assert probe_gpu_aware("fake").aware is None  # no probe for fake arrays


def test_combining_ranks() -> None:
    vendor_no = GpuAwareness(False, "vendor query", "Open MPI v4.1.4: returned 0")
    got = combine_gpu_aware([YES, YES, vendor_no, YES])
    assert not got.aware and got.source == "vendor query" and got.agreed
    assert got.detail.startswith("not GPU-aware on rank(s) 2 of 4: rank 2: vendor query: Open MPI")
    assert combine_gpu_aware([YES, YES]) == GpuAwareness(True, "setting", YES.detail, agreed=True)
    assert combine_gpu_aware([NO]) == GpuAwareness(False, "setting", NO.detail, agreed=True)
    many = combine_gpu_aware([NO] * 6)
    assert "rank(s) 0, 1, 2, 3, 4, 5 of 6" in many.detail and "and 2 more" in many.detail


# --- DeviceComm over the simulator ------------------------------------------------------------


def pooled(dc: DeviceComm) -> list[np.ndarray]:
    return [e.buf for kept in dc.pool._kept.values() for e in kept]


@pytest.mark.parametrize("aware", [False, True])
@pytest.mark.parametrize("k", KS)
def test_every_collective_matches_the_host_op(k: int, aware: bool) -> None:
    mesh = line(k)
    lines: list[str] = []

    def body(comm: SimComm) -> None:
        ops = FakeDeviceOps()
        dc = DeviceComm(comm, ops, YES if aware else NO, log=lines.append)
        for i, step in enumerate(steps_for(k)):
            x = step_input(step, mesh, comm.rank, seed=i)
            before = (comm.stats.bytes_sent, comm.stats.bytes_received)
            want = run_spec(comm, step, mesh, x)
            middle = (comm.stats.bytes_sent, comm.stats.bytes_received)
            ops.events.clear()
            d = dev(x)
            got = run_spec(dc, step, mesh, d)
            assert same(got, want), (comm.rank, str(step))
            after = (comm.stats.bytes_sent, comm.stats.bytes_received)
            assert [a - m for a, m in zip(after, middle, strict=True)] == [
                m - b for m, b in zip(middle, before, strict=True)
            ]  # the same accounting as the host op
            assert ops.events[0] == "sync" and ops.events.count("sync") == 1, ops.events
            assert not any(np.shares_memory(got.host, b) for b in pooled(dc))
            d.host[...] = -7  # the input may change: the result is a copy
            assert same(got, want)
        n = len(steps_for(k))
        assert ops.syncs == n and sum(dc.paths.staged.values()) == n and not dc.paths.direct
        why = NOT_AWARE if not aware else None
        assert set(dc.paths.why) == ({why} if why else {"the inner comm is not MPI"})

    run_ranks(mesh, body, timeout_s=20)
    if aware:
        assert lines == []  # staging for lack of a direct path is not news
    else:
        assert len(lines) == k and len(set(lines)) == 1  # once per rank (per run)
        assert lines[0] == (
            "staging device buffers through pinned host memory: MPI is not GPU-aware "
            "(setting: --gpu-aware-mpi no)"
        )


@pytest.mark.parametrize("k", KS)
def test_started_collectives_on_device_buffers_complete_at_once(k: int) -> None:
    """``start_allgather`` (a prefetched gather) and ``start_allreduce`` (an overlapped
    bucket) on device buffers run the blocking call at once (the stream is synchronised
    around MPI): completed handles whose results are the host ops'."""
    from dtm_mpi.comm.interface import Completed
    from dtm_mpi.sharding.steps import AllgatherSpec

    mesh = line(k)

    def body(comm: SimComm) -> None:
        dc = DeviceComm(comm, FakeDeviceOps(), YES)
        group = tuple(range(k))
        x = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * comm.rank
        gather = AllgatherSpec(group, comm.rank, 0, (2,) * k, (6,) * k)
        started = dc.start_allgather(dev(x), ("x",), gather)
        assert isinstance(started, Completed)
        want = np.concatenate(
            [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r for r in group]
        )
        assert same(started.wait(), want)
        summed = dc.start_allreduce(
            dev(x), ("x",), AllreduceSpec(group, comm.rank, ReduceOp.SUM, 6)
        )
        assert isinstance(summed, Completed) and same(summed.wait(), want.reshape(k, 2, 3).sum(0))

    run_ranks(mesh, body, timeout_s=20)


@pytest.mark.parametrize("k", KS)
def test_staging_buffers_are_reused_and_results_never_alias_them(k: int) -> None:
    mesh = line(k)

    def body(comm: SimComm) -> tuple[int, int, int]:
        ops = FakeDeviceOps()
        dc = DeviceComm(comm, ops, NO, log=lambda _: None)
        spec = AllreduceSpec(tuple(range(k)), comm.rank, ReduceOp.SUM, 300)
        results = []
        for step in range(20):
            x = np.full((10, 30), step + comm.rank, dtype=np.float64)
            results.append(dc.allreduce(dev(x), ("x",), spec))
        for step, r in enumerate(results):  # later calls overwrote the staging buffer
            assert np.all(r.host == sum(step + j for j in range(k))), step
        return ops.pinned_calls, dc.pool.allocations, dc.pool.reused

    for pinned, allocations, reused in run_ranks(mesh, body, timeout_s=20):
        # a peer may still read this rank's previous buffer (the simulator hands arrays by
        # reference), never the one before: at most two buffers, however many calls
        assert pinned == allocations and allocations <= (1 if k == 1 else 2)
        assert reused == 20 - allocations


@pytest.mark.parametrize("k", KS)
def test_broadcast_send_recv(k: int) -> None:
    mesh = line(k)

    def body(comm: SimComm) -> None:
        ops = FakeDeviceOps()
        dc = DeviceComm(comm, ops, NO, log=lambda _: None)
        r = comm.rank
        for root in range(k):
            x = dev(np.arange(6, dtype=np.int32).reshape(2, 3) * 10 + r)
            got = dc.broadcast(x, ("x",), root)
            assert same(got, np.arange(6, dtype=np.int32).reshape(2, 3) * 10 + root)
            assert (got is x) == (r == root)  # the root keeps its own value (as MpiComm)
        data = np.linspace(0, 1, 7, dtype=np.float32) + r
        dc.send(dev(data), (r + 1) % k, tag=3)
        got = dc.recv((7,), np.dtype(np.float32), (r - 1) % k, tag=3)
        dc.flush()
        assert same(got, np.linspace(0, 1, 7, dtype=np.float32) + (r - 1) % k)
        dc.send(data, (r + 1) % k, tag=4)  # a host send, received as a host array
        host = dc.recv((7,), np.dtype(np.float32), (r - 1) % k, tag=4, device=False)
        assert isinstance(host, np.ndarray) and np.array_equal(host, got.host)
        assert dc.paths.staged == {"broadcast": k, "send": 1, "recv": 1}
        assert dc.paths.host == {"send": 1, "recv": 1}
        assert ops.syncs == k + 2

    run_ranks(mesh, body, timeout_s=20)


def test_host_arrays_pass_straight_through() -> None:
    mesh = line(2)

    def body(comm: SimComm) -> None:
        ops = FakeDeviceOps()
        lines: list[str] = []
        dc = DeviceComm(comm, ops, NO, log=lines.append)
        for i, step in enumerate(steps_for(2)):
            x = step_input(step, mesh, comm.rank, seed=i)
            got = run_spec(dc, step, mesh, x)
            assert isinstance(got, np.ndarray)
        b = dc.broadcast(np.ones(3), ("x",), 0)
        assert isinstance(b, np.ndarray)
        assert ops.syncs == 0 and ops.events == [] and lines == [] and not dc.paths.staged
        assert dc.paths.host["allreduce"] == 6 and dc.pool.allocations == 0
        assert dc.stats is comm.stats
        assert "host arrays" in dc.describe()

    run_ranks(mesh, body, timeout_s=20)


def test_required_gpu_aware_names_the_deciding_layer() -> None:
    comm = SimComm(SimWorld(line(1), 5.0), 0)
    vendor_no = GpuAwareness(
        False, "vendor query", "Open MPI v4.1.4: MPIX_Query_cuda_support() returned 0"
    )
    with pytest.raises(GpuAwareMpiError) as info:
        DeviceComm(comm, FakeDeviceOps(), vendor_no, require_gpu_aware=True)
    text = str(info.value)
    assert "GPU-aware MPI is required" in text and "the vendor query layer decided" in text
    assert "MPIX_Query_cuda_support() returned 0" in text
    assert isinstance(info.value, CommError) and not info.value.agreed
    agreed_no = combine_gpu_aware([vendor_no])
    with pytest.raises(GpuAwareMpiError) as info:
        DeviceComm(comm, FakeDeviceOps(), agreed_no, require_gpu_aware=True)
    assert info.value.agreed  # the same decision on every rank: raised alike everywhere
    DeviceComm(comm, FakeDeviceOps(), YES, require_gpu_aware=True)  # aware: fine


# --- the pinned pool --------------------------------------------------------------------------


def test_pool_reuses_free_buffers_only() -> None:
    ops = FakeDeviceOps()
    pool = PinnedPool(ops)
    a = pool.take(100)
    a[:] = 1
    b = pool.take(100)  # a is alive: another buffer
    assert not np.shares_memory(a, b) and ops.pinned_calls == 2
    view = a[10:20].view(np.uint16)  # a view of a view still holds the buffer
    del a
    c = pool.take(3000)  # same size class (4 KiB), b and the view alive
    assert ops.pinned_calls == 3 and not np.shares_memory(c, view)
    del view, b, c
    for _ in range(10):
        d = pool.take(4096)
        del d
    assert ops.pinned_calls == 3 and pool.reused == 10 and pool.buffers == 3
    big = pool.take(5000)  # next class
    assert big.nbytes == 5000 and pool.pinned_bytes == 3 * 4096 + 8192
    assert pool.take(0).nbytes == 0


def test_pool_limits_fall_back_to_pageable_memory() -> None:
    ops = FakeDeviceOps()
    pool = PinnedPool(ops, max_bytes=3 * 4096)
    held = [pool.take(10) for _ in range(5)]
    assert ops.pinned_calls == 3 and pool.pageable == 2 and len(held) == 5
    pool.PER_CLASS = 1
    pool.clear()
    held += [pool.take(10) for _ in range(2)]
    assert ops.pinned_calls == 4 and pool.pageable == 3


# --- the handshake ----------------------------------------------------------------------------


def test_handshake_carries_but_does_not_compare_the_local_answer() -> None:
    def hello(gpu_aware: str, backend: str = "cuda") -> Hello:
        return Hello(1, "0.1", "h", "x=2", ("a",), backend, False, gpu_aware)

    compare_hellos([hello("yes (vendor query)"), hello("no (probe)")])
    with pytest.raises(HandshakeError, match="backend differs") as info:
        compare_hellos([hello("yes (vendor query)"), hello("no (probe)", "hip")])
    assert "gpu_aware" not in str(info.value)
    assert Hello(1, "0.1", "h", "x=2", (), "numpy", False).gpu_aware == ""


@pytest.mark.parametrize("aware", [False, True])
def test_scalars_stay_scalars(aware: bool) -> None:
    """A 0-d value (a loss) keeps shape () through staging: numpy's and CuPy's
    ascontiguousarray would make it (1,)."""
    k = 3
    mesh = line(k)
    axes = mesh.axis_names

    def body(comm: SimComm) -> None:
        dc = DeviceComm(comm, FakeDeviceOps(), YES if aware else NO, log=lambda line: None)
        x = np.array(comm.rank + 1.5, dtype=np.float32)
        spec = AllreduceSpec(tuple(range(k)), comm.rank, ReduceOp.SUM, 1)
        want = comm.allreduce(x, axes, spec)
        got = dc.allreduce(dev(x), axes, spec)
        assert want.shape == () and same(got, want), (got.shape, want)
        b = dc.broadcast(dev(np.array(comm.rank, dtype=np.int64)), axes, 1)
        assert b.shape == () and int(b.host) == 1

    run_ranks(mesh, body, timeout_s=20)


def test_probe_child_never_outlives_an_interrupted_wait(tmp_path: Path) -> None:
    """The launcher's SIGTERM (raised as an exception in the waiting thread) or Ctrl-C while
    the probe runs: the child and its session are killed before the exception goes on."""
    import signal

    pidfile = tmp_path / "pid"
    script = tmp_path / "child.sh"
    script.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 1000\n")
    script.chmod(0o755)

    def interrupt(signum: int, frame: Any) -> None:
        raise RuntimeError("launcher says stop")

    import threading

    old = signal.signal(signal.SIGUSR1, interrupt)  # (SIGALRM belongs to pytest-timeout)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(RuntimeError, match="launcher says stop"):
            probe_gpu_aware("cuda", python=str(script), timeout_s=30.0)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the probe child {pid} is still running")


def test_ranks_planning_other_overlap_buckets_fail_the_handshake() -> None:
    def hello(buckets: int) -> Hello:
        return Hello(1, "0.1", "h", "x=2", (), "numpy", False, buckets=buckets)

    compare_hellos([hello(0), hello(0)])
    with pytest.raises(
        HandshakeError, match=r"buckets differs \(rank\(s\) 0: 26214400; rank\(s\) 1: 0\)"
    ):
        compare_hellos([hello(26214400), hello(0)])


def test_ranks_cutting_deterministic_matmuls_differently_fail_the_handshake() -> None:
    """The ranks of a split matmul add integer slices of one width: a rank asked for the
    fast precision while the others keep the full one is named before any step."""

    def hello(precision: str) -> Hello:
        return Hello(1, "0.1", "h", "x=3", (), "numpy", True, deterministic_matmul=precision)

    compare_hellos([hello("fast")] * 3)
    with pytest.raises(
        HandshakeError,
        match=r"deterministic_matmul differs \(rank\(s\) 0,2: 'full'; rank\(s\) 1: 'fast'\)",
    ):
        compare_hellos([hello("full"), hello("fast"), hello("full")])
