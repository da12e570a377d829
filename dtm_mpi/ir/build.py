"""Building IR functions from code: the one place ops are made outside the parser.

A :class:`FunctionBuilder` appends ops to a function body. Every result type comes from the
op's registry rule (``infer``) applied to its operands' types, so a built function is typed
exactly as the verifier will type it. :meth:`FunctionBuilder.apply` adds **sharding
propagation**: where the rule refuses the operands' layouts it inserts the collectives or
``redistribute`` that make them acceptable, in a fixed order of attempts (complete pending
sums; give elementwise operands one layout; align a matmul's contracted dim; unshard the dims
an op works along; replicate), the way DTensor redistributes its inputs. The frontend traces
Python through it and the autodiff pass emits the backward pass through it.

Pure: no MPI, no arrays. Spans: each op carries the span its caller gives (the frontend gives
the user's Python line), so a rule's error points there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dtm_mpi.errors import SourceSpan, VerifyError
from dtm_mpi.ir.nodes import (
    NO_SPAN,
    Attr,
    Function,
    Init,
    MeshDecl,
    Module,
    Op,
    Param,
    ResultSpec,
)
from dtm_mpi.ir.registry import FormatElem, OpContext, OpDef, Trait, lookup_op
from dtm_mpi.ir.types import DType, Layout, ReduceOp, TensorType

__all__ = ["FunctionBuilder", "Value", "complete_layout"]


@dataclass(frozen=True, slots=True)
class Value:
    """An SSA value of a function being built: its name (with ``%``) and type."""

    name: str
    type: TensorType


def complete_layout(layout: Layout) -> Layout:
    """``layout`` without its pending reduction (the layout of the completed value)."""
    return layout.with_partial(None)


def _attr_order(elems: Sequence[FormatElem], out: list[str]) -> list[str]:
    for el in elems:
        if el.kind == "opt":
            _attr_order(el.group, out)
        elif el.kind not in ("kw", "punct", "operand", "operands"):
            out.append(el.name)
    return out


_ATTR_ORDER: dict[str, tuple[str, ...]] = {}


def _ordered_attrs(opdef: OpDef, attrs: Mapping[str, Attr]) -> tuple[tuple[str, Attr], ...]:
    """``attrs`` in the op's format order, absent flags and None values left out (as the
    parser stores them)."""
    if not attrs:
        return ()
    order = _ATTR_ORDER.get(opdef.name)
    if order is None:
        order = _ATTR_ORDER[opdef.name] = tuple(_attr_order(opdef.format, []))
    unknown = [k for k in attrs if k not in order]
    assert not unknown, f"{opdef.name}: unknown attribute(s) {sorted(unknown)}"
    return tuple(
        (k, attrs[k])
        for k in order
        if k in attrs and attrs[k] is not None and attrs[k] is not False
    )


class FunctionBuilder:
    """Appends typed ops to a function body on ``mesh`` (None: no mesh)."""

    def __init__(
        self, mesh: MeshDecl | None, *, module_name: str = "built", names: Sequence[str] = ()
    ) -> None:
        self.mesh = mesh
        self.module = Module((1, 0), module_name, (mesh,) if mesh is not None else (), ())
        self.params: list[Param] = []
        self.ops: list[Op] = []
        self.types: dict[str, TensorType] = {}
        self._taken: set[str] = set(names)
        self._counter = 0
        self._repeats: dict[str, str] = {}  # a broadcast_to's result -> its operand
        self.gave_up: list[tuple[SourceSpan, str]] = []
        """Where propagation gave up on a sharded operand (the op ran on replicated values):
        the op's place and what happened, in the order met."""

    # --- names and values ------------------------------------------------------------------

    def fresh(self, hint: str = "t") -> str:
        """A value name not used yet, from ``hint`` (``%hint``, else ``%hint.N``)."""
        base = "%" + hint.lstrip("%")
        if base not in self._taken and base not in self.types:
            self._taken.add(base)
            return base
        while True:
            self._counter += 1
            name = f"{base}.{self._counter}"
            if name not in self._taken and name not in self.types:
                self._taken.add(name)
                return name

    def value(self, name: str) -> Value:
        return Value(name, self.types[name])

    def add_param(
        self,
        name: str,
        type: TensorType,
        *,
        state: bool = False,
        init: Init | None = None,
        span: SourceSpan = NO_SPAN,
    ) -> Value:
        name = "%" + name.lstrip("%")
        if name in self.types:
            raise VerifyError(f"parameter {name} is declared twice", span)
        self._taken.add(name)
        self.params.append(Param(name, type, state, init, span, span))
        self.types[name] = type
        return Value(name, type)

    def append(self, op: Op) -> tuple[Value, ...]:
        """Append an op built elsewhere (already typed; its result names must be new)."""
        for n in op.results:
            assert n not in self.types, f"value {n} defined twice"
            self._taken.add(n)
        self.ops.append(op)
        for n, t in zip(op.results, op.result_types, strict=True):
            self.types[n] = t
        opdef = lookup_op(op.name)
        if op.operands and opdef is not None and opdef.has(Trait.BROADCASTS):
            self._repeats[op.results[0]] = op.operands[0]
        return tuple(Value(n, t) for n, t in zip(op.results, op.result_types, strict=True))

    # --- emitting ops ----------------------------------------------------------------------

    def infer(
        self,
        name: str,
        operands: Sequence[Value],
        attrs: Mapping[str, Attr] = {},
        declared: Sequence[TensorType] = (),
        *,
        span: SourceSpan = NO_SPAN,
    ) -> tuple[TensorType, ...]:
        """The result types op ``name`` would have (raises the rule's :class:`VerifyError`)."""
        opdef = lookup_op(name)
        assert opdef is not None, f"unknown op {name!r}"
        op = self._op(
            opdef, ("%_",) * max(len(declared), 1), tuple(declared), operands, attrs, span
        )
        return opdef.infer(
            OpContext(op, [v.type for v in operands], declared, self.mesh, self.module)
        )

    def emit(
        self,
        name: str,
        operands: Sequence[Value],
        attrs: Mapping[str, Attr] = {},
        declared: Sequence[TensorType] = (),
        *,
        span: SourceSpan = NO_SPAN,
        hint: str | None = None,
    ) -> tuple[Value, ...]:
        """Append op ``name`` as given (no layout changes); its results, typed by its rule."""
        opdef = lookup_op(name)
        assert opdef is not None, f"unknown op {name!r}"
        types = self.infer(name, operands, attrs, declared, span=span)
        return self._emit_typed(opdef, types, operands, attrs, span, hint)

    def _emit_typed(
        self,
        opdef: OpDef,
        types: tuple[TensorType, ...],
        operands: Sequence[Value],
        attrs: Mapping[str, Attr],
        span: SourceSpan,
        hint: str | None,
    ) -> tuple[Value, ...]:
        results = tuple(self.fresh(hint or opdef.name) for _ in types)
        return self.append(self._op(opdef, results, types, operands, attrs, span))

    def emit1(
        self,
        name: str,
        operands: Sequence[Value],
        attrs: Mapping[str, Attr] = {},
        declared: Sequence[TensorType] = (),
        *,
        span: SourceSpan = NO_SPAN,
        hint: str | None = None,
    ) -> Value:
        (out,) = self.emit(name, operands, attrs, declared, span=span, hint=hint)
        return out

    def _op(
        self,
        opdef: OpDef,
        results: tuple[str, ...],
        types: tuple[TensorType, ...],
        operands: Sequence[Value],
        attrs: Mapping[str, Attr],
        span: SourceSpan,
    ) -> Op:
        ordered = _ordered_attrs(opdef, attrs)
        return Op(
            opdef.name,
            results,
            types,
            tuple([v.name for v in operands]),
            ordered,
            span,
            (span,) * len(results),
            (span,) * len(operands),
            (span,) * len(types),
            tuple([(k, span) for k, _ in ordered]) if ordered else (),
        )

    def apply(
        self,
        name: str,
        operands: Sequence[Value],
        attrs: Mapping[str, Attr] = {},
        declared: Sequence[TensorType] = (),
        *,
        span: SourceSpan = NO_SPAN,
        hint: str | None = None,
    ) -> tuple[Value, ...]:
        """Append op ``name``, first changing its operands' layouts where its rule refuses
        them (sharding propagation, in the order of the module docstring). The first
        rule's error is raised if no attempt is accepted."""
        opdef = lookup_op(name)
        assert opdef is not None, f"unknown op {name!r}"
        first: VerifyError | None = None
        mark = len(self.ops)
        for attempt in _ATTEMPTS:
            try:
                xs = attempt(self, opdef, list(operands), attrs, declared, span)
                if xs is None:
                    continue
                types = self.infer(name, xs, attrs, declared, span=span)
            except VerifyError as err:
                first = first or err
                self._rollback(mark)
                continue
            if attempt is _replicated:
                self._note_replicated(name, operands, span)
            return self._emit_typed(opdef, types, xs, attrs, span, hint)
        assert first is not None
        raise first

    def _note_replicated(self, name: str, operands: Sequence[Value], span: SourceSpan) -> None:
        split = [x for x in operands if x.type.layout.sharded_axes]
        if not split:
            return
        moved = ", ".join(f"{x.name} {x.type}" for x in split)
        self.gave_up.append(
            (
                span,
                f"{name} ran replicated: no sharding rule takes {moved} as it is split, so every rank gathers the whole value (reshape or redistribute it first to keep it split)",
            )
        )

    def _rollback(self, mark: int) -> None:
        """Drop the ops appended after the first ``mark`` (an attempt that failed)."""
        for op in self.ops[mark:]:
            for n in op.results:
                del self.types[n]
                self._repeats.pop(n, None)
        del self.ops[mark:]

    def apply1(
        self,
        name: str,
        operands: Sequence[Value],
        attrs: Mapping[str, Attr] = {},
        declared: Sequence[TensorType] = (),
        *,
        span: SourceSpan = NO_SPAN,
        hint: str | None = None,
    ) -> Value:
        (out,) = self.apply(name, operands, attrs, declared, span=span, hint=hint)
        return out

    # --- layouts ---------------------------------------------------------------------------

    def complete(self, v: Value, *, span: SourceSpan = NO_SPAN) -> Value:
        """``v`` with its pending reduction completed (an ``allreduce``; ``v`` if none). A
        broadcast of a pending value is completed before it repeats: the operand reduced, then
        broadcast again (the same values; the reduction moves the operand's bytes, not the
        repeat's)."""
        p = v.type.layout.partial
        if p is None:
            return v
        src = self._repeats.get(v.name)
        if src is not None:
            small = self.complete(self.value(src), span=span)
            done = v.type.with_layout(complete_layout(v.type.layout))
            return self.emit1("broadcast_to", [small], declared=[done], span=span, hint=v.name)
        return self.emit1(
            "allreduce", [v], {"op": p.op.value, "axes": p.axes}, span=span, hint=v.name
        )

    def to_layout(self, v: Value, layout: Layout, *, span: SourceSpan = NO_SPAN) -> Value:
        """The same global value in ``layout``: a pending sum completed by ``reduce_scatter``
        where it lands on one dim as that dim's innermost axes, else ``allreduce``; a dim
        gathered by ``allgather`` where only that changes; anything else ``redistribute``."""
        t = v.type
        if t.layout == layout:
            return v
        from dtm_mpi.ir.verify import check_layout  # verify loads the ops, which use this module

        check_layout(t.with_layout(layout), self.mesh, span, "layout")
        p = t.layout.partial
        if p is not None and layout.partial is None and p.op is ReduceOp.SUM:
            grown = [
                d for d, (a, b) in enumerate(zip(t.layout.dims, layout.dims, strict=True)) if a != b
            ]
            if len(grown) == 1 and layout.dims[grown[0]] == t.layout.dims[grown[0]] + p.axes:
                return self.emit1(
                    "reduce_scatter",
                    [v],
                    {"op": "sum", "axes": p.axes, "dim": grown[0]},
                    span=span,
                    hint=v.name,
                )
            v = self.complete(v, span=span)
            t = v.type
            if t.layout == layout:
                return v
        if t.layout.partial == layout.partial:
            diff = [
                d for d, (a, b) in enumerate(zip(t.layout.dims, layout.dims, strict=True)) if a != b
            ]
            if len(diff) == 1:
                have, want = t.layout.dims[diff[0]], layout.dims[diff[0]]
                if have[: len(want)] == want and len(have) > len(want):
                    return self.emit1(
                        "allgather", [v], {"axes": have[len(want) :]}, span=span, hint=v.name
                    )
        return self.emit1(
            "redistribute", [v], declared=[t.with_layout(layout)], span=span, hint=v.name
        )

    def constant(
        self, value: float | int | bool, like: TensorType, *, span: SourceSpan = NO_SPAN
    ) -> Value:
        """A splat constant of ``like``'s dtype, shape and dims (never pending)."""
        if like.dtype.is_float:
            lit: Attr = float(value)
        elif like.dtype is DType.BOOL:
            lit = bool(value)
        else:
            lit = int(value)
        t = like.with_layout(complete_layout(like.layout))
        return self.emit1("constant", [], {"value": lit}, [t], span=span, hint="c")

    # --- finishing -------------------------------------------------------------------------

    def function(
        self,
        name: str,
        returns: Sequence[Value | tuple[Value, str | None]],
        *,
        entry: bool = False,
        requires: Sequence[str] = (),
        span: SourceSpan = NO_SPAN,
    ) -> Function:
        """The function built so far, returning ``returns`` (a value, or (value, the state
        parameter it updates))."""
        results, names = [], []
        for r in returns:
            v, updates = r if isinstance(r, tuple) else (r, None)
            results.append(ResultSpec(v.type, updates, span))
            names.append(v.name)
        return Function(
            name,
            tuple(self.params),
            tuple(results),
            tuple(self.ops),
            tuple(names),
            entry,
            self.mesh.name if self.mesh is not None else None,
            tuple(requires),
            span,
            span,
            (span,) * len(names),
            span,
            (span,) * len(requires),
        )


