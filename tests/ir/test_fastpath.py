"""The parser's fast path (dtm_mpi.ir.fastpath) against the token parser it stands in for.

For every input — valid modules, the invalid goldens, generated modules in random spellings,
and those modules with random character edits — parsing with the fast path and without it must
give the same outcome: the same module *including every source span*, or the same diagnostic
(class, message, location).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_properties import FUZZ_SETTINGS, VALID_SETTINGS, Case, Style, render, valid_cases

from dtm_mpi.bench.ir import generate_module
from dtm_mpi.errors import ParseError
from dtm_mpi.ir.fastpath import match_statement
from dtm_mpi.ir.lexer import Source, tokenize
from dtm_mpi.ir.parser import parse_module

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
VECTORS = ROOT / "io" / "vectors" / "ir"
FILES = sorted((VECTORS / "valid").glob("*.dtm")) + sorted((ROOT / "examples").glob("*.dtm"))
INVALID = sorted((VECTORS / "invalid").glob("*.dtm"))
EDIT_CHARS = ' \t\n\r,:=%@[](){}-+.0123456789aefx_/"#'


def deep(value: Any) -> Any:
    """Every field of a node, spans (compare=False) included, as nested tuples."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__name__,
            *(deep(getattr(value, f.name)) for f in dataclasses.fields(value)),
        )
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(deep(v) for v in value)
    return value


def outcome(text: str, *, fast: bool) -> Any:
    try:
        module = parse_module(text, "f.dtm", fast=fast)
    except ParseError as err:
        return ("error", type(err).__name__, str(err), tuple(err.span))
    return ("module", deep(module))


def assert_same(text: str) -> Any:
    fast = outcome(text, fast=True)
    slow = outcome(text, fast=False)
    assert fast == slow, f"fast path differs from the token parser on:\n{text}"
    return fast


def stmt_count(text: str) -> int:
    return sum(1 for tok in tokenize(Source(text)) if tok[0] == "STMT")


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_valid_files_parse_identically(path: Path) -> None:
    result = assert_same(path.read_text(encoding="utf-8"))
    assert result[0] == "module"


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_files_give_identical_diagnostics(path: Path) -> None:
    assert_same(path.read_text(encoding="utf-8"))


def test_generated_module_takes_the_fast_path() -> None:
    text = generate_module(500)
    assert assert_same(text)[0] == "module"
    # every op line but none of the others goes through the fast path
    assert stmt_count(text) == 500


@pytest.mark.parametrize(
    "line",
    [
        "  %a = add %x, %y : f32[4]",
        "%a=add %x,%y:f32[4]// c",
        "  %s = sum %x dims [0, 1] keepdims : f32[1,1]",
        "  %s = sum %x dims [] : f32[2] partial(sum: dp)",
        "  %r = allreduce sum %p on [dp, tp] : f32[4]\r",
        "  %r = random normal seed 3 offset %o std 0.5 : f32[4]",
        "  %c = call @f.g(%a, %b) : f32[4]",
        "  %c = call @f() : f32[4]",
        "  %t = transpose %x perm [1,0] : f32[2,3]{-,dp}",
    ],
)
def test_common_lines_match(line: str) -> None:
    assert match_statement(line) is not None


@pytest.mark.parametrize(
    "line",
    [
        "  %a, %b = quantize %x block 4 : i8[4], f32[1]",  # several results
        "  %k = constant [1, 2] : f32[2]",  # literals take the token parser
        "  %a = add %x, %y : f32[4] x",  # trailing garbage
        "  %a = add %x %y : f32[4]",  # missing comma
        "  %a = ad %x, %y : f32[4]",  # unknown op
        "  %a = iota dim 1.0 : f32[4]",  # not an integer
        "  %a = iota dim 1e : f32[4]",  # not a number token
        "  %r = allreduce sum %p ontp : f32[4]",  # keyword glued to a name
        "  %r = random normal seed 3 offset : f32[4]",  # optional group started, not finished
        "  %a = add %x, %y : f32[4]\f",  # a character the lexer refuses
        "  %a = add %x, %y",  # no type
    ],
)
def test_other_lines_do_not_match(line: str) -> None:
    assert match_statement(line) is None


