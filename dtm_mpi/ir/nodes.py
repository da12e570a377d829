"""The IR's syntax tree: frozen, slotted values. Source spans are carried for diagnostics but
take no part in equality, so ``parse(print(m)) == m``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

from dtm_mpi.errors import SourceSpan
from dtm_mpi.ir.types import TensorType

__all__ = [
    "Attr",
    "Function",
    "Init",
    "InitKind",
    "MeshDecl",
    "Module",
    "Op",
    "Param",
    "ResultSpec",
    "NO_SPAN",
    "new_op",
]

NO_SPAN = SourceSpan("<none>", 0, 0)

# An attribute value: ints, floats, strings (axis names, enum words, symbols), flags (bool),
# lists of ints or names, and nested numeric literals (constant data).
Attr = int | float | str | bool | tuple["Attr", ...] | None


@dataclass(frozen=True, slots=True)
class MeshDecl:
    name: str
    axes: tuple[tuple[str, int], ...]
    span: SourceSpan = field(default=NO_SPAN, compare=False)
    axis_spans: tuple[tuple[SourceSpan, SourceSpan], ...] = field(default=(), compare=False)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    def size_of(self, axis: str) -> int:
        return dict(self.axes)[axis]


class InitKind(enum.Enum):
    ZEROS = "zeros"
    ONES = "ones"
    NORMAL = "normal"
    UNIFORM = "uniform"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class Init:
    """How an entry parameter gets its first value when no input supplies it."""

    kind: InitKind
    params: tuple[tuple[str, int | float], ...] = ()

    def get(self, key: str, default: float) -> float:
        return float(dict(self.params).get(key, default))


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    type: TensorType
    state: bool = False
    init: Init | None = None
    span: SourceSpan = field(default=NO_SPAN, compare=False)
    type_span: SourceSpan = field(default=NO_SPAN, compare=False)


@dataclass(frozen=True, slots=True)
class ResultSpec:
    type: TensorType
    updates: str | None = None
    span: SourceSpan = field(default=NO_SPAN, compare=False)


@dataclass(frozen=True, slots=True)
class Op:
    name: str
    results: tuple[str, ...]
    result_types: tuple[TensorType, ...]
    operands: tuple[str, ...]
    attrs: tuple[tuple[str, Attr], ...]
    span: SourceSpan = field(default=NO_SPAN, compare=False)
    result_spans: tuple[SourceSpan, ...] = field(default=(), compare=False)
    operand_spans: tuple[SourceSpan, ...] = field(default=(), compare=False)
    type_spans: tuple[SourceSpan, ...] = field(default=(), compare=False)
    attr_spans: tuple[tuple[str, SourceSpan], ...] = field(default=(), compare=False)

    def attr(self, key: str) -> Attr:
        for k, v in self.attrs:
            if k == key:
                return v
        return None

    def attr_span(self, key: str) -> SourceSpan:
        for k, s in self.attr_spans:
            if k == key:
                return s
        return self.span


_OP_FIELDS = (
    "name",
    "results",
    "result_types",
    "operands",
    "attrs",
    "span",
    "result_spans",
    "operand_spans",
    "type_spans",
    "attr_spans",
)
assert tuple(f.name for f in fields(Op)) == _OP_FIELDS, "new_op must list Op's fields in order"
_NEW = object.__new__
(
    _s_name,
    _s_results,
    _s_rtypes,
    _s_operands,
    _s_attrs,
    _s_span,
    _s_rspans,
    _s_ospans,
    _s_tspans,
    _s_aspans,
) = (getattr(Op, f).__set__ for f in _OP_FIELDS)


def new_op(
    name: str,
    results: tuple[str, ...],
    result_types: tuple[TensorType, ...],
    operands: tuple[str, ...],
    attrs: tuple[tuple[str, Attr], ...],
    span: SourceSpan,
    result_spans: tuple[SourceSpan, ...],
    operand_spans: tuple[SourceSpan, ...],
    type_spans: tuple[SourceSpan, ...],
    attr_spans: tuple[tuple[str, SourceSpan], ...],
) -> Op:
    """``Op(...)`` with every field given, built through the slot descriptors: a third of the
    cost of the frozen dataclass ``__init__`` (ten ``object.__setattr__`` calls), which matters
    for the parser's fast path on 100,000-op modules. The result is an ordinary ``Op``."""
    op: Op = _NEW(Op)
    _s_name(op, name)
    _s_results(op, results)
    _s_rtypes(op, result_types)
    _s_operands(op, operands)
    _s_attrs(op, attrs)
    _s_span(op, span)
    _s_rspans(op, result_spans)
    _s_ospans(op, operand_spans)
    _s_tspans(op, type_spans)
    _s_aspans(op, attr_spans)
    return op


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    params: tuple[Param, ...]
    results: tuple[ResultSpec, ...]
    body: tuple[Op, ...]
    returns: tuple[str, ...]
    entry: bool = False
    mesh: str | None = None
    requires: tuple[str, ...] = ()
    span: SourceSpan = field(default=NO_SPAN, compare=False)
    return_span: SourceSpan = field(default=NO_SPAN, compare=False)
    return_spans: tuple[SourceSpan, ...] = field(default=(), compare=False)
    mesh_span: SourceSpan = field(default=NO_SPAN, compare=False)
    requires_spans: tuple[SourceSpan, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class Module:
    version: tuple[int, int]
    name: str
    meshes: tuple[MeshDecl, ...]
    functions: tuple[Function, ...]
    span: SourceSpan = field(default=NO_SPAN, compare=False)

    def function(self, name: str) -> Function | None:
        for f in self.functions:
            if f.name == name:
                return f
        return None

    def mesh(self, name: str) -> MeshDecl | None:
        for m in self.meshes:
            if m.name == name:
                return m
        return None

    @property
    def entry(self) -> Function | None:
        for f in self.functions:
            if f.entry:
                return f
        return None
