"""The one op registry: each op declares, in one place, its text form (a small declarative
format from which both the parser and the printer are derived), its shape and sharding rule
(``infer``), its numpy reference semantics on global values (``reference``), its kind (how
the planner and the executor run it: :class:`OpKind`), its traits (:class:`Trait`), the
pending reductions it is linear in (``linear_in``) and, for elementwise ops, its array
function (``array_fn``, written against any numpy-like namespace) and the C expression of the
generated GPU kernels (``c_expr``), and its gradient rule (``grad``, used by
:mod:`dtm_mpi.ir.autodiff`). Every other per-op table (the executor's communication
ops, the fusible ops, the C expressions, the reference interpreter's identities) is derived
from here: passes ask the kind or a trait, never a list of names.

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

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dtm_mpi.errors import SourceSpan, VerifyError
from dtm_mpi.ir.nodes import MeshDecl, Module, Op
from dtm_mpi.ir.types import ReduceOp, TensorType

if TYPE_CHECKING:
    import numpy as np

    from dtm_mpi.ir.grad_context import GradRule

__all__ = [
    "OPS",
    "FormatElem",
    "OpContext",
    "OpDef",
    "OpKind",
    "Trait",
    "all_ops",
    "lookup_op",
    "ops_of_kind",
    "ops_with",
    "register_op",
    "required_version",
]


class OpKind(enum.Enum):
    """How an op runs: what the planner makes of it and what the reference does with it."""

    LOCAL = "local"
    """Computed by a backend kernel from the rank's local blocks."""
    REDIST = "redist"
    """A layout change (collectives, ``redistribute``): the identity on global values, run
    as the redistribution plan from the operand's type to the result's layout."""
    BROADCAST = "broadcast"
    """Every rank takes the root's block along mesh axes (the identity on global values)."""
    SEND = "send"
    """Point-to-point: send blocks to another coordinate of an axis (no result)."""
    RECV = "recv"
    """Point-to-point: the paired send's blocks (``partial(sum)`` over the axis)."""
    CALL = "call"
    """The results of another function of the module."""

    @property
    def is_local(self) -> bool:
        return self is OpKind.LOCAL

    @property
    def is_identity(self) -> bool:
        """The identity on global values (only the layout changes)."""
        return self in (OpKind.REDIST, OpKind.BROADCAST)


class Trait(enum.Enum):
    """Facts about an op that passes ask instead of lists of names."""

    ELEMENTWISE = "elementwise"
    """Operands share one shape and layout; a block of the result is the op of the blocks."""
    FUSIBLE = "fusible"
    """Elementwise with a C expression: on float dtypes it may join a generated GPU kernel."""
    FLOAT_ONLY = "float_only"
    """Operands must be floating (the rule rejects others)."""
    NEEDS_STEP = "needs_step"
    """The value depends on the executor's step (``step_index``)."""
    LINEAR_ONE_SIDE = "linear_one_side"
    """A binary op linear in each operand alone (``mul``): one side may be pending."""
    LINEAR_FIRST = "linear_first"
    """A binary op linear in its first operand only, on floats (``div``)."""
    SUMS = "sums"
    """Adds float values in an order the mesh decides: across ranks (its result is a pending
    sum over the axes of a sharded dim it sums) or by a kernel whose order follows the block's
    shape (a BLAS matmul). Deterministic mode computes it by its exact rule (:attr:`OpDef.exact`,
    attached by :mod:`dtm_mpi.kernels.exact`), the same bits on every mesh."""
    REDUCTION = "reduction"
    """Reduces its operand over the dims of attribute ``dims`` (``sum``, ``mean``, ``max``,
    ``min``): backends register one reduction kernel for each."""
    ROWWISE = "rowwise"
    """Normalises each row along the last dim (``layer_norm``, ``rms_norm``): that dim must be
    unsharded (the builder gathers it where it is split)."""
    BROADCASTS = "broadcasts"
    """The result repeats the operand along the result's leading dims (numpy broadcasting,
    ``broadcast_to``): a generated kernel may read a vector operand as ``v[i % cols]``
    instead of running the op."""


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
        mesh: MeshDecl | None,
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


ShardExtents = Callable[[int, tuple[str, ...]], Sequence[tuple[int, int]]]
"""``(size, axes)`` -> ``(start, length)`` of every shard of a dimension of that size split over
those mesh axes of the bound mesh, in shard order (what the planner gives a plan check)."""

PlanCheck = Callable[[Op, Sequence[TensorType], ShardExtents], "str | None"]
"""A rule that depends on the bound mesh's sizes (which ``--mesh`` may change after ``dtm
check``): ``check(op, operand types, extents)`` gives the broken rule's message, else None.
The planner runs it on every rank before any communication and reports it at the op."""
FlopsFn = Callable[[Sequence[TensorType], Sequence[TensorType]], int]
"""An op's floating-point operations from its operand and result types (:attr:`OpDef.flops`)."""

