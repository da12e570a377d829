"""Golden tests of the IR front end: valid modules round-trip through the printer, each invalid
module's first diagnostic is at the location and has the message its ``// expect:`` line names,
and the ``dtm check | fmt | hash`` commands behave (exit codes, one-line usage errors)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from dtm_mpi.cli import run
from dtm_mpi.ir import check_text, module_hash, parse_module, print_module, verify_errors

HERE = Path(__file__).parent
VECTORS = HERE.parents[1] / "io" / "vectors" / "ir"  # the language-neutral IR vectors
VALID = sorted((VECTORS / "valid").glob("*.dtm"))
INVALID = sorted((VECTORS / "invalid").glob("*.dtm"))
EXPECT_RE = re.compile(r"// expect: (\d+):(\d+): (.+)")
HASH_RE = re.compile(r"dtm-mh1:[0-9a-f]{64}")


def _expectation(path: Path) -> tuple[int, int, str]:
    first = path.read_text(encoding="utf-8").split("\n", 1)[0]
    m = EXPECT_RE.fullmatch(first)
    assert m, f"{path.name}: first line must be '// expect: LINE:COL: fragment'; got {first!r}"
    return int(m.group(1)), int(m.group(2)), m.group(3)


# --- valid modules ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", VALID, ids=[p.name for p in VALID])
def test_valid_module_round_trips(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    module = parse_module(text, path.name)
    assert verify_errors(module) == []
    printed = print_module(module)
    reparsed = parse_module(printed, path.name)
    assert reparsed == module
    assert print_module(reparsed) == printed  # the canonical form is a fixed point
    assert verify_errors(reparsed) == []
    assert module_hash(reparsed) == module_hash(module)


@pytest.mark.parametrize("path", VALID, ids=[p.name for p in VALID])
def test_valid_module_checks_clean(path: Path) -> None:
    module, errors = check_text(path.read_text(encoding="utf-8"), path.name)
    assert module is not None
    assert errors == []


# --- invalid modules --------------------------------------------------------------------------


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_module_diagnostic(path: Path) -> None:
    line, col, fragment = _expectation(path)
    _, errors = check_text(path.read_text(encoding="utf-8"), path.name)
    assert errors, f"{path.name}: expected a diagnostic, got none"
    first = errors[0]
    assert (first.span.line, first.span.col) == (line, col), str(first)
    assert fragment in first.message, str(first)
    text = str(first)
    assert f"{path.name}:{line}:{col}: " in text
    caret = text.splitlines()[-1]
    assert re.fullmatch(r" *\^~*", caret), text
    assert caret.index("^") == col + 1, text  # two spaces of indent, then col - 1


def test_golden_counts() -> None:
    assert len(VALID) >= 12, [p.name for p in VALID]
    assert len(INVALID) >= 45, [p.name for p in INVALID]
    for path in INVALID:
        _expectation(path)


# --- command line -----------------------------------------------------------------------------

CANONICAL_SOURCE = VECTORS / "valid" / "calls_state.dtm"


def _one_line_error(err: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dtm: error: "), err


def test_cli_check_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["check", *map(str, VALID)]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("", "")


def test_cli_check_invalid(capsys: pytest.CaptureFixture[str]) -> None:
    path = VECTORS / "invalid" / "undefined_value.dtm"
    line, col, fragment = _expectation(path)
    assert run(["check", str(VALID[0]), str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}:{line}:{col}: verify error: " in err
    assert fragment in err
    assert "1 of 2 file(s) have errors" in err


@pytest.mark.parametrize("kind", ["missing", "directory", "binary", "not_utf8"])
def test_cli_check_unreadable(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{kind}.dtm"
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"dtm 1.0\nmodule m\x00\x01\x02\n")
    elif kind == "not_utf8":
        path.write_bytes(b"dtm 1.0\nmodule caf\xe9\n")
    assert run(["check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_line_error(err)
    assert str(path) in err
    assert "Traceback" not in err


def test_cli_fmt_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    canonical = tmp_path / "canonical.dtm"
    canonical.write_text(print_module(parse_module(CANONICAL_SOURCE.read_text())), "utf-8")
    assert run(["fmt", "--check", str(canonical)]) == 0
    assert run(["fmt", "--check", str(CANONICAL_SOURCE)]) == 1  # comments, line breaks
    _, err = capsys.readouterr()
    assert "not in canonical form" in err


def test_cli_fmt_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.dtm"
    shutil.copy(CANONICAL_SOURCE, path)
    want = print_module(parse_module(CANONICAL_SOURCE.read_text()))
    assert run(["fmt", "-w", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == want
    assert run(["fmt", "--check", str(path)]) == 0
    assert run(["fmt", str(path)]) == 0
    assert capsys.readouterr().out == want


def test_cli_fmt_invalid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.dtm"
    shutil.copy(VECTORS / "invalid" / "undefined_value.dtm", path)
    before = path.read_text(encoding="utf-8")
    assert run(["fmt", "-w", str(path)]) == 1
    assert path.read_text(encoding="utf-8") == before
    assert "use of undefined value" in capsys.readouterr().err


def _hash(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert run(["hash", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert HASH_RE.fullmatch(out), out
    return out


def test_cli_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = CANONICAL_SOURCE.read_text(encoding="utf-8")
    original = tmp_path / "original.dtm"
    original.write_text(text, encoding="utf-8")
    # renamed SSA values, extra comments, blank lines and spaces: the same meaning
    renamed = re.sub(r"%([A-Za-z0-9_.]+)", r"%renamed_\1", text)
    assert renamed != text
    noisy = "\n".join(f"   {line}   // noise\n" for line in renamed.splitlines())
    noisy = noisy.replace(", ", " ,   ").replace(" = ", "   =   ")
    copy = tmp_path / "copy.dtm"
    copy.write_text("// a leading comment\n\n" + noisy, encoding="utf-8")
    changed = tmp_path / "changed.dtm"
    assert "constant 0.5 :" in text
    changed.write_text(text.replace("constant 0.5 :", "constant 0.25 :"), encoding="utf-8")

    h_original = _hash(original, capsys)
    assert _hash(copy, capsys) == h_original
    assert h_original == module_hash(parse_module(text))
    assert _hash(changed, capsys) != h_original


def test_cli_hash_invalid(capsys: pytest.CaptureFixture[str]) -> None:
    path = VECTORS / "invalid" / "recursion.dtm"
    assert run(["hash", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "recursive call" in err


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["frobnicate"]) == 2
    _one_line_error(capsys.readouterr().err)
    assert run(["hash", str(VECTORS / "valid" / "no_such_file.dtm")]) == 2
    _one_line_error(capsys.readouterr().err)


TWO_ERRORS = """dtm 1.0
module two

