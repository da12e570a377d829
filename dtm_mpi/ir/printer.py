"""The canonical text form of a module. ``parse(print(m)) == m`` for every module, and the
canonical form with positional value names is what ``module_hash`` hashes. (A ``nan``
literal round-trips to ``nan``, though ``nan != nan`` makes the two modules compare unequal.)"""

from __future__ import annotations

import re

from dtm_mpi.ir.nodes import Attr, Function, Init, Module, Op, Param, ResultSpec
from dtm_mpi.ir.registry import FormatElem, lookup_op
from dtm_mpi.ir.types import TensorType

__all__ = ["format_attr_number", "print_module"]

_NO_SPACE_BEFORE = {",", ")", "]"}
_NO_SPACE_AFTER = {"(", "["}


def format_attr_number(value: float | int) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = repr(float(value))
    return text


def _literal(value: Attr) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    assert isinstance(value, int | float)
    return format_attr_number(value)


def _join(parts: list[str]) -> str:
    out: list[str] = []
    for part in parts:
        glued = part in _NO_SPACE_BEFORE or (part == "(" and out and out[-1].startswith("@"))
        if out and not glued and out[-1] not in _NO_SPACE_AFTER:
            out.append(" ")
        out.append(part)
    return "".join(out)


_PLACEHOLDER = re.compile("\x00([0-9]+)")
_TEMPLATES: dict[tuple[object, ...], str] = {}
_MAX_TEMPLATES = 4096


