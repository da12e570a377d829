"""The one byte-count parser (:func:`dtm_mpi.units.parse_bytes`) and the ``dtm`` options that
use it: ``--max-bytes-per-rank``, ``bench ckpt --bytes`` and ``bench comm --sizes`` accept and
refuse the same texts (two parsers with different rules before)."""

from __future__ import annotations

import pytest

from dtm_mpi.cli import run
from dtm_mpi.errors import UsageError
from dtm_mpi.units import parse_bytes, parse_ranks_per_file

GOOD = {
    "0": 0,
    "512": 512,
    "64K": 65536,
    "64k": 65536,
    "1M": 2**20,
    "2G": 2 * 2**30,
    "1T": 2**40,
    "1.5K": 1536,
    "1.5KiB": 1536,
    "2kb": 2048,
    "8 MiB": 8 * 2**20,
    "12B": 12,
    ".5k": 512,
    " 7 ": 7,
}
BAD = ["", "-1", "lots", "12Q", "inf", "nan", "1e400", "12ib", "K", "1..5K", "1,5K", "9" * 30]


@pytest.mark.parametrize(("text", "want"), list(GOOD.items()))
def test_parse_bytes(text: str, want: int) -> None:
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", BAD)
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(UsageError, match="byte count"):
        parse_bytes(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["explain", "examples/tp_mlp.dtm", "--max-bytes-per-rank", "12Q"],
        ["bench", "comm", "--sizes", "8,12Q"],
        ["bench", "ckpt", "--bytes", "12Q"],
    ],
    ids=["max-bytes-per-rank", "bench-comm-sizes", "bench-ckpt-bytes"],
)
def test_every_size_option_uses_the_one_parser(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).parent.parent)
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert "not a byte count: '12Q'" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("text", "want"), [("1", 1), ("4", 4), (" 16 ", 16), ("all", 0), ("ALL", 0), ("007", 7)]
)
def test_ranks_per_file_valid(text: str, want: int) -> None:
    assert parse_ranks_per_file(text) == want


@pytest.mark.parametrize("text", ["0", "-1", "", "two", "1.5", "+2", "٣", "all ranks"])
def test_ranks_per_file_invalid_states_the_rule_and_what_was_found(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_ranks_per_file(text)
    assert str(info.value) == f"expected an integer >= 1 or all, got {text!r}"
