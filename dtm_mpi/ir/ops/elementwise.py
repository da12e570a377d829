"""Elementwise ops: unary math, binary arithmetic, compare, where, cast.

Sharding rule: operands share one shape and one per-dimension layout, which the result keeps
(use ``broadcast_to`` and ``redistribute`` explicitly). Pending reductions pass only through
ops linear in them (each entry's ``linear_in``): ``neg`` and ``cast`` (float to float) of
``partial(sum)``; ``sigmoid`` of ``partial(max)``/``partial(min)`` (it is non-decreasing);
``add``/``sub`` of two identical ``partial(sum)``; ``mul`` with one ``partial(sum)`` side;
``div`` with a ``partial(sum)`` numerator (floats); ``maximum``/``minimum`` of two
``partial(max)``/``partial(min)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dtm_mpi.ir.build import Value
from dtm_mpi.ir.dtypes import as_dtype
from dtm_mpi.ir.grad_context import GradContext, GradRule
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import (
    no_partial,
    require_float,
    require_numeric,
    same_dims,
    same_dtype,
    same_shape,
)
from dtm_mpi.ir.registry import OPS, OpContext, OpDef, Trait, register_op
from dtm_mpi.ir.types import DType, ReduceOp, TensorType

Arr = np.ndarray
IR_1_4 = (1, 4)
"""The IR version of the LLM layers' ops (``silu``, ``sin``, ``cos``, ``rms_norm``)."""
IR_1_5 = (1, 5)
"""The IR version of ``erf`` and of ``gelu``'s ``approximate`` attribute."""

_SERIES_BANDS = (0.5, 1.0, 1.75, 2.5)  # erf's series below 2.5, each band to its own depth
_CF_TERMS = 40  # erfc's continued fraction from 2.5 up: binary64 precision at that depth


def _erf_series(xp: Any, s: Any) -> Any:
    """``2/sqrt(pi) exp(-s^2) sum_n 2^n s^(2n+1) / (2n+1)!!`` for ``s >= 0``: positive terms,
    summed (four at a time) until the last is below 1e-17 of the sum."""
    s2 = s * s
    term, total, n = s.copy(), s.copy(), 0
    while True:
        for _ in range(4):
            term *= s2
            term *= 2.0 / (2 * n + 3)
            total += term
            n += 1
        if not bool(xp.any(term > 1e-17 * total)):
            return (2.0 / math.sqrt(math.pi)) * xp.exp(-s2) * total


def _erf(xp: Any, x: Arr) -> Any:
    """The error function in binary64 (numpy has none), to within 2e-15 relative.

    Below 2.5 in magnitude, ``erf(x) = 2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (2n+1)!!``
    (:func:`_erf_series`; the elements are banded by magnitude, so the small ones, most of a
    GELU's inputs, stop after a dozen terms and the largest after 40); above, ``1 - erfc(x)``
    with erfc's continued fraction ``exp(-x^2)/sqrt(pi) / (x + (1/2)/(x + 1/(x + (3/2)/(x +
    ...))))`` to depth 40. Odd, so computed on ``|x|``; NaN stays NaN, +-inf gives +-1.
    Narrower floats are computed in binary64 (the caller casts the result back)."""
    x = xp.asarray(x)
    a = xp.abs(x.astype(xp.float64))
    out = xp.empty_like(a)
    lo = 0.0
    for hi in _SERIES_BANDS:
        band = (a < hi) & (a >= lo) if lo else a < hi
        if bool(band.any()):
            out[band] = _erf_series(xp, a[band])
        lo = hi
    big = ~(a < lo)  # NaN lands here and stays NaN
    b = a[big]
    if b.size:
        with np.errstate(over="ignore", invalid="ignore"):
            f = xp.zeros_like(b)
            for k in range(_CF_TERMS, 0, -1):
                f = (k / 2.0) / (b + f)
            erfc = xp.exp(-b * b) / (math.sqrt(math.pi) * (b + f))
        out[big] = 1.0 - xp.where(xp.isinf(b), 0.0, erfc)
    return xp.copysign(out, x)