# --- sharding propagation: the attempts, in order ----------------------------------------------

Attempt = Callable[
    [FunctionBuilder, OpDef, list[Value], Mapping[str, Attr], Sequence[TensorType], SourceSpan],
    "list[Value] | None",
]


def _as_given(
    b: FunctionBuilder,
    d: OpDef,
    xs: list[Value],
    attrs: Mapping[str, Attr],
    declared: Sequence[TensorType],
    span: SourceSpan,
) -> list[Value] | None:
    return xs


def _completed(
    b: FunctionBuilder,
    d: OpDef,
    xs: list[Value],
    attrs: Mapping[str, Attr],
    declared: Sequence[TensorType],
    span: SourceSpan,
) -> list[Value] | None:
    if all(x.type.layout.partial is None for x in xs):
        return None
    return [b.complete(x, span=span) for x in xs]


def _most_sharded(xs: Sequence[Value]) -> Layout:
    best = max(xs, key=lambda x: (x.type.rank, len(x.type.layout.sharded_axes)))
    return complete_layout(best.type.layout)


def _common_layout(
    b: FunctionBuilder,
    d: OpDef,
    xs: list[Value],
    attrs: Mapping[str, Attr],
    declared: Sequence[TensorType],
    span: SourceSpan,
) -> list[Value] | None:
    """Elementwise ops: every operand in the layout of the most sharded one. A pending sum
    stays pending where the op is linear in it and the other operands share its dims."""
    if not d.has(Trait.ELEMENTWISE) or len({x.type.shape for x in xs}) != 1:
        return None
    target = _most_sharded(xs)
    return [b.to_layout(b.complete(x, span=span), target, span=span) for x in xs]


