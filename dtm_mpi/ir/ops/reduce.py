"""Reductions over dims (sum mean max min), softmax, log_softmax, layer_norm, rms_norm.

Sharding rule: reducing a dim sharded over axes A yields a pending reduction over A
(``sum``/``mean`` -> ``partial(sum)``, ``max`` -> ``partial(max)``, ``min`` -> ``partial(min)``).
softmax/log_softmax/layer_norm/rms_norm need their normalised dim unsharded and no pending reduction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtm_mpi.ir.build import Value
from dtm_mpi.ir.dtypes import as_dtype
from dtm_mpi.ir.grad_context import GradContext, GradRule
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import (
    dim_index,
    merge_partial,
    no_partial,
    require_float,
    require_numeric,
    unsharded_dim,
)
from dtm_mpi.ir.registry import OpContext, Trait, register_op
from dtm_mpi.ir.types import DType, Layout, ReduceOp, TensorType

_PARTIAL_OF = {"sum": ReduceOp.SUM, "mean": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}
_NP = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def _reduce_rule(name: str):  # type: ignore[no-untyped-def]
    def infer(ctx: OpContext) -> tuple[TensorType, ...]:
        t = ctx.operand_types[0]
        (require_float if name == "mean" else require_numeric)(ctx, 0)
        dims: tuple[int, ...] = ctx.attr("dims")
        if not dims:
            raise ctx.attr_error("dims", "needs at least one dim to reduce")
        for d in dims:
            dim_index(ctx, "dims", d, t.rank)
        if len(set(dims)) != len(dims):
            raise ctx.attr_error("dims", f"dims must be distinct; got {list(dims)}")
        keep = bool(ctx.attr("keepdims"))
        axes = tuple(a for d in sorted(dims) for a in t.layout.dims[d])
        existing = t.layout.partial
        if existing is not None and existing.op is not _PARTIAL_OF[name]:
            no_partial(ctx, 0)
        if existing is not None and name == "mean" and axes:
            pass  # a mean of a pending sum is still a pending sum (linear)
        partial = merge_partial(ctx, existing, _PARTIAL_OF[name], axes)
        shape: list[int] = []
        ldims: list[tuple[str, ...]] = []
        for i, (s, ax) in enumerate(zip(t.shape, t.layout.dims, strict=True)):
            if i in dims:
                if keep:
                    shape.append(1)
                    ldims.append(())
            else:
                shape.append(s)
                ldims.append(ax)
        return (TensorType(t.dtype, tuple(shape), Layout(tuple(ldims), partial)),)

    return infer


def _identity(name: str, dtype: np.dtype[Any]) -> Any:
    """The identity of ``max``/``min`` (spec §7.1): the value over an empty dimension."""
    if dtype.kind == "f":
        return -np.inf if name == "max" else np.inf
    info = np.iinfo(dtype)
    return info.min if name == "max" else info.max


def _reduce_ref(name: str):  # type: ignore[no-untyped-def]
    def ref(op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
        fn: Any = _NP[name]
        x = xs[0]
        extra = {"initial": _identity(name, x.dtype)} if name in ("max", "min") else {}
        out = fn(x, axis=tuple(op.attr("dims")), keepdims=bool(op.attr("keepdims")), **extra)  # type: ignore[arg-type]
        return (as_dtype(out, rt[0]),)

    return ref


def _reduce_grad(name: str) -> GradRule:
    """sum: the cotangent spread over each reduced group; mean: also divided by the group's
    size; max/min: the cotangent shared by the elements equal to the group's result."""

    def rule(c: GradContext) -> tuple[Value]:
        x = c.xs[0].type
        dims: tuple[int, ...] = c.attr("dims")  # type: ignore[assignment]
        keep = bool(c.attr("keepdims"))
        if name == "mean":  # scaled before it is spread: one multiply per group
            return (
                c.unreduce(c.scale(c.g, 1.0 / math.prod(x.shape[d] for d in dims)), x, dims, keep),
            )
        g = c.unreduce(c.g, x, dims, keep)
        if name in ("max", "min"):  # shared evenly by the elements that tie (as torch's amax)
            hit = c.compare("eq", c.xs[0], c.unreduce(c.ys[0], x, dims, keep))
            ones = c.cast(hit, x.dtype)
            count = c.unreduce(c.reduce_sum(ones, dims, keepdims=True), x, dims, True)
            return (c.div(c.mul(g, ones), count),)
        return (g,)

    return rule


for _name in ("sum", "mean", "max", "min"):
    _sums = {Trait.SUMS} if _PARTIAL_OF[_name] is ReduceOp.SUM else set()
    register_op(
        _name,
        "$x:operand dims $dims:ints $keepdims:flag(keepdims)",
        grad=_reduce_grad(_name),
        reference=_reduce_ref(_name),
        doc=f"{_name} over dims",
        traits=frozenset({Trait.REDUCTION, *_sums}),
    )(_reduce_rule(_name))