ArrayFn = Callable[..., Any]
"""An elementwise op's array function: ``fn(xp, *arrays)`` with ``xp`` numpy or a namespace
like it (CuPy), so one definition serves the reference and every array backend."""


@dataclass(frozen=True, slots=True)
class OpDef:
    """One op: its name, text format, result count (``-1``: variadic), rules and semantics,
    kind and traits."""

    name: str
    format: tuple[FormatElem, ...]
    n_results: int
    infer: InferFn
    reference: RefFn
    capability: str | None = None
    doc: str = ""
    kind: OpKind = OpKind.LOCAL
    traits: frozenset[Trait] = frozenset()
    linear_in: frozenset[ReduceOp] = frozenset()
    """The pending reductions the op passes through (elementwise rules read it): a unary op
    of ``partial(op: A)`` gives ``partial(op: A)``; a binary op needs both operands pending
    alike unless a ``LINEAR_*`` trait says otherwise."""
    c_expr: str | None = None
    """The C expression of the generated kernels (``{0}``, ``{1}``: the operands), over the
    device helpers of ``kernels/dtm_common.cuh``; None where the op is not generated."""
    array_fn: ArrayFn | None = None
    ufunc: str | None = None
    """The name of the numpy (and CuPy) ufunc that is the op on operands of its result's dtype
    (its array function calls it): the CPU's fused chains call it with ``out=`` a buffer they
    reuse. None where the op is not one ufunc."""
    plan_check: PlanCheck | None = None
    grad: GradRule | None = None
    """The gradient rule (:mod:`dtm_mpi.ir.grad_context`): the operands' cotangents from the
    results'. None: a gradient cannot flow through the op (the reverse pass says so)."""
    exact_attrs: bool = True
    """No float or literal attributes: equal attribute tuples then print and infer alike, so
    the printer and verifier may cache by them (``0.0 == -0.0`` and ``1 == 1.0`` otherwise
    make equal keys for different ops)."""
    since: tuple[int, int] = (1, 0)
    """The IR version that introduced the op: a module using it must declare that version
    or a later one (the verifier checks; builders declare the least version their ops need)."""
    form_attrs: tuple[tuple[str, str], ...] = ()
    """The enum attributes an elementwise op's array function and C expression read, each with
    the value its absence means (``gelu``'s ``approximate``, ``tanh``): passed to the array
    function as keywords and to the C expression's ``str.format`` by name (:meth:`form`)."""
    attr_since: tuple[tuple[str, tuple[int, int]], ...] = ()
    """Attributes newer than the op, with the IR version that introduced each: a module that
    writes one must declare that version or a later one."""
    flops: FlopsFn | None = None
    """The floating-point operations of one application (its operand and result types, the
    global shapes): a multiply-add counts two. Ops without it count none (what a model's
    FLOPs and MFU count, as the papers do: the contractions)."""
    exact: object | None = None
    """Deterministic mode's exact form of an op that sums floats (:data:`Trait.SUMS`): an
    ``ExactRule`` attached by :mod:`dtm_mpi.kernels.exact` (:func:`attach_exact`), as backends
    register their kernels (the IR layer does not import the kernels)."""

    def has(self, trait: Trait) -> bool:
        return trait in self.traits

    def form(self, op: Op) -> dict[str, str]:
        """The values of :attr:`form_attrs` on ``op`` (the default where one is absent)."""
        out: dict[str, str] = {}
        for key, default in self.form_attrs:
            v = op.attr(key)
            out[key] = default if v is None else str(v)
        return out

    def forms(self) -> tuple[dict[str, str], ...]:
        """Every form of the op: each combination of its form attributes' enum values (one
        empty form for an op without them)."""
        out: list[dict[str, str]] = [{}]
        for key, _ in self.form_attrs:
            choices = _choices(self.format, key)
            out = [{**f, key: c} for f in out for c in choices]
        return tuple(out)

    def since_for(self, op: Op) -> tuple[int, int]:
        """The least IR version ``op`` needs: the op's own, or that of a newer attribute it
        writes."""
        present = set(self.optional_operands(op))
        newer = [v for k, v in self.attr_since if op.attr(k) is not None or k in present]
        return max([self.since, *newer])

    def optional_operands(self, op: Op) -> tuple[str, ...]:
        """The names of the optional operands (``?( kw $name:operand )`` groups) ``op``
        writes: those beyond the required ones, in format order."""
        if self.arity < 0:
            return ()
        return _optional_operand_names(self.format)[: max(0, len(op.operands) - self.arity)]

    @property
    def arity(self) -> int:
        """The number of single operands of the format (``-1``: a variadic operand list)."""
        return _arity(self.format)


