"""Lines dtm prints are written whole: one ``write`` per line, so a launcher merging the ranks'
pipes never splices another line into one (``...(after step 5)dtm run: stopped ...``)."""

from __future__ import annotations

import io
import sys

import pytest

from dtm_mpi.console import say, write_line


class _Writes(io.StringIO):
    """A stream that records each write call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


@pytest.mark.parametrize(("func", "stream"), [(say, "stdout"), (write_line, "stderr")])
def test_a_line_and_its_newline_are_one_write(
    func: object, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _Writes()
    monkeypatch.setattr(sys, stream, fake)
    func("checkpoint /s/ckpt-5 (after step 5)")  # type: ignore[operator]
    func("two\nlines")  # type: ignore[operator]
    assert fake.calls == ["checkpoint /s/ckpt-5 (after step 5)\n", "two\nlines\n"]


def test_print_would_split_it() -> None:
    """Why: ``print`` writes the text and the newline apart (what the helpers avoid)."""
    fake = _Writes()
    print("checkpoint /s/ckpt-5 (after step 5)", file=fake)
    assert fake.calls == ["checkpoint /s/ckpt-5 (after step 5)", "\n"]
