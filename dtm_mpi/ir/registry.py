"""The one op registry: each op declares, in one place, its text form (a small declarative
format from which both the parser and the printer are derived), its shape and sharding rule
(``infer``) and its numpy reference semantics on global values (``reference``).

Format strings are whitespace-separated elements:

``$name:operand``            one SSA operand           ``$name:operands``  ``%a, %b, ...``
``$name:symbol``             ``@callee``               ``$name:int`` / ``$name:float``
``$name:ints``               ``[1, 2]``                ``$name:axes``      ``tp`` or ``[dp, tp]``
``$name:enum(a|b)``          one of the words          ``$name:flag(word)`` optional word
``$name:literal``            nested numeric literal    ``?( kw ... )``     optional group,
                                                                             present iff ``kw``
anything else                a literal keyword or punctuation token
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtm_mpi.errors import SourceSpan, VerifyError
from dtm_mpi.ir.nodes import Mesh, Module, Op
from dtm_mpi.ir.types import TensorType

if TYPE_CHECKING:
    import numpy as np

__all__ = ["OPS", "FormatElem", "OpContext", "OpDef", "lookup_op", "register_op"]


@dataclass(frozen=True, slots=True)
class FormatElem:
    kind: str
    name: str = ""
    choices: tuple[str, ...] = ()
    group: tuple[FormatElem, ...] = ()


def _parse_format(text: str) -> tuple[FormatElem, ...]:
    words = text.split()
    elems, pos = _parse_elems(words, 0, top=True)
    assert pos == len(words), f"bad op format {text!r}"
    return elems


def _parse_elems(words: list[str], pos: int, *, top: bool) -> tuple[tuple[FormatElem, ...], int]:
    out: list[FormatElem] = []
    while pos < len(words):
        word = words[pos]
        if word == ")" and not top:
            return tuple(out), pos + 1
        if word == "?(":
            group, pos = _parse_elems(words, pos + 1, top=False)
            assert group and group[0].kind == "kw", "an optional group must start with a keyword"
            out.append(FormatElem("opt", group=group))
            continue
        if word.startswith("$"):
            name, _, kind = word[1:].partition(":")
            choices: tuple[str, ...] = ()
            if "(" in kind:
                kind, _, rest = kind.partition("(")
                choices = tuple(rest.rstrip(")").split("|"))
            assert kind in _KINDS, f"unknown format kind {kind!r}"
            out.append(FormatElem(kind, name, choices))
        elif word[0].isalpha():
            out.append(FormatElem("kw", word))
        else:
            out.append(FormatElem("punct", word))
        pos += 1
    assert top, "unclosed ?( group"
    return tuple(out), pos


_KINDS = {
    "operand",
    "operands",
    "symbol",
    "int",
    "ints",
    "float",
    "axes",
    "enum",
    "flag",
    "literal",
}


class OpContext:
    """What an op's ``infer`` rule sees: its operands' types, attributes, the declared result
    types, the function's mesh and the module (for calls). ``error`` builds a diagnostic."""

    __slots__ = ("declared", "mesh", "module", "op", "operand_types")

    def __init__(
        self,
        op: Op,
        operand_types: Sequence[TensorType],
        declared: Sequence[TensorType],
        mesh: Mesh | None,
        module: Module,
    ) -> None:
        self.op = op
        self.operand_types = tuple(operand_types)
        self.declared = tuple(declared)
        self.mesh = mesh
        self.module = module

    def attr(self, key: str) -> Any:
        return self.op.attr(key)

    def error(self, message: str, span: SourceSpan | None = None) -> VerifyError:
        return VerifyError(f"{self.op.name}: {message}", span or self.op.span)

    def operand_error(self, index: int, message: str) -> VerifyError:
        spans = self.op.operand_spans
        return self.error(message, spans[index] if index < len(spans) else None)

    def attr_error(self, key: str, message: str) -> VerifyError:
        return self.error(message, self.op.attr_span(key))

    def result_error(self, index: int, message: str) -> VerifyError:
        spans = self.op.type_spans
        return self.error(message, spans[index] if index < len(spans) else None)

    def axis_size(self, axis: str) -> int:
        assert self.mesh is not None
        return self.mesh.size_of(axis)


InferFn = Callable[[OpContext], tuple[TensorType, ...]]
RefFn = Callable[[Op, Sequence["np.ndarray"], Sequence[TensorType]], tuple["np.ndarray", ...]]


@dataclass(frozen=True, slots=True)
class OpDef:
    """One op: its name, text format, result count (``-1``: variadic), rules and semantics."""

    name: str
    format: tuple[FormatElem, ...]
    n_results: int
    infer: InferFn
    reference: RefFn
    capability: str | None = None
    doc: str = ""
    linear_in: tuple[str, ...] = field(default=())
    exact_attrs: bool = True
    """No float or literal attributes: equal attribute tuples then print and infer alike, so
    the printer and verifier may cache by them (``0.0 == -0.0`` and ``1 == 1.0`` otherwise
    make equal keys for different ops)."""


OPS: dict[str, OpDef] = {}


def register_op(
    name: str,
    fmt: str,
    *,
    results: int = 1,
    reference: RefFn,
    capability: str | None = None,
    doc: str = "",
) -> Callable[[InferFn], InferFn]:
    """Decorator registering ``infer`` as the shape+sharding rule of op ``name``."""

    def deco(infer: InferFn) -> InferFn:
        assert name not in OPS, f"op {name!r} registered twice"
        elems = _parse_format(fmt)
        OPS[name] = OpDef(
            name, elems, results, infer, reference, capability, doc,
            exact_attrs=not _has_inexact(elems),
        )  # fmt: skip
        return infer

    return deco


def _has_inexact(elems: tuple[FormatElem, ...]) -> bool:
    return any(el.kind in ("float", "literal") or _has_inexact(el.group) for el in elems)


def lookup_op(name: str) -> OpDef | None:
    _load_ops()
    return OPS.get(name)


def _load_ops() -> None:
    if not OPS:
        from dtm_mpi.ir import ops  # noqa: F401  (registers every op)