def _softmax_np(x: np.ndarray, dim: int, log: bool) -> np.ndarray:
    shifted: np.ndarray = x - np.max(x, axis=dim, keepdims=True)  # ours: worked on in place
    if log:
        total = np.sum(np.exp(shifted), axis=dim, keepdims=True)
        np.log(total, out=total)
        np.subtract(shifted, total, out=shifted)
        return shifted
    np.exp(shifted, out=shifted)
    np.divide(shifted, np.sum(shifted, axis=dim, keepdims=True), out=shifted)
    return shifted


def _d_softmax(c: GradContext) -> tuple[Value]:
    """y (g - sum(g y)) along dim."""
    y, dim = c.ys[0], int(c.attr("dim"))  # type: ignore[arg-type]
    s = c.unreduce(c.reduce_sum(c.mul(c.g, y), [dim], keepdims=True), y.type, [dim], True)
    return (c.mul(y, c.sub(c.g, s)),)


def _d_log_softmax(c: GradContext) -> tuple[Value]:
    """g - exp(y) sum(g) along dim."""
    y, dim = c.ys[0], int(c.attr("dim"))  # type: ignore[arg-type]
    s = c.unreduce(c.reduce_sum(c.g, [dim], keepdims=True), y.type, [dim], True)
    return (c.sub(c.g, c.mul(c.apply("exp", y), s)),)