def _gelu(xp: Any, x: Arr, approximate: str = "tanh") -> Any:
    if approximate == "none":  # x Phi(x), Phi the standard normal CDF (torch's default form)
        return 0.5 * x * (1.0 + _erf(xp, x * (1.0 / math.sqrt(2.0))))
    # tanh approximation (documented in the spec)
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + xp.tanh(c * (x + 0.044715 * (x * x * x))))  # x*x*x: pow is 10x slower


def _sigmoid(xp: Any, x: Arr) -> Any:
    # 1 / (1 + exp(-x)): exp(-x) overflows to inf for very negative x, giving exactly 0. f16 is
    # computed in binary32 (as the GPU kernels do), else exp(-x) overflows f16 from x < -11
    # and the result would be 0 where f16 holds it (sigmoid(-12) ~ 6e-6).
    if x.dtype == np.float16:
        x = x.astype(np.float32)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + xp.exp(-x))


def _silu(xp: Any, x: Arr) -> Any:
    # x * sigmoid(x) as torch's silu computes it, x / (1 + exp(-x)): exp(-x) overflows to inf
    # for very negative x, giving -0.0; f16 in binary32 (as sigmoid).
    if x.dtype == np.float16:
        x = x.astype(np.float32)
    with np.errstate(over="ignore"):
        return x / (1.0 + xp.exp(-x))


def _div(xp: Any, a: Arr, b: Arr) -> Any:
    return xp.divide(a, b) if a.dtype.kind == "f" else xp.floor_divide(a, b)


_SUM, _MAX, _MIN = (frozenset({r}) for r in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN))
_ELEMENTWISE = frozenset({Trait.ELEMENTWISE})
_FUSIBLE = frozenset({Trait.ELEMENTWISE, Trait.FUSIBLE})


def _unary_rule(opdef: Callable[[], OpDef]) -> Callable[[OpContext], tuple[TensorType, ...]]:
    def infer(ctx: OpContext) -> tuple[TensorType, ...]:
        d = opdef()
        t = ctx.operand_types[0]
        (require_float if d.has(Trait.FLOAT_ONLY) else require_numeric)(ctx, 0)
        p = t.layout.partial
        if p is not None and p.op not in d.linear_in:
            no_partial(ctx, 0)
        return (t,)

    return infer


def _elementwise_ref(
    name: str,
) -> Callable[[Op, Sequence[Arr], Sequence[TensorType]], tuple[Arr, ...]]:
    def ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
        d = OPS[name]
        fn = d.array_fn
        assert fn is not None
        with np.errstate(all="ignore"):
            return (as_dtype(fn(np, *xs, **d.form(op)), rt[0]),)

    return ref


def _unary(
    name: str,
    fn: Callable[..., Arr] | str,
    c_expr: str,
    *,
    float_only: bool,
    linear_in: frozenset[ReduceOp] = frozenset(),
    grad: Callable[[GradContext], Value],
    since: tuple[int, int] = (1, 0),
    fmt: str = "$x:operand",
    form_attrs: tuple[tuple[str, str], ...] = (),
    attr_since: tuple[tuple[str, tuple[int, int]], ...] = (),
) -> None:
    traits = _FUSIBLE | ({Trait.FLOAT_ONLY} if float_only else set())
    register_op(
        name,
        fmt,
        reference=_elementwise_ref(name),
        doc=f"elementwise {name}",
        traits=traits,
        linear_in=linear_in,
        c_expr=c_expr,
        array_fn=None if isinstance(fn, str) else fn,
        ufunc=fn if isinstance(fn, str) else None,
        grad=lambda c: (grad(c),),
        since=since,
        form_attrs=form_attrs,
        attr_since=attr_since,
    )(_unary_rule(lambda: OPS[name]))


# Gradient rules (g: the result's cotangent, x: the operand, y: the result).


