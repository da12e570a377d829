"""``dtm bench ckpt``: checkpoint save and restore against plain file I/O in the same run.

Run under the launcher (``mpirun -n 4 python -m mpi4py -m dtm_mpi bench ckpt --dir D``). The
state is ``tensors`` float32 tensors of ``bytes`` in all, each split over every rank along
dimension 0 (uneven when the rows do not divide). Measured, alternating (the two writes swap
order every round), best of ``repeat``:

* ``save_GBps``: :meth:`CheckpointStore.save` (hashing, parallel-HDF5 writes of the data
  files, main file and manifest, flush, fsync, verification, commit) of a new checkpoint, with
  ``ranks_per_file`` ranks per data file (default: the store's default, 1), against the **raw
  baseline**: every rank writes the same local bytes to a new file of its own in the same
  directory with ``os.write`` and ``fsync``. Aggregate bandwidth = all bytes / the slowest
  rank's time. Nothing is deleted while timing (retention would free the previous file's
  blocks in the background, competing with the next write).
* ``first_save_GBps``: the process's first save (into a new store, before any other: file
  creation, HDF5's start-up, first touches of buffers), against the best raw write.
* ``restore_GBps``: :meth:`CheckpointStore.restore` onto the same mesh and layout (read,
  verify every chunk) in place, into arrays allocated once (``into=``), against every rank
  reading its raw file back with ``readinto`` into arrays allocated once. Both read what the
  page cache holds (dropping it needs privileges a job does not have).
* ``restore_cold_GBps`` (with ``cold=True``, ``--cold``): the same restore and raw read with
  the page cache dropped before each (``/proc/sys/vm/drop_caches``: needs root; refused
  otherwise), as a restart on another node reads from storage. Best of ``repeat``.
* ``reshard_restore_s``: the job shrinks by one rank: the N-rank checkpoint restored on the first
  N-1 ranks, against the same state saved on those N-1 ranks and restored there (the
  same-mesh time). With one rank there is nothing to shrink: 0.
* ``reshard_transpose_s``: the worst case on the same ranks: the checkpoint restored split
  along dimension 1 instead of 0 (every rank needs a piece of every stored shard), in place
  into arrays allocated and touched once (``into=``, as the same-mesh restore: the VM's cost
  of first touches of new memory is not the library's), against the same-mesh restore time.
* ``peak_extra_rss_bytes``: the largest rise of a rank's peak resident memory (``VmHWM``,
  reset through ``/proc/self/clear_refs``) during a save or a restore (one that allocates its
  output), against the bytes of its local shard. A restore's output is itself one shard of
  new memory. Measured first, before the timings.
"""

from __future__ import annotations

import csv
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.bench.proc import status_kib
from dtm_mpi.errors import UsageError

__all__ = ["CkptRow", "run_ckpt_async_bench", "run_ckpt_bench"]


@dataclass(frozen=True, slots=True)
class CkptRow:
    metric: str
    value: float
    baseline: float

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else 0.0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _drop_caches(comm: Any) -> None:
    """Collective: write back and drop the page cache of this node (every rank tries; root
    only), so that the next read comes from storage."""
    from mpi4py import MPI

    ok = True
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
    except OSError:
        ok = False
    if not comm.allreduce(ok, op=MPI.LAND):
        raise UsageError(
            "bench ckpt --cold: cannot drop the page cache (/proc/sys/vm/drop_caches needs root)"
        )
    comm.Barrier()


def _timed(comm: Any, fn: Callable[[], object]) -> float:
    """The slowest rank's time of one call of ``fn`` (started together). Collective."""
    from dtm_mpi.bench.comm import slowest_rank_time

    return slowest_rank_time(fn, 1, comm)


def _peak_extra(comm: Any, fn: Callable[[], object]) -> int:
    """The largest rise of peak RSS over the ranks while ``fn`` runs, in bytes. Collective."""
    from mpi4py import MPI

    comm.Barrier()
    base = status_kib("VmRSS")
    ok = _reset_peak()
    keep = fn()
    extra = (status_kib("VmHWM") - base) * 1024 if ok else -1
    del keep
    return int(comm.allreduce(extra, op=MPI.MAX))


