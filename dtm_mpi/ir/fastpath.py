"""The parser's fast path for the common statement: one result, one op, one type, one line.

Large modules are mostly lines like ``%h = matmul %x, %w1 : f32[64,1024]{dp,tp}``. For each
op, a regular expression is compiled from the op's format in the registry (the same format the
token parser and the printer use) that matches such a line *exactly as the lexer would split
it*: every token piece carries the lexer's own pattern and refuses to stop where the lexer
would not. A line the expression matches is handed to the parser as one ``STMT`` token and
turned into an :class:`Op` without tokenizing it; any line it does not match (several results,
a statement spread over lines, a literal, anything malformed) takes the token parser, which
alone produces diagnostics. The fast path therefore never accepts or rejects anything the
token parser would not, and builds the identical op, spans included (tests/ir/test_fastpath.py
checks both on valid modules and on mutated ones).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from dtm_mpi.errors import SourceSpan
from dtm_mpi.ir.limits import MAX_INT_DIGITS
from dtm_mpi.ir.nodes import Attr, Op, new_op
from dtm_mpi.ir.registry import FormatElem, lookup_op
from dtm_mpi.ir.types import DTYPE_NAMES

__all__ = ["FastMatch", "build_op", "match_statement"]

_WS = r"[ \t\r]*"
_WORD_END = r"(?![A-Za-z0-9_])"
_DTYPES = "|".join(sorted(DTYPE_NAMES, key=len, reverse=True))
# The lexer's token patterns, each closed so that no backtracking can shorten a token.
_VALUE = r"%[A-Za-z0-9_.]+(?![A-Za-z0-9_.])"
_SYMBOL = r"@[A-Za-z_][A-Za-z0-9_.]*(?![A-Za-z0-9_.])"
_IDENT = rf"(?!(?:{_DTYPES})\[)[A-Za-z_][A-Za-z0-9_]*{_WORD_END}"
_INT = rf"[-+]?[0-9]{{1,{MAX_INT_DIGITS}}}(?![A-Za-z0-9_.])"
_NUM = (
    r"(?>[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?"
    r"|[0-9]+[eE][-+]?[0-9]+|[0-9]+))(?![A-Za-z0-9_.])"
)
_TYPE = rf"(?:{_DTYPES})\[[^\]]*\](?:\{{[^}}]*\}})?(?:[ \t]*partial\([^)]*\))?"
_HEAD = re.compile(rf"{_WS}({_VALUE}){_WS}={_WS}([A-Za-z_][A-Za-z0-9_]*){_WORD_END}")
_TAIL = rf"{_WS}:{_WS}({_TYPE}){_WS}(?://.*)?"
_VALUE_RE = re.compile(_VALUE)
# SourceSpan is a NamedTuple; tuple.__new__ skips its Python-level __new__ (half the cost).
_span = tuple.__new__
_IDENT_RE = re.compile(_IDENT)
_INT_RE = re.compile(_INT)

# An action turns the match into one part of the op: (kind, attribute name, group, guard group).
# ``guard`` is the group of the first keyword of an optional group (None: always present).
_Action = tuple[str, str, int, int | None]


class _Compiler:
    def __init__(self) -> None:
        self.ngroups = 0
        self.actions: list[_Action] = []

    def group(self, pattern: str) -> str:
        self.ngroups += 1
        return f"({pattern})"

    def elems(self, fmt: tuple[FormatElem, ...], guard: int | None) -> str | None:
        out: list[str] = []
        for el in fmt:
            piece = self.elem(el, guard)
            if piece is None:
                return None
            out.append(piece)
        return "".join(out)

    def elem(self, el: FormatElem, guard: int | None) -> str | None:
        kind = el.kind
        if kind == "kw":
            return _WS + re.escape(el.name) + _WORD_END
        if kind == "punct":
            return _WS + re.escape(el.name)
        if kind == "opt":
            first = el.group[0].name
            g = self.ngroups + 1
            self.ngroups += 1
            inner = self.elems(el.group[1:], g)
            if inner is None:
                return None
            kw = re.escape(first) + _WORD_END
            return rf"(?:{_WS}({kw}){inner}|(?!{_WS}{kw}))"
        if kind == "flag":
            word = re.escape(el.choices[0]) + _WORD_END
            pattern = rf"(?:{_WS}{self.group(word)}|(?!{_WS}{word}))"
            self.actions.append(("flag", el.name, self.ngroups, guard))
            return pattern
        simple = {"operand": _VALUE, "symbol": _SYMBOL, "int": _INT, "float": _NUM}
        if kind in simple:
            pattern = _WS + self.group(simple[kind])
            self.actions.append((kind, el.name, self.ngroups, guard))
            return pattern
        if kind == "enum":
            words = "|".join(re.escape(c) for c in el.choices)
            pattern = _WS + self.group(rf"(?:{words}){_WORD_END}")
            self.actions.append(("enum", el.name, self.ngroups, guard))
            return pattern
        if kind == "operands":
            items = rf"{_VALUE}(?:{_WS},{_WS}{_VALUE})*"
            pattern = rf"(?:{_WS}{self.group(items)}|(?!{_WS}%))"
            self.actions.append(("operands", el.name, self.ngroups, guard))
            return pattern
        if kind == "ints":
            items = rf"\[{_WS}(?:{_INT}(?:{_WS},{_WS}{_INT})*)?{_WS}\]"
            pattern = _WS + self.group(items)
            self.actions.append(("ints", el.name, self.ngroups, guard))
            return pattern
        if kind == "axes":
            items = rf"\[{_WS}{_IDENT}(?:{_WS},{_WS}{_IDENT})*{_WS}\]|{_IDENT}"
            pattern = _WS + self.group(items)
            self.actions.append(("axes", el.name, self.ngroups, guard))
            return pattern
        return None  # literal: the token parser handles it


class _FastOp:
    __slots__ = ("actions", "name", "regex", "type_group")

    def __init__(self, name: str, regex: re.Pattern[str], actions: tuple[_Action, ...]) -> None:
        self.name = name
        self.regex = regex
        self.actions = actions
        self.type_group = regex.groups


def _compile(name: str) -> _FastOp | None:
    opdef = lookup_op(name)
    if opdef is None:
        return None
    comp = _Compiler()
    body = comp.elems(opdef.format, None)
    if body is None:
        return None
    return _FastOp(name, re.compile(body + _TAIL), tuple(comp.actions))


_CACHE: dict[str, _FastOp | None] = {}

# A match: the op, the regex match of the body and tail, and the head match (result, op name).
FastMatch = tuple[_FastOp, "re.Match[str]", "re.Match[str]"]


def match_statement(line: str) -> FastMatch | None:
    """The fast-path match of a whole line, or None where the token parser must read it."""
    head = _HEAD.match(line)
    if head is None:
        return None
    name = head.group(2)
    try:
        fast = _CACHE[name]
    except KeyError:
        fast = _CACHE[name] = _compile(name)
    if fast is None:
        return None
    m = fast.regex.fullmatch(line, head.end())
    if m is None:
        return None
    return fast, m, head


def build_op(
    match: FastMatch, file: str, lineno: int, parse_type: Callable[[str, int, int], Any]
) -> Op:
    """The op of a matched line, identical (spans included) to what the token parser builds."""
    fast, m, head = match
    result = head.group(1)
    rcol = head.start(1) + 1
    ncol = head.start(2) + 1
    operands: list[str] = []
    operand_spans: list[SourceSpan] = []
    attrs: list[tuple[str, Attr]] = []
    attr_spans: list[tuple[str, SourceSpan]] = []
    group = m.group
    start = m.start
    for kind, key, g, guard in fast.actions:
        if guard is not None and group(guard) is None:
            continue
        text = group(g)
        if kind == "operand":
            operands.append(text)
            operand_spans.append(_span(SourceSpan, (file, lineno, start(g) + 1, len(text))))
            continue
        if text is None:  # an absent flag or an empty operand list
            continue
        col = start(g) + 1
        value: Attr
        if kind == "operands":
            for vm in _VALUE_RE.finditer(text):
                operands.append(vm.group())
                operand_spans.append(
                    _span(SourceSpan, (file, lineno, col + vm.start(), len(vm.group())))
                )
            continue
        if kind == "int":
            value = int(text)
        elif kind == "float":
            value = float(text)
        elif kind == "symbol":
            value = text[1:]
        elif kind == "ints":
            value = tuple(int(x) for x in _INT_RE.findall(text))
        elif kind == "axes":
            value = tuple(_IDENT_RE.findall(text)) if text[0] == "[" else (text,)
        else:  # enum, flag
            value = True if kind == "flag" else text
        attrs.append((key, value))
        length = 1 if kind in ("ints", "axes") and text[0] == "[" else len(text)
        attr_spans.append((key, _span(SourceSpan, (file, lineno, col, length))))
    tg = fast.type_group
    ttext = group(tg)
    tcol = start(tg) + 1
    return new_op(
        fast.name,
        (result,),
        (parse_type(ttext, lineno, tcol),),
        tuple(operands),
        tuple(attrs),
        _span(SourceSpan, (file, lineno, ncol, len(fast.name))),
        (_span(SourceSpan, (file, lineno, rcol, len(result))),),
        tuple(operand_spans),
        (_span(SourceSpan, (file, lineno, tcol, len(ttext))),),
        tuple(attr_spans),
    )