def _d_gelu(c: GradContext) -> Value:
    """d gelu/dx. The tanh form: 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2), with
    t = tanh(k (x + a x^3)), k = sqrt(2/pi), a = 0.044715. The exact form (``approximate
    none``, x Phi(x)): Phi(x) + x phi(x) = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)."""
    x = c.xs[0]
    if c.attr("approximate") == "none":
        cdf = c.scale(c.add(c.const(1.0, x), c.apply("erf", c.scale(x, 1.0 / math.sqrt(2.0)))), 0.5)
        pdf = c.scale(c.apply("exp", c.scale(c.mul(x, x), -0.5)), 1.0 / math.sqrt(2.0 * math.pi))
        return c.add(cdf, c.mul(x, pdf))
    k, a = math.sqrt(2.0 / math.pi), 0.044715
    x2 = c.mul(x, x)
    t = c.apply("tanh", c.scale(c.add(x, c.scale(c.mul(x2, x), a)), k))
    left = c.scale(c.add(c.const(1.0, t), t), 0.5)
    sech2 = c.sub(c.const(1.0, t), c.mul(t, t))
    inner = c.scale(c.add(c.const(1.0, x2), c.scale(x2, 3 * a)), 0.5 * k)
    return c.add(left, c.mul(c.mul(x, sech2), inner))


def _positive(c: GradContext, x: Value) -> Value:
    return c.compare("gt", x, c.const(0, x))


# One entry per op: numpy-like semantics, C expression (kernels/dtm_common.cuh), float only,
# the pending reductions it passes through, the gradient (g: the result's cotangent).
_unary(
    "neg",
    "negative",
    "dtm_neg({0})",
    float_only=False,
    linear_in=_SUM,
    grad=lambda c: c.neg(c.g),
)
_unary(
    "exp",
    "exp",
    "dtm_exp({0})",
    float_only=True,
    grad=lambda c: c.mul(c.g, c.ys[0]),
)
_unary(
    "log",
    "log",
    "dtm_log({0})",
    float_only=True,
    grad=lambda c: c.div(c.g, c.xs[0]),
)
_unary(
    "tanh",
    "tanh",
    "dtm_tanh({0})",
    float_only=True,
    grad=lambda c: c.mul(c.g, c.sub(c.const(1.0, c.ys[0]), c.mul(c.ys[0], c.ys[0]))),
)
_unary(
    "relu",
    lambda xp, x: xp.maximum(x, xp.zeros_like(x)),
    "dtm_relu({0})",
    float_only=False,
    grad=lambda c: c.where(_positive(c, c.xs[0]), c.g, c.const(0, c.xs[0])),
)
# gelu: the tanh approximation (GPT-2's "gelu_new") unless ``approximate none`` asks for the
# exact x Phi(x) (BERT's and torch's default "gelu"); the attribute is new in 1.5.
_unary(
    "gelu",
    _gelu,
    "dtm_gelu_{approximate}({0})",
    float_only=True,
    grad=lambda c: c.mul(c.g, _d_gelu(c)),
    fmt="$x:operand ?( approximate $approximate:enum(tanh|none) )",
    form_attrs=(("approximate", "tanh"),),
    attr_since=(("approximate", IR_1_5),),
)
# erf: d erf/dx = 2/sqrt(pi) exp(-x^2). Not additive; non-decreasing, so (as sigmoid) it
# passes partial(max) and partial(min) through (an empty block's -inf becomes -1, the least).
_unary(
    "erf",
    _erf,
    "dtm_erf({0})",
    float_only=True,
    linear_in=_MAX | _MIN,
    grad=lambda c: c.mul(
        c.g, c.scale(c.apply("exp", c.neg(c.mul(c.xs[0], c.xs[0]))), 2.0 / math.sqrt(math.pi))
    ),
    since=IR_1_5,
)
_unary(
    "sqrt",
    "sqrt",
    "dtm_sqrt({0})",
    float_only=True,
    grad=lambda c: c.div(c.scale(c.g, 0.5), c.ys[0]),
)
_unary(
    "rsqrt",
    lambda xp, x: 1.0 / xp.sqrt(x),
    "dtm_rsqrt({0})",
    float_only=True,
    grad=lambda c: c.mul(c.scale(c.g, -0.5), c.mul(c.ys[0], c.mul(c.ys[0], c.ys[0]))),
)
# sigmoid is non-decreasing, so it commutes with max and min: sigmoid of partial(max) is the
# partial(max) of the sigmoids (an empty block's -inf becomes 0, still below every value).
# It is not linear in partial(sum).
_unary(
    "sigmoid",
    _sigmoid,
    "dtm_sigmoid({0})",
    float_only=True,
    linear_in=_MAX | _MIN,
    grad=lambda c: c.mul(c.g, c.mul(c.ys[0], c.sub(c.const(1.0, c.ys[0]), c.ys[0]))),
)


