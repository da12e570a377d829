"""The device communication layer under real MPI, with fake device arrays (host memory behind
``__cuda_array_interface__``, whose pointer mpi4py hands to MPI as it would a GPU's): staging
when MPI is not GPU-aware, the direct path when it is, every result equal to the host op's
(uneven blocks, tiny message chunks), the same byte accounting; the agreement of the decision
across ranks; and this machine's own vendor query. Size-agnostic: runs at any ``-n``."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from dtm_mpi.comm.device import NOT_AWARE, DeviceComm
from dtm_mpi.comm.gpu_aware import (
    Answer,
    GpuAwareness,
    agree_gpu_aware,
    decide_gpu_aware,
    detect_gpu_aware,
    mpi_vendor,
    probe_gpu_aware,
    query_vendor,
)
from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.mpi_session import MpiSession
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

pytestmark = pytest.mark.mpi(min_size=2)

NO = GpuAwareness(False, "setting", "--gpu-aware-mpi no", agreed=True)
YES = GpuAwareness(True, "setting", "--gpu-aware-mpi yes", agreed=True)


@contextmanager
def endpoint(comm: Any, **kwargs: Any) -> Iterator[tuple[MpiSession, MpiComm]]:
    size = comm.Get_size()
    session = MpiSession(MeshShape((("x", size),)), [("x",)], timeout_s=30, world=comm)
    try:
        yield session, MpiComm(session, **kwargs)
    finally:
        session.close()


def traffic(mc: MpiComm) -> tuple[int, int]:
    return mc.stats.bytes_sent, mc.stats.bytes_received


def check_steps(comm: Any, all_ranks: Any, dc: DeviceComm, mc: MpiComm) -> int:
    """Every step on fake device arrays through ``dc`` equals (bitwise) the same step on host
    arrays through ``mc``, and moves the same bytes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = mc.mesh
    problems = []
    steps = steps_for(size)
    for i, step in enumerate(steps):
        for _ in range(2):  # the second call of a step takes MpiComm's bound fast path
            x = step_input(step, mesh, rank, seed=i)
            before = traffic(mc)
            want = run_spec(mc, step, mesh, x)
            middle = traffic(mc)
            syncs = dc.ops.syncs  # type: ignore[attr-defined]
            got = run_spec(dc, step, mesh, dev(x))
            after = traffic(mc)
            if not same(got, want):
                problems.append(f"{step}: got {got!r}, want {want!r}")
            if [a - m for a, m in zip(after, middle, strict=True)] != [
                m - b for m, b in zip(middle, before, strict=True)
            ]:
                problems.append(f"{step}: accounting {after} {middle} {before}")
            if dc.ops.syncs != syncs + 1:  # type: ignore[attr-defined]
                problems.append(f"{step}: {dc.ops.syncs - syncs} synchronisations")  # type: ignore[attr-defined]
    all_ranks(not problems, f"rank {rank}: " + "; ".join(problems)[:800])
    return 2 * len(steps)


