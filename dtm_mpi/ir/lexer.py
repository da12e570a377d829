"""Tokens of the DTM IR text (docs/spec/ir.md, "Lexical structure").

A token is a ``(kind, text, offset)`` tuple; line and column are computed from the offset only
when a diagnostic needs them (:class:`Source`). Tensor types are one token each (``TYPE``),
parsed by :mod:`dtm_mpi.ir.typetext` with a cache, which keeps large modules fast.
"""

from __future__ import annotations

import bisect
import re

from dtm_mpi.errors import ParseError, SourceSpan
from dtm_mpi.ir.types import DTYPE_NAMES

__all__ = ["Source", "Token", "tokenize"]

Token = tuple[str, str, int]

_DTYPES = "|".join(sorted(DTYPE_NAMES, key=len, reverse=True))
_TOKEN_RE = re.compile(
    rf"""
    (?P<WS>[ \t\r\n]+)
  | (?P<COMMENT>//[^\n]*)
  | (?P<TYPE>(?:{_DTYPES})\[[^\]\n]*\](?:\{{[^}}\n]*\}})?(?:[ \t]*partial\([^)\n]*\))?)
  | (?P<VALUE>%[A-Za-z0-9_.]+)
  | (?P<SYMBOL>@[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<NUMBER>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+)(?![A-Za-z_]))
  | (?P<IDENT>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<STRING>"(?:[^"\\\n]|\\.)*")
  | (?P<ARROW>->)
  | (?P<PUNCT>[()\[\]{{}},=:<>*-])
    """,
    re.VERBOSE,
)


class Source:
    """A source text with its file name; maps offsets to line/column for diagnostics."""

    __slots__ = ("_line_starts", "file", "text")

    def __init__(self, text: str, file: str = "<input>") -> None:
        self.text = text
        self.file = file
        self._line_starts: list[int] | None = None

    def _starts(self) -> list[int]:
        if self._line_starts is None:
            starts = [0]
            find = self.text.find
            pos = find("\n")
            while pos >= 0:
                starts.append(pos + 1)
                pos = find("\n", pos + 1)
            self._line_starts = starts
        return self._line_starts

    def span(self, offset: int, length: int = 1) -> SourceSpan:
        starts = self._starts()
        line = bisect.bisect_right(starts, offset) - 1
        return SourceSpan(self.file, line + 1, offset - starts[line] + 1, max(1, length))

    def line_text(self, line: int) -> str:
        starts = self._starts()
        if not 1 <= line <= len(starts):
            return ""
        end = self.text.find("\n", starts[line - 1])
        return self.text[starts[line - 1] : end if end >= 0 else len(self.text)]

    def error(
        self, cls: type[ParseError], message: str, offset: int, length: int = 1
    ) -> ParseError:
        span = self.span(offset, length)
        return cls(message, span, self.line_text(span.line))


def tokenize(source: Source) -> list[Token]:
    """Split ``source`` into tokens (whitespace and comments dropped), ending with ``EOF``.

    Raises :class:`ParseError` at the first character that starts no token.
    """
    text = source.text
    tokens: list[Token] = []
    append = tokens.append
    pos = 0
    end = len(text)
    match = _TOKEN_RE.match
    while pos < end:
        m = match(text, pos)
        if m is None:
            ch = text[pos]
            if ch == '"':
                raise source.error(ParseError, "unterminated string literal", pos)
            shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"
            raise source.error(ParseError, f"unexpected character {shown}", pos)
        kind = m.lastgroup
        assert kind is not None
        if kind not in {"WS", "COMMENT"}:
            append((kind, m.group(), pos))
        pos = m.end()
    append(("EOF", "", end))
    return tokens