def _d_silu(c: GradContext) -> Value:
    """d silu/dx = s (1 + x (1 - s)), s = sigmoid(x)."""
    x = c.xs[0]
    s = c.apply("sigmoid", x)
    one = c.const(1.0, x)
    return c.mul(c.g, c.mul(s, c.add(one, c.mul(x, c.sub(one, s)))))


# silu (swish, x sigmoid(x)): the gate of Llama's SwiGLU MLP. Neither additive nor monotone.
_unary("silu", _silu, "dtm_silu({0})", float_only=True, grad=_d_silu, since=IR_1_4)
# sin and cos: rotary position tables made inside the step (from positions and frequencies).
_unary(
    "sin",
    "sin",
    "dtm_sin({0})",
    float_only=True,
    grad=lambda c: c.mul(c.g, c.apply("cos", c.xs[0])),
    since=IR_1_4,
)
_unary(
    "cos",
    "cos",
    "dtm_cos({0})",
    float_only=True,
    grad=lambda c: c.neg(c.mul(c.g, c.apply("sin", c.xs[0]))),
    since=IR_1_4,
)
# abs is neither additive nor monotone: |a + b| != |a| + |b|, |max(-3, 1)| != max(3, 1).
_unary(
    "abs",
    "absolute",
    "dtm_abs({0})",
    float_only=False,
    grad=lambda c: c.where(c.compare("ge", c.xs[0], c.const(0, c.xs[0])), c.g, c.neg(c.g)),
)


def _binary_partial(ctx: OpContext, d: OpDef) -> None:
    pa, pb = (t.layout.partial for t in ctx.operand_types)
    if pa is None and pb is None:
        return
    if d.has(Trait.LINEAR_ONE_SIDE):  # f(a, sum b) = sum f(a, b), either side
        one = pa if pb is None else pb if pa is None else None
        ok = one is not None and one.op in d.linear_in
    elif d.has(Trait.LINEAR_FIRST):  # f(sum a, b) = sum f(a, b) on floats (ints round)
        floats = ctx.operand_types[0].dtype.is_float
        ok = floats and pb is None and pa is not None and pa.op in d.linear_in
    else:  # f(sum a, sum b) = sum f(a, b): both pending alike
        ok = pa == pb and pa is not None and pa.op in d.linear_in
    if ok:
        return
    bad = 0 if pa is not None else 1
    other = ctx.operand_types[1 - bad].layout.partial
    raise ctx.operand_error(
        bad,
        f"{d.name} is not linear in {ctx.operand_types[bad].layout.partial} with the other "
        f"operand {'being ' + str(other) if other else 'not pending'}; allreduce first",
    )


def _binary_rule(opdef: Callable[[], OpDef]) -> Callable[[OpContext], tuple[TensorType, ...]]:
    def infer(ctx: OpContext) -> tuple[TensorType, ...]:
        require_numeric(ctx, 0)
        same_dtype(ctx, 0, 1)
        same_shape(ctx, 0, 1)
        same_dims(ctx, 0, 1)
        _binary_partial(ctx, opdef())
        a, b = ctx.operand_types
        return (a if a.layout.partial is not None else b,)

    return infer


def _binary(
    name: str,
    fn: Callable[..., Arr] | str,
    c_expr: str,
    linear_in: frozenset[ReduceOp],
    *extra: Trait,
    grad: GradRule,
) -> None:
    register_op(
        name,
        "$lhs:operand , $rhs:operand",
        reference=_elementwise_ref(name),
        doc=f"elementwise {name}",
        traits=_FUSIBLE | set(extra),
        linear_in=linear_in,
        c_expr=c_expr,
        array_fn=None if isinstance(fn, str) else fn,
        ufunc=fn if isinstance(fn, str) else None,
        grad=grad,
    )(_binary_rule(lambda: OPS[name]))


def _d_div(c: GradContext) -> tuple[Value | None, Value | None]:
    if not c.xs[0].type.dtype.is_float:
        return (None, None)  # floor division: no gradient (the operands are not float)
    da = c.div(c.g, c.xs[1]) if c.wants[0] else None
    db = c.neg(c.div(c.mul(c.g, c.ys[0]), c.xs[1])) if c.wants[1] else None
    return (da, db)