HEAD = "dtm 1.0\nmodule t\nmesh @m = [dp=2]\n"
TRICKY = [
    # a statement line followed by more result types on the next line
    HEAD + "entry func @f(%x: f32[4]) -> f32[4] {\n  %a = neg %x : f32[4]\n  , f32[4]\n"
    "  return %a\n}\n",
    # a valid two-result statement spread over two lines
    HEAD + "func @g(%x: f32[4]) -> (f32[4], f32[4]) {\n  return %x, %x\n}\n"
    "entry func @f(%x: f32[4]) -> f32[4] {\n  %a, %b = call @g(%x) : f32[4]\n"
    "  // between\n\n  , f32[4]\n  return %a\n}\n",
    # a statement-shaped line where a parameter list goes on
    HEAD + "entry func @f(%x: f32[4]\n  %a = neg %x : f32[4]\n) -> f32[4] {\n  return %x\n}\n",
    # ... after the result types, before '{'
    HEAD + "entry func @f(%x: f32[4]) -> f32[4]\n  %a = neg %x : f32[4]\n{\n  return %x\n}\n",
    # ... after a result type in parentheses
    HEAD + "entry func @f(%x: f32[4]) -> (f32[4]\n  %a = neg %x : f32[4]\n) {\n  return %x\n}\n",
    # ... after return
    HEAD + "entry func @f(%x: f32[4]) -> f32[4] {\n  return %x\n  %a = neg %x : f32[4]\n}\n",
    # a bad type on a fast line after a parse error on an earlier line
    HEAD + "entry func @f(%x: f32[4]) -> f32[4] {\n  %a = neg %x %x : f32[4]\n"
    "  %b = neg %x : f32[4}\n  return %x\n}\n",
    # a bad type on a fast line
    HEAD + "entry func @f(%x: f32[4]) -> f32[4] {\n  %b = neg %x : f32[4,]\n  return %x\n}\n",
    # a lexical error on a later line wins over everything
    HEAD + "entry func @f(%x: f32[4]) -> f32[4] {\n  %b = neg %x : f32[4]\n  return %x $\n}\n",
]


@pytest.mark.parametrize("text", TRICKY, ids=[f"tricky{i}" for i in range(len(TRICKY))])
def test_tricky_inputs_give_identical_outcomes(text: str) -> None:
    assert_same(text)


def test_a_two_line_statement_parses() -> None:
    result = assert_same(TRICKY[1])
    assert result[0] == "module"


@VALID_SETTINGS
@given(case=valid_cases(), seed=st.integers(0, 2**32 - 1), plain=st.booleans())
def test_generated_modules_parse_identically(case: Case, seed: int, plain: bool) -> None:
    style = Style(case.names) if plain else Style(case.names, random.Random(seed))
    text = render(case.spec, style)
    assert assert_same(text)[0] == "module"
    if plain:
        assert stmt_count(text) > 0 or all(
            match_statement(line) is None for line in text.split("\n")
        )


@FUZZ_SETTINGS
@given(
    case=valid_cases(),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["insert", "delete", "newline", "cut"]),
            st.integers(0, 10**6),
            st.sampled_from(EDIT_CHARS),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_edited_modules_give_identical_outcomes(
    case: Case, edits: list[tuple[str, int, str]]
) -> None:
    text = render(case.spec, Style(case.names))
    for kind, at, ch in edits:
        i = at % (len(text) + 1)
        if kind == "insert":
            text = text[:i] + ch + text[i:]
        elif kind == "delete":
            text = text[:i] + text[i + 1 :]
        elif kind == "newline":
            text = text[:i] + "\n" + text[i:]
        else:
            text = text[:i] + text[i + 1 + at % 7 :]
    assert_same(text)
