"""Traced tensors: numpy-like values whose operations append IR ops to the function being
traced.

A :class:`Tensor` stands for an SSA value of the function being built. Its operators and
methods emit registry ops through :meth:`FunctionBuilder.apply`, so every result's type and
layout come from the op's own rule, and where a rule needs other layouts the collective or
``redistribute`` is inserted (sharding propagation). numpy broadcasting is spelled out as
``reshape`` + ``broadcast_to``; Python numbers become constants of the other operand's dtype.
Every op carries the user's source line, and a rule's refusal is a :class:`TraceError` there.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import linecache
import os
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dtm_mpi.errors import SourceSpan, TraceError, VerifyError
from dtm_mpi.ir.build import FunctionBuilder, Value
from dtm_mpi.ir.nodes import Attr
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = ["Tensor", "Tracer", "as_layout", "current_tracer", "parse_dtype", "tracing", "user_span"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_span() -> SourceSpan:
    """The place in the user's code (the first frame outside this package) making the call:
    file, line, and the column span of the expression where Python records it."""
    frame = inspect.currentframe()
    while frame is not None and _inside(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return SourceSpan("<frontend>", 0, 0)
    code, line = frame.f_code, frame.f_lineno
    positions = _positions(code)
    at = frame.f_lasti // 2
    pos = positions[at] if 0 <= at < len(positions) else None
    if pos is None or pos[0] != line:
        return SourceSpan(code.co_filename, line or 0, 1)
    _, end_line, col, end_col = pos
    if col is None:
        return SourceSpan(code.co_filename, line, 1)
    length = end_col - col if end_line == line and end_col is not None else 1
    return SourceSpan(code.co_filename, line, col + 1, max(1, length))


@functools.lru_cache(maxsize=256)
def _positions(code: types.CodeType) -> tuple[tuple[int | None, ...], ...]:
    """Every instruction's source position in ``code`` (walked once per code object)."""
    return tuple(code.co_positions())


@functools.cache
def _inside(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE + os.sep)


def trace_error(err: VerifyError | str, span: SourceSpan | None = None) -> TraceError:
    """``err`` as an error at the user's line (with that line's text)."""
    message = err.message if isinstance(err, VerifyError) else err
    where = span or (err.span if isinstance(err, VerifyError) else user_span())
    out = TraceError(message, where)
    line = linecache.getline(where.file, where.line)
    if line:
        out.with_source(line)
    return out


def parse_dtype(dtype: str | DType) -> DType:
    if isinstance(dtype, DType):
        return dtype
    try:
        return DType(dtype)
    except ValueError:
        raise TraceError(
            f"unknown dtype {dtype!r} (one of {', '.join(d.value for d in DType)})", user_span()
        ) from None


def as_layout(spec: Sequence[str | Sequence[str] | None] | Layout | None, rank: int) -> Layout:
    """A layout from the user's spelling: one entry per dim, ``None``/``"-"`` (not split),
    an axis name, or a tuple of axis names (major first); None: replicated."""
    if isinstance(spec, Layout):
        return spec
    if spec is None:
        return Layout.replicated(rank)
    spec = tuple(spec)
    if len(spec) != rank:
        raise TraceError(f"layout {spec!r} needs one entry per dim ({rank})", user_span())
    dims: list[tuple[str, ...]] = []
    for entry in spec:
        if entry is None or entry == "-":
            dims.append(())
        elif isinstance(entry, str):
            dims.append((entry,))
        else:
            dims.append(tuple(entry))
    return Layout(tuple(dims))


