"""The GPU backends (``cuda`` and ``hip``: the same code on CuPy's CUDA or ROCm build).

Hot ops run as RawKernels compiled from ``kernels/*.cu`` (:mod:`dtm_mpi.kernels.launch`):
softmax and log_softmax along the last dim, layer_norm, rms_norm, reductions over the last dim,
int8 block quantize/dequantize, and every float elementwise op through the generated
kernels of :mod:`dtm_mpi.kernels.fused`. Matmul goes to cuBLAS/hipBLAS through
``cupy.matmul``. The other ops are composed from CuPy's own functions with exactly the numpy
backend's semantics (:mod:`dtm_mpi.kernels.numpy_backend`); the ops that create values from
global indices (``iota``, ``random``, ``constant``, ``step_index``) compute the rank's block
with the numpy kernel and upload it. Every op has a kernel here: the tests check the table
covers the registry, so no op can reach the CPU unannounced.

One known difference from numpy: ``cast`` of NaN, infinities or out-of-range floats to an
integer type saturates on GPUs (CUDA/HIP conversion rules) where numpy on x86 gives the
integer minimum or wraps; both are undefined in C, and the IR leaves them unspecified.

Importing this module needs no GPU and no CuPy (kernels import CuPy when they run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.ops.update import update_attrs
from dtm_mpi.ir.registry import OPS, Trait, ops_with
from dtm_mpi.kernels import launch
from dtm_mpi.kernels.backends import BackendKind
from dtm_mpi.kernels.dispatch import (
    COMM_OPS,
    Kernel,
    KernelContext,
    Placement,
    placement_of,
    register_kernel,
)
from dtm_mpi.kernels.fused import CTYPES, Expr, FusedInput
from dtm_mpi.kernels.numpy_backend import extremum_identity, global_count

__all__ = ["GPU_BACKENDS", "covered", "placement"]

GPU_BACKENDS = tuple(k.value for k in BackendKind if k.is_gpu)

Arr = Any  # cupy.ndarray


def _cp() -> Any:
    import cupy

    return cupy


def _register(*ops: str, placement: Placement | str = "CuPy") -> Callable[[Kernel], Kernel]:
    """Register ``fn`` for both GPU backends with where it runs (``placement``)."""

    def deco(fn: Kernel) -> Kernel:
        for b in GPU_BACKENDS:
            register_kernel(b, *ops, placement=placement)(fn)
        return fn

    return deco


def _out_dtype(ctx: KernelContext, i: int = 0) -> np.dtype[Any]:
    return np_dtype(ctx.result_types[i].dtype)


def _is_float(x: Arr) -> bool:
    return np.dtype(x.dtype) in CTYPES


def _generated(dtypes: Sequence[Any]) -> bool:
    """Elementwise ops on these dtypes run as generated kernels (else CuPy's own)."""
    return bool(dtypes) and all(np.dtype(d) in CTYPES for d in dtypes)


def _row_kernel(dtype: Any, dims: Sequence[int], ndim: int) -> bool:
    """A reduction runs as the row_reduce RawKernel: a float dtype, over the last dim only."""
    return np.dtype(dtype) in CTYPES and tuple(dims) == (ndim - 1,)


# -- elementwise -------------------------------------------------------------------------------
def _elementwise_placement(op: str, dtypes: Sequence[Any], attrs: dict[str, Any], rank: int) -> str:
    return "generated kernel" if _generated(dtypes) else "CuPy"


def _elementwise(name: str) -> None:
    """Every ``FUSIBLE`` op of the registry: its generated kernel on floats, else (integers)
    its registry array function on CuPy."""
    opdef = OPS[name]
    fn = opdef.array_fn
    assert fn is not None, name

    @_register(name, placement=_elementwise_placement)
    def kernel(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
        out = _out_dtype(ctx)
        form = opdef.form(ctx.op)
        if _generated([*(x.dtype for x in xs), out]):
            expr = Expr(name, tuple(range(opdef.arity)), tuple(form.items()))
            ins = [FusedInput(np.dtype(x.dtype)) for x in xs]
            return (launch.fused(expr, ins, list(xs), out, ctx.local_shapes[0]),)
        return (fn(_cp(), *xs, **form).astype(out, copy=False),)


for _name in sorted(ops_with(Trait.FUSIBLE)):
    _elementwise(_name)


@_register("compare")
def _compare(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    cp = _cp()
    fn = {
        "lt": cp.less,
        "le": cp.less_equal,
        "gt": cp.greater,
        "ge": cp.greater_equal,
        "eq": cp.equal,
        "ne": cp.not_equal,
    }[str(ctx.op.attr("pred"))]
    return (fn(xs[0], xs[1]),)


@_register("where")
def _where(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    return (_cp().where(xs[0], xs[1], xs[2]).astype(_out_dtype(ctx), copy=False),)


@_register("cast")
def _cast(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    return (xs[0].astype(_out_dtype(ctx)),)


@_register("adamw", placement="RawKernel adamw.cu")
def _adamw(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    p, g, m, v, bc1, bc2 = xs[:6]
    attrs = update_attrs(ctx.op)
    if len(xs) > 6:  # a schedule's factor: lr * scale rounded to the dtype, read to the host
        dt = np.dtype(p.dtype)
        scale = np.asarray(xs[6].get() if hasattr(xs[6], "get") else xs[6], dtype=dt)
        attrs["lr"] = float(np.asarray(attrs["lr"], dtype=dt) * scale)
    return launch.adamw(p, g, m, v, bc1, bc2, attrs)


@_register("matmul", placement="cuBLAS/hipBLAS")
def _matmul(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    return (_cp().matmul(xs[0], xs[1]).astype(_out_dtype(ctx), copy=False),)


# -- normalisations and reductions -------------------------------------------------------------
def _softmax_placement(op: str, dtypes: Sequence[Any], attrs: dict[str, Any], rank: int) -> str:
    dim = int(attrs.get("dim", -1)) % max(rank, 1)
    return "RawKernel softmax.cu" + ("" if dim == rank - 1 else " (moved to the last dim)")


def _softmax(name: str, log: bool) -> None:
    @_register(name, placement=_softmax_placement)
    def kernel(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
        cp = _cp()
        x = xs[0]
        dim = int(ctx.op.attr("dim")) % max(x.ndim, 1)  # type: ignore[arg-type]
        if not _is_float(x) or x.ndim == 0:
            raise launch.unsupported(name, x)
        last = dim == x.ndim - 1
        xt = x if last else cp.ascontiguousarray(cp.moveaxis(x, dim, -1))
        y = launch.softmax(xt, log=log)
        return (y if last else cp.ascontiguousarray(cp.moveaxis(y, -1, dim)),)


_softmax("softmax", False)
_softmax("log_softmax", True)


@_register("layer_norm", placement="RawKernel layer_norm.cu")
def _layer_norm(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    x, gamma, beta = xs
    if not _is_float(x):
        raise launch.unsupported("layer_norm", x)
    return (launch.layer_norm(x, gamma, beta, float(ctx.op.attr("eps"))),)  # type: ignore[arg-type]


@_register("rms_norm", placement="RawKernel rms_norm.cu")
def _rms_norm(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    x, w = xs
    if not _is_float(x):
        raise launch.unsupported("rms_norm", x)
    return (launch.rms_norm(x, w, float(ctx.op.attr("eps"))),)  # type: ignore[arg-type]


def _reduction_placement(op: str, dtypes: Sequence[Any], attrs: dict[str, Any], rank: int) -> str:
    dims = tuple(int(d) % max(rank, 1) for d in attrs.get("dims", ()))
    row = bool(dtypes) and _row_kernel(dtypes[0], dims, rank)
    return "RawKernel row_reduce.cu" if row else "CuPy"


def _reduction(name: str) -> None:
    @_register(name, placement=_reduction_placement)
    def kernel(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
        cp = _cp()
        x = xs[0]
        dims = tuple(int(d) % max(x.ndim, 1) for d in ctx.op.attr("dims"))  # type: ignore[union-attr, arg-type]
        keep = bool(ctx.op.attr("keepdims"))
        out = _out_dtype(ctx)
        count = global_count(ctx, dims)
        if _row_kernel(x.dtype, dims, x.ndim) and (name != "mean" or count):
            scale = 1.0 / count if name == "mean" else 1.0
            y = launch.row_reduce("sum" if name == "mean" else name, x, scale)
            if keep:
                y = y.reshape(*x.shape[:-1], 1)
            return (y.astype(out, copy=False),)
        if name in ("sum", "mean"):
            total = cp.sum(x, axis=dims, keepdims=keep)
            value = (
                total / count
                if (name == "mean" and count)
                else total * np.nan
                if name == "mean"
                else total
            )
            return (value.astype(out, copy=False),)
        if x.size == 0:  # an empty block: the reduction's identity (CuPy refuses size 0)
            shape = tuple(ctx.local_shapes[0])
            return (cp.full(shape, extremum_identity(name, np.dtype(x.dtype)), dtype=out),)
        fn = cp.max if name == "max" else cp.min
        return (fn(x, axis=dims, keepdims=keep).astype(out, copy=False),)


for _name in sorted(ops_with(Trait.REDUCTION)):
    _reduction(_name)


@_register("quantize", placement="RawKernel quant.cu")
def _quantize(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    x = xs[0]
    if not _is_float(x):
        raise launch.unsupported("quantize", x)
    q, scales = launch.quantize(x, int(ctx.op.attr("block")))  # type: ignore[arg-type]
    return (q, scales.reshape(ctx.local_shapes[1]))


@_register("dequantize", placement="RawKernel quant.cu")
def _dequantize(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    out = _out_dtype(ctx)
    return (launch.dequantize(xs[0], xs[1], int(ctx.op.attr("block")), out),)  # type: ignore[arg-type]


# -- shapes --------------------------------------------------------------------------------------
def _owned(x: Arr) -> Arr:
    """A C-contiguous copy of a view, shape kept (``ascontiguousarray`` makes 0-d arrays
    1-d), as the numpy kernels return new arrays."""
    return x.copy(order="C")


@_register("reshape")
def _reshape(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    x = xs[0] if xs[0].flags.c_contiguous else _owned(xs[0])
    return (x.reshape(ctx.local_shapes[0]),)  # a view, as numpy's reshape


@_register("transpose")
def _transpose(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    perm = tuple(ctx.op.attr("perm"))  # type: ignore[arg-type]
    return (_owned(xs[0].transpose(perm)),)


@_register("broadcast_to")
def _broadcast_to(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    cp = _cp()
    return (_owned(cp.broadcast_to(xs[0], ctx.local_shapes[0])),)


@_register("slice")
def _slice(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    from dtm_mpi.kernels.numpy_backend import slice_index

    return (_owned(xs[0][slice_index(ctx, xs[0].shape)]),)


@_register("concat")
def _concat(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    return (_cp().concatenate(list(xs), axis=int(ctx.op.attr("dim"))),)  # type: ignore[arg-type]


# -- indexing: rows at indices and their scatter-add (RawKernels take.cu) -------------------------
def _checked_indices(op: str, idx: Arr, size: int, dim: int, origin: Sequence[int]) -> Arr:
    """The indices flattened to int64 on the device; one bound check (two scalars read
    back), the numpy check's message on the host where one is out of range."""
    from dtm_mpi.ir.ops.index import check_indices

    flat = _cp().ascontiguousarray(idx.reshape(-1), dtype=np.int64)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= size):
        host = idx if isinstance(idx, np.ndarray) else idx.get()
        check_indices(op, np.asarray(host), size, dim, origin)
    return flat


def _split3(shape: Sequence[int], d: int, k: int) -> tuple[int, int, int]:
    """``shape`` as ``[pre, mid, post]`` around dims ``d .. d+k-1``."""
    pre = math.prod(shape[:d])
    return pre, math.prod(shape[d : d + k]), math.prod(shape[d + k :])


def _index_placement(
    op: str, dtypes: Sequence[np.dtype[Any]], attrs: dict[str, Any], rank: int
) -> str:
    return (
        "RawKernel take.cu"
        if dtypes and dtypes[0] in launch.SUFFIX
        else "host (integer rows), uploaded each step"
    )


def _on_host(name: str, ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    """The numpy kernel on the downloaded blocks, uploaded (integer and bool tables)."""
    from dtm_mpi.kernels.dispatch import backend_kernels

    host = [x if isinstance(x, np.ndarray) else x.get() for x in xs]
    return tuple(_cp().asarray(o) for o in backend_kernels("numpy")[name](ctx, host))


@_register("take", placement=_index_placement)
def _take(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    x, idx = xs
    d = int(ctx.op.attr("dim"))  # type: ignore[arg-type]
    if np.dtype(x.dtype) not in launch.SUFFIX:
        return _on_host("take", ctx, xs)
    flat = _checked_indices("take", idx, ctx.operand_types[0].shape[d], d, ctx.operand_offsets[1])
    x3 = (
        x.reshape(_split3(x.shape, d, 1))
        if x.flags.c_contiguous
        else _owned(x).reshape(_split3(x.shape, d, 1))
    )
    y = launch.take_rows(x3, flat, ctx.operand_offsets[0][d])
    return (y.reshape(ctx.local_shapes[0]),)


@_register("scatter_add", placement=_index_placement)
def _scatter_add(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    cp = _cp()
    u, idx = xs
    d = int(ctx.op.attr("dim"))  # type: ignore[arg-type]
    if np.dtype(u.dtype) not in launch.SUFFIX:
        return _on_host("scatter_add", ctx, xs)
    lo, n = ctx.offsets[0][d], ctx.local_shapes[0][d]
    flat = _checked_indices(
        "scatter_add", idx, ctx.result_types[0].shape[d], d, ctx.operand_offsets[1]
    )
    rows = cp.nonzero((flat >= lo) & (flat < lo + n))[0]  # ascending: the updates' order
    keys = flat[rows] - lo
    order = cp.argsort(keys, kind="stable")
    perm = rows[order]
    starts = cp.searchsorted(keys[order], cp.arange(n + 1, dtype=np.int64))
    u3 = (
        u.reshape(_split3(u.shape, d, idx.ndim))
        if u.flags.c_contiguous
        else _owned(u).reshape(_split3(u.shape, d, idx.ndim))
    )
    y = launch.scatter_rows(u3, perm, starts, n)
    return (y.reshape(ctx.local_shapes[0]),)


# -- values made from global indices: the numpy kernel's block, uploaded -------------------------
_STEADY: dict[tuple[int, Any, Any], tuple[Any, tuple[Arr, ...]]] = {}
"""Uploaded values that no step changes (``constant``, ``iota``), per op and block: computed
and uploaded once, then handed out again (values are never written in place)."""


def _uploaded(name: str, steady: bool) -> None:
    @_register(name, placement="host, uploaded once" if steady else "host, uploaded each step")
    def kernel(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
        key = (id(ctx.op), ctx.local_shapes, ctx.offsets)
        if steady:
            hit = _STEADY.get(key)
            if hit is not None and hit[0] is ctx.op:
                return hit[1]
        outs = _on_host(name, ctx, xs)
        if steady:
            _STEADY[key] = (ctx.op, outs)
        return outs


for _name, _steady in (
    ("iota", True),
    ("constant", True),
    ("random", False),
    ("step_index", False),
    ("microbatch_index", False),
):
    _uploaded(_name, _steady)


def covered(ops: Sequence[str]) -> list[str]:
    """The ops of ``ops`` (besides those the executor runs) this backend has no kernel for."""
    from dtm_mpi.kernels.dispatch import has_kernel

    return [o for o in ops if o not in COMM_OPS and not has_kernel("cuda", o)]


def placement(
    op: str, operand_dtypes: Sequence[np.dtype[Any]], attrs: dict[str, Any], rank: int
) -> str:
    """Where the GPU backends run ``op`` (pure): the placement rule its kernel registered
    above -- ``RawKernel <file>``, ``generated kernel``, ``cuBLAS``, ``CuPy`` or ``host,
    uploaded``. ``rank``: the operand's rank; ``attrs``: the op's attributes."""
    where = placement_of("cuda", op, operand_dtypes, attrs, rank)
    return "CuPy" if where is None else where