def ring_and_broadcasts(comm: Any, all_ranks: Any, dc: DeviceComm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    problems = []
    for root in range(size):
        for dt in (np.float32, np.int64, np.float16):
            x = dev(np.arange(12, dtype=dt).reshape(3, 4) + rank)
            got = dc.broadcast(x, ("x",), root)
            if not same(got, np.arange(12, dtype=dt).reshape(3, 4) + root):
                problems.append(f"broadcast root {root} {dt.__name__}: {got!r}")
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    dc.send(dev(np.arange(9, dtype=np.float64) * rank), nxt, tag=11)
    got = dc.recv((9,), np.dtype(np.float64), prev, tag=11)
    dc.send(np.arange(5, dtype=np.int32) + rank, nxt, tag=12)  # a host send ...
    mixed = dc.recv((5,), np.dtype(np.int32), prev, tag=12)  # ... into a device array
    dc.flush()
    if not same(got, np.arange(9, dtype=np.float64) * prev):
        problems.append(f"recv: {got!r}")
    if not same(mixed, np.arange(5, dtype=np.int32) + prev):
        problems.append(f"mixed recv: {mixed!r}")
    all_ranks(not problems, f"rank {rank}: " + "; ".join(problems))


# --- (a) not GPU-aware: staging ---------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"max_msg_elems": 3}, {"deterministic": True}])
def test_staging_matches_the_host_ops(comm: Any, all_ranks: Any, kwargs: dict[str, Any]) -> None:
    lines: list[str] = []
    with endpoint(comm, **kwargs) as (_, mc):
        dc = DeviceComm(mc, FakeDeviceOps(), NO, log=lines.append)
        n = check_steps(comm, all_ranks, dc, mc)
        ring_and_broadcasts(comm, all_ranks, dc)
        size = comm.Get_size()
        all_ranks(not dc.paths.direct, f"direct paths: {dc.paths.direct}")
        staged = sum(dc.paths.staged.values())
        all_ranks(staged == n + 3 * size + 3, f"staged {dc.paths.staged}")
        all_ranks(set(dc.paths.why) == {NOT_AWARE}, f"why {dc.paths.why}")
        all_ranks(len(lines) == 1 and NOT_AWARE in lines[0], f"log {lines}")
        # repeated sizes reuse the pool: MPI is done with a buffer when its call returns, so
        # one buffer per size class serves dozens of staged calls
        pool = dc.pool
        all_ranks(pool.allocations <= 2 and pool.pageable == 0 and pool.reused >= 20, dc.describe())


# --- (b) GPU-aware: the direct path -----------------------------------------------------------


def test_direct_path_for_allreduce_broadcast_send_recv(comm: Any, all_ranks: Any) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    with endpoint(comm) as (session, mc):
        lines: list[str] = []
        dc = DeviceComm(mc, FakeDeviceOps(), YES, log=lines.append)
        threaded = session.watchdog is not None  # blocking collectives: the direct path
        check_steps(comm, all_ranks, dc, mc)
        ring_and_broadcasts(comm, all_ranks, dc)
        p = dc.paths
        # steps_for: 2 f32/f64 SUM allreduces direct, the 4 float max/min folded on the host;
        # the reduce-scatter and the (uneven) allgather along dim 0 direct, those along dim 1
        # staged
        want_direct = (
            {"allreduce": 2 * 2, "broadcast": 3 * size, "reduce_scatter": 2, "allgather": 2}
            if threaded
            else {}
        )
        if p.direct["all_to_all"]:
            want_direct["all_to_all"] = p.direct["all_to_all"]  # checked below
        want_direct.update({"send": 1, "recv": 2})
        all_ranks(p.direct == want_direct, f"direct {p.direct} want {want_direct}")
        folded = 2 * 4 if threaded else 2 * 6
        gathers = 2 if threaded else 4
        all_ranks(
            p.staged["allreduce"] == folded and p.staged["allgather"] == gathers,
            f"staged {p.staged}",
        )
        # the dim-1 gather: an inner dim, or (a rank's block of 5 columns at 4 ranks) empty
        inner = (
            p.why["gathered along an inner dim (the blocks would need reordering)"]
            + p.why["empty array"]
        )
        inner_rs = p.why["scattered along an inner dim (the pieces would need packing)"]
        # the exchange: column blocks of row blocks are not back to back (at 4 ranks the rank
        # holding one row is: it goes direct and meets the others' Alltoallv)
        packing = p.why["pieces not back to back (they would need packing)"]
        all_ranks(not threaded or packing + p.direct["all_to_all"] == 2, f"why {p.why}")
        all_ranks(
            p.direct["all_to_all"] == (2 if threaded and size == 4 and rank == 3 else 0),
            f"direct {p.direct}",
        )
        all_ranks(NOT_AWARE not in p.why, f"why {p.why}")
        all_ranks(not threaded or (inner == 2 and inner_rs == 2), f"why {p.why}")
        all_ranks(p.host == {"send": 1} and lines == [], f"host {p.host}; log {lines}")
        # the device buffers really went to MPI: the output is a fresh device array
        spec = AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, 4)
        x = dev(np.full(4, rank + 1.0, dtype=np.float32))
        got = dc.allreduce(x, ("x",), spec)
        all_ranks(same(got, np.full(4, size * (size + 1) / 2, dtype=np.float32)), repr(got))
        all_ranks(got is not x and not np.shares_memory(got.host, x.host), "aliased output")
        # an allgather of equal blocks along dim 0: device buffers straight to MPI too
        from dtm_mpi.sharding.steps import AllgatherSpec

        block = np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * rank
        gspec = AllgatherSpec(tuple(range(size)), rank, 0, (2,) * size, (6,) * size)
        before = p.direct["allgather"]
        gathered = dc.allgather(dev(block), ("x",), gspec)
        want = np.concatenate(
            [np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * r for r in range(size)]
        )
        all_ranks(same(gathered, want), repr(gathered))
        all_ranks(p.direct["allgather"] == before + (1 if threaded else 0), f"direct {p.direct}")