class Tracer:
    """The function being traced: its builder, and the values the user detached."""

    def __init__(self, builder: FunctionBuilder) -> None:
        self.b = builder
        self.detached: set[str] = set()
        self.paths: dict[int, str] = {}  # id(layer) -> its path in the traced model
        self.entered: list[tuple[int, str]] = []  # (ops emitted so far, path) per layer call
        self.gathered: set[str] = set()  # sharded parameters' gathers (values), re-gathered
        self.updates: list[tuple[str, Tensor]] = []  # (state parameter, its new value): assign()
        self.compute: DType | None = None  # a mixed-precision step's compute dtype

    def enter(self, layer: object) -> None:
        """A layer of the traced model is called: remember where its ops start."""
        path = self.paths.get(id(layer))
        if path is not None:
            self.entered.append((len(self.b.ops), path))

    def apply(
        self,
        name: str,
        xs: Sequence[Tensor],
        attrs: dict[str, Attr] | None = None,
        declared: Sequence[TensorType] = (),
        *,
        hint: str | None = None,
    ) -> Tensor:
        span = user_span()
        for x in xs:
            if x.tracer is not self:
                raise trace_error("a tensor of another traced function is used here", span)
        try:
            out = self.b.apply1(
                name, [x.value for x in xs], attrs or {}, declared, span=span, hint=hint
            )
        except VerifyError as err:
            raise trace_error(err) from None
        return Tensor(out, self)

    def apply_n(
        self,
        name: str,
        xs: Sequence[Tensor],
        attrs: dict[str, Attr],
        declared: Sequence[TensorType],
    ) -> tuple[Tensor, ...]:
        """:meth:`apply` of an op with several results (``declared``: their types)."""
        span = user_span()
        try:
            outs = self.b.apply(name, [x.value for x in xs], attrs, declared, span=span)
        except VerifyError as err:
            raise trace_error(err) from None
        return tuple(Tensor(o, self) for o in outs)

    def constant(self, value: float | int | bool, like: TensorType) -> Tensor:
        return Tensor(self.b.constant(value, like, span=user_span()), self)

    def to_layout(self, x: Tensor, layout: Layout) -> Tensor:
        from dtm_mpi.ir.verify import check_layout

        span = user_span()
        try:
            check_layout(x.type.with_layout(layout), self.b.mesh, span, "the layout asked for:")
            return Tensor(self.b.to_layout(x.value, layout, span=span), self)
        except VerifyError as err:
            raise trace_error(err) from None


_CURRENT: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("dtm_tracer", default=None)


def tracer_or_none() -> Tracer | None:
    """The function being traced, if any."""
    return _CURRENT.get()


def current_tracer() -> Tracer:
    t = _CURRENT.get()
    if t is None:
        raise TraceError(
            "no function is being traced here (tensors exist only inside a traced function)",
            user_span(),
        )
    return t


@contextmanager
def tracing(tracer: Tracer) -> Iterator[Tracer]:
    token = _CURRENT.set(tracer)
    try:
        yield tracer
    finally:
        _CURRENT.reset(token)


Operand = "Tensor | float | int | bool"