def _resize(
    comm: Any, store: Any, workdir: Path, saved: list[Any], repeat: int
) -> tuple[float, float]:
    """Restore times on the first N-1 ranks: the N-rank checkpoint (resharded) and the same
    state saved on those N-1 ranks (same mesh). Collective on ``comm``; the times are the
    slowest sub-rank's, valid on the sub-ranks (0.0 elsewhere)."""
    from mpi4py import MPI

    from dtm_mpi.io.checkpoint import CheckpointStore
    from dtm_mpi.io.ckpt_plan import TensorSpec
    from dtm_mpi.sharding.mesh import MeshShape

    n, rank = int(comm.Get_size()), int(comm.Get_rank())
    sub = comm.Split(0 if rank < n - 1 else MPI.UNDEFINED, rank)
    times = (0.0, 0.0)
    if sub != MPI.COMM_NULL:
        small = MeshShape((("x", n - 1),))
        targets = [(f"t{i}", t) for i, t in enumerate(saved)]
        got = CheckpointStore(store.path, sub).restore(small, targets).values
        other = CheckpointStore(workdir / "resized", sub, ranks_per_file=store.ranks_per_file)
        other.save(1, small, [(TensorSpec(name, t), got[name]) for name, t in targets])
        del got
        reader = CheckpointStore(store.path, sub)
        resharded = min(_timed(sub, lambda: reader.restore(small, targets)) for _ in range(repeat))
        same = min(_timed(sub, lambda: other.restore(small, targets)) for _ in range(repeat))
        other.close()
        reader.close()
        sub.Free()
        times = (resharded, same)
    comm.Barrier()
    return times