func @g(%x: f32[4]) -> f32[4] {
  %y = exp %undefined_a : f32[4]
  return %y
}

entry func @f(%x: f32[4]) -> f32[4] {
  %y = exp %undefined_b : f32[4]
  return %y
}
"""


@pytest.mark.parametrize("command", ["check", "fmt", "hash"])
def test_cli_prints_diagnostics_in_order(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dtm fmt`` and ``dtm hash`` print an invalid module's diagnostics as ``dtm check``
    does: first error first, then one summary line (spec §10.3)."""
    path = tmp_path / "two.dtm"
    path.write_text(TWO_ERRORS, encoding="utf-8")
    assert run([command, str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    first = err.index(f"{path}:5:12: verify error: use of undefined value %undefined_a")
    second = err.index(f"{path}:10:12: verify error: use of undefined value %undefined_b")
    assert first < second
    last = err.rstrip().splitlines()[-1]
    if command == "check":
        assert last == "dtm check: 1 of 1 file(s) have errors"
    else:
        assert last == f"dtm: error: {path}: 2 error(s), see above"


@pytest.mark.parametrize("bounds", ["high nan", "low nan", "low nan high nan"])
def test_random_uniform_nan_bound_is_refused(bounds: str) -> None:
    """A NaN bound of ``random uniform`` fails ``low <= high`` (spec §8.2.3). Not a golden
    file: a module holding a NaN attribute never compares equal to itself, which the fast
    path's module comparison needs."""
    text = (
        "dtm 1.0\nmodule bad\nentry func @main() -> f32[8] {\n"
        f"  %y = random uniform seed 1 {bounds} : f32[8]\n  return %y\n}}\n"
    )
    _, errors = check_text(text, "t.dtm")
    assert len(errors) == 1 and "random: need low <= high" in errors[0].message, errors
    assert "nan" in errors[0].message
