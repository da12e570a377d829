"""``dtm bench comm --backend cuda`` without a GPU: the benchmark's device-buffer path end to end
on a fake CuPy (:class:`tests.comm.fake_device.FakeCupy`: host memory behind
``__cuda_array_interface__``, whose pointer mpi4py hands to MPI as it would a GPU's, and an
asynchronous stream: fills and uploads run only when something synchronises, so a path that
hands a buffer to MPI before synchronising sends stale values).

Everything below the import of CuPy is the production code: ``open_backend`` binds the fake
device, ``CupyDeviceOps`` copies with ``get``/``set``, the GPU-aware decision comes from
``DTM_GPU_AWARE_MPI`` (yes: the direct path; no: staging; auto: this MPI's vendor query) and is
agreed by every rank. Checked: every op's dtm and raw cases compute the collective (with values
that differ per rank, element and round), return with nothing left queued on the stream and
report the bytes their buffers hold; the whole benchmark's rows, table, paths, copies,
synchronisations and CSV; and the ``dtm bench comm --backend cuda`` command at 1 rank
(singleton) and under mpirun. The MPI tests are size-agnostic (any ``-n``)."""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dtm_mpi.bench.comm as bench
from dtm_mpi.comm.device import NOT_AWARE, DeviceComm
from dtm_mpi.config import get_config
from tests.comm.fake_device import FakeCupy, FakeCupyArray, fake_cupy_package
from tests.mpi_env import mpirun_env

HEADER = ["op", "ranks", "bytes", "dtm_s", "raw_s", "busbw_dtm", "busbw_raw", "ratio"]
SIZES = [8, 100, 4096]  # 100 B: 25 floats, not a multiple of the ranks at 2, 3 or 4
BLOCK = 256  # BLOCK_BYTES for the in-process runs: 32, 2 and 1 calls per timed block


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    """A fake CuPy as ``cupy`` for this test (one fake device)."""
    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    return cp


@contextmanager
def gpu_aware_mpi(mode: str) -> Iterator[None]:
    """``DTM_GPU_AWARE_MPI=mode`` for what runs inside (the benchmark has no flag of its own:
    the environment's setting decides, then the vendor query, then the probe)."""
    old = os.environ.get("DTM_GPU_AWARE_MPI")
    os.environ["DTM_GPU_AWARE_MPI"] = mode
    get_config.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ["DTM_GPU_AWARE_MPI"]
        else:
            os.environ["DTM_GPU_AWARE_MPI"] = old
        get_config.cache_clear()