def run_ckpt_bench(
    total_bytes: int = 1 << 30,
    tensors: int = 4,
    directory: str | None = None,
    repeat: int = 4,
    csv_path: str | None = None,
    ranks_per_file: int | None = None,
    cold: bool = False,
) -> str:
    """Run the benchmark on every rank of the world; returns the table on rank 0.

    Collective: call on all ranks."""
    from mpi4py import MPI

    from dtm_mpi.io.checkpoint import CheckpointStore
    from dtm_mpi.io.ckpt_plan import TensorSpec
    from dtm_mpi.sharding.blocks import local_shape
    from dtm_mpi.sharding.mesh import MeshShape

    if total_bytes < 4 * tensors or tensors < 1 or repeat < 1:
        raise UsageError("need --bytes >= 4 per tensor, --tensors >= 1, --repeat >= 1")
    world = MPI.COMM_WORLD
    comm = world.Dup()
    rank, n = int(comm.Get_rank()), int(comm.Get_size())
    root = directory if directory is not None else tempfile.gettempdir()
    base = comm.bcast(tempfile.mkdtemp(prefix="dtm-bench-ckpt-", dir=root) if rank == 0 else None)
    workdir = Path(base)
    mesh = MeshShape((("x", n),))
    saved, resharded, blocks = _workload(mesh, rank, total_bytes, tensors)
    local_bytes = sum(b.nbytes for b in blocks)
    all_bytes = int(comm.allreduce(local_bytes, op=MPI.SUM))
    items = [
        (TensorSpec(f"t{i}", t), b) for i, (t, b) in enumerate(zip(saved, blocks, strict=True))
    ]
    restored = [np.empty_like(b) for b in blocks]
    into = {f"t{i}": a for i, a in enumerate(restored)}
    into_re = {
        f"t{i}": np.empty(local_shape(t.shape, t.layout, mesh, rank), np.float32)
        for i, t in enumerate(resharded)
    }
    for arr in into_re.values():
        arr.fill(0)  # touched once, like ``into``: the timing is the library's, not first touches
    raw = _RawFiles(workdir, rank, blocks)

    mem = CheckpointStore(workdir / "mem", comm, ranks_per_file=ranks_per_file)
    targets_same = [(f"t{i}", t) for i, t in enumerate(saved)]
    targets_re = [(f"t{i}", t) for i, t in enumerate(resharded)]
    first: list[float] = []
    try:  # the process's first save: its one-off costs (file creation, HDF5, first touches)
        peak_save = _peak_extra(
            comm, lambda: first.append(_timed(comm, lambda: mem.save(1, mesh, items)))
        )
        peak_restore = _peak_extra(comm, lambda: mem.restore(mesh, targets_same))
        peak_reshard = _peak_extra(comm, lambda: mem.restore(mesh, targets_re))
    finally:
        mem.close()

    store = CheckpointStore(
        workdir / "store", comm, ranks_per_file=ranks_per_file
    )  # no retention: no deletes in the timing
    per_file = store.ranks_per_file or n
    saves = itertools.count(1)

    def dtm_save() -> None:
        store.save(next(saves), mesh, items)

    try:
        best = _best_times(
            comm,
            repeat,
            cold,
            raw,
            dtm_save,
            restore=lambda: store.restore(mesh, targets_same, into=into),
            transpose=lambda: store.restore(mesh, targets_re, into=into_re),
        )
        if n > 1:  # the job shrinks by one rank: N -> N-1 against a checkpoint saved on N-1
            best["resize"], best["resize_same"] = _resize(comm, store, workdir, saved, repeat)
        got = store.restore(mesh, targets_same).values
        same = all(np.array_equal(got[f"t{i}"], b) for i, b in enumerate(blocks))
        same = same and all(np.array_equal(a, b) for a, b in zip(restored, blocks, strict=True))
        if not comm.allreduce(same, op=MPI.LAND):
            raise UsageError("bench ckpt: restored values differ from the saved ones")
        del got
        shard = int(comm.allreduce(local_bytes, op=MPI.MAX))
    finally:
        store.close()
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        comm.Free()
    peaks = (peak_save, peak_restore, peak_reshard)
    best["first_save"] = first[0]
    rows_out = _ckpt_rows(best, all_bytes, peaks, shard, cold)
    if rank != 0:
        return ""
    if csv_path:
        _write_csv(csv_path, rows_out)
    head = (
        f"dtm bench ckpt: {n} ranks, {tensors} tensors, {all_bytes / 2**20:.1f} MiB in all, "
        f"{local_bytes / 2**20:.1f} MiB local on rank 0, in {root}, {per_file} rank(s) per data file"
    )
    return _ckpt_table(head, rows_out, peaks, shard)


