"""Compile and launch the RawKernels of ``kernels/*.cu`` through CuPy.

Modules are compiled by NVRTC (hipRTC on ROCm) through ``cupy.RawModule`` once per source and
device, and each kernel function is looked up once per (kernel, dtype, device); CuPy also
keeps compiled binaries in its on-disk cache, so a second run does not compile again. The
launchers take and return CuPy arrays (C-contiguous), accept a preallocated ``out`` (the tests
poison it first) and follow the launch contract of ``kernels/README.md``: grid-stride loops,
``THREADS`` threads per block (a multiple of every warp size), a grid capped at ``MAX_BLOCKS``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtm_mpi.errors import KernelError
from dtm_mpi.kernels.fused import CTYPES, Expr, FusedInput, fused_source
from dtm_mpi.kernels.sources import kernel_source

__all__ = [
    "MAX_BLOCKS",
    "THREADS",
    "bias_gelu",
    "dequantize",
    "function",
    "fused",
    "layer_norm",
    "quantize",
    "rms_norm",
    "row_reduce",
    "scatter_rows",
    "softmax",
    "take_rows",
    "unsupported",
]

THREADS = 256
MAX_BLOCKS = 65535 * 4
SUFFIX = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
OPTIONS = ("-std=c++17",)

_MODULES: dict[tuple[str, int], Any] = {}
_FUNCTIONS: dict[tuple[str, str, int], Any] = {}
_FUSED: dict[tuple[Any, ...], Any] = {}

Arr = Any


def _cp() -> Any:
    import cupy

    return cupy


def unsupported(op: str, x: Arr) -> KernelError:
    return KernelError(
        f"the GPU kernel of {op} takes f16/f32/f64 (bf16 is held as f32); got {x.dtype}"
    )


def _module(key: str, code: str) -> Any:
    cp = _cp()
    device = int(cp.cuda.Device().id)
    got = _MODULES.get((key, device))
    if got is None:
        try:
            got = cp.RawModule(code=code, options=OPTIONS)
            got.compile()
        except Exception as exc:  # a compile error names the source and the compiler's log
            raise KernelError(f"compiling {key} for device {device} failed: {exc}") from None
        _MODULES[(key, device)] = got
    return got


def function(source: str, name: str) -> Any:
    """Kernel ``name`` of ``kernels/<source>`` on the current device (compiled once)."""
    cp = _cp()
    device = int(cp.cuda.Device().id)
    got = _FUNCTIONS.get((source, name, device))
    if got is None:
        got = _module(source, kernel_source(source)).get_function(name)
        _FUNCTIONS[(source, name, device)] = got
    return got


def _suffix(x: Arr, op: str) -> str:
    s = SUFFIX.get(np.dtype(x.dtype))
    if s is None:
        raise unsupported(op, x)
    return s


def _grid(units: int, per_block: int = 1) -> int:
    return max(1, min(MAX_BLOCKS, math.ceil(units / per_block)))


def _out(out: Arr | None, shape: tuple[int, ...], dtype: Any) -> Arr:
    cp = _cp()
    if out is None:
        return cp.empty(shape, dtype=dtype)
    if (
        tuple(out.shape) != tuple(shape)
        or np.dtype(out.dtype) != np.dtype(dtype)
        or not out.flags.c_contiguous
    ):
        raise KernelError(
            f"out must be C-contiguous {np.dtype(dtype)}{list(shape)}; got {out.dtype}{list(out.shape)}"
        )
    return out


def _dev(x: Arr, what: str, dtype: Any = None) -> Arr:
    """``x`` as a C-contiguous device array (of ``dtype`` if given). A host (numpy) array is a
    :class:`KernelError` naming ``what``: the GPU path uploads at its host boundary, never
    implicitly here (CuPy's own answer would be a bare TypeError)."""
    cp = _cp()
    if isinstance(x, np.ndarray) and not isinstance(x, cp.ndarray):
        raise KernelError(f"{what}: got a host (numpy) array; GPU kernels take device arrays")
    return cp.ascontiguousarray(x) if dtype is None else cp.ascontiguousarray(x, dtype=dtype)


def _rows(x: Arr, what: str) -> tuple[Arr, int, int]:
    x = _dev(x, what)
    cols = int(x.shape[-1]) if x.ndim else 1
    rows = int(x.size // cols) if cols else int(math.prod(x.shape[:-1]))
    return x, rows, cols


def softmax(x: Arr, *, log: bool = False, out: Arr | None = None) -> Arr:
    """Softmax (``log``: log-softmax) along the last dim."""
    sfx = _suffix(x, "softmax")
    x, rows, cols = _rows(x, "softmax")
    y = _out(out, tuple(x.shape), x.dtype)
    if rows and cols:
        fn = function("softmax.cu", f"dtm_{'log_' if log else ''}softmax_{sfx}")
        fn((_grid(rows),), (THREADS,), (x, y, np.int64(rows), np.int64(cols)))
    return y


def layer_norm(x: Arr, gamma: Arr, beta: Arr, eps: float, *, out: Arr | None = None) -> Arr:
    """Normalise over the last dim, then ``* gamma + beta``."""
    sfx = _suffix(x, "layer_norm")
    x, rows, cols = _rows(x, "layer_norm")
    g, b = _dev(gamma, "layer_norm gamma", x.dtype), _dev(beta, "layer_norm beta", x.dtype)
    y = _out(out, tuple(x.shape), x.dtype)
    if rows and cols:
        fn = function("layer_norm.cu", f"dtm_layer_norm_{sfx}")
        fn(
            (_grid(rows),),
            (THREADS,),
            (x, g, b, y, np.int64(rows), np.int64(cols), np.float64(eps)),
        )
    return y


def rms_norm(x: Arr, w: Arr, eps: float, *, out: Arr | None = None) -> Arr:
    """Root-mean-square normalisation over the last dim, then ``* w`` (Llama's RMSNorm)."""
    sfx = _suffix(x, "rms_norm")
    x, rows, cols = _rows(x, "rms_norm")
    weight = _dev(w, "rms_norm weight", x.dtype)
    y = _out(out, tuple(x.shape), x.dtype)
    if rows and cols:
        fn = function("rms_norm.cu", f"dtm_rms_norm_{sfx}")
        fn(
            (_grid(rows),),
            (THREADS,),
            (x, weight, y, np.int64(rows), np.int64(cols), np.float64(eps)),
        )
    return y


def row_reduce(op: str, x: Arr, scale: float = 1.0, *, out: Arr | None = None) -> Arr:
    """``sum`` (times ``scale``), ``max`` or ``min`` over the last dim: shape ``x.shape[:-1]``."""
    if op not in ("sum", "max", "min"):
        raise KernelError(f"no row reduction {op!r}")
    sfx = _suffix(x, op)
    x, rows, cols = _rows(x, f"row {op}")
    y = _out(out, tuple(x.shape[:-1]), x.dtype)
    if rows:
        fn = function("row_reduce.cu", f"dtm_row_{op}_{sfx}")
        args: tuple[Any, ...] = (x, y, np.int64(rows), np.int64(cols))
        if op == "sum":
            args += (np.float64(scale),)
        fn((_grid(rows),), (THREADS,), args)
    return y


_WARP: dict[int, int] = {}


def _warp() -> int:
    """The current device's warp size (32 on NVIDIA, 64 on most AMD GPUs), asked once."""
    cp = _cp()
    device = int(cp.cuda.Device().id)
    if device not in _WARP:
        _WARP[device] = int(cp.cuda.Device().attributes.get("WarpSize", 32))
    return _WARP[device]


def quantize(x: Arr, block: int, *, out: tuple[Arr, Arr] | None = None) -> tuple[Arr, Arr]:
    """int8 values (shape of ``x``) and f32 scales (one per ``block`` consecutive elements)."""
    sfx = _suffix(x, "quantize")
    x = _dev(x, "quantize")
    if block < 1 or x.size % block:
        raise KernelError(f"quantize: {x.size} elements are not whole blocks of {block}")
    nblocks = x.size // block
    q = _out(None if out is None else out[0], tuple(x.shape), np.int8)
    s = _out(None if out is None else out[1], (nblocks,), np.float32)
    if nblocks:
        fn = function("quant.cu", f"dtm_quantize_{sfx}")
        fn(
            (_grid(nblocks, THREADS // _warp()),),
            (THREADS,),
            (x, q, s, np.int64(nblocks), np.int32(block)),
        )
    return q, s


def dequantize(q: Arr, scales: Arr, block: int, dtype: Any, *, out: Arr | None = None) -> Arr:
    """``q * scale`` per block of ``block`` elements, as ``dtype`` (f16/f32/f64)."""
    dtype = np.dtype(dtype)
    sfx = SUFFIX.get(dtype)
    if sfx is None:
        raise KernelError(f"dequantize: result dtype {dtype} is not f16/f32/f64")
    q = _dev(q, "dequantize values")
    s = _dev(scales, "dequantize scales", np.float32)
    y = _out(out, tuple(q.shape), dtype)
    if q.size:
        fn = function("quant.cu", f"dtm_dequantize_{sfx}")
        fn((_grid(q.size, THREADS),), (THREADS,), (q, s, y, np.int64(q.size), np.int32(block)))
    return y


def fused(
    expr: Expr,
    inputs: Sequence[FusedInput],
    xs: Sequence[Arr],
    dtype: Any,
    shape: Sequence[int],
    *,
    out: Arr | None = None,
) -> Arr:
    """``expr`` over the arrays ``xs`` (described by ``inputs``) elementwise, as ``dtype``."""
    cp = _cp()
    dtype = np.dtype(dtype)
    if dtype not in CTYPES:
        raise KernelError(f"generated kernels write f16/f32/f64; got {dtype}")
    key = (expr, tuple(inputs), dtype, int(cp.cuda.Device().id))
    fn = _FUSED.get(key)
    if fn is None:  # generated, compiled and looked up once per expression, types and device
        name, code = fused_source(expr, inputs, dtype, kernel_source("fused_elementwise.cu"))
        fn = _FUSED[key] = _module(name, code).get_function(name)
    y = _out(out, tuple(shape), dtype)
    n = int(y.size)
    cols = int(shape[-1]) if len(shape) else 1
    args = [_dev(x, f"fused kernel input {k}") for k, x in enumerate(xs)]
    if n:
        fn((_grid(n, THREADS),), (THREADS,), (*args, y, np.int64(n), np.int64(max(cols, 1))))
    return y


def bias_gelu(x: Arr, bias: Arr, *, out: Arr | None = None) -> Arr:
    """``gelu(x + bias)`` with ``bias`` a vector along the last dim (the fused MLP epilogue)."""
    sfx = _suffix(x, "bias_gelu")
    x, _, cols = _rows(x, "bias_gelu")
    b = _dev(bias, "bias_gelu bias", x.dtype)
    if b.size != cols:
        raise KernelError(f"bias_gelu: bias has {b.size} elements, the last dim {cols}")
    y = _out(out, tuple(x.shape), x.dtype)
    if x.size:
        fn = function("bias_gelu.cu", f"dtm_bias_gelu_{sfx}")
        fn((_grid(x.size, THREADS),), (THREADS,), (x, b, y, np.int64(x.size), np.int64(cols)))
    return y


def adamw(
    p: Arr, g: Arr, m: Arr, v: Arr, bc1: Arr, bc2: Arr, attrs: dict[str, float]
) -> tuple[Arr, Arr, Arr]:
    """AdamW's update of ``p`` and its moments ``m``, ``v`` by gradient ``g`` (one shape and
    dtype), with the bias corrections ``bc1``, ``bc2`` (device scalars of that dtype): the
    new ``p``, ``m``, ``v`` (IR op ``adamw``; ``attrs``: lr, beta1, beta2, eps, decay)."""
    sfx = _suffix(p, "adamw")
    ins = zip((p, g, m, v, bc1, bc2), ("p", "g", "m", "v", "bc1", "bc2"), strict=True)
    xs = [_dev(a, f"adamw {w}", p.dtype) for a, w in ins]
    outs = tuple(_out(None, tuple(p.shape), p.dtype) for _ in range(3))
    n = int(outs[0].size)
    if n:
        b1, b2 = attrs["beta1"], attrs["beta2"]
        consts = (attrs["lr"], b1, 1.0 - b1, b2, 1.0 - b2, attrs["eps"], attrs["decay"])
        fn = function("adamw.cu", f"dtm_adamw_{sfx}")
        fn(
            (_grid(n, THREADS),),
            (THREADS,),
            (*xs, *outs, np.int64(n), *(np.float64(c) for c in consts)),
        )
    return outs


def take_rows(x: Arr, idx: Arr, lo: int, *, out: Arr | None = None) -> Arr:
    """``x`` ``[pre, n, post]`` (rows ``lo .. lo+n-1`` of a longer dim) at the int64 indices
    ``idx`` ``[k]``: ``[pre, k, post]``, zeros for indices outside the block."""
    sfx = _suffix(x, "take")
    x = _dev(x, "take")
    i = _dev(idx, "take indices", np.int64)
    pre, n, post = (int(s) for s in x.shape)
    k = int(i.size)
    y = _out(out, (pre, k, post), x.dtype)
    if y.size:
        fn = function("take.cu", f"dtm_take_rows_{sfx}")
        fn(
            (_grid(y.size, THREADS),),
            (THREADS,),
            (x, i, y, np.int64(pre), np.int64(n), np.int64(k), np.int64(post), np.int64(lo)),
        )
    return y


def scatter_rows(u: Arr, perm: Arr, starts: Arr, n: int, *, out: Arr | None = None) -> Arr:
    """``[pre, n, post]``: row ``r`` the sum, in order, of the update rows ``perm[starts[r] ..
    starts[r+1]-1]`` of ``u`` ``[pre, k, post]`` (deterministic; see ``kernels/take.cu``)."""
    sfx = _suffix(u, "scatter_add")
    u = _dev(u, "scatter_add")
    p = _dev(perm, "scatter_add rows", np.int64)
    st = _dev(starts, "scatter_add starts", np.int64)
    pre, k, post = (int(s) for s in u.shape)
    if st.size != n + 1:
        raise KernelError(f"scatter_add: starts has {st.size} entries; {n + 1} needed")
    y = _out(out, (pre, n, post), u.dtype)
    if y.size:
        fn = function("take.cu", f"dtm_scatter_rows_{sfx}")
        fn(
            (_grid(y.size, THREADS),),
            (THREADS,),
            (u, p, st, y, np.int64(pre), np.int64(n), np.int64(k), np.int64(post)),
        )
    return y
