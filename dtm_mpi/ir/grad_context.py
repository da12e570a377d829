"""What an op's gradient rule sees, and the small builders the rules share.

An op's registry entry holds its gradient rule (``OpDef.grad``): ``rule(ctx)`` gets a
:class:`GradContext` -- the op, its operand and result values, the cotangents of its results
(None where no gradient reaches a result) -- and returns one cotangent per operand (None:
none flows to it). Rules emit IR through ``ctx.b`` (a :class:`~dtm_mpi.ir.build.FunctionBuilder`,
so layouts are propagated and collectives inserted as the forward pass would need them).

Cotangents are global values: a cotangent has its primal's dtype and shape, and any layout,
pending sums included (a pending cotangent stands for the sum of its contributions). The
reverse pass (:mod:`dtm_mpi.ir.autodiff`) adds the cotangents of a value and finally converts
each gradient to its parameter's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dtm_mpi.errors import SourceSpan
from dtm_mpi.ir.build import FunctionBuilder, Value
from dtm_mpi.ir.nodes import Attr, Op
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = ["GradContext", "GradRule"]


@dataclass(frozen=True, slots=True)
class GradContext:
    """One op of the forward pass, seen from the reverse pass."""

    b: FunctionBuilder
    op: Op
    xs: tuple[Value, ...]
    """The operands (forward values)."""
    ys: tuple[Value, ...]
    """The results (forward values)."""
    cts: tuple[Value | None, ...]
    """The cotangent of each result, None where no gradient reaches it."""
    wants: tuple[bool, ...]
    """Which operands need a cotangent (float values the differentiated inputs reach)."""
    reverse_tag: Callable[[int], int]
    """The tag of the backward transfer of the forward ``send``/``recv`` pair with this tag
    (one no forward pair uses; the same for both ops of the pair)."""

    @property
    def span(self) -> SourceSpan:
        return self.op.span

    @property
    def g(self) -> Value:
        """The cotangent of the single result (a constant 0 when none reached it)."""
        ct = self.cts[0]
        return ct if ct is not None else self.zeros(self.ys[0].type)

    def attr(self, key: str) -> Attr:
        return self.op.attr(key)

    # --- emitting --------------------------------------------------------------------------

    def apply(
        self, name: str, *xs: Value, declared: Sequence[TensorType] = (), **attrs: Attr
    ) -> Value:
        return self.b.apply1(name, list(xs), attrs, declared, span=self.span, hint="g")

    def add(self, a: Value, b: Value) -> Value:
        return self.apply("add", a, b)

    def sub(self, a: Value, b: Value) -> Value:
        return self.apply("sub", a, b)

    def mul(self, a: Value, b: Value) -> Value:
        return self.apply("mul", a, b)

    def div(self, a: Value, b: Value) -> Value:
        return self.apply("div", a, b)

    def neg(self, a: Value) -> Value:
        return self.apply("neg", a)

    def const(self, value: float, like: Value) -> Value:
        """A splat constant shaped and laid out (dims) like ``like``."""
        return self.b.constant(value, like.type, span=self.span)

    def scale(self, a: Value, k: float) -> Value:
        return self.mul(a, self.const(k, a))

    def zeros(self, t: TensorType) -> Value:
        return self.b.constant(0, t, span=self.span)

    def where(self, cond: Value, a: Value, b: Value) -> Value:
        return self.apply("where", cond, a, b)

    def compare(self, pred: str, a: Value, b: Value) -> Value:
        return self.apply("compare", a, b, pred=pred)

    def cast(self, a: Value, dtype: DType) -> Value:
        if a.type.dtype is dtype:
            return a
        return self.apply("cast", a, declared=[a.type.with_dtype(dtype)])

    def transpose(self, a: Value, perm: Sequence[int]) -> Value:
        return self.apply("transpose", a, perm=tuple(perm))

    def reduce_sum(self, a: Value, dims: Sequence[int], keepdims: bool = False) -> Value:
        if not dims:
            return a
        return self.apply("sum", a, dims=tuple(dims), keepdims=keepdims)

    def reshape(self, a: Value, shape: Sequence[int]) -> Value:
        if a.type.shape == tuple(shape):
            return a
        t = TensorType(a.type.dtype, tuple(shape), Layout.replicated(len(shape)))
        return self.apply("reshape", a, declared=[t])

    def broadcast(self, a: Value, shape: Sequence[int]) -> Value:
        """``a`` (the same rank as ``shape``, size 1 where it differs) repeated to ``shape``."""
        if a.type.shape == tuple(shape):
            return a
        t = TensorType(a.type.dtype, tuple(shape), Layout.replicated(len(shape)))
        return self.apply("broadcast_to", a, declared=[t])

    def unreduce(self, g: Value, x: TensorType, dims: Sequence[int], keepdims: bool) -> Value:
        """The cotangent ``g`` of a reduction of ``x`` over ``dims`` spread back over
        ``x``'s shape (each element of a reduced group gets the group's cotangent)."""
        kept = tuple(1 if d in dims else s for d, s in enumerate(x.shape))
        if not keepdims:
            g = self.reshape(g, kept)
        return self.broadcast(g, x.shape)


GradRule = Callable[[GradContext], Sequence[Value | None]]
"""An op's gradient rule: a cotangent per operand (None: none flows there)."""