class Tensor:
    """A traced value (see the module docstring)."""

    __slots__ = ("tracer", "value")
    __array_priority__ = 1000  # numpy scalars on the left defer to us

    def __init__(self, value: Value, tracer: Tracer) -> None:
        self.value = value
        self.tracer = tracer

    # --- facts -----------------------------------------------------------------------------

    @property
    def type(self) -> TensorType:
        return self.value.type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.type.shape

    @property
    def ndim(self) -> int:
        return self.value.type.rank

    @property
    def dtype(self) -> DType:
        return self.value.type.dtype

    @property
    def layout(self) -> Layout:
        return self.value.type.layout

    def __repr__(self) -> str:
        return f"Tensor({self.value.name}: {self.value.type})"

    def __bool__(self) -> bool:
        raise trace_error(
            "a traced tensor has no truth value while tracing (use where(...) to select)"
        )

    # --- helpers ---------------------------------------------------------------------------

    def _apply(
        self, name: str, *xs: Tensor, declared: Sequence[TensorType] = (), **attrs: Attr
    ) -> Tensor:
        return self.tracer.apply(name, [self, *xs], attrs, declared)

    def _lift(self, other: Any) -> Tensor:
        if isinstance(other, Tensor):
            return other
        if isinstance(other, bool | int | float) or (
            hasattr(other, "dtype") and getattr(other, "shape", None) == ()
        ):
            value = other.item() if hasattr(other, "item") else other
            if isinstance(value, float) and not self.dtype.is_float:
                raise trace_error(
                    f"a float ({value!r}) with a {self.dtype} tensor: cast the tensor first (.cast('f32')); its dtype would truncate the number"
                )
            return self.tracer.constant(
                value, self.type.with_layout(self.layout.with_partial(None))
            )
        raise trace_error(
            f"cannot combine a traced tensor with {type(other).__name__} (use a Python number or a traced tensor)"
        )

    def _binary(self, name: str, other: Any, *, swap: bool = False, **attrs: Attr) -> Tensor:
        a, b = self, self._lift(other)
        if swap:
            a, b = b, a
        a, b = broadcast_pair(a, b)
        return a.tracer.apply(name, [a, b], attrs)

    # --- arithmetic ------------------------------------------------------------------------

    def __add__(self, o: Any) -> Tensor:
        return self._binary("add", o)

    def __radd__(self, o: Any) -> Tensor:
        return self._binary("add", o, swap=True)

    def __sub__(self, o: Any) -> Tensor:
        return self._binary("sub", o)

    def __rsub__(self, o: Any) -> Tensor:
        return self._binary("sub", o, swap=True)

    def __mul__(self, o: Any) -> Tensor:
        return self._binary("mul", o)

    def __rmul__(self, o: Any) -> Tensor:
        return self._binary("mul", o, swap=True)

    def __truediv__(self, o: Any) -> Tensor:
        return self._binary("div", o)

    def __rtruediv__(self, o: Any) -> Tensor:
        return self._binary("div", o, swap=True)

    def __neg__(self) -> Tensor:
        return self._apply("neg")

    def __pow__(self, k: int) -> Tensor:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise trace_error(f"** takes a positive integer power; got {k!r}")
        out = self
        for _ in range(k - 1):
            out = out * self
        return out

    def __matmul__(self, o: Tensor) -> Tensor:
        if not isinstance(o, Tensor):
            raise trace_error("@ needs a traced tensor on both sides")
        return self.tracer.apply("matmul", [self, o])

    def __rmatmul__(self, o: Any) -> Tensor:
        if not isinstance(o, Tensor):
            raise trace_error("@ needs a traced tensor on both sides")
        return o.__matmul__(self)

    # comparisons give bool tensors
    def __lt__(self, o: Any) -> Tensor:
        return self._binary("compare", o, pred="lt")

    def __le__(self, o: Any) -> Tensor:
        return self._binary("compare", o, pred="le")

    def __gt__(self, o: Any) -> Tensor:
        return self._binary("compare", o, pred="gt")

    def __ge__(self, o: Any) -> Tensor:
        return self._binary("compare", o, pred="ge")

    def eq(self, o: Any) -> Tensor:
        return self._binary("compare", o, pred="eq")

    def ne(self, o: Any) -> Tensor:
        return self._binary("compare", o, pred="ne")

    # --- elementwise -----------------------------------------------------------------------

    def exp(self) -> Tensor:
        return self._apply("exp")

    def log(self) -> Tensor:
        return self._apply("log")

    def tanh(self) -> Tensor:
        return self._apply("tanh")

    def relu(self) -> Tensor:
        return self._apply("relu")

    def gelu(self, approximate: str = "tanh") -> Tensor:
        """GELU: ``approximate="tanh"`` (the default here, GPT-2's ``gelu_new``) or ``"none"``,
        the exact ``x * Phi(x)`` (torch's default, BERT's ``gelu``), as torch's
        ``gelu(x, approximate=...)``."""
        if approximate == "tanh":
            return self._apply("gelu")  # no attribute: the form every IR version reads
        if approximate != "none":
            raise trace_error(f"gelu approximate must be 'tanh' or 'none'; got {approximate!r}")
        return self._apply("gelu", approximate="none")

    def sigmoid(self) -> Tensor:
        return self._apply("sigmoid")

    def silu(self) -> Tensor:
        """``x * sigmoid(x)`` (swish), as torch's ``silu``."""
        return self._apply("silu")

    def sin(self) -> Tensor:
        return self._apply("sin")

    def cos(self) -> Tensor:
        return self._apply("cos")

    def erf(self) -> Tensor:
        """The error function (``torch.erf``)."""
        return self._apply("erf")

    def sqrt(self) -> Tensor:
        return self._apply("sqrt")

    def rsqrt(self) -> Tensor:
        return self._apply("rsqrt")

    def abs(self) -> Tensor:
        return self._apply("abs")

    def cast(self, dtype: str | DType) -> Tensor:
        d = parse_dtype(dtype)
        if d is self.dtype:
            return self
        return self._apply("cast", declared=[self.type.with_dtype(d)])

    astype = cast

    # --- reductions ------------------------------------------------------------------------

    def _dims(self, dims: int | Sequence[int] | None) -> tuple[int, ...]:
        if dims is None:
            return tuple(range(self.ndim))
        items = (dims,) if isinstance(dims, int) else tuple(dims)
        out = []
        for d in items:
            if not -self.ndim <= d < self.ndim:
                raise trace_error(f"dim {d} is out of range for a rank-{self.ndim} tensor")
            out.append(d % self.ndim)
        return tuple(out)

    def _reduce(self, name: str, dims: int | Sequence[int] | None, keepdims: bool) -> Tensor:
        ds = self._dims(dims)
        if not ds:
            return self
        return self._apply(name, dims=ds, keepdims=keepdims)

    def sum(self, dims: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("sum", dims, keepdims)

    def mean(self, dims: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("mean", dims, keepdims)

    def max(self, dims: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("max", dims, keepdims)

    def min(self, dims: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("min", dims, keepdims)

    def softmax(self, dim: int = -1) -> Tensor:
        return self._apply("softmax", dim=self._dims(dim)[0])

    def log_softmax(self, dim: int = -1) -> Tensor:
        return self._apply("log_softmax", dim=self._dims(dim)[0])

    # --- indexing --------------------------------------------------------------------------

    def take(self, indices: Tensor, dim: int = 0) -> Tensor:
        """The rows along ``dim`` at integer ``indices`` (``numpy.take``): shape
        ``self.shape[:dim] + indices.shape + self.shape[dim+1:]``. With ``dim`` split (a
        vocab-parallel table) the result is a pending sum over its axes (``complete()`` it);
        an index outside the dim is an error when the step runs."""
        if not isinstance(indices, Tensor):
            raise trace_error(f"take needs traced integer indices; got {type(indices).__name__}")
        return self._apply("take", indices, dim=self._dims(dim)[0])

    # --- shapes and layouts ----------------------------------------------------------------

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        first = shape[0] if shape else ()
        dims: tuple[int, ...] = (
            tuple(first)
            if len(shape) == 1 and not isinstance(first, int)
            else tuple(int(s) for s in shape)  # type: ignore[arg-type]
        )
        size = 1
        for n in self.shape:
            size *= n
        written = list(dims)
        if dims.count(-1) > 1 or any(n < -1 for n in dims):
            raise trace_error(f"reshape to {written}: sizes must be >= 0, with at most one -1")
        if dims.count(-1) == 1:
            known = 1
            for n in dims:
                known *= n if n != -1 else 1
            if known == 0 or size % known:
                raise trace_error(
                    f"reshape of {list(self.shape)} ({size} elements) to {written}: no size for -1 gives that count"
                )
            dims = tuple(size // known if n == -1 else n for n in dims)
        target = tuple(int(n) for n in dims)
        if target == self.shape:
            return self
        return self._apply(
            "reshape", declared=[TensorType(self.dtype, target, Layout.replicated(len(target)))]
        )

    def transpose(self, *perm: int) -> Tensor:
        p = tuple(perm) if perm else tuple(reversed(range(self.ndim)))
        if sorted(d % self.ndim if -self.ndim <= d < self.ndim else -1 for d in p) != list(
            range(self.ndim)
        ):
            raise trace_error(
                f"transpose{p}: not a permutation of the {self.ndim} dims of {list(self.shape)}"
            )
        return self._apply("transpose", perm=tuple(d % self.ndim for d in p))

    @property
    def T(self) -> Tensor:  # noqa: N802 (numpy's name)
        if self.ndim < 2:
            return self
        return self.transpose(*range(self.ndim - 2), self.ndim - 1, self.ndim - 2)

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        target = tuple(shape)
        if target == self.shape:
            return self
        return self._apply(
            "broadcast_to",
            declared=[TensorType(self.dtype, target, Layout.replicated(len(target)))],
        )

    def __getitem__(self, index: Any) -> Tensor:
        items = index if isinstance(index, tuple) else (index,)
        if len(items) > self.ndim:
            raise trace_error(f"too many indices ({len(items)}) for a rank-{self.ndim} tensor")
        start, limit, drop = [], [], []
        for d, size in enumerate(self.shape):
            it = items[d] if d < len(items) else slice(None)
            if isinstance(it, bool):
                raise trace_error(f"index {it!r}: use ints and slices")
            if isinstance(it, int):
                i = it % size if -size <= it < size else None
                if i is None:
                    raise trace_error(f"index {it} is out of range for dim {d} of size {size}")
                start.append(i)
                limit.append(i + 1)
                drop.append(d)
            elif isinstance(it, slice):
                a, b, step = it.indices(size)
                if step != 1:
                    raise trace_error("slices with a step are not supported")
                start.append(a)
                limit.append(max(a, b))
            else:
                raise trace_error(f"index {it!r}: use ints and slices")
        out = self
        if tuple(start) != (0,) * self.ndim or tuple(limit) != self.shape:
            out = self._apply("slice", start=tuple(start), limit=tuple(limit))
        if drop:
            out = out.reshape(tuple(s for d, s in enumerate(out.shape) if d not in drop))
        return out

    def redistribute(self, layout: Sequence[str | Sequence[str] | None] | Layout) -> Tensor:
        """The same value in another layout (explicit, as DTensor's ``redistribute``)."""
        return self.tracer.to_layout(self, as_layout(layout, self.ndim))

    def complete(self) -> Tensor:
        """The pending reduction of this value finished (an ``allreduce``; no-op if none)."""
        return self.tracer.to_layout(self, self.layout.with_partial(None))

    def detach(self) -> Tensor:
        """This value with no gradient flowing back through it (a copy the reverse pass
        treats as a constant)."""
        out = self._apply("redistribute", declared=[self.type])
        self.tracer.detached.add(out.value.name)
        return out


def broadcast_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``b`` broadcast to one shape (numpy rules; dims of size 1 repeated)."""
    if a.shape == b.shape:
        return a, b
    ra, rb = a.ndim, b.ndim
    n = max(ra, rb)
    sa = (1,) * (n - ra) + a.shape
    sb = (1,) * (n - rb) + b.shape
    shape = []
    for d, (x, y) in enumerate(zip(sa, sb, strict=True)):
        if x != y and 1 not in (x, y):
            raise trace_error(
                f"shapes {list(a.shape)} and {list(b.shape)} do not broadcast (dim {d}: {x} vs {y})"
            )
        shape.append(max(x, y))
    return _expand(a, tuple(shape)), _expand(b, tuple(shape))


def _expand(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    if x.shape == shape:
        return x
    if x.ndim < len(shape):
        x = (
            x.reshape((1,) * (len(shape) - x.ndim) + x.shape)
            if x.ndim
            else x.reshape((1,) * len(shape))
        )
    return x.broadcast_to(shape)