def test_direct_reduce_scatter_makes_the_host_ops_call(comm: Any, all_ranks: Any) -> None:
    """A reduce-scatter along the leading dim hands device buffers straight to MPI, with the
    call MpiComm makes for the same counts (Reduce_scatter_block for equal pieces,
    Reduce_scatter otherwise) on its first and its later calls, so ranks passing host arrays
    (MpiComm) and ranks passing device arrays (direct) make the same MPI call."""
    from dtm_mpi.sharding.steps import ReduceScatterSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    with endpoint(comm) as (session, mc):
        if session.watchdog is None:
            pytest.skip("MPI is not THREAD_MULTIPLE: collectives stage")
        dc = DeviceComm(mc, FakeDeviceOps(), YES)
        problems = []
        devices = 0
        for rows in (3 * size, 3 * size + 1):  # equal pieces, then uneven ones
            b = -(-rows // size)
            lens = [max(0, min(b, rows - i * b)) for i in range(size)]
            starts = [min(i * b, rows) for i in range(size)]
            spec = ReduceScatterSpec(
                tuple(range(size)),
                rank,
                ReduceOp.SUM,
                0,
                tuple(zip(starts, lens, strict=True)),
                tuple(n * 4 for n in lens),
            )
            full = np.arange(rows * 4, dtype=np.float64).reshape(rows, 4)
            want = (size * full + sum(range(size)))[starts[rank] : starts[rank] + lens[rank]]
            for round_ in range(3):  # MpiComm's first (unbound) and later (bound) calls
                on_device = (rank + round_) % 2 == 0  # device and host ranks mix
                devices += on_device
                x = full + rank
                got = dc.reduce_scatter(dev(x) if on_device else x, ("x",), spec)
                ok = (
                    same(got, want)
                    if on_device
                    else isinstance(got, np.ndarray) and got.tobytes() == want.tobytes()
                )
                if not ok:
                    problems.append(f"rows {rows} round {round_} device {on_device}: {got!r}")
        all_ranks(not problems, "; ".join(problems)[:600])
        paths = dc.paths
        all_ranks(paths.direct["reduce_scatter"] == devices and not paths.staged, f"paths {paths}")
        all_ranks(paths.host["reduce_scatter"] == 6 - devices, f"paths {paths}")


def test_a_large_reduce_scatter_is_folded_on_host_and_device_ranks_alike(
    comm: Any, all_ranks: Any
) -> None:
    """A reduce-scatter that MpiComm moves and folds itself (a large array in a small group:
    FOLDED_RS_FROM) is staged by the device ranks through that same path, so device and host
    ranks mixed in one call make the same MPI call (an all-to-all) and get the folded sum."""
    from dtm_mpi.comm.device import FOLDED
    from dtm_mpi.comm.mpi_comm import FOLDED_RS_FROM
    from dtm_mpi.sharding.steps import ReduceScatterSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("a reduce-scatter needs 2 or more ranks")
    with endpoint(comm) as (session, mc):
        if session.watchdog is None:
            pytest.skip("MPI is not THREAD_MULTIPLE: collectives stage")
        dc = DeviceComm(mc, FakeDeviceOps(), YES)
        cols = 256
        rows = size * (-(-FOLDED_RS_FROM * size * size // (8 * cols * size)))  # float64
        b = rows // size
        spec = ReduceScatterSpec(
            tuple(range(size)),
            rank,
            ReduceOp.SUM,
            0,
            tuple((i * b, b) for i in range(size)),
            (b * cols,) * size,
        )
        full = np.arange(rows * cols, dtype=np.float64).reshape(rows, cols)
        want = (size * full + sum(range(size)))[rank * b : (rank + 1) * b]
        on_device = rank % 2 == 0  # device and host ranks mix
        x = full + rank
        got = dc.reduce_scatter(dev(x) if on_device else x, ("x",), spec)
        all_ranks(same(got, want) if on_device else np.array_equal(got, want), repr(got)[:200])
        if on_device:
            all_ranks(dc.paths.why.get(FOLDED) == 1 and not dc.paths.direct, f"{dc.paths}")
        else:
            all_ranks(dc.paths.host["reduce_scatter"] == 1, f"{dc.paths}")


def test_direct_uneven_allgather_meets_staging_and_host_ranks(comm: Any, all_ranks: Any) -> None:
    """Uneven blocks along the leading dim go to MPI as device buffers with ``Allgatherv``,
    the call MpiComm makes for them; a rank whose block is empty stages and a rank passing a
    host array goes through MpiComm, and all of them still meet in the same MPI call."""
    from dtm_mpi.sharding.steps import AllgatherSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    with endpoint(comm) as (session, mc):
        if session.watchdog is None:
            pytest.skip("MPI is not THREAD_MULTIPLE: collectives stage")
        dc = DeviceComm(mc, FakeDeviceOps(), YES)
        rows = [r % 3 for r in range(size)]  # 0, 1, 2, 0, ...: rank 0's block is empty
        spec = AllgatherSpec(tuple(range(size)), rank, 0, tuple(rows), tuple(n * 4 for n in rows))
        blocks = [
            np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 100 * r for r, n in enumerate(rows)
        ]
        want = np.concatenate(blocks)
        problems = []
        devices = 0
        for round_ in range(3):
            on_device = (rank + round_) % 2 == 1
            devices += on_device and rows[rank] > 0
            x = blocks[rank]
            got = dc.allgather(dev(x) if on_device else x, ("x",), spec)
            ok = (
                same(got, want)
                if on_device
                else isinstance(got, np.ndarray) and got.tobytes() == want.tobytes()
            )
            if not ok:
                problems.append(f"round {round_} device {on_device}: {got!r}")
        all_ranks(not problems, "; ".join(problems)[:600])
        all_ranks(dc.paths.direct["allgather"] == devices, f"paths {dc.paths}")
        all_ranks(
            rank != 0 or dc.paths.why == {"empty array": dc.paths.staged["allgather"]},
            f"paths {dc.paths}",
        )


def test_direct_exchange_of_back_to_back_pieces(comm: Any, all_ranks: Any) -> None:
    """An all-to-all whose pieces are back to back in member order on every rank (rows of a
    column-sharded [k, 3k] to row shards) is one ``Alltoall`` on device buffers, the call
    MpiComm makes for the same uniform spec (first and later calls alike); the result equals
    the host op's, with the same accounting."""
    from dtm_mpi.sharding.steps import RedistStep, StepKind
    from tests.comm.fake_device import _t

    rank, size = comm.Get_rank(), comm.Get_size()
    x = ("x",)
    step = RedistStep(
        StepKind.ALL_TO_ALL,
        _t((size, 3 * size), ((), x)),
        _t((size, 3 * size), (x, ())),
        x,
        dim=1,
        dst_dim=0,
    )
    with endpoint(comm) as (session, mc):
        if session.watchdog is None:
            pytest.skip("MPI is not THREAD_MULTIPLE: collectives stage")
        dc = DeviceComm(mc, FakeDeviceOps(), YES)
        problems = []
        for round_ in range(2):
            inp = step_input(step, mc.mesh, rank, seed=round_)
            want = run_spec(mc, step, mc.mesh, inp)
            before = traffic(mc)
            got = run_spec(dc, step, mc.mesh, dev(inp))
            after = traffic(mc)
            if not same(got, want):
                problems.append(f"round {round_}: {got!r} want {want!r}")
            if after == before:
                problems.append("no traffic recorded")
        all_ranks(not problems, "; ".join(problems)[:600])
        all_ranks(dc.paths.direct["all_to_all"] == 2 and not dc.paths.staged, f"paths {dc.paths}")


def test_non_contiguous_device_inputs_are_copied_not_staged(comm: Any, all_ranks: Any) -> None:
    """Under GPU-aware MPI, a non-contiguous device input (a transposed view) is first copied
    to a contiguous device array, so its rank makes the same direct MPI call as the ranks whose
    input is contiguous: contiguity is a rank's own fact, and staging on it would split the
    group's calls. Reduce-scatter and all-to-all, strided and contiguous ranks mixed."""
    from dtm_mpi.sharding.steps import RedistStep, ReduceScatterSpec, StepKind
    from tests.comm.fake_device import _t, dev_strided

    rank, size = comm.Get_rank(), comm.Get_size()
    strided = rank % 2 == 0
    with endpoint(comm) as (session, mc):
        if session.watchdog is None:
            pytest.skip("MPI is not THREAD_MULTIPLE: collectives stage")
        ops = FakeDeviceOps()
        dc = DeviceComm(mc, ops, YES)
        rows = 2 * size
        pieces = tuple((2 * j, 2) for j in range(size))
        spec = ReduceScatterSpec(tuple(range(size)), rank, ReduceOp.SUM, 0, pieces, (2 * 3,) * size)
        full = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        x = full * (rank + 1)
        got = dc.reduce_scatter(dev_strided(x) if strided else dev(x), ("x",), spec)
        want = (full * sum(range(1, size + 1)))[2 * rank : 2 * rank + 2]
        all_ranks(same(got, want), repr(got))
        all_ranks(ops.events.count("to_device") == (1 if strided else 0), f"events {ops.events}")

        x_ = ("x",)
        step = RedistStep(
            StepKind.ALL_TO_ALL,
            _t((size, 3 * size), ((), x_)),
            _t((size, 3 * size), (x_, ())),
            x_,
            dim=1,
            dst_dim=0,
        )
        inp = step_input(step, mc.mesh, rank, seed=3)
        want_ex = run_spec(mc, step, mc.mesh, inp)
        got_ex = run_spec(
            dc, step, mc.mesh, dev_strided(inp) if strided and min(inp.shape) > 1 else dev(inp)
        )
        all_ranks(same(got_ex, want_ex), f"{got_ex!r} want {want_ex!r}")
        paths = dc.paths
        all_ranks(
            paths.direct["reduce_scatter"] == 1 and paths.direct["all_to_all"] == 1,
            f"paths {paths}",
        )
        all_ranks(not paths.staged, f"paths {paths}")


def test_direct_path_falls_back_where_mpi_cannot_take_device_buffers(
    comm: Any, all_ranks: Any
) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    spec = AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, 10)
    x = np.arange(10, dtype=np.float64) + rank
    want = sum(np.arange(10, dtype=np.float64) + r for r in range(size))
    for kwargs, why in [
        ({"deterministic": True}, "deterministic mode"),
        ({"max_msg_elems": 4}, "more elements than one MPI message"),
    ]:
        with endpoint(comm, **kwargs) as (_, mc):
            dc = DeviceComm(mc, FakeDeviceOps(), YES)
            got = dc.allreduce(dev(x), ("x",), spec)
            all_ranks(same(got, want) and not dc.paths.direct, f"{kwargs}: {got!r} {dc.paths}")
            all_ranks(any(w.startswith(why) for w in dc.paths.why), f"why {dc.paths.why}")
    with endpoint(comm) as (session, mc):  # no watchdog: non-blocking collectives only
        if session.watchdog is not None:
            session.watchdog.stop()
            session.watchdog = None
        dc = DeviceComm(mc, FakeDeviceOps(), YES)
        got = dc.allreduce(dev(x), ("x",), spec)
        b = dc.broadcast(dev(x), ("x",), size - 1)
        dc.send(dev(x), (rank + 1) % size, tag=9)
        r = dc.recv((10,), np.dtype(np.float64), (rank - 1) % size, tag=9)
        dc.flush()
        ok = same(got, want) and same(b, np.arange(10, dtype=np.float64) + size - 1)
        all_ranks(ok and same(r, np.arange(10, dtype=np.float64) + (rank - 1) % size), "values")
        all_ranks(dc.paths.direct == {"send": 1, "recv": 1}, f"direct {dc.paths.direct}")
        all_ranks(dc.paths.staged == {"allreduce": 1, "broadcast": 1}, f"staged {dc.paths.staged}")


# --- (c) agreement ----------------------------------------------------------------------------


def test_one_rank_saying_no_makes_everyone_stage(comm: Any, all_ranks: Any) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    dissenter = size - 1
    mine = (
        GpuAwareness(False, "vendor query", "MPIX_Query_cuda_support() returned 0")
        if rank == dissenter
        else GpuAwareness(True, "probe", "intact")
    )
    with endpoint(comm) as (session, _):
        got = agree_gpu_aware(session, mine)
    again = agree_gpu_aware(comm, mine, timeout_s=30)
    everyone = comm.allgather(got)
    all_ranks(again == got and all(e == got for e in everyone), f"differs: {everyone}")
    all_ranks(not got.aware and got.agreed and got.source == "vendor query", str(got))
    named = f"rank(s) {dissenter} of {size}: rank {dissenter}: vendor query: MPIX_Query"
    all_ranks(named in got.detail, got.detail)
    yes = agree_gpu_aware(comm, GpuAwareness(True, "probe", "intact"), timeout_s=30)
    all_ranks(yes == GpuAwareness(True, "probe", "intact", agreed=True), str(yes))


def test_probe_inside_the_job_cannot_crash_it(comm: Any, all_ranks: Any) -> None:
    """Every rank probes at once from inside the MPI job (the child must shed the launcher's
    environment to initialise MPI alone); a child that crashes in MPI means "no", and the job
    goes on."""
    with tempfile.TemporaryDirectory() as tmp:
        yes = probe_gpu_aware("cuda", environ=fake_cupy_environ(tmp, "host"), timeout_s=60)
        no = probe_gpu_aware("cuda", environ=fake_cupy_environ(tmp, "unmapped"), timeout_s=60)
    all_ranks(yes.aware is True, str(yes))
    all_ranks(no.aware is False and "SIGSEGV" in no.detail, str(no))
    agreed = agree_gpu_aware(comm, decide_gpu_aware(Answer(None, "auto"), None, no), timeout_s=30)
    all_ranks(not agreed.aware and agreed.source == "probe", str(agreed))


# --- (d) this machine's MPI -------------------------------------------------------------------


def _built_with_cuda() -> bool | None:
    """What ``ompi_info`` says about CUDA support (None: no ompi_info)."""
    tool = shutil.which("ompi_info")
    if tool is None:
        return None
    run = subprocess.run(
        [tool, "--parsable", "--all"], capture_output=True, text=True, timeout=60, check=False
    )
    out = run.stdout
    for line in out.splitlines():
        if line.startswith("mca:opal:base:param:opal_built_with_cuda_support:value:"):
            return line.rsplit(":", 1)[1] == "true"
    return None


def test_vendor_query_of_this_mpi(comm: Any, all_ranks: Any) -> None:
    from mpi4py import MPI

    rank = comm.Get_rank()
    cuda, hip = query_vendor("cuda"), query_vendor("hip")
    decided = detect_gpu_aware("auto", "cuda", probe=lambda b: Answer(None, "not run in tests"))
    everyone = comm.allgather((cuda, hip, decided))
    all_ranks(all(e == everyone[0] for e in everyone), f"ranks disagree: {everyone}")
    if rank == 0:
        print(f"\nvendor query here: cuda {cuda}; hip {hip}; decided {decided.describe()}")
    if mpi_vendor(MPI.Get_library_version()) == "openmpi":
        built = _built_with_cuda() if rank == 0 else None
        built = comm.bcast(built, root=0)
        # the cuda query is in every Open MPI with the cuda extension; built without CUDA
        # support it is a definite no (checked against ompi_info, not assumed)
        if built is False and cuda.aware is not None:
            all_ranks(cuda.aware is False and "returned 0" in cuda.detail, str(cuda))
            all_ranks(not decided.aware and decided.source == "vendor query", str(decided))
        if cuda.aware is not None:  # a vendor answer decides; the probe never runs
            all_ranks(decided.source == "vendor query", decided.describe())
        if MPI.Get_library_version().startswith("Open MPI v4."):  # rocm query: Open MPI 5+
            all_ranks(hip.aware is None and "no MPIX_Query_rocm_support" in hip.detail, str(hip))
