"""Tokens of the DTM IR text (docs/spec/ir.md, "Lexical structure").

A token is a ``(kind, text, line, col)`` tuple (1-based line and column). Tensor types are one
token each (``TYPE``), parsed by :mod:`dtm_mpi.ir.typetext` with a cache, which keeps large
modules fast. Whitespace (space, tab, carriage return, newline) and ``//`` comments separate
tokens and are dropped.
"""

from __future__ import annotations

import re

from dtm_mpi.errors import ParseError, SourceSpan
from dtm_mpi.ir.types import DTYPE_NAMES

__all__ = ["Source", "Token", "tokenize"]

Token = tuple[str, str, int, int]

_DTYPES = "|".join(sorted(DTYPE_NAMES, key=len, reverse=True))
_NUM = r"[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+|[0-9]+)"
_TOKEN_RE = re.compile(
    rf"""
    (?P<COMMENT>//.*)
  | (?P<TYPE>(?:{_DTYPES})\[[^\]]*\](?:\{{[^}}]*\}})?(?:[ \t]*partial\([^)]*\))?)
  | (?P<VALUE>%[A-Za-z0-9_.]+)
  | (?P<SYMBOL>@[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<NUMBER>{_NUM}(?![A-Za-z_]))
  | (?P<IDENT>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<STRING>"(?:[^"\\]|\\.)*")
  | (?P<ARROW>->)
  | (?P<PUNCT>[()\[\]{{}},=:<>*-])
  | (?P<ERROR>[^ \t\r])
    """,
    re.VERBOSE,
)


class Source:
    """A source text with its file name, for diagnostics."""

    __slots__ = ("_lines", "file", "text")

    def __init__(self, text: str, file: str = "<input>") -> None:
        self.text = text
        self.file = file
        self._lines: list[str] | None = None

    def line_text(self, line: int) -> str:
        if self._lines is None:
            self._lines = self.text.split("\n")
        return self._lines[line - 1] if 1 <= line <= len(self._lines) else ""

    def error(
        self, cls: type[ParseError], message: str, line: int, col: int, length: int = 1
    ) -> ParseError:
        return cls(message, SourceSpan(self.file, line, col, max(1, length)), self.line_text(line))


def tokenize(source: Source) -> list[Token]:
    """Split ``source`` into tokens, ending with ``EOF``.

    Raises :class:`ParseError` at the first character that starts no token.
    """
    tokens: list[Token] = []
    append = tokens.append
    finditer = _TOKEN_RE.finditer
    lineno = 0
    # finditer skips what no alternative matches: exactly the blanks between tokens.
    for lineno, line in enumerate(source.text.split("\n"), start=1):
        for m in finditer(line):
            kind = m.lastgroup
            if kind == "COMMENT":
                continue
            if kind == "ERROR":
                ch = m.group()
                col = m.start() + 1
                if ch == '"':
                    raise source.error(ParseError, "unterminated string literal", lineno, col)
                shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"
                raise source.error(ParseError, f"unexpected character {shown}", lineno, col)
            append((kind, m.group(), lineno, m.start() + 1))  # type: ignore[arg-type]
    last = source.line_text(lineno) if lineno else ""
    append(("EOF", "", max(1, lineno), len(last) + 1))
    return tokens