def _optional_operand_names(elems: tuple[FormatElem, ...]) -> tuple[str, ...]:
    return tuple(
        g.name for el in elems if el.kind == "opt" for g in el.group if g.kind == "operand"
    )


def _choices(elems: tuple[FormatElem, ...], key: str) -> tuple[str, ...]:
    for el in elems:
        found = el.choices if el.name == key else _choices(el.group, key)
        if found:
            return found
    return ()


def _arity(elems: tuple[FormatElem, ...]) -> int:
    n = 0
    for el in elems:
        if el.kind == "operands":
            return -1
        n += el.kind == "operand"
    return n


OPS: dict[str, OpDef] = {}


def register_op(
    name: str,
    fmt: str,
    *,
    results: int = 1,
    reference: RefFn,
    capability: str | None = None,
    doc: str = "",
    kind: OpKind = OpKind.LOCAL,
    traits: frozenset[Trait] = frozenset(),
    linear_in: frozenset[ReduceOp] = frozenset(),
    c_expr: str | None = None,
    array_fn: ArrayFn | None = None,
    ufunc: str | None = None,
    plan_check: PlanCheck | None = None,
    grad: GradRule | None = None,
    since: tuple[int, int] = (1, 0),
    form_attrs: tuple[tuple[str, str], ...] = (),
    attr_since: tuple[tuple[str, tuple[int, int]], ...] = (),
    flops: FlopsFn | None = None,
) -> Callable[[InferFn], InferFn]:
    """Decorator registering ``infer`` as the shape+sharding rule of op ``name``. With
    ``ufunc`` (and no ``array_fn``) the array function calls that ufunc of its namespace."""

    def deco(infer: InferFn) -> InferFn:
        assert name not in OPS, f"op {name!r} registered twice"
        elems = _parse_format(fmt)
        assert (Trait.FUSIBLE in traits) == (c_expr is not None), f"{name}: fusible iff c_expr"
        assert Trait.FUSIBLE not in traits or Trait.ELEMENTWISE in traits, name
        assert kind is OpKind.LOCAL or not traits, f"{name}: traits are for local ops"
        assert ufunc is None or array_fn is None, f"{name}: the ufunc is its array function"
        assert not form_attrs or (array_fn is not None and c_expr is not None), name
        assert all(d in _choices(elems, k) for k, d in form_attrs), f"{name}: form attributes"
        OPS[name] = OpDef(
            name,
            elems,
            results,
            infer,
            reference,
            capability,
            doc,
            kind,
            frozenset(traits),
            frozenset(linear_in),
            c_expr,
            array_fn if ufunc is None else _ufunc_fn(ufunc),
            ufunc,
            plan_check,
            grad,
            exact_attrs=not _has_inexact(elems),
            since=since,
            form_attrs=form_attrs,
            flops=flops,
            attr_since=attr_since,
        )
        return infer

    return deco


def _ufunc_fn(name: str) -> ArrayFn:
    def call(xp: Any, *xs: Any) -> Any:
        return getattr(xp, name)(*xs)

    return call


def attach_exact(name: str, rule: object) -> None:
    """Attach deterministic mode's exact form to op ``name``, which must sum floats."""
    op = all_ops()[name]
    assert op.has(Trait.SUMS), f"{name}: an exact rule for an op that does not sum floats"
    OPS[name] = replace(op, exact=rule)


def _has_inexact(elems: tuple[FormatElem, ...]) -> bool:
    return any(el.kind in ("float", "literal") or _has_inexact(el.group) for el in elems)


def lookup_op(name: str) -> OpDef | None:
    _load_ops()
    return OPS.get(name)


def all_ops() -> dict[str, OpDef]:
    """Every registered op (loading the registry on first use)."""
    _load_ops()
    return OPS


def required_version(ops: Iterable[Op], least: tuple[int, int] = (1, 0)) -> tuple[int, int]:
    """The least IR version a module holding ``ops`` may declare (at least ``least``)."""
    _load_ops()
    return max([least, *(OPS[op.name].since_for(op) for op in ops if op.name in OPS)])


def ops_of_kind(*kinds: OpKind) -> frozenset[str]:
    """The names of the ops of these kinds."""
    return frozenset(n for n, d in all_ops().items() if d.kind in kinds)


def ops_with(trait: Trait) -> frozenset[str]:
    """The names of the ops with ``trait``."""
    return frozenset(n for n, d in all_ops().items() if trait in d.traits)


def _load_ops() -> None:
    if not OPS:
        from dtm_mpi.ir import ops  # noqa: F401  (registers every op)
