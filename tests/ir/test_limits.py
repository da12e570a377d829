"""The reader's limits (docs/spec/ir.md §2.3) and the header rule of §1: the spec's stated
values are the code's constants, each limit is enforced exactly at its value by the token
parser and the fast path alike, and the version is decided before anything after it is lexed.
Also the lexical details of §2.1 (malformed numbers, CRLF lines in diagnostics)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtm_mpi.errors import ParseError, VersionError
from dtm_mpi.ir import check_text, limits, parse_module, typetext
from dtm_mpi.ir import source_files as ir_files
from dtm_mpi.ir.parser import SUPPORTED_VERSION

SPEC = Path(__file__).parents[2] / "docs" / "spec" / "ir.md"

CONSTANTS = {
    "MAX_VERSION_CHARS": limits.MAX_VERSION_CHARS,
    "MAX_INT_DIGITS": limits.MAX_INT_DIGITS,
    "MAX_LITERAL_DEPTH": limits.MAX_LITERAL_DEPTH,
    "MAX_RANK": typetext.MAX_RANK,
    "MAX_DIM": typetext._MAX_DIM,
    "MAX_SOURCE_BYTES": ir_files.MAX_SOURCE_BYTES,
}

NEWER = f"{SUPPORTED_VERSION[0]}.{SUPPORTED_VERSION[1] + 1}"  # a minor version this reader is older than


def _spec_limits() -> dict[str, int]:
    """The §2.3 table: constant name -> stated value (``N`` or ``B^E``)."""
    text = SPEC.read_text(encoding="utf-8")
    section = text.split("### 2.3 Limits\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, int] = {}
    for m in re.finditer(r"^\| [^|]*\(`(MAX_[A-Z_]+)`\) \| ([0-9^]+) \|", section, re.M):
        base, _, exp = m.group(2).partition("^")
        out[m.group(1)] = int(base) ** int(exp) if exp else int(base)
    return out


def test_spec_states_the_code_limits() -> None:
    assert _spec_limits() == CONSTANTS


def _parse_both(text: str) -> None:
    """Parse with the fast path and with the token parser; both must agree."""
    outcomes = []
    for fast in (True, False):
        try:
            outcomes.append(("ok", parse_module(text, "t.dtm", fast=fast)))
        except ParseError as err:
            outcomes.append(("error", (type(err), err.span, err.message)))
    assert outcomes[0] == outcomes[1]
    if outcomes[0][0] == "error":
        kind, span, message = outcomes[0][1]  # type: ignore[misc]
        raise kind(message, span)


def _module(body: str, params: str = "", result: str = "f32[]") -> str:
    return (
        f"dtm 1.0\nmodule m\nmesh @m = [tp=2]\n\nentry func @f({params}) -> {result} on @m {{\n"
        f"{body}\n}}\n"
    )


# --- INTEGER digits ------------------------------------------------------------------------


@pytest.mark.parametrize("sign", ["", "-", "+"])
def test_integer_digit_limit_in_a_fast_path_attribute(sign: str) -> None:
    n = limits.MAX_INT_DIGITS
    ok = _module(f"  %y = sum %x dims [{sign}{'1' * n}] : f32[]\n  return %y", "%x: f32[4]")
    _parse_both(ok)  # parses (the verifier then rejects the dim)
    bad = ok.replace("1" * n, "1" * (n + 1))
    with pytest.raises(ParseError, match=f"has {n + 1} digits; at most {n} are allowed"):
        _parse_both(bad)


def test_integer_digit_limit_in_a_literal_and_a_mesh_size() -> None:
    n = limits.MAX_INT_DIGITS
    ok = _module(f"  %y = constant -{'9' * n} : f32[]\n  return %y")
    assert parse_module(ok).functions[0].body[0].attr("value") == -int("9" * n)
    with pytest.raises(ParseError, match=f"has {n + 1} digits") as info:
        parse_module(ok.replace("9" * n, "9" * (n + 1)))
    assert (info.value.span.line, info.value.span.col) == (6, 17)
    with pytest.raises(ParseError, match=f"has {n + 1} digits") as info:
        parse_module(ok.replace("[tp=2]", f"[tp={'2' * (n + 1)}]"))
    assert (info.value.span.line, info.value.span.col) == (3, 15)


# --- literal nesting, rank, dimension size --------------------------------------------------


def test_literal_nesting_limit() -> None:
    depth = limits.MAX_LITERAL_DEPTH
    ok = _module(
        f"  %y = constant {'[' * depth}1{']' * depth} : f32[{','.join(['1'] * depth)}]\n  return %y",
        result=f"f32[{','.join(['1'] * depth)}]",
    )
    module, errors = check_text(ok)
    assert module is not None and errors == []
    deeper = ok.replace("[" * depth + "1", "[" * (depth + 1) + "1", 1).replace(
        "1" + "]" * depth, "1" + "]" * (depth + 1), 1
    )
    with pytest.raises(ParseError, match=f"nested deeper than {depth} levels") as info:
        parse_module(deeper)
    col = deeper.split("\n")[5].index("[") + 1 + depth  # the (depth+1)-th '['
    assert (info.value.span.line, info.value.span.col) == (6, col)


def test_rank_limit() -> None:
    r = typetext.MAX_RANK
    shape = ",".join(["1"] * r)
    ok = _module("  return %x", f"%x: f32[{shape}]", f"f32[{shape}]")
    _parse_both(ok)
    with pytest.raises(ParseError, match=f"rank above the limit of {r} dimensions"):
        _parse_both(ok.replace(f"f32[{shape}]", f"f32[{shape},1]"))


def test_dimension_size_limit() -> None:
    top = typetext._MAX_DIM
    ok = _module("  return %x", f"%x: f32[{top}]", f"f32[{top}]")
    _parse_both(ok)
    for size in (top + 1, 10**19, 10**30):
        with pytest.raises(ParseError, match="is too large"):
            _parse_both(ok.replace(f"[{top}]", f"[{size}]", 1))


# --- the header: version token length, version before lexing --------------------------------


def test_version_token_length_limit() -> None:
    n = limits.MAX_VERSION_CHARS
    minor = "0" * (n - 2)  # "1." + minor: exactly n characters, still version 1.0
    module = parse_module(f"dtm 1.{minor}\nmodule m\n")
    assert module.version == (1, 0)
    with pytest.raises(ParseError, match=f"{n + 1} characters long; at most {n}") as info:
        parse_module(f"dtm 1.{minor}0\nmodule m\n")
    assert not isinstance(info.value, VersionError)


LEXICAL_ERRORS = [
    "module bad $",  # on the line after the header
    'module bad\nentry func @f() -> f32[] {\n  %s = constant "open : f32[]\n  return %s\n}',
    "module bad\nmesh @m = [tp=12x]",  # a malformed number
    "module bad\n\u00a7",  # a non-ASCII character
]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    ("version", "fragment"),
    [("2.0", "unsupported IR major version 2"), (NEWER, "is newer than this reader")],
)
@pytest.mark.parametrize("rest", LEXICAL_ERRORS)
def test_version_error_wins_over_a_later_lexical_error(
    version: str, fragment: str, rest: str, fast: bool
) -> None:
    """Regression: the whole text was lexed before the header was read, so a lexical error
    anywhere hid the version error (spec §1)."""
    text = f"// a comment\ndtm {version}\n{rest}\n"
    with pytest.raises(VersionError, match=fragment) as info:
        parse_module(text, "t.dtm", fast=fast)
    assert (info.value.span.line, info.value.span.col) == (2, 5)


@pytest.mark.parametrize("fast", [True, False])
def test_version_error_wins_on_the_header_line(fast: bool) -> None:
    with pytest.raises(VersionError, match="newer than this reader"):
        parse_module(f"dtm {NEWER} module m \u00a7 $\n", fast=fast)


def test_lexical_error_before_the_version_is_reported() -> None:
    with pytest.raises(ParseError, match="unexpected character '\\$'") as info:
        parse_module("$ dtm 2.0\nmodule m\n")
    assert not isinstance(info.value, VersionError)
    with pytest.raises(ParseError, match="malformed number '2x'"):
        parse_module("dtm 2x\nmodule m\n")


def test_supported_version_still_reports_the_lexical_error() -> None:
    with pytest.raises(ParseError, match="unexpected character '\\$'") as info:
        parse_module("dtm 1.0\nmodule m $\n")
    assert (info.value.span.line, info.value.span.col) == (2, 10)


# --- lexical details (§2.1) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "col", "shown"),
    [("12x", 15, "12x"), ("1_000", 15, "1_000"), ("0x10", 15, "0x10"), ("1.5e", 15, "1.5e")],
)
def test_malformed_number_is_reported_at_its_start(text: str, col: int, shown: str) -> None:
    """Regression: the number pattern backtracked, so ``12x`` was reported at ``2``."""
    with pytest.raises(ParseError, match=f"malformed number '{re.escape(shown)}'") as info:
        parse_module(f"dtm 1.0\nmodule m\nmesh @m = [tp={text}]\n")
    assert (info.value.span.line, info.value.span.col, info.value.span.length) == (
        3,
        col,
        len(shown),
    )


def test_crlf_diagnostic_shows_the_line_without_its_cr() -> None:
    """Regression: a CRLF file's diagnostics echoed the CR."""
    _, errors = check_text("dtm 1.0\r\nmodule m\r\nfoo bar\r\n", "t.dtm")
    text = str(errors[0])
    assert "\r" not in text
    assert text.splitlines()[1] == "  foo bar"