def _d_pick(pred: str) -> GradRule:
    """maximum (``ge``) / minimum (``le``): the cotangent goes to the operand picked (the
    lhs on a tie)."""

    def rule(c: GradContext) -> tuple[Value | None, Value | None]:
        first = c.compare(pred, c.xs[0], c.xs[1])
        zero = c.const(0, c.ys[0])
        return (c.where(first, c.g, zero), c.where(first, zero, c.g))

    return rule


# C expressions on floats (the generated kernels): ``div`` is a true division there.
_binary("add", "add", "({0} + {1})", _SUM, grad=lambda c: (c.g, c.g))
_binary("sub", "subtract", "({0} - {1})", _SUM, grad=lambda c: (c.g, c.neg(c.g)))


def _d_mul(c: GradContext) -> tuple[Value | None, Value | None]:
    if c.xs[0].name == c.xs[1].name:  # x * x: one cotangent, 2 g x
        return (c.mul(c.scale(c.g, 2.0), c.xs[0]), None)
    return (
        c.mul(c.g, c.xs[1]) if c.wants[0] else None,
        c.mul(c.g, c.xs[0]) if c.wants[1] else None,
    )


_binary(
    "mul",
    "multiply",
    "({0} * {1})",
    _SUM,
    Trait.LINEAR_ONE_SIDE,
    grad=_d_mul,
)
_binary("div", _div, "({0} / {1})", _SUM, Trait.LINEAR_FIRST, grad=_d_div)
_binary("maximum", "maximum", "dtm_maximum({0}, {1})", _MAX, grad=_d_pick("ge"))
_binary("minimum", "minimum", "dtm_minimum({0}, {1})", _MIN, grad=_d_pick("le"))

_COMPARE = {
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
}


def _compare_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (_COMPARE[str(op.attr("pred"))](xs[0], xs[1]),)


@register_op(
    "compare",
    "$pred:enum(lt|le|gt|ge|eq|ne) $lhs:operand , $rhs:operand",
    reference=_compare_ref,
    doc="elementwise comparison, bool result",
    traits=_ELEMENTWISE,
)
def _compare(ctx: OpContext) -> tuple[TensorType, ...]:
    same_dtype(ctx, 0, 1)
    same_shape(ctx, 0, 1)
    same_dims(ctx, 0, 1)
    no_partial(ctx, 0)
    no_partial(ctx, 1)
    return (ctx.operand_types[0].with_dtype(DType.BOOL),)


def _where_ref(op: Op, xs: Sequence[Arr], rt: Sequence[TensorType]) -> tuple[Arr, ...]:
    return (as_dtype(np.where(xs[0], xs[1], xs[2]), rt[0]),)


def _d_where(c: GradContext) -> tuple[Value | None, Value | None, Value | None]:
    zero = c.const(0, c.ys[0])
    return (None, c.where(c.xs[0], c.g, zero), c.where(c.xs[0], zero, c.g))


@register_op(
    "where",
    "$cond:operand , $a:operand , $b:operand",
    reference=_where_ref,
    doc="elementwise select: cond ? a : b",
    traits=_ELEMENTWISE,
    grad=_d_where,
)
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


def _d_cast(c: GradContext) -> tuple[Value | None]:
    """Float to float: the cotangent cast back. From an integer or bool: nothing flows."""
    if not (c.xs[0].type.dtype.is_float and c.ys[0].type.dtype.is_float):
        return (None,)
    return (c.cast(c.g, c.xs[0].type.dtype),)


@register_op(
    "cast",
    "$x:operand",
    reference=_cast_ref,
    doc="convert to the result dtype",
    traits=_ELEMENTWISE,
    linear_in=_SUM,
    grad=_d_cast,
)
def _cast(ctx: OpContext) -> tuple[TensorType, ...]:
    t, d = ctx.operand_types[0], ctx.declared[0]
    p = t.layout.partial
    linear = p is not None and p.op in OPS["cast"].linear_in  # float to float only (ints round)
    if p is not None and not (linear and t.dtype.is_float and d.dtype.is_float):
        raise ctx.operand_error(
            0,
            f"cast of {p} to {d.dtype} is not linear; only float-to-float casts keep a pending sum",
        )
    return (t.with_dtype(d.dtype),)