def _matmul_aligned(
    b: FunctionBuilder,
    d: OpDef,
    xs: list[Value],
    attrs: Mapping[str, Attr],
    declared: Sequence[TensorType],
    span: SourceSpan,
) -> list[Value] | None:
    """matmul: batch dims and the contracted dim of the rhs as the lhs has them; the rhs's N
    keeps its axes unless the lhs already uses them."""
    if d.name != "matmul" or len(xs) != 2 or min(x.type.rank for x in xs) < 2:
        return None
    lhs = (
        b.complete(xs[0], span=span)
        if xs[0].type.layout.partial and xs[1].type.layout.partial
        else xs[0]
    )
    ld = lhs.type.layout.dims
    used = {a for dims in ld for a in dims} | set(
        lhs.type.layout.partial.axes if lhs.type.layout.partial else ()
    )
    rhs = b.complete(xs[1], span=span) if lhs.type.layout.partial else xs[1]
    rd = rhs.type.layout.dims
    n_axes = tuple(a for a in rd[-1] if a not in used)
    want = Layout((*ld[:-2], ld[-1], n_axes), rhs.type.layout.partial)
    rp = rhs.type.layout.partial
    if rp is not None and set(rp.axes) & (used | set(n_axes)):
        rhs = b.complete(rhs, span=span)
        want = complete_layout(want)
    if rhs.type.rank != lhs.type.rank:
        return None
    return [lhs, b.to_layout(rhs, want, span=span)]