def _workload(
    mesh: Any, rank: int, total_bytes: int, tensors: int
) -> tuple[list[Any], list[Any], list[np.ndarray]]:
    """``tensors`` float32 matrices of ``total_bytes`` in all: their types sharded by rows
    (saved) and by columns (restored resharded), and this rank's random blocks of them."""
    from dtm_mpi.ir.types import DType, Layout, TensorType
    from dtm_mpi.sharding.blocks import local_block

    cols = 256
    rows = max(1, total_bytes // tensors // 4 // cols)
    saved = [TensorType(DType.F32, (rows, cols), Layout((("x",), ()))) for _ in range(tensors)]
    resharded = [TensorType(DType.F32, (rows, cols), Layout(((), ("x",)))) for _ in range(tensors)]
    rng = np.random.default_rng(rank)
    blocks = [
        rng.standard_normal(
            size=tuple(s.stop - s.start for s in local_block(t.shape, t.layout, mesh, rank))
        ).astype(np.float32)
        for t in saved
    ]
    return saved, resharded, blocks


def _best_times(
    comm: Any,
    repeat: int,
    cold: bool,
    raw: _RawFiles,
    save: Callable[[], object],
    *,
    restore: Callable[[], object],
    transpose: Callable[[], object],
) -> dict[str, float]:
    """The best of ``repeat`` rounds of each timed operation, dtm's and the raw baseline's
    (the cold reads with the page cache dropped first, if ``cold``)."""
    best = {
        "raw_w": 1e30,
        "save": 1e30,
        "raw_r": 1e30,
        "restore": 1e30,
        "transpose": 1e30,
        "resize": 0.0,
        "resize_same": 0.0,
        "raw_cold": 1e30,
        "cold": 1e30,
    }
    for i in range(repeat):
        # The order alternates, so that neither side always writes right after the other's
        # gigabyte (on a virtual machine, page-cache writes depend on what ran before).
        writes = [("raw_w", raw.write), ("save", save)]
        for key, fn in writes if i % 2 == 0 else writes[::-1]:
            best[key] = min(best[key], _timed(comm, fn))
        best["raw_r"] = min(best["raw_r"], _timed(comm, raw.read))
        best["restore"] = min(best["restore"], _timed(comm, restore))
        best["transpose"] = min(best["transpose"], _timed(comm, transpose))
    # After the warm rounds: a dropped cache would make the next writes start from cold
    # pages (slow to touch on a VM) and disturb the save figures.
    reads: list[tuple[str, Callable[[], object]]] = [("raw_cold", raw.read), ("cold", restore)]
    for i in range(repeat if cold else 0):  # the order alternates here too
        for key, read in reads if i % 2 == 0 else reads[::-1]:
            _drop_caches(comm)
            best[key] = min(best[key], _timed(comm, read))
    return best


class _RawFiles:
    """The baseline: this rank's blocks written to a new file with plain writes and an fsync
    (each round a new file, as every checkpoint is a new file), and read back."""

    def __init__(self, workdir: Path, rank: int, blocks: list[np.ndarray]) -> None:
        self.workdir, self.rank, self.blocks = workdir, rank, blocks
        self.read_back = [np.empty_like(b) for b in blocks]
        self.rounds = itertools.count()

    def write(self) -> None:
        path = self.workdir / f"raw-{self.rank}-{next(self.rounds)}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for b in self.blocks:
                view = b.reshape(-1).view(np.uint8).data
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> None:
        with open(self.workdir / f"raw-{self.rank}-0.bin", "rb", buffering=0) as f:
            for b in self.read_back:
                f.readinto(b.reshape(-1).view(np.uint8).data)


def _ckpt_rows(
    best: dict[str, float], all_bytes: int, peaks: tuple[int, int, int], shard: int, cold: bool
) -> list[CkptRow]:
    """The ``dtm bench ckpt`` metrics against their baselines."""
    rows_out = [
        CkptRow("save_GBps", all_bytes / best["save"] / 1e9, all_bytes / best["raw_w"] / 1e9),
        CkptRow(
            "first_save_GBps", all_bytes / best["first_save"] / 1e9, all_bytes / best["raw_w"] / 1e9
        ),
        CkptRow("restore_GBps", all_bytes / best["restore"] / 1e9, all_bytes / best["raw_r"] / 1e9),
        CkptRow("reshard_restore_s", best["resize"], best["resize_same"]),
        CkptRow("reshard_transpose_s", best["transpose"], best["restore"]),
        CkptRow("peak_extra_rss_bytes", float(max(peaks)), float(shard)),
    ]
    if cold:
        cold_row = CkptRow(
            "restore_cold_GBps", all_bytes / best["cold"] / 1e9, all_bytes / best["raw_cold"] / 1e9
        )
        rows_out.insert(3, cold_row)
    return rows_out


def _write_csv(csv_path: str, rows_out: list[CkptRow]) -> None:
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["metric", "value", "baseline", "ratio"])
        for r in rows_out:
            w.writerow([r.metric, f"{r.value:.6g}", f"{r.baseline:.6g}", f"{r.ratio:.3f}"])


