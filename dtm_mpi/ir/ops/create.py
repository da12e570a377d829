"""Ops that create values: constant, iota, seeded random, step_index, microbatch_index.

The result type (and layout) is the declared one; none may be a pending reduction.

Seeded random values are a pure function of (seed, offset, global element index), so every
layout and every rank count yields the same global tensor, and each rank can compute only its
own block: ``u = (splitmix64(seed * 2**32 + offset, index) >> 11) * 2**-53`` in [0, 1);
uniform: ``low + (high - low) * u``; normal: Box-Muller of the pair (u at 2*index, u at
2*index+1): ``mean + std * sqrt(-2 ln(1 - u1)) * cos(2 pi u2)`` (spec: "Random values").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.ir.dtypes import as_dtype, np_dtype
from dtm_mpi.ir.nodes import Attr, Op
from dtm_mpi.ir.ops._common import dim_index
from dtm_mpi.ir.registry import OpContext, Trait, register_op
from dtm_mpi.ir.types import DType, TensorType

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniform01(seed: int, offset: int, index: np.ndarray) -> np.ndarray:
    """Uniform doubles in [0, 1) for global element indices ``index`` (uint64)."""
    key = np.uint64(((seed & 0xFFFFFFFF) << 32) | (offset & 0xFFFFFFFF))
    with np.errstate(over="ignore"):
        mixed = splitmix64(
            splitmix64(np.asarray(index, dtype=np.uint64) ^ splitmix64(np.array(key)))
        )
    return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def random_values(
    dist: str, seed: int, offset: int, index: np.ndarray, params: dict[str, float]
) -> np.ndarray:
    """Values of a seeded random tensor at global flat indices ``index``."""
    index = np.asarray(index, dtype=np.uint64)
    if dist == "uniform":
        low, high = params.get("low", 0.0), params.get("high", 1.0)
        return low + (high - low) * uniform01(seed, offset, index)
    u1 = uniform01(seed, offset, index * np.uint64(2))
    u2 = uniform01(seed, offset, index * np.uint64(2) + np.uint64(1))
    z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
    out: np.ndarray = params.get("mean", 0.0) + params.get("std", 1.0) * z
    return out


def _no_partial_result(ctx: OpContext) -> TensorType:
    d = ctx.declared[0]
    if d.layout.partial is not None:
        raise ctx.result_error(0, f"a created value cannot be {d.layout.partial}")
    return d


def _literal_shape(value: Attr) -> tuple[int, ...] | None:
    if not isinstance(value, tuple):
        return ()
    if not value:
        return (0,)
    inner = [_literal_shape(v) for v in value]
    if any(s is None or s != inner[0] for s in inner):
        return None
    first = inner[0]
    assert first is not None
    return (len(value), *first)


def _flat(value: Attr) -> list[int | float | bool]:
    if isinstance(value, tuple):
        return [x for v in value for x in _flat(v)]
    assert isinstance(value, int | float | bool)
    return [value]


def _constant_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    t = rt[0]
    value = np.array(_flat(op.attr("value")), dtype=np.float64 if t.dtype.is_float else None)
    if value.size == 1:
        return (as_dtype(np.full(t.shape, value.reshape(()), dtype=np_dtype(t.dtype)), t),)
    return (as_dtype(value.reshape(t.shape), t),)


@register_op(
    "constant",
    "$value:literal",
    reference=_constant_ref,
    doc="a literal: a scalar splat or nested lists of the result shape",
)
def _constant(ctx: OpContext) -> tuple[TensorType, ...]:
    d = _no_partial_result(ctx)
    value = ctx.attr("value")
    shape = _literal_shape(value)
    if shape is None:
        raise ctx.attr_error("value", "ragged literal: nested lists must have equal lengths")
    if shape not in ((), d.shape):
        raise ctx.attr_error(
            "value", f"literal has shape {list(shape)} but the result is {list(d.shape)}"
        )
    for v in _flat(value):
        if isinstance(v, float) and not d.dtype.is_float:
            raise ctx.attr_error(
                "value", f"literal {v!r} is not an integer, but the result is {d.dtype}"
            )
        if d.dtype is DType.BOOL and v not in (0, 1):
            raise ctx.attr_error("value", f"bool literal must be true/false/0/1; got {v!r}")
    return (d,)


def _iota_ref(op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
    t = rt[0]
    dim = int(op.attr("dim"))  # type: ignore[arg-type]
    shape = [1] * t.rank
    shape[dim] = t.shape[dim]
    return (as_dtype(np.broadcast_to(np.arange(t.shape[dim]).reshape(shape), t.shape), t),)


@register_op("iota", "dim $dim:int", reference=_iota_ref, doc="each element's index along dim")
def _iota(ctx: OpContext) -> tuple[TensorType, ...]:
    d = _no_partial_result(ctx)
    dim_index(ctx, "dim", int(ctx.attr("dim")), d.rank)
    if d.dtype is DType.BOOL:
        raise ctx.result_error(0, "iota needs a numeric result dtype; got bool")
    return (d,)


def _random_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    t = rt[0]
    offset = int(xs[0]) if xs else 0
    params = {k: float(v) for k, v in op.attrs if k in ("mean", "std", "low", "high")}  # type: ignore[arg-type]
    index = np.arange(t.numel, dtype=np.uint64)
    values = random_values(str(op.attr("dist")), int(op.attr("seed")), offset, index, params)  # type: ignore[arg-type]
    return (as_dtype(values.reshape(t.shape), t),)


@register_op(
    "random",
    "$dist:enum(normal|uniform) seed $seed:int ?( offset $offset:operand ) ?( mean $mean:float )"
    " ?( std $std:float ) ?( low $low:float ) ?( high $high:float )",
    reference=_random_ref,
    doc="seeded random values, independent of layout and rank count",
)
def _random(ctx: OpContext) -> tuple[TensorType, ...]:
    d = _no_partial_result(ctx)
    if not d.dtype.is_float:
        raise ctx.result_error(0, f"random needs a floating result dtype; got {d.dtype}")
    dist = ctx.attr("dist")
    wrong = ("low", "high") if dist == "normal" else ("mean", "std")
    for key in wrong:
        if ctx.attr(key) is not None:
            raise ctx.attr_error(key, f"{key} does not apply to {dist} random values")
    if dist == "normal" and ctx.attr("std") is not None and not float(ctx.attr("std")) >= 0:
        raise ctx.attr_error("std", "std must be >= 0")
    if dist == "uniform":
        low = 0.0 if ctx.attr("low") is None else float(ctx.attr("low"))
        high = 1.0 if ctx.attr("high") is None else float(ctx.attr("high"))
        if not low <= high:  # also rejects nan
            raise ctx.attr_error("high", f"need low <= high; got low {low}, high {high}")
    if ctx.operand_types:
        off = ctx.operand_types[0]
        if (
            off.dtype not in (DType.I32, DType.I64)
            or off.shape != ()
            or not off.layout.is_replicated
        ):
            raise ctx.operand_error(
                0, f"offset must be a replicated i32[] or i64[] scalar; got {off}"
            )
    return (d,)


def _supplied_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    raise NotImplementedError(f"{op.name} is supplied by the executor")


def _counter_type(ctx: OpContext) -> tuple[TensorType, ...]:
    """``step_index`` and ``microbatch_index``: the declared replicated ``i64[]``."""
    d = ctx.declared[0]
    if d.dtype is not DType.I64 or d.shape != () or not d.layout.is_replicated:
        raise ctx.result_error(0, f"{ctx.op.name} is a replicated i64[]; got {d}")
    return (d,)


register_op(
    "step_index",
    "",
    reference=_supplied_ref,
    traits=frozenset({Trait.NEEDS_STEP}),
    doc="the current step (0-based), i64[]",
)(_counter_type)
register_op(
    "microbatch_index",
    "",
    reference=_supplied_ref,
    traits=frozenset({Trait.NEEDS_STEP}),
    doc="the microbatch being run, counted over the run (step x microbatches + k), i64[]",
    since=(1, 2),
)(_counter_type)
