"""The control channel's bookkeeping of failures (pure parts, no MPI): whatever order the
reports of the same failures arrive in, every rank keeps the same list and messages."""

from __future__ import annotations

import itertools
from typing import Any

from dtm_mpi.comm.control import Control


class _FakeMPI:
    @staticmethod
    def Status() -> Any:
        return None


def _control(rank: int) -> Control:
    return Control(_FakeMPI, None, rank, 4, lambda: "")


REPORTS = [
    (1, [(1, "step 0", "injected failure on rank 1")]),  # rank 1's own report
    (0, [(2, "step 0", "in no communication while rank 0 waited")]),
    (3, [(2, "step 0", "in no communication while rank 3 waited"), (1, "step 0", "seen by 3")]),
]


def test_the_same_reports_in_any_order_give_the_same_error() -> None:
    texts = set()
    for order in itertools.permutations(REPORTS):
        c = _control(0)
        for reporter, failures in order:
            c._merge(reporter, failures)
        err = c.error()
        assert err is not None
        texts.add(str(err))
    assert len(texts) == 1
    (text,) = texts
    assert text.startswith("step 0 failed on rank(s) 1, 2: ")
    assert "injected failure on rank 1" in text  # a rank's own report wins
    assert "while rank 0 waited" in text and "rank 3 waited" not in text  # then the lowest


def test_no_failure_is_no_error_and_phases_are_counted() -> None:
    c = _control(2)
    assert c.error() is None
    start = c.seq
    c.phase = "load"
    c.phase = "plan"
    assert (c.phase, c.seq - start) == ("plan", 2)