class _Printer:
    def __init__(self, positional: bool) -> None:
        self.positional = positional
        self.names: dict[str, str] = {}
        self.types: dict[int, tuple[TensorType, str]] = {}

    def v(self, name: str) -> str:
        if not self.positional:
            return name
        return self.names.get(name, name)

    def define(self, name: str) -> str:
        if self.positional and name not in self.names:
            self.names[name] = f"%{len(self.names)}"
        return self.v(name)

    def module(self, m: Module) -> str:
        lines = [f"dtm {m.version[0]}.{m.version[1]}", f"module {m.name}"]
        for mesh in m.meshes:
            axes = ", ".join(f"{a}={n}" for a, n in mesh.axes)
            lines += ["", f"mesh @{mesh.name} = [{axes}]"]
        for f in m.functions:
            lines += ["", *self.function(f)]
        return "\n".join(lines) + "\n"

    def function(self, f: Function) -> list[str]:
        self.names = {}
        params = ", ".join(self.param(p) for p in f.params)
        results = [self.result(r) for r in f.results]
        rtext = (
            results[0]
            if len(results) == 1 and f.results[0].updates is None
            else ("(" + ", ".join(results) + ")")
        )
        head = f"{'entry ' if f.entry else ''}func @{f.name}({params}) -> {rtext}"
        if f.mesh is not None:
            head += f" on @{f.mesh}"
        if f.requires:
            head += f" requires [{', '.join(f.requires)}]"
        lines = [head + " {"]
        lines += ["  " + self.op(op) for op in f.body]
        ret = ", ".join(self.v(r) for r in f.returns)
        lines += [f"  return {ret}".rstrip(), "}"]
        return lines

    def param(self, p: Param) -> str:
        text = f"{'state ' if p.state else ''}{self.define(p.name)}: {p.type}"
        if p.init is not None:
            text += " init " + _init(p.init)
        return text

    def result(self, r: ResultSpec) -> str:
        text = str(r.type)
        if r.updates is not None:
            text += f" updates {self.v(r.updates)}"
        return text

    def op(self, op: Op) -> str:
        template = self.template(op)
        if self.positional:
            get = self.names.get
            body = template.format(*[get(n, n) for n in op.operands])
        else:
            body = template.format(*op.operands)
        if op.results:
            names = ", ".join([self.define(r) for r in op.results])
            types = ", ".join([self.type_text(t) for t in op.result_types])
            return f"{names} = {body} : {types}"
        return body

    def template(self, op: Op) -> str:
        """The op's text with ``{0}``, ``{1}``, ... for its operands, cached per (op,
        attributes, operand count) where attributes compare exactly (OpDef.exact_attrs):
        layers repeat, and the format walk is the slow part of printing."""
        opdef = lookup_op(op.name)
        if opdef is None or not opdef.exact_attrs:
            return self.template_uncached(op)
        key = (op.name, op.attrs, len(op.operands))
        try:
            return _TEMPLATES[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable attribute (never from the parser)
            return self.template_uncached(op)
        text = self.template_uncached(op)
        if len(_TEMPLATES) >= _MAX_TEMPLATES:
            _TEMPLATES.clear()
        _TEMPLATES[key] = text
        return text

    def template_uncached(self, op: Op) -> str:
        opdef = lookup_op(op.name)
        assert opdef is not None, op.name
        parts: list[str] = [op.name]
        _Placeholders().elems(opdef.format, op, _Operands(op.operands), parts)
        text = _join(parts).replace("{", "{{").replace("}", "}}")
        return _PLACEHOLDER.sub(r"{\1}", text)

    def type_text(self, t: TensorType) -> str:
        try:
            return self.types[id(t)][1]
        except KeyError:
            text = str(t)
            self.types[id(t)] = (t, text)  # the type is kept alive with its id
            return text

    def elems(
        self, fmt: tuple[FormatElem, ...], op: Op, operands: _Operands, parts: list[str]
    ) -> None:
        it = operands.next
        for el in fmt:
            kind = el.kind
            if kind in {"kw", "punct"}:
                parts.append(el.name)
            elif kind == "operand":
                parts.append(self.v(it()))
            elif kind == "operands":
                rest = operands.rest()
                for i, name in enumerate(rest):
                    parts.append(self.v(name))
                    if i + 1 < len(rest):
                        parts.append(",")
            elif kind == "opt":
                first = el.group[0]
                present = _group_present(el.group, op, operands.left())
                if present:
                    assert first.kind == "kw"
                    self.elems(el.group, op, operands, parts)
            elif kind == "flag":
                if op.attr(el.name):
                    parts.append(el.choices[0])
            else:
                parts.append(_attr_text(el, op.attr(el.name)))


class _Placeholders(_Printer):
    """Prints operand ``i`` (in consumption order) as NUL + ``i``: a template in the making."""

    def __init__(self) -> None:
        super().__init__(positional=False)
        self.count = 0

    def v(self, name: str) -> str:
        self.count += 1
        return f"\x00{self.count - 1}"


class _Operands:
    """The operands of an op, consumed in format order."""

    __slots__ = ("i", "names")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.i = 0

    def next(self) -> str:
        self.i += 1
        return self.names[self.i - 1]

    def rest(self) -> list[str]:
        out = list(self.names[self.i :])
        self.i = len(self.names)
        return out

    def left(self) -> int:
        return len(self.names) - self.i


def _group_present(group: tuple[FormatElem, ...], op: Op, operands_left: int) -> bool:
    """An optional group is printed when it holds an attribute the op has, or an operand
    that is still unconsumed (optional operands come last in a format)."""
    keys = {k for k, _ in op.attrs}
    for el in group:
        if el.kind in ("operand", "operands"):
            return operands_left > 0
        if el.kind not in ("kw", "punct") and el.name in keys:
            return True
    return False


def _attr_text(el: FormatElem, value: Attr) -> str:
    kind = el.kind
    if kind == "symbol":
        return f"@{value}"
    if kind == "ints":
        assert isinstance(value, tuple)
        return "[" + ", ".join(str(v) for v in value) + "]"
    if kind == "axes":
        assert isinstance(value, tuple)
        return str(value[0]) if len(value) == 1 else "[" + ", ".join(map(str, value)) + "]"
    if kind == "literal":
        return _literal(value)
    if kind in ("int", "float"):
        assert isinstance(value, int | float)
        return format_attr_number(value)
    return str(value)


def _init(init: Init) -> str:
    if not init.params:
        return init.kind.value
    inner = ", ".join(f"{k}={format_attr_number(v)}" for k, v in init.params)
    return f"{init.kind.value}({inner})"


def print_module(module: Module, *, positional_names: bool = False) -> str:
    """The canonical text of ``module``; with ``positional_names`` every function's values are
    renamed ``%0, %1, ...`` in order of definition (the form ``module_hash`` hashes)."""
    return _Printer(positional_names).module(module)