def _softmax_family(name: str, log: bool) -> None:
    def ref(op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
        return (as_dtype(_softmax_np(xs[0], int(op.attr("dim")), log), rt[0]),)  # type: ignore[arg-type]

    @register_op(
        name,
        "$x:operand dim $dim:int",
        reference=ref,
        doc=f"{name} along dim",
        grad=_d_log_softmax if log else _d_softmax,
    )
    def infer(ctx: OpContext) -> tuple[TensorType, ...]:
        t = ctx.operand_types[0]
        require_float(ctx, 0)
        no_partial(ctx, 0)
        d = dim_index(ctx, "dim", int(ctx.attr("dim")), t.rank)
        unsharded_dim(ctx, 0, d, f"the {name}")
        return (t,)


_softmax_family("softmax", False)
_softmax_family("log_softmax", True)


def _layer_norm_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    x, gamma, beta = xs
    eps = float(op.attr("eps"))  # type: ignore[arg-type]
    work = np.float64 if x.dtype == np.float64 else np.float32  # binary32 below f64 (spec)
    xf = x.astype(work)  # a copy: worked on in place (the values of the formula above)
    mean = xf.mean(axis=-1, keepdims=True)
    np.subtract(xf, mean, out=xf)
    var = np.square(xf).mean(axis=-1, keepdims=True)
    var += work(eps)
    np.sqrt(var, out=var)
    np.divide(xf, var, out=xf)
    np.multiply(xf, gamma.astype(work, copy=False), out=xf)
    np.add(xf, beta.astype(work, copy=False), out=xf)
    return (as_dtype(xf, rt[0]),)


def _d_layer_norm(c: GradContext) -> tuple[Value | None, ...]:
    """With xh = (x - mean) r, r = 1/sqrt(var + eps), over the last dim (size n):
    dx = r (dxh - mean(dxh) - xh mean(dxh xh)), dxh = g gamma; dgamma = sum(g xh) and
    dbeta = sum(g) over the leading dims."""
    x, gamma, _ = c.xs
    t = x.type
    last, n = t.rank - 1, t.shape[-1]
    lead = list(range(last))

    def row_mean(v: Value) -> Value:  # mean over the last dim, spread back over it
        return c.unreduce(c.scale(c.reduce_sum(v, [last], keepdims=True), 1.0 / n), t, [last], True)

    centred = c.sub(x, row_mean(x))
    var = row_mean(c.mul(centred, centred))
    r = c.apply("rsqrt", c.add(var, c.const(float(c.attr("eps")), var)))  # type: ignore[arg-type]
    xh = c.mul(centred, r)
    g = c.g
    dxh = (
        c.mul(g, c.broadcast(c.reshape(gamma, (1,) * last + (n,)), t.shape)) if c.wants[0] else None
    )
    dx = (
        c.mul(r, c.sub(c.sub(dxh, row_mean(dxh)), c.mul(xh, row_mean(c.mul(dxh, xh)))))
        if dxh is not None
        else None
    )
    dgamma = c.reshape(c.reduce_sum(c.mul(g, xh), lead), (n,)) if c.wants[1] else None
    dbeta = c.reshape(c.reduce_sum(g, lead), (n,)) if c.wants[2] else None
    return (dx, dgamma, dbeta)


@register_op(
    "layer_norm",
    "$x:operand , $gamma:operand , $beta:operand eps $eps:float",
    grad=_d_layer_norm,
    reference=_layer_norm_ref,
    doc="normalise over the last dim, then scale and shift",
    traits=frozenset({Trait.ROWWISE}),
)
def _layer_norm(ctx: OpContext) -> tuple[TensorType, ...]:
    x = ctx.operand_types[0]
    require_float(ctx, 0)
    no_partial(ctx, 0)
    if x.rank < 1:
        raise ctx.operand_error(0, "operand must have rank >= 1")
    unsharded_dim(ctx, 0, x.rank - 1, "the normalised (last)")
    for i, what in ((1, "gamma"), (2, "beta")):
        p = ctx.operand_types[i]
        if p.dtype is not x.dtype or p.shape != (x.shape[-1],):
            raise ctx.operand_error(i, f"{what} must be {x.dtype}[{x.shape[-1]}]; got {p}")
        if not p.layout.is_replicated:
            raise ctx.operand_error(i, f"{what} must be replicated; got {p}")
    eps = float(ctx.attr("eps"))
    if not eps > 0:
        raise ctx.attr_error("eps", f"eps must be > 0; got {eps}")
    return (x,)


def _work_dtype(x: np.dtype[Any]) -> type[np.floating[Any]]:
    """binary32 below binary64, as the normalisations compute (spec)."""
    return np.float64 if x == np.float64 else np.float32


def _rms_norm_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    """Hugging Face's ``LlamaRMSNorm``: ``x`` in the working precision, ``x * rsqrt(mean(x^2)
    + eps)`` (the reciprocal of the square root, as torch's ``rsqrt``), cast back to ``x``'s
    dtype, then times the weight."""
    x, w = xs
    eps = float(op.attr("eps"))  # type: ignore[arg-type]
    work = _work_dtype(x.dtype)
    xf = x.astype(work)
    var = np.square(xf).mean(axis=-1, keepdims=True)
    var += work(eps)
    np.sqrt(var, out=var)
    np.divide(work(1.0), var, out=var)
    np.multiply(xf, var, out=xf)
    normed = as_dtype(xf, rt[0])
    return (as_dtype(np.multiply(w, normed, dtype=normed.dtype), rt[0]),)


def _d_rms_norm(c: GradContext) -> tuple[Value | None, ...]:
    """With xh = x r, r = 1/sqrt(mean(x^2) + eps) over the last dim (size n), y = w xh:
    dx = r (dxh - xh mean(dxh xh)), dxh = g w; dw = sum(g xh) over the leading dims. Computed
    in binary32 for f16/bf16 operands (as the forward), then cast back."""
    x0, w0 = c.xs
    t0 = x0.type
    work = t0.dtype if t0.dtype in (DType.F32, DType.F64) else DType.F32
    x, w, g = c.cast(x0, work), c.cast(w0, work), c.cast(c.g, work)
    t = x.type
    last, n = t.rank - 1, t.shape[-1]
    lead = list(range(last))

    def row_mean(v: Value) -> Value:  # mean over the last dim, spread back over it
        return c.unreduce(c.scale(c.reduce_sum(v, [last], keepdims=True), 1.0 / n), t, [last], True)

    ms = row_mean(c.mul(x, x))
    r = c.apply("rsqrt", c.add(ms, c.const(float(c.attr("eps")), ms)))  # type: ignore[arg-type]
    xh = c.mul(x, r)
    dx = None
    if c.wants[0]:
        dxh = c.mul(g, c.broadcast(c.reshape(w, (1,) * last + (n,)), t.shape))
        dx = c.cast(c.mul(r, c.sub(dxh, c.mul(xh, row_mean(c.mul(dxh, xh))))), t0.dtype)
    dw = c.cast(c.reshape(c.reduce_sum(c.mul(g, xh), lead), (n,)), t0.dtype) if c.wants[1] else None
    return (dx, dw)


@register_op(
    "rms_norm",
    "$x:operand , $w:operand eps $eps:float",
    grad=_d_rms_norm,
    reference=_rms_norm_ref,
    doc="root-mean-square normalisation over the last dim, then scale (Llama's RMSNorm)",
    traits=frozenset({Trait.ROWWISE}),
    since=(1, 4),
)
def _rms_norm(ctx: OpContext) -> tuple[TensorType, ...]:
    x = ctx.operand_types[0]
    require_float(ctx, 0)
    no_partial(ctx, 0)
    if x.rank < 1:
        raise ctx.operand_error(0, "operand must have rank >= 1")
    unsharded_dim(ctx, 0, x.rank - 1, "the normalised (last)")
    w = ctx.operand_types[1]
    if w.dtype is not x.dtype or w.shape != (x.shape[-1],):
        raise ctx.operand_error(1, f"the weight must be {x.dtype}[{x.shape[-1]}]; got {w}")
    if not w.layout.is_replicated:
        raise ctx.operand_error(1, f"the weight must be replicated; got {w}")
    eps = float(ctx.attr("eps"))
    if not eps > 0:
        raise ctx.attr_error("eps", f"eps must be > 0; got {eps}")
    return (x,)
