"""``dtm bench comm``: dtm_mpi's collectives against raw mpi4py on the same buffers.

Run under the launcher (``mpirun -n 4 python -m mpi4py -m dtm_mpi bench comm``). For each op
and size, both paths run in the same process, alternating, on the same numpy buffers: the dtm
path is :class:`~dtm_mpi.comm.mpi_comm.MpiComm` (what the executor calls: group
communicator, non-blocking call, bounded wait, accounting), the raw path is mpi4py's blocking
buffer call on a duplicate of the world communicator. Times are the slowest rank's mean over
a block of calls, best of ``repeat`` alternating rounds.

Sizes and bandwidths follow nccl-tests: ``bytes`` is the whole array (allreduce and broadcast:
the buffer; allgather: the gathered output; reduce_scatter: the input; all_to_all: what one
rank sends in total), in float32 elements: the size asked for, rounded down to a multiple of
the ranks, at least one element per rank (:func:`case_bytes`); ``algbw = bytes / time``;
``busbw = algbw * f`` with ``f = 2(n-1)/n`` for allreduce, ``(n-1)/n`` for allgather,
reduce_scatter and all_to_all, ``1`` for broadcast.
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError

__all__ = ["BenchRow", "case_bytes", "default_sizes", "run_comm_bench"]

BLOCK_BYTES = 8 << 20
"""Bytes per timed block (at least one call, at most 1000): about a millisecond of work."""
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all")


@dataclass(frozen=True, slots=True)
class BenchRow:
    op: str
    ranks: int
    bytes: int
    dtm_s: float
    raw_s: float
    checked_s: float | None = None
    """The dtm path in payload integrity mode (``--integrity``), timed in the same rounds."""

    def busbw(self, seconds: float) -> float:
        n = self.ranks
        factor = {"allreduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(self.op, (n - 1) / n)
        return self.bytes / seconds * factor if seconds > 0 else 0.0

    @property
    def ratio(self) -> float:
        """busbw(dtm) / busbw(raw) = raw time / dtm time."""
        return self.raw_s / self.dtm_s if self.dtm_s > 0 else 0.0

    @property
    def integrity_cost(self) -> float | None:
        """What integrity mode adds to the dtm path, relative (None: not measured)."""
        if self.checked_s is None or self.dtm_s <= 0:
            return None
        return self.checked_s / self.dtm_s - 1.0

    @property
    def speedup(self) -> float | None:
        """The third path's effective bandwidth against the plain one's (``--quantize``: the
        quantized allreduce against float32's): plain time over its time (None: not measured)."""
        if not self.checked_s:
            return None
        return self.dtm_s / self.checked_s


def default_sizes() -> list[int]:
    """8 B to 64 MiB: every factor of 8 up to 256 KiB, then 1, 8 and 64 MiB."""
    return [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 8 << 20, 64 << 20]


def case_bytes(nbytes: int, n: int) -> int:
    """The bytes a case of ``nbytes`` moves on ``n`` ranks (see the module's docstring)."""
    return 4 * max(n, nbytes // 4 // n * n)


def slowest_rank_time(
    fn: Callable[[], object],
    iters: int,
    comm: Any,
    guard: Callable[[Callable[[], Any]], Any] | None = None,
    guard_calls: bool = True,
) -> float:
    """The slowest rank's mean time of ``iters`` calls of ``fn``, started together. ``guard``
    runs each blocking part within a deadline: the barrier, the result's reduction and, with
    ``guard_calls``, the block of calls (the dtm path's calls bound themselves).

    Collective: call on all ranks of ``comm``."""
    from mpi4py import MPI

    run = guard or (lambda f: f())

    def block() -> float:
        start = MPI.Wtime()
        for _ in range(iters):
            fn()
        return float((MPI.Wtime() - start) / iters)

    run(comm.Barrier)
    elapsed = run(block) if guard_calls else block()
    return float(run(lambda: comm.allreduce(elapsed, op=MPI.MAX)))


class _DeviceRaw:
    """The raw path on device buffers, as a careful mpi4py user writes it: synchronise the
    stream, then hand the device buffers to MPI (GPU-aware MPI), or copy to host buffers,
    call MPI there and copy back what MPI wrote (otherwise)."""

    def __init__(self, backend: Any, aware: bool, rank: int) -> None:
        self.ops, self.aware, self.rank = backend.ops, aware, rank
        self._host: dict[tuple[int, int], np.ndarray] = {}

    def _staged(self, x: Any, slot: int, copy: bool = True) -> np.ndarray:
        """A pinned host twin of device array ``x`` (holding its values when ``copy``)."""
        key = (slot, int(x.nbytes))
        if key not in self._host:
            self._host[key] = self.ops.pinned(int(x.nbytes))
        buf = self._host[key]
        if copy:
            out: np.ndarray = self.ops.to_host(x, buf)
            return out
        twin: np.ndarray = buf[: int(x.nbytes)].view(x.dtype).reshape(x.shape)
        return twin

    def wrap(
        self, call: Callable[..., object], send: Any, recv: Any | None, **kw: Any
    ) -> Callable[[], object]:
        """A function making the buffer call ``call(send, recv, **kw)`` (``call(send,
        **kw)``: in place, a broadcast) on device buffers."""
        ops = self.ops
        in_place_root = recv is None and kw.get("root") == self.rank  # MPI only reads there

        def direct() -> object:
            ops.synchronize()
            return call(send, recv, **kw) if recv is not None else call(send, **kw)

        def staged() -> object:
            ops.synchronize()
            hs = self._staged(send, 0)
            if recv is None:
                call(hs, **kw)
                return send if in_place_root else ops.to_device(hs, send)
            hr = self._staged(recv, 1, copy=False)
            call(hs, hr, **kw)
            return ops.to_device(hr, recv)

        return direct if self.aware else staged


def _cases(
    op: str, nbytes: int, comm_dtm: Any, raw: Any, n: int, rank: int, device: Any = None
) -> tuple[Callable[[], object], Callable[[], object]]:
    from mpi4py import MPI

    from dtm_mpi.comm.buffers import empty_aligned
    from dtm_mpi.ir.types import ReduceOp
    from dtm_mpi.sharding.steps import (
        AllgatherSpec,
        AllreduceSpec,
        ExchangeSpec,
        ReduceScatterSpec,
        Transfer,
    )

    def _host_ones(count: int) -> np.ndarray:  # page-aligned, as both paths get their best case
        a = empty_aligned(count, np.float32)
        a[:] = 1
        return a

    _ones: Callable[[int], Any] = _host_ones
    _empty: Callable[[int, Any], Any] = empty_aligned
    if device is not None:  # device buffers on both paths; the raw one synchronises/stages
        cp = device[0].ops.cp
        _ones = lambda count: cp.ones(count, dtype=np.float32)  # noqa: E731
        _empty = lambda count, dtype: cp.empty(count, dtype=dtype)  # noqa: E731

    def raw_call(name: str, send: Any, recv: Any | None = None, **kw: Any) -> Callable[[], object]:
        """The raw path's call, bound once: timing measures MPI's call, not its lookup."""
        call = getattr(raw, name)
        if device is not None:
            draw: _DeviceRaw = device[1]
            return draw.wrap(call, send, recv, **kw)
        return (lambda: call(send, **kw)) if recv is None else (lambda: call(send, recv, **kw))

    group = tuple(range(n))
    axes = ("x",)
    elems = case_bytes(nbytes, n) // 4  # float32, divisible by n
    per = elems // n
    if op == "allreduce":
        x, out = _ones(elems), _empty(elems, np.float32)
        spec_ar = AllreduceSpec(group, rank, ReduceOp.SUM, elems)
        return (lambda: comm_dtm.allreduce(x, axes, spec_ar)), raw_call(
            "Allreduce", x, out, op=MPI.SUM
        )
    if op == "allgather":
        x, out = _ones(per), _empty(elems, np.float32)
        spec_ag = AllgatherSpec(group, rank, 0, (per,) * n, (per,) * n)
        return (lambda: comm_dtm.allgather(x, axes, spec_ag)), raw_call("Allgather", x, out)
    if op == "reduce_scatter":
        x, out = _ones(elems), _empty(per, np.float32)
        pieces = tuple((j * per, per) for j in range(n))
        spec_rs = ReduceScatterSpec(group, rank, ReduceOp.SUM, 0, pieces, (per,) * n)
        return (lambda: comm_dtm.reduce_scatter(x, axes, spec_rs)), raw_call(
            "Reduce_scatter_block", x, out, op=MPI.SUM
        )
    if op == "broadcast":
        x = _ones(elems)
        return (lambda: comm_dtm.broadcast(x, axes, 0)), raw_call("Bcast", x, root=0)
    x, out = _ones(elems), _empty(elems, np.float32)

    def region(j: int) -> tuple[slice, ...]:
        return (slice(j * per, (j + 1) * per),)

    spec_ex = ExchangeSpec(
        group,
        rank,
        tuple(Transfer(j, region(j), per) for j in range(n)),
        tuple(Transfer(j, region(j), per) for j in range(n)),
        (elems,),
        per,
        per,
    )
    return (lambda: comm_dtm.exchange(x, axes, spec_ex, "all_to_all")), raw_call("Alltoall", x, out)


def run_comm_bench(
    ops: Sequence[str] = OPS,
    sizes: Sequence[int] | None = None,
    repeat: int = 30,
    csv_path: str | None = None,
    backend: str = "numpy",
    integrity: bool = False,
    quantize: int = 0,
) -> str:
    """Run the benchmark on every rank of the world; returns the table on rank 0. With a
    GPU ``backend``, both paths move device buffers (each rank on its node-local GPU): the
    dtm path through :class:`~dtm_mpi.comm.device.DeviceComm`, the raw path synchronising
    and then calling MPI on the device buffers (GPU-aware MPI) or staging through host
    buffers itself. ``integrity``: a third path, dtm's in payload integrity mode
    (``DTM_INTEGRITY``), timed in the same alternating rounds, and its cost over the plain one;
    ``quantize``: that third path is the quantized allreduce and allgather in blocks of
    ``quantize`` (``DTM_QUANT_ALLREDUCE``; the other ops pass through it), and its column the
    effective bandwidth against float32's (the plain dtm time over the quantized one).

    Collective: call on all ranks."""
    from mpi4py import MPI

    from dtm_mpi.comm.presence import Presence

    for op in ops:
        if op not in OPS:
            raise UsageError(f"unknown op {op!r} (choose from {', '.join(OPS)})")
    world = MPI.COMM_WORLD
    presence = Presence(world, LABEL)  # from here on, a rank that dies is named
    try:
        if integrity and quantize:
            raise UsageError("--integrity and --quantize are two third paths: give one")
        rows, dtm_comm, device = _run_cases(world, ops, sizes, repeat, backend, integrity, quantize)
    finally:
        presence.stop()
    if int(world.Get_rank()) != 0:
        return ""
    head = ""
    if device is not None:
        head = f"{device[0].description}; {dtm_comm.describe()}\n"
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            head_row = ["op", "ranks", "bytes", "dtm_s", "raw_s", "busbw_dtm", "busbw_raw", "ratio"]
            third = ["quantized_s", "speedup"] if quantize else ["checked_s", "integrity_cost"]
            w.writerow(head_row + (third if integrity or quantize else []))
            for r in rows:
                cells = [
                    r.op,
                    r.ranks,
                    r.bytes,
                    f"{r.dtm_s:.9f}",
                    f"{r.raw_s:.9f}",
                    f"{r.busbw(r.dtm_s):.1f}",
                    f"{r.busbw(r.raw_s):.1f}",
                    f"{r.ratio:.3f}",
                ]
                if integrity:
                    cells += [f"{r.checked_s:.9f}", f"{r.integrity_cost:.4f}"]
                if quantize and r.speedup is not None:
                    cells += [f"{r.checked_s:.9f}", f"{r.speedup:.3f}"]
                w.writerow(cells)
    return head + format_table(rows, quantized=bool(quantize))


def _run_cases(
    world: Any,
    ops: Sequence[str],
    sizes: Sequence[int] | None,
    repeat: int,
    backend: str,
    integrity: bool = False,
    quantize: int = 0,
) -> tuple[list[BenchRow], Any, Any]:
    """Both paths of every case, each timed block bounded by ``DTM_TIMEOUT``: the raw path
    (blocking mpi4py calls on its own communicator) runs under the session's watchdog like
    the dtm path, so a peer that dies, stops or fails ends every rank with one error naming
    it, never a wait without end.

    Collective: call on all ranks."""
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.config import get_config
    from dtm_mpi.errors import DtmError
    from dtm_mpi.sharding.mesh import MeshShape

    n, rank = int(world.Get_size()), int(world.Get_rank())
    timeout_s = get_config().timeout_s
    session = MpiSession(MeshShape((("x", n),)), [("x",)], timeout_s=timeout_s)
    session.label = LABEL
    session.on_launcher_terminate()
    try:
        session.phase = "setup"
        dtm_comm: Any = MpiComm(session, deterministic=False, integrity=False)
        checked: Any = MpiComm(session, deterministic=False, integrity=True) if integrity else None
        if quantize:
            from dtm_mpi.comm.quantized import QuantizedComm

            checked = QuantizedComm(dtm_comm, quantize, min_count=0)  # (around the plain path)
        raw = world.Dup()
        device = None
        if backend != "numpy":
            if integrity or quantize:
                raise UsageError(
                    "--integrity and --quantize measure host buffers only (--backend numpy)"
                )
            dtm_comm, device = _device_setup(backend, world, session, dtm_comm)
        rows: list[BenchRow] = []
        for op in ops:
            for nbytes in sizes or default_sizes():
                session.phase = f"{op} {case_bytes(nbytes, n)} B"
                dtm_fn, raw_fn = _cases(op, nbytes, dtm_comm, raw, n, rank, device)
                chk_fn = _cases(op, nbytes, checked, raw, n, rank)[0] if checked else None
                if quantize and chk_fn is not None:  # each call a step of its own, as in runs
                    chk_fn = functools.partial(_each_a_step, checked, chk_fn)
                # short blocks, many alternating rounds, the best block of each path: on a
                # shared machine noise only ever slows a block down, and one noisy block in a
                # long run would decide the ratio
                iters = max(1, min(1000, BLOCK_BYTES // max(nbytes, 1)))
                guard = functools.partial(_bounded, session, op)
                for _ in range(min(iters, 20)):  # warm up both paths
                    dtm_fn()
                    if chk_fn is not None:
                        chk_fn()
                guard(functools.partial(_repeat, raw_fn, min(iters, 20)))
                best_d = best_r = best_c = float("inf")
                for _ in range(repeat):
                    best_d = min(best_d, slowest_rank_time(dtm_fn, iters, raw, guard, False))
                    best_r = min(best_r, slowest_rank_time(raw_fn, iters, raw, guard))
                    if chk_fn is not None:
                        best_c = min(best_c, slowest_rank_time(chk_fn, iters, raw, guard, False))
                rows.append(
                    BenchRow(
                        op,
                        n,
                        case_bytes(nbytes, n),
                        best_d,
                        best_r,
                        best_c if chk_fn is not None else None,
                    )
                )
        raw.Free()
    except BaseException as exc:  # every failure ends every rank with one error
        if isinstance(exc, DtmError) and exc.agreed and session.poisoned is None:
            session.close()
            raise
        session.end_with(session.fail(exc))
    session.close()
    return rows, dtm_comm, device


def _each_a_step(comm: Any, fn: Callable[[], object]) -> object:
    """``fn()`` as one step's quantized call: the same allreduce each time takes the residual
    its previous call left (without it every call would be a new allreduce of the step)."""
    comm.begin_step()
    return fn()


def _repeat(fn: Callable[[], object], times: int) -> None:
    for _ in range(times):
        fn()


LABEL = "dtm bench comm"
"""How this command's error lines start."""


def _bounded(session: Any, op: str, block: Callable[[], Any]) -> Any:
    """``block()`` (blocking MPI calls) within the session's deadline: with the watchdog, the
    session's own guard (a peer that stops is named by the liveness check); without it, a
    deadline thread that ends the job."""
    got: list[Any] = []
    if session.watchdog is not None:
        session.guarded(lambda: got.append(block()), f"timed block of {op}", ("x",))
        return got[0]
    from dtm_mpi.comm.objects import io_deadline

    with io_deadline(f"timed block of {op}", session.phase, session.rank, session.timeout_s):
        return block()


def _device_setup(
    backend: str, world: Any, session: Any, inner: Any
) -> tuple[Any, tuple[Any, _DeviceRaw]]:
    """Open the GPU backend on every rank (node-local GPU), agree on GPU-aware MPI and wrap
    the dtm endpoint for device buffers (a rank without a GPU ends every rank's run).

    Collective: call on all ranks."""
    from dtm_mpi.comm.device import DeviceComm
    from dtm_mpi.comm.gpu_aware import agree_gpu_aware, detect_gpu_aware
    from dtm_mpi.runtime.mpirun import open_backend_everywhere

    opened = open_backend_everywhere(backend, world)
    aware = agree_gpu_aware(session, detect_gpu_aware(None, opened.name, device=opened.device))
    return DeviceComm(inner, opened.ops, aware, log=lambda line: None), (
        opened,
        _DeviceRaw(opened, aware.aware, int(world.Get_rank())),
    )


def format_table(rows: Sequence[BenchRow], quantized: bool = False) -> str:
    """The table; ``quantized``: the third path is the quantized allreduce (its column: the
    effective bandwidth against float32's), else payload integrity mode (its cost)."""
    checked = any(r.checked_s is not None for r in rows)
    third = f"{'quant us':>12}{'x f32':>8}" if quantized else f"{'checked us':>12}{'cost':>8}"
    lines = [
        f"{'op':<15}{'ranks':>6}{'bytes':>11}{'dtm us':>11}{'raw us':>11}{'+us':>8}"
        f"{'busbw dtm':>12}{'busbw raw':>12}{'ratio':>7}" + (third if checked else ""),
    ]
    for r in rows:
        line = (
            f"{r.op:<15}{r.ranks:>6}{r.bytes:>11}{r.dtm_s * 1e6:>11.1f}{r.raw_s * 1e6:>11.1f}"
            f"{(r.dtm_s - r.raw_s) * 1e6:>8.1f}{r.busbw(r.dtm_s) / 1e9:>10.2f}GB"
            f"{r.busbw(r.raw_s) / 1e9:>10.2f}GB{r.ratio:>7.2f}"
        )
        if quantized and r.checked_s and r.speedup is not None:
            line += f"{r.checked_s * 1e6:>12.1f}{r.speedup:>8.2f}"
        elif r.checked_s is not None and r.integrity_cost is not None:
            line += f"{r.checked_s * 1e6:>12.1f}{r.integrity_cost:>+8.0%}"
        lines.append(line)
    return "\n".join(lines)