def _unsharded_along(
    b: FunctionBuilder,
    d: OpDef,
    xs: list[Value],
    attrs: Mapping[str, Attr],
    declared: Sequence[TensorType],
    span: SourceSpan,
) -> list[Value] | None:
    """Ops that work along a dim (``dim``, or the last dim for a row-wise op such as
    ``layer_norm``): that dim unsharded in every operand of full rank, pending sums completed."""
    dims: list[int] = []
    if isinstance(attrs.get("dim"), int):
        dims.append(int(attrs["dim"]))  # type: ignore[arg-type]
    if d.has(Trait.ROWWISE):
        dims.append(-1)
    if d.name == "slice" and xs:  # the dims the box cuts
        start, limit = attrs.get("start"), attrs.get("limit")
        if isinstance(start, tuple) and isinstance(limit, tuple):
            dims += [
                i
                for i, (a, b, n) in enumerate(zip(start, limit, xs[0].type.shape, strict=False))
                if (a, b) != (0, n)
            ]
    if not dims:
        return None
    out = []
    for given in xs:
        x = b.complete(given, span=span)
        lay = list(x.type.layout.dims)
        for dim in dims:
            if -x.type.rank <= dim < x.type.rank:
                lay[dim] = ()
        out.append(b.to_layout(x, Layout(tuple(lay)), span=span))
    return out


def _replicated(
    b: FunctionBuilder,
    d: OpDef,
    xs: list[Value],
    attrs: Mapping[str, Attr],
    declared: Sequence[TensorType],
    span: SourceSpan,
) -> list[Value] | None:
    if all(x.type.layout.is_replicated and x.type.layout.partial is None for x in xs):
        return None
    return [b.to_layout(x, Layout.replicated(x.type.rank), span=span) for x in xs]


_ATTEMPTS: tuple[Attempt, ...] = (
    _as_given,
    _completed,
    _common_layout,
    _matmul_aligned,
    _unsharded_along,
    _replicated,
)
