"""Elementwise ops: unary math, binary arithmetic, compare, where, cast.

Sharding rule: operands share one shape and one per-dimension layout, which the result keeps
(use ``broadcast_to`` and ``redistribute`` explicitly). Pending reductions pass only through
ops linear in them: ``neg`` and ``cast`` (float to float) of ``partial(sum)``; ``add``/``sub``
of two identical ``partial(sum)``; ``mul`` with one ``partial(sum)`` side; ``div`` with a
``partial(sum)`` numerator; ``maximum``/``minimum`` of two ``partial(max)``/``partial(min)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import (
    as_dtype,
    no_partial,
    require_float,
    require_numeric,
    same_dims,
    same_dtype,
    same_shape,
)  # fmt: skip
from dtm_mpi.ir.registry import OpContext, register_op
from dtm_mpi.ir.types import DType, ReduceOp, TensorType

Arr = np.ndarray


def _gelu(x: Arr) -> Arr:
    # tanh approximation (documented in the spec)
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x**3)))


_UNARY: dict[str, tuple[Callable[[Arr], Arr], bool, bool]] = {
    # name: (numpy semantics, float only, linear in partial(sum))
    "neg": (np.negative, False, True),
    "exp": (np.exp, True, False),
    "log": (np.log, True, False),
    "tanh": (np.tanh, True, False),
    "relu": (lambda x: np.maximum(x, np.zeros_like(x)), False, False),
    "gelu": (_gelu, True, False),
    "sqrt": (np.sqrt, True, False),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), True, False),
}


def _unary_rule(
    name: str, float_only: bool, linear: bool
) -> Callable[[OpContext], tuple[TensorType, ...]]:
    def infer(ctx: OpContext) -> tuple[TensorType, ...]:
        t = ctx.operand_types[0]
        (require_float if float_only else require_numeric)(ctx, 0)
        p = t.layout.partial
        if p is not None and not (linear and p.op is ReduceOp.SUM):
            no_partial(ctx, 0)
        return (t,)

    return infer


def _unary_ref(
    fn: Callable[[Arr], Arr],
) -> Callable[[Op, Sequence[Arr], Sequence[TensorType]], tuple[Arr, ...]]:
    def ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
        return (as_dtype(fn(xs[0]), rt[0]),)

    return ref


for _name, (_fn, _float_only, _linear) in _UNARY.items():
    register_op(_name, "$x:operand", reference=_unary_ref(_fn), doc=f"elementwise {_name}")(
        _unary_rule(_name, _float_only, _linear)
    )

_BINARY: dict[str, Callable[[Arr, Arr], Arr]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": lambda a, b: np.divide(a, b) if a.dtype.kind == "f" else np.floor_divide(a, b),
    "maximum": np.maximum,
    "minimum": np.minimum,
}


def _binary_partial(ctx: OpContext, name: str) -> None:
    pa, pb = (t.layout.partial for t in ctx.operand_types)
    if pa is None and pb is None:
        return
    if name in ("add", "sub"):
        if pa == pb and pa is not None and pa.op is ReduceOp.SUM:
            return
    elif name == "mul":
        if (pa is None) != (pb is None) and (pa or pb).op is ReduceOp.SUM:  # type: ignore[union-attr]
            return
    elif name == "div":
        floats = ctx.operand_types[0].dtype.is_float
        if floats and pb is None and pa is not None and pa.op is ReduceOp.SUM:
            return
    elif name in ("maximum", "minimum"):
        want = ReduceOp.MAX if name == "maximum" else ReduceOp.MIN
        if pa == pb and pa is not None and pa.op is want:
            return
    bad = 0 if pa is not None else 1
    other = ctx.operand_types[1 - bad].layout.partial
    raise ctx.operand_error(
        bad, f"{name} is not linear in {ctx.operand_types[bad].layout.partial} with the other "
        f"operand {'being ' + str(other) if other else 'not pending'}; allreduce first"
    )  # fmt: skip


def _binary_rule(name: str) -> Callable[[OpContext], tuple[TensorType, ...]]:
    def infer(ctx: OpContext) -> tuple[TensorType, ...]:
        require_numeric(ctx, 0)
        same_dtype(ctx, 0, 1)
        same_shape(ctx, 0, 1)
        same_dims(ctx, 0, 1)
        _binary_partial(ctx, name)
        a, b = ctx.operand_types
        return (a if a.layout.partial is not None else b,)

    return infer


def _binary_ref(
    fn: Callable[[Arr, Arr], Arr],
) -> Callable[[Op, Sequence[Arr], Sequence[TensorType]], tuple[Arr, ...]]:
    def ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
        with np.errstate(all="ignore"):
            return (as_dtype(fn(xs[0], xs[1]), rt[0]),)

    return ref


for _name, _bfn in _BINARY.items():
    register_op(_name, "$lhs:operand , $rhs:operand", reference=_binary_ref(_bfn),
                doc=f"elementwise {_name}")(_binary_rule(_name))  # fmt: skip

_COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
            "eq": np.equal, "ne": np.not_equal}  # fmt: skip


def _compare_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (_COMPARE[str(op.attr("pred"))](xs[0], xs[1]),)


@register_op("compare", "$pred:enum(lt|le|gt|ge|eq|ne) $lhs:operand , $rhs:operand",
             reference=_compare_ref, doc="elementwise comparison, bool result")  # fmt: skip
def _compare(ctx: OpContext) -> tuple[TensorType, ...]:
    same_dtype(ctx, 0, 1)
    same_shape(ctx, 0, 1)
    same_dims(ctx, 0, 1)
    no_partial(ctx, 0)
    no_partial(ctx, 1)
    return (ctx.operand_types[0].with_dtype(DType.BOOL),)


def _where_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (as_dtype(np.where(xs[0], xs[1], xs[2]), rt[0]),)


@register_op("where", "$cond:operand , $a:operand , $b:operand", reference=_where_ref,
             doc="elementwise select: cond ? a : b")  # fmt: skip
def _where(ctx: OpContext) -> tuple[TensorType, ...]:
    if ctx.operand_types[0].dtype is not DType.BOOL:
        raise ctx.operand_error(0, f"condition must be bool; got {ctx.operand_types[0].dtype}")
    same_dtype(ctx, 1, 2)
    for i in (1, 2):
        same_shape(ctx, 0, i)
        same_dims(ctx, 0, i)
        no_partial(ctx, i)
    no_partial(ctx, 0)
    return (ctx.operand_types[1],)


def _cast_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (as_dtype(xs[0], rt[0]),)


@register_op("cast", "$x:operand", reference=_cast_ref, doc="convert to the result dtype")
def _cast(ctx: OpContext) -> tuple[TensorType, ...]:
    t, d = ctx.operand_types[0], ctx.declared[0]
    p = t.layout.partial
    if p is not None and not (p.op is ReduceOp.SUM and t.dtype.is_float and d.dtype.is_float):
        raise ctx.operand_error(
            0, f"cast of {p} to {d.dtype} is not linear; only float-to-float casts keep a "
            "pending sum"
        )  # fmt: skip
    return (t.with_dtype(d.dtype),)