def _ckpt_table(head: str, rows_out: list[CkptRow], peaks: tuple[int, int, int], shard: int) -> str:
    peak_save, peak_restore, peak_reshard = peaks
    lines = [head, f"{'metric':<22}{'dtm':>14}{'baseline':>14}{'ratio':>8}"]
    for r in rows_out:
        lines.append(f"{r.metric:<22}{r.value:>14.4g}{r.baseline:>14.4g}{r.ratio:>8.2f}")
    lines.append(
        f"peak extra RSS: save {peak_save / 2**20:.1f} MiB, restore {peak_restore / 2**20:.1f} "
        f"MiB, resharded restore {peak_reshard / 2**20:.1f} MiB (local shard {shard / 2**20:.1f} MiB)"
    )
    return "\n".join(lines)


# --- async checkpoints in the training loop: `dtm bench ckpt-async` ------------------------------


def _tp_mlp_step(batch: int, width: int, hidden: int, ranks: int) -> Any:
    """A training step whose state every rank shares in equal parts: an MLP ``width ->
    hidden -> width`` (column- then row-parallel over ``tp``, every rank) with AdamW (the
    weights and two moments per weight: the state a checkpoint holds)."""
    from dtm_mpi import frontend as dtm
    from dtm_mpi.frontend import functional as fn

    model = dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(width, hidden, bias=False),
        fn.gelu,
        dtm.nn.RowParallelLinear(hidden, width, bias=False),
    )

    def loss(m: Any, x: dtm.Tensor, t: dtm.Tensor) -> dtm.Tensor:
        d: dtm.Tensor = m(x) - t
        return (d * d).mean()

    spec = dtm.Input((batch, width), "f32")
    return dtm.train_step(
        model,
        loss,
        mesh=dtm.Mesh(tp=ranks),
        inputs={"x": spec, "t": spec},
        optimizer=dtm.optim.AdamW(1e-3),
        name="mlp",
    )


def run_ckpt_async_bench(
    batch: int = 256,
    width: int = 1024,
    hidden: int = 4096,
    steps: int = 9,
    every: int = 2,
    directory: str | None = None,
    repeat: int = 3,
) -> str:
    """Time the training loop of ``dtm run`` (the steps, the per-step agreement, the saves)
    on every rank of the world, three ways in the same run: no checkpoints, a checkpoint
    every ``every`` steps written synchronously, and the same written in the background
    (``--checkpoint-async``). Reported: the loop times from the first step to the end of the
    last (best of ``repeat``, the modes alternating; an async save still being written then
    is finished untimed: in a long run it overlaps the next steps) and the part of the
    synchronous saves' cost the async ones hide, ``1 - (async - none) / (sync - none)``;
    returns the table on rank 0.

    Collective: call on all ranks."""
    from mpi4py import MPI

    from dtm_mpi.comm.handshake import agree_gemm
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.config import get_config
    from dtm_mpi.kernels.backends import parse_backend
    from dtm_mpi.kernels.devices import open_backend
    from dtm_mpi.plan.program import compile_plan, mesh_for
    from dtm_mpi.runtime.mpirun import plan_groups, run_loop
    from dtm_mpi.runtime.policies import CheckpointPolicy
    from dtm_mpi.runtime.request import RunRequest
    from dtm_mpi.runtime.step_loop import RunHooks

    if steps < 2 or every < 1 or every >= steps or repeat < 1:
        raise UsageError("need --steps >= 2, 1 <= --every < --steps, --repeat >= 1")
    world = MPI.COMM_WORLD
    rank, n = int(world.Get_rank()), int(world.Get_size())
    if hidden % n or batch < 1:
        raise UsageError(f"--hidden {hidden} must divide over the {n} ranks")
    step = _tp_mlp_step(batch, width, hidden, n)
    plan = compile_plan(step.module, mesh_for(step.module, n, {"tp": n}))
    root = directory if directory is not None else tempfile.gettempdir()
    base = world.bcast(
        tempfile.mkdtemp(prefix="dtm-bench-ckpt-async-", dir=root) if rank == 0 else None
    )
    workdir = Path(base)
    rng = np.random.default_rng(0)  # the same batch every step, on every rank
    data = {k: rng.standard_normal((batch, width)).astype(np.float32) for k in ("x", "t")}

    def feed(s: int, regions: Any) -> dict[str, np.ndarray]:
        return {k: data[k][r] for k, r in regions.items()}

    hooks = RunHooks(feed, ("x", "t"))
    config = get_config()
    session = MpiSession(plan.mesh, timeout_s=config.timeout_s, world=world, join=False)
    agree_gemm(world, config.gemm, timeout_s=config.timeout_s)  # one GEMM provider per job
    backend = open_backend(parse_backend("numpy"))
    state_bytes = 0
    best = {"none": 1e30, "sync": 1e30, "async": 1e30}
    try:
        session.join_mesh(plan_groups(plan, config.deterministic))
        comm = MpiComm(
            session, deterministic=config.deterministic, max_msg_elems=config.max_msg_elems
        )
        modes = ["none", "sync", "async"]
        for i in range(repeat):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                checkpoint = (
                    None
                    if mode == "none"
                    else CheckpointPolicy(
                        str(workdir / f"{mode}-{i}"),
                        every,
                        background=mode == "async",
                        keep_last=1,
                    )
                )
                request = RunRequest(
                    "<bench>", module=step.module, steps=steps, hooks=hooks, checkpoint=checkpoint
                )
                world.Barrier()
                blocks, seconds = run_loop(session, comm, plan, request, rank, backend)
                elapsed = float(world.allreduce(seconds, op=MPI.MAX))
                best[mode] = min(best[mode], elapsed)
                names = [p.name.lstrip("%") for p in plan.entry_plan.function.params]
                mine = sum(
                    int(b.nbytes) for k, b in zip(names, blocks, strict=True) if k not in hooks.fed
                )
                state_bytes = int(world.allreduce(mine, op=MPI.SUM))
    finally:
        session.close()
        world.Barrier()
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
    if rank != 0:
        return ""
    return _async_table(
        n, batch, width, hidden, steps, every, repeat, root, state_bytes=state_bytes, best=best
    )


