"""Overlapped allreduces (``DTM_OVERLAP=1``): buckets planned alike on every rank
(:mod:`dtm_mpi.plan.overlap`), run by the executor's fast loop; the examples give the
reference's values with exactly the collectives the plan counts (one per bucket), and in
deterministic mode (op by op) the members run where they stand, with the same bits."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from dtm_mpi.config import get_config
from dtm_mpi.runtime.simulate import run_simulated
from tests.runtime.test_sim_examples import NAMES, assert_matches, load


@pytest.fixture
def overlap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("DTM_OVERLAP", "1")
    monkeypatch.setenv("DTM_BUCKET_BYTES", str(1 << 20))
    get_config.cache_clear()
    yield
    monkeypatch.delenv("DTM_OVERLAP")
    monkeypatch.delenv("DTM_BUCKET_BYTES")
    get_config.cache_clear()


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "pipeline"])
def test_examples_with_overlapped_buckets_match_the_reference(overlap: None, name: str, nranks: int) -> None:  # fmt: skip
    assert_matches(load(name), nranks, None)


def test_deterministic_mode_ignores_buckets_and_keeps_its_bits(overlap: None) -> None:
    module = load("tp_mlp")
    got = run_simulated(module, 4, binding={"dp": 2, "tp": 2}, steps=2, deterministic=True).outputs()  # fmt: skip
    one = run_simulated(module, 1, steps=2, deterministic=True).outputs()
    for k, v in one.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
