"""Parsing the text of one tensor type token, e.g. ``f32[64,256]{dp,(tp,ep)} partial(sum: tp)``.

Types repeat a lot in real modules, so successful parses are cached by text. A malformed type
raises :class:`ParseError` pointing at the exact character inside the token.
"""

from __future__ import annotations

import re
from functools import lru_cache

from dtm_mpi.errors import ParseError
from dtm_mpi.ir.lexer import Source
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType

__all__ = ["parse_type_text"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT = re.compile(r"[0-9]+")
_MAX_DIM = 2**62
MAX_RANK = 32


class _TypeSyntaxError(Exception):
    def __init__(self, message: str, offset: int, length: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset
        self.length = length


class _Cursor:
    __slots__ = ("pos", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def found(self) -> str:
        return repr(self.text[self.pos]) if self.pos < len(self.text) else "end of type"

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def peek(self) -> str:
        self.skip_ws()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, ch: str, what: str) -> None:
        if self.peek() != ch:
            raise _TypeSyntaxError(f"expected {what}, found {self.found()}", self.pos)
        self.pos += 1

    def name(self, what: str) -> str:
        self.skip_ws()
        m = _NAME.match(self.text, self.pos)
        if m is None:
            raise _TypeSyntaxError(f"expected {what}, found {self.found()}", self.pos)
        self.pos = m.end()
        return m.group()

    def integer(self, what: str) -> tuple[int, int]:
        self.skip_ws()
        m = _INT.match(self.text, self.pos)
        if m is not None and len(m.group()) > 19:
            raise _TypeSyntaxError(
                f"{what}: {m.group()[:20]}... is too large", m.start(), len(m.group())
            )
        if m is None:
            raise _TypeSyntaxError(f"expected {what}, found {self.found()}", self.pos)
        self.pos = m.end()
        return int(m.group()), m.start()


def _parse(text: str) -> TensorType:
    cur = _Cursor(text)
    bracket = text.index("[")
    dtype = DType(text[:bracket])
    cur.pos = bracket + 1
    shape: list[int] = []
    if cur.peek() != "]":
        while True:
            value, at = cur.integer("a dimension size (a non-negative integer)")
            if value > _MAX_DIM:
                raise _TypeSyntaxError(f"dimension size {value} is too large", at, len(str(value)))
            shape.append(value)
            if len(shape) > MAX_RANK:
                raise _TypeSyntaxError(f"rank above the limit of {MAX_RANK} dimensions", at)
            if cur.peek() == ",":
                cur.pos += 1
                continue
            cur.expect("]", "',' or ']' in the shape")
            break
    else:
        cur.pos += 1
    dims: list[tuple[str, ...]] = [() for _ in shape]
    if cur.peek() == "{":
        brace = cur.pos
        cur.pos += 1
        entries: list[tuple[str, ...]] = []
        while True:
            ch = cur.peek()
            if ch == "-":
                cur.pos += 1
                entries.append(())
            elif ch == "(":
                cur.pos += 1
                axes = [cur.name("a mesh axis name")]
                while cur.peek() == ",":
                    cur.pos += 1
                    axes.append(cur.name("a mesh axis name"))
                cur.expect(")", "',' or ')' closing the axis group")
                entries.append(tuple(axes))
            else:
                entries.append((cur.name("'-', a mesh axis name or '(' in the layout"),))
            if cur.peek() == ",":
                cur.pos += 1
                continue
            cur.expect("}", "',' or '}' in the layout")
            break
        if len(entries) != len(shape):
            raise _TypeSyntaxError(
                f"layout has {len(entries)} entries but the shape has rank {len(shape)}; "
                "give one entry ('-' or mesh axes) per dimension",
                brace,
                cur.pos - brace,
            )
        dims = entries
    partial: Partial | None = None
    if cur.peek() == "p":
        word_at = cur.pos
        if cur.name("'partial'") != "partial":
            raise _TypeSyntaxError("expected 'partial(...)' after the type", word_at)
        cur.expect("(", "'(' after 'partial'")
        op_at = cur.pos
        op_name = cur.name("a reduction (sum, max, min, prod)")
        try:
            op = ReduceOp(op_name)
        except ValueError:
            raise _TypeSyntaxError(
                f"unknown reduction {op_name!r} in partial (expected sum, max, min or prod)",
                op_at,
                len(op_name),
            ) from None
        cur.expect(":", "':' after the reduction in partial(...)")
        axes_p = [cur.name("a mesh axis name")]
        while cur.peek() == ",":
            cur.pos += 1
            axes_p.append(cur.name("a mesh axis name"))
        cur.expect(")", "',' or ')' closing partial(...)")
        partial = Partial(op, tuple(axes_p))
    if cur.peek() != "":
        raise _TypeSyntaxError(f"unexpected {cur.text[cur.pos]!r} in the type", cur.pos)
    return TensorType(dtype, tuple(shape), Layout(tuple(dims), partial))


@lru_cache(maxsize=4096)
def _parse_cached(text: str) -> TensorType | _TypeSyntaxError:
    try:
        return _parse(text)
    except _TypeSyntaxError as err:
        return err


def parse_type_text(source: Source, text: str, line: int, col: int) -> TensorType:
    """Parse the type token ``text`` found at ``line``:``col`` of ``source``."""
    result = _parse_cached(text)
    if isinstance(result, _TypeSyntaxError):
        raise source.error(ParseError, result.message, line, col + result.offset, result.length)
    return result