def calls_per_case(nbytes: int, repeat: int) -> int:
    """How often the benchmark calls each path of one (op, size): warm-up, then ``repeat``
    timed blocks."""
    iters = max(1, min(1000, BLOCK // nbytes))
    return min(iters, 20) + repeat * iters


def busbw_factor(op: str, n: int) -> float:
    return {"allreduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


# --- each case computes its collective --------------------------------------------------------


def case_values(op: str, rank: int, n: int, count: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's input in round ``r`` and the output it must get (float32 integers: exact).
    ``count``: the input's elements."""
    f32 = np.float32
    if op in ("allreduce", "reduce_scatter"):
        elems = count
        x = np.arange(elems, dtype=f32) + 10 * rank + r
        total = n * np.arange(elems, dtype=f32) + 10 * n * (n - 1) // 2 + n * r
        per = elems // n
        return x, total if op == "allreduce" else total[rank * per : (rank + 1) * per]
    if op == "allgather":
        per = count
        block = [np.arange(per, dtype=f32) + 1000 * j + r for j in range(n)]
        return block[rank], np.concatenate(block)
    if op == "broadcast":
        data = np.arange(count, dtype=f32) + 1 + r
        return (data if rank == 0 else np.full(count, -1, dtype=f32)), data
    assert op == "all_to_all"
    per = count // n
    k = np.arange(per, dtype=f32)
    x = np.concatenate([1_000_000 * rank + 10_000 * j + k + r for j in range(n)])
    return x, np.concatenate([1_000_000 * j + 10_000 * rank + k + r for j in range(n)])


def check_case(
    cp: FakeCupy, dtm: DeviceComm, raw: Any, device: Any, op: str, nbytes: int, aware: bool
) -> list[str]:
    """Run one (op, size) case of the benchmark, each path twice, on inputs written by a
    kernel still queued when the path is called; the problems found."""
    rank, n = dtm.rank, int(raw.Get_size())
    threaded = dtm.inner.session.watchdog is not None  # type: ignore[attr-defined]  # else staged
    cp.recording, start = True, len(cp.created)
    dtm_fn, raw_fn = bench._cases(op, nbytes, dtm, raw, n, rank, device)
    cp.recording = False
    bufs = cp.created[start:]
    x, out = bufs[0], (bufs[1] if len(bufs) > 1 else None)
    where = f"{op} {nbytes} B"
    problems = []
    if len(bufs) != (1 if op == "broadcast" else 2) or x.dtype != np.float32:
        return [f"{where}: buffers {bufs!r}"]
    moved = out.nbytes if op == "allgather" and out is not None else x.nbytes
    if bench.case_bytes(nbytes, n) != moved:
        problems.append(f"{where}: reports {bench.case_bytes(nbytes, n)} B, moves {moved} B")
    paths: list[tuple[str, Callable[[], object]]] = [("raw", raw_fn), ("dtm", dtm_fn)]
    for name, fn in paths:
        for r in range(2):
            given, want = case_values(op, rank, n, x.size, r)
            cp.stream.launch(lambda given=given: np.copyto(x.host, given))  # a kernel wrote x
            if out is not None:
                out.host.fill(-7.0)
            ups, downs = cp.uploads, cp.downloads
            got = fn()
            res = got if name == "dtm" else (x if out is None else out)
            tag = f"{where} {name} round {r}"
            if cp.stream.queue:  # the time stops when the call returns: nothing may be left
                problems.append(f"{tag}: returned with {len(cp.stream.queue)} queued kernel(s)")
                cp.stream.drain()
            if not isinstance(res, FakeCupyArray) or not np.array_equal(res.host, want):
                problems.append(f"{tag}: got {res!r}, want {want}")
            copies = (cp.uploads - ups, cp.downloads - downs)
            if aware and (name == "raw" or threaded) and copies != (0, 0):
                problems.append(f"{tag}: GPU-aware MPI, yet {copies} (uploads, downloads)")
            if not aware and name == "raw":  # staged by hand: down, MPI, up (not on bcast roots)
                expected = (0 if op == "broadcast" and rank == 0 else 1, 1)
                if copies != expected:
                    problems.append(
                        f"{tag}: staging made {copies} (uploads, downloads), expected {expected}"
                    )
            if (
                name == "dtm"
                and isinstance(got, FakeCupyArray)
                and got is not x
                and np.shares_memory(got.host, x.host)
            ):
                problems.append(f"{tag}: the output aliases the input")
    return problems


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["yes", "no"])
def test_every_case_computes_its_collective(
    comm: Any, all_ranks: Any, fake_gpu: FakeCupy, mode: str
) -> None:
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.sharding import MeshShape

    rank, n = comm.Get_rank(), comm.Get_size()
    session = MpiSession(MeshShape((("x", n),)), [("x",)], timeout_s=60, world=comm)
    raw = comm.Dup()
    try:
        with gpu_aware_mpi(mode):
            inner = MpiComm(session, deterministic=False)  # as the benchmark's
            dtm, device = bench._device_setup("cuda", comm, session, inner)
        all_ranks(
            isinstance(dtm, DeviceComm) and dtm.awareness.aware == (mode == "yes"),
            str(dtm.awareness),
        )
        all_ranks(
            fake_gpu.device == 0 and "Fake GPU" in device[0].description, device[0].description
        )
        problems = []
        for op in bench.OPS:
            for nbytes in SIZES:
                problems += check_case(fake_gpu, dtm, raw, device, op, nbytes, mode == "yes")
        all_ranks(not problems, f"rank {rank}: " + "; ".join(problems)[:1500])
        threaded = session.watchdog is not None  # else collectives stage (non-blocking calls)
        calls = {op: 2 * len(SIZES) for op in bench.OPS}  # the dtm path's two rounds a size
        if mode == "yes" and threaded:
            all_ranks(dtm.paths.direct == calls and not dtm.paths.staged, dtm.describe())
        if mode == "no":
            all_ranks(
                dtm.paths.staged == calls and set(dtm.paths.why) == {NOT_AWARE}, dtm.describe()
            )
    finally:
        raw.Free()
        session.close()


# --- the whole benchmark ----------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["yes", "no", "auto"])
def test_bench_on_device_buffers(
    comm: Any, mpi_tmp_path: Path, fake_gpu: FakeCupy, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    seen: dict[str, Any] = {}
    setup = bench._device_setup

    def spy(*args: Any) -> Any:
        dtm, device = setup(*args)
        seen.update(dtm=dtm, raw=device[1])
        return dtm, device

    monkeypatch.setattr(bench, "_device_setup", spy)
    monkeypatch.setattr(bench, "BLOCK_BYTES", BLOCK)
    repeat = 2
    path = mpi_tmp_path / "comm.csv"
    with gpu_aware_mpi(mode):
        table = bench.run_comm_bench(bench.OPS, SIZES, repeat, str(path), backend="cuda")
    dtm: DeviceComm = seen["dtm"]
    aware = dtm.awareness.aware
    if mode != "auto":
        assert aware == (mode == "yes") and dtm.awareness.agreed
    per_op = sum(calls_per_case(s, repeat) for s in SIZES)
    calls = {op: per_op for op in bench.OPS}
    total = per_op * len(bench.OPS)
    cp = fake_gpu
    if aware:
        assert not seen["raw"]._host  # the raw path never staged
        if dtm.inner.session.watchdog is not None:  # type: ignore[attr-defined]  # else staged
            assert dtm.paths.direct == calls and not dtm.paths.staged, dtm.describe()
            # each path synchronises once per call and copies nothing
            assert cp.stream.syncs == 2 * total
            assert (cp.uploads, cp.downloads, cp.pinned_allocations) == (0, 0, 0)
    else:
        assert dtm.paths.staged == calls and not dtm.paths.direct, dtm.describe()
        assert dtm.paths.why == {NOT_AWARE: total}
        # one download per call of each path; one upload too, but on a broadcast's root
        assert cp.downloads == 2 * total
        assert cp.uploads == 2 * total - (2 * per_op if rank == 0 else 0)
        assert cp.stream.syncs >= cp.uploads  # every upload waited for before the time stops
        assert {slot for slot, _ in seen["raw"]._host} == {0, 1}
        assert cp.pinned_allocations == len(seen["raw"]._host) + dtm.pool.allocations
        assert dtm.pool.pageable == 0
    assert not cp.stream.queue
    if rank != 0:
        assert table == ""
        return
    want = {(op, bench.case_bytes(s, n)) for op in bench.OPS for s in SIZES}
    assert len(want) == len(bench.OPS) * len(SIZES)
    # the table: what ran where, then one row per (op, size)
    lines = table.splitlines()
    assert lines[0].startswith("cuda (device 0: Fake GPU, CuPy 13.0.0+fake)"), lines[0]
    assert ("staged none" if aware else "direct none") in lines[0], lines[0]
    assert lines[1].split()[:3] == ["op", "ranks", "bytes"] and lines[1].endswith("ratio")
    table_rows = [line.split() for line in lines[2:]]
    assert {(r[0], int(r[2])) for r in table_rows} == want and len(table_rows) == len(want)
    for r in table_rows:
        assert int(r[1]) == n and float(r[3]) > 0 and float(r[4]) > 0 and float(r[-1]) > 0, r
    # the CSV: the documented header, one row per (op, size), consistent columns
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == HEADER
    assert {(r[0], int(r[2])) for r in rows[1:]} == want and len(rows) == 1 + len(want)
    for r in rows[1:]:
        d = dict(zip(HEADER, r, strict=True))
        dtm_s, raw_s, nbytes = float(d["dtm_s"]), float(d["raw_s"]), int(d["bytes"])
        assert int(d["ranks"]) == n, r
        assert 0 < dtm_s < 10 and 0 < raw_s < 10 and math.isfinite(float(d["ratio"])), r
        assert float(d["ratio"]) == pytest.approx(raw_s / dtm_s, rel=1e-2, abs=1e-3), r
        f = busbw_factor(d["op"], n)
        assert float(d["busbw_dtm"]) == pytest.approx(nbytes / dtm_s * f, rel=1e-2, abs=0.1), r
        assert float(d["busbw_raw"]) == pytest.approx(nbytes / raw_s * f, rel=1e-2, abs=0.1), r


# --- the command ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "mode"), [(1, "yes"), (1, "no"), (2, "auto")])
def test_dtm_bench_comm_backend_cuda(tmp_path: Path, ranks: int, mode: str) -> None:
    """The command as ``make gpu-check`` runs it (auto at 2 ranks), and at 1 rank without a
    launcher (MPI's singleton): each rank's ``import cupy`` is the fake CuPy."""
    if shutil.which("mpirun") is None:  # (1 rank: MPI's singleton; its MPI is mpirun's)
        pytest.skip("mpirun not on PATH")
    out = tmp_path / "comm.csv"
    fake = fake_cupy_package(str(tmp_path / "fake"))
    env = mpirun_env(PYTHONPATH=fake["PYTHONPATH"], DTM_GPU_AWARE_MPI=mode, DTM_TIMEOUT="60")
    cmd = [
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "bench",
        "comm",
        "--backend",
        "cuda",
        "--sizes",
        "8,100,4K",
        "--repeat",
        "1",
        "--csv",
        str(out),
    ]
    if ranks > 1:
        cmd = ["mpirun", "--timeout", "120", "--bind-to", "none", "-n", str(ranks), *cmd]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = proc.stdout.splitlines()[0]
    assert head.startswith("cuda (device 0: Fake GPU, CuPy 13.0.0+fake)"), proc.stdout
    if mode != "auto":
        assert ("staged none" if mode == "yes" else "direct none") in head, head
    else:  # one path for every op, whichever this MPI's vendor query chose
        assert ("staged none" in head) != ("direct none" in head), head
    with out.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == HEADER
    want = {(op, bench.case_bytes(s, ranks)) for op in bench.OPS for s in (8, 100, 4096)}
    assert {(r[0], int(r[2])) for r in rows[1:]} == want and len(rows) == 1 + len(want)
    for r in rows[1:]:
        assert r[1] == str(ranks) and float(r[3]) > 0 and float(r[4]) > 0, r
        assert math.isfinite(float(r[7])) and float(r[7]) > 0, r
