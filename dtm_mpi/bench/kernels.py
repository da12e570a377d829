"""``dtm bench kernels``: each RawKernel's achieved bandwidth on the GPU, against a measured
device-to-device copy of the same bytes and against CuPy's composed equivalent.

One process, one GPU (``--backend cuda|hip``; without a GPU this is a :class:`BackendError`,
like every GPU path). Each case times the kernel, a copy of the bytes it must move at least
(one read of its inputs and one write of its output: ``y[...] = x`` over that many bytes), and
the same computation written with CuPy's own functions, each best of ``repeat`` blocks of
calls timed with CUDA events. Rows: ``metric`` (case), ``value`` (kernel GB/s),
``baseline`` (copy GB/s), ``ratio`` (kernel / copy), plus the composed time against the
kernel's (``speedup``). Bandwidth counts the minimum traffic, so 1.0 is the copy's speed.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KernelRow", "run_kernel_bench"]


@dataclass(frozen=True, slots=True)
class KernelRow:
    case: str
    nbytes: int  # minimum traffic: inputs read once + output written once
    kernel_s: float
    copy_s: float
    composed_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.kernel_s / 1e9

    @property
    def copy_gbps(self) -> float:
        return self.nbytes / self.copy_s / 1e9

    @property
    def ratio(self) -> float:
        return self.copy_s / self.kernel_s

    @property
    def speedup(self) -> float:
        return self.composed_s / self.kernel_s


def _time(cp: Any, fn: Callable[[], object], repeat: int, calls: int) -> float:
    """Best mean seconds per call over ``repeat`` blocks of ``calls`` (CUDA events)."""
    fn()  # compile / warm up
    cp.cuda.get_current_stream().synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3 / calls)
    return best


def _cases(
    cp: Any, rows: int, cols: int, dtype: Any
) -> list[tuple[str, int, Callable[[], object], Callable[[], object]]]:
    """(name, minimum bytes moved, kernel call, composed CuPy call) for each case."""
    from dtm_mpi.kernels import launch
    from dtm_mpi.kernels.fused import Expr, FusedInput

    rng = cp.random.default_rng(7)
    x = rng.standard_normal((rows, cols), dtype=np.float32).astype(dtype)
    g = rng.standard_normal(cols, dtype=np.float32).astype(dtype)
    b = rng.standard_normal(cols, dtype=np.float32).astype(dtype)
    y = cp.empty_like(x)
    isz = np.dtype(dtype).itemsize
    big = x.size * isz

    def sm() -> object:
        e = cp.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def lsm() -> object:
        s = x - x.max(axis=-1, keepdims=True)
        return s - cp.log(cp.exp(s).sum(axis=-1, keepdims=True))

    def ln() -> object:
        m = x.mean(axis=-1, keepdims=True)
        v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
        return (x - m) / cp.sqrt(v + 1e-5) * g + b

    def gelu(v: Any) -> Any:
        return 0.5 * v * (1.0 + cp.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))

    def q() -> object:
        xb = x.reshape(-1, 32).astype(cp.float64)
        amax = cp.abs(xb).max(axis=-1)
        s = cp.where(amax > 0, amax / 127.0, 1.0)
        return cp.clip(cp.rint(xb / s[:, None]), -127, 127).astype(cp.int8), s.astype(cp.float32)

    qv, qs = launch.quantize(x, 32)
    chain = Expr("mul", (Expr("gelu", (Expr("add", (0, 1)),)), 2))
    ins = [
        FusedInput(np.dtype(dtype)),
        FusedInput(np.dtype(dtype), lastdim=True),
        FusedInput(np.dtype(dtype)),
    ]
    return [
        ("softmax", 2 * big, lambda: launch.softmax(x, out=y), sm),
        ("log_softmax", 2 * big, lambda: launch.softmax(x, log=True, out=y), lsm),
        ("layer_norm", 2 * big, lambda: launch.layer_norm(x, g, b, 1e-5, out=y), ln),
        ("row_sum", big + rows * isz, lambda: launch.row_reduce("sum", x), lambda: x.sum(axis=-1)),
        ("row_max", big + rows * isz, lambda: launch.row_reduce("max", x), lambda: x.max(axis=-1)),
        ("bias_gelu", 2 * big, lambda: launch.bias_gelu(x, b, out=y), lambda: gelu(x + b)),
        (
            "fused gelu(x+b)*z",
            3 * big,
            lambda: launch.fused(chain, ins, [x, b, x], dtype, x.shape, out=y),
            lambda: gelu(x + b) * x,
        ),
        ("quantize b32", big + x.size + x.size // 32 * 4, lambda: launch.quantize(x, 32), q),
        (
            "dequantize b32",
            x.size + x.size // 32 * 4 + big,
            lambda: launch.dequantize(qv, qs, 32, dtype, out=y),
            lambda: (qv.reshape(-1, 32).astype(cp.float64) * qs[:, None]).astype(dtype),
        ),
    ]


def run_kernel_bench(
    backend: str = "cuda",
    rows: int = 16384,
    cols: int = 4096,
    dtypes: tuple[str, ...] = ("f32", "f16"),
    repeat: int = 5,
    csv_path: str | None = None,
) -> str:
    """Run every case on this process's GPU; returns the table (a
    :class:`~dtm_mpi.errors.BackendError` without a GPU)."""
    from dtm_mpi.kernels.backends import parse_backend
    from dtm_mpi.kernels.devices import open_backend

    dev = open_backend(parse_backend(backend))
    cp = dev.ops.cp
    rows_out: list[tuple[str, KernelRow]] = []
    for name in dtypes:
        dtype = {"f16": np.float16, "f32": np.float32, "f64": np.float64}[name]
        for case, nbytes, kernel, composed in _cases(cp, rows, cols, dtype):
            src = cp.empty(nbytes // 2 or 1, dtype=cp.uint8)
            dst = cp.empty_like(src)
            # a copy of nbytes in all: nbytes/2 read plus nbytes/2 written

            def copy(s: Any = src, d: Any = dst) -> None:
                d[...] = s

            copy_s = _time(cp, copy, repeat, 20)
            calls = 20
            k = _time(cp, kernel, repeat, calls)
            c = _time(cp, composed, repeat, max(1, calls // 4))
            rows_out.append((name, KernelRow(case, nbytes, k, copy_s, c)))
            del src, dst
    lines = [
        f"dtm bench kernels: {dev.description}; [{rows}, {cols}] per case; best of {repeat}",
        f"{'case':<22}{'dtype':>6}{'GB/s':>10}{'copy GB/s':>11}{'of copy':>9}{'vs CuPy':>9}",
    ]
    for name, r in rows_out:
        lines.append(
            f"{r.case:<22}{name:>6}{r.gbps:>10.1f}{r.copy_gbps:>11.1f}{r.ratio:>9.2f}{r.speedup:>8.2f}x"
        )
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["metric", "value", "baseline", "ratio"])
            for name, r in rows_out:
                w.writerow(
                    [
                        f"{r.case} {name} GBps",
                        f"{r.gbps:.6g}",
                        f"{r.copy_gbps:.6g}",
                        f"{r.ratio:.4g}",
                    ]
                )
                w.writerow(
                    [
                        f"{r.case} {name} s_vs_cupy",
                        f"{r.kernel_s:.6g}",
                        f"{r.composed_s:.6g}",
                        f"{r.speedup:.4g}",
                    ]
                )
    return "\n".join(lines)
