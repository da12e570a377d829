"""Tokens of the DTM IR text (docs/spec/ir.md, "Lexical structure").

A token is a ``(kind, text, line, col)`` tuple (1-based line and column). Tensor types are one
token each (``TYPE``), parsed by :mod:`dtm_mpi.ir.typetext` with a cache, which keeps large
modules fast. Whitespace (space, tab, carriage return, newline) and ``//`` comments separate
tokens and are dropped.
"""

from __future__ import annotations

import re

from dtm_mpi.errors import ParseError, SourceSpan
from dtm_mpi.ir.fastpath import FastMatch, match_statement
from dtm_mpi.ir.types import DTYPE_NAMES

__all__ = ["Source", "Token", "leading_tokens", "line_tokens", "tokenize"]

Token = tuple[str, str, int, int]

_DTYPES = "|".join(sorted(DTYPE_NAMES, key=len, reverse=True))
_NUM = r"[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+|[0-9]+)"
_TOKEN_RE = re.compile(
    rf"""
    (?P<COMMENT>//.*)
  | (?P<TYPE>(?:{_DTYPES})\[[^\]]*\](?:\{{[^}}]*\}})?(?:[ \t]*partial\([^)]*\))?)
  | (?P<VALUE>%[A-Za-z0-9_.]+)
  | (?P<SYMBOL>@[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<NUMBER>(?>{_NUM})(?![A-Za-z_]))
  | (?P<BADNUMBER>(?>{_NUM})[A-Za-z0-9_]*)
  | (?P<IDENT>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<STRING>"(?:[^"\\]|\\.)*")
  | (?P<ARROW>->)
  | (?P<PUNCT>[()\[\]{{}},=:<>*-])
  | (?P<ERROR>[^ \t\r])
    """,
    re.VERBOSE,
)

_BAD_KINDS = frozenset({"ERROR", "BADNUMBER"})


class Source:
    """A source text with its file name, for diagnostics. ``fast`` holds the fast-path matches
    of the lines the lexer turned into ``STMT`` tokens (by line number)."""

    __slots__ = ("_lines", "fast", "file", "text")

    def __init__(self, text: str, file: str = "<input>") -> None:
        self.text = text
        self.file = file
        self._lines: list[str] | None = None
        self.fast: dict[int, FastMatch] = {}

    def line_text(self, line: int) -> str:
        if self._lines is None:
            self._lines = self.text.split("\n")
        text = self._lines[line - 1] if 1 <= line <= len(self._lines) else ""
        return text[:-1] if text.endswith("\r") else text  # a CRLF line ends before its CR

    def error(
        self, cls: type[ParseError], message: str, line: int, col: int, length: int = 1
    ) -> ParseError:
        return cls(message, SourceSpan(self.file, line, col, max(1, length)), self.line_text(line))


def _bad_character(source: Source, ch: str, lineno: int, col: int) -> ParseError:
    if len(ch) > 1:  # a number running into a letter, '_' or more digits: 12x, 1_000, 0x10
        shown = ch if len(ch) <= 24 else ch[:20] + "..."
        return source.error(
            ParseError,
            f"malformed number {shown!r}: a number must not run into a letter or '_'",
            lineno,
            col,
            len(ch),
        )
    if ch == '"':
        return source.error(ParseError, "unterminated string literal", lineno, col)
    shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"
    return source.error(ParseError, f"unexpected character {shown}", lineno, col)


def line_tokens(source: Source, line: str, lineno: int) -> list[Token]:
    """The tokens of one line. Raises :class:`ParseError` at a character that starts no token."""
    out: list[Token] = []
    append = out.append
    # finditer skips what no alternative matches: exactly the blanks between tokens.
    for m in _TOKEN_RE.finditer(line):
        kind = m.lastgroup
        if kind == "COMMENT":
            continue
        if kind in _BAD_KINDS:
            raise _bad_character(source, m.group(), lineno, m.start() + 1)
        append((kind, m.group(), lineno, m.start() + 1))  # type: ignore[arg-type]
    return out


def leading_tokens(source: Source, count: int) -> list[Token]:
    """The first ``count`` tokens of ``source`` (fewer if the text ends first), lexing nothing
    after them: the reader decides on the header's version before it reads anything after the
    header (docs/spec/ir.md, section 1). Raises :class:`ParseError` at a character before them
    that starts no token."""
    out: list[Token] = []
    text = source.text
    pos = 0
    lineno = 0
    while len(out) < count and pos <= len(text):
        end = text.find("\n", pos)
        if end < 0:
            end = len(text)
        lineno += 1
        for m in _TOKEN_RE.finditer(text, pos, end):
            kind = m.lastgroup
            if kind == "COMMENT":
                continue
            if kind in _BAD_KINDS:
                raise _bad_character(source, m.group(), lineno, m.start() - pos + 1)
            out.append((kind, m.group(), lineno, m.start() - pos + 1))  # type: ignore[arg-type]
            if len(out) == count:
                break
        pos = end + 1
    return out


def tokenize(source: Source, *, fast: bool = True) -> list[Token]:
    """Split ``source`` into tokens, ending with ``EOF``.

    With ``fast``, a line that can only start a statement (the previous token is a type or the
    ``{`` opening a function body) and that the fast path matches whole becomes one ``STMT``
    token (text: the line); see :mod:`dtm_mpi.ir.fastpath`. A ``STMT`` directly followed by
    ``,`` (more result types on the next line) is split back into its tokens.

    Raises :class:`ParseError` at the first character that starts no token.
    """
    tokens: list[Token] = []
    matches = source.fast
    lineno = 0
    after_type = False  # the last token ends a type: a statement may start here
    for lineno, line in enumerate(source.text.split("\n"), start=1):
        if after_type and fast:
            fm = match_statement(line)
            if fm is not None:
                matches[lineno] = fm
                tokens.append(("STMT", line, lineno, fm[2].start(1) + 1))
                continue
        toks = line_tokens(source, line, lineno)
        if not toks:
            continue
        if tokens and tokens[-1][0] == "STMT" and toks[0][0] == "PUNCT" and toks[0][1] == ",":
            stmt = tokens.pop()
            del matches[stmt[2]]
            tokens += line_tokens(source, stmt[1], stmt[2])
        tokens += toks
        kind, text, _, _ = toks[-1]
        after_type = kind == "TYPE" or (kind == "PUNCT" and text == "{")
    last = source.line_text(lineno) if lineno else ""
    tokens.append(("EOF", "", max(1, lineno), len(last) + 1))
    return tokens