def _async_table(
    n: int,
    batch: int,
    width: int,
    hidden: int,
    steps: int,
    every: int,
    repeat: int,
    root: str,
    *,
    state_bytes: int,
    best: dict[str, float],
) -> str:
    """The ``dtm bench ckpt-async`` table of the best loop times by mode."""
    saves = steps // every
    sync_cost, async_cost = best["sync"] - best["none"], best["async"] - best["none"]
    hidden_part = 1.0 - async_cost / sync_cost if sync_cost > 0 else float("nan")
    lines = [
        f"dtm bench ckpt-async: {n} ranks, MLP {width}->{hidden}->{width} tp={n}, AdamW, batch {batch}; "
        f"state {state_bytes / 2**20:.4g} MiB; {steps} steps, a checkpoint every {every} ({saves} saves); "
        f"loop times best of {repeat}, in {root}",
        f"{'mode':<26}{'loop s':>10}{'per step ms':>14}{'saves cost s':>14}",
        f"{'no checkpoints':<26}{best['none']:>10.3f}{best['none'] / steps * 1e3:>14.1f}{0.0:>14.3f}",
        f"{'synchronous saves':<26}{best['sync']:>10.3f}{best['sync'] / steps * 1e3:>14.1f}{sync_cost:>14.3f}",
        f"{'async saves':<26}{best['async']:>10.3f}{best['async'] / steps * 1e3:>14.1f}{async_cost:>14.3f}",
        (
            f"hidden by async: {hidden_part * 100:.0f}% of the synchronous saves' cost (target >= 80%)"
            if sync_cost > 0
            else f"hidden by async: not measurable: the synchronous saves cost {sync_cost:.3f} s, within the noise of the loop without checkpoints (larger --width/--hidden or --steps make them show)"
        ),
    ]
    return "\n".join(lines)
