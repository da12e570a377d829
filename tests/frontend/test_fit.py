"""fit() on simulated ranks in the modes of the one executor and step loop: overlapped
allreduces with deterministic mode and CPU chains (the same bits on every mesh), an injected
fault named with its rank and place, and rank 0's progress bar."""

from __future__ import annotations

import pytest

from dtm_mpi.errors import DtmError
from tests.runtime.test_executor_modes import _fresh_config, _set
from tests.runtime.test_sim_checkpoints import _tiny_fit

__all__ = ["_fresh_config"]  # (the autouse fixture: a fresh configuration for every test)


def test_fit_overlaps_its_allreduces_in_deterministic_mode_with_the_same_bits_on_every_mesh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _set(monkeypatch, DTM_DETERMINISTIC="1", DTM_OVERLAP="0", DTM_FUSE="1")
    one = _tiny_fit(steps=3, sim=1, mesh={"dp": 1, "tp": 1})
    _set(monkeypatch, DTM_DETERMINISTIC="1", DTM_OVERLAP="1", DTM_BUCKET_BYTES="64", DTM_FUSE="1")
    four = _tiny_fit(steps=3, sim=4, mesh={"dp": 2, "tp": 2})
    assert [m["loss"] for m in four.metrics] == [m["loss"] for m in one.metrics]
    assert sorted(four.outputs) == sorted(one.outputs)
    for k, v in one.outputs.items():
        assert four.outputs[k].tobytes() == v.tobytes(), k


def test_an_injected_fault_in_fit_is_named_with_its_rank_and_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _set(monkeypatch, DTM_FAULT="1:allreduce:raise")
    with pytest.raises(
        DtmError, match=r"injected failure \(DTM_FAULT=1:allreduce:raise\) on rank 1 at allreduce"
    ):
        _tiny_fit(steps=2, sim=2, mesh={"dp": 2, "tp": 1})


def test_fit_shows_rank_0s_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    got = _tiny_fit(steps=3, sim=2, mesh={"dp": 1, "tp": 2}, quiet=False)
    err = capsys.readouterr().err
    assert len(got.metrics) == 3
    assert "3/3" in err and "loss=" in err and "samples/s=" in err, err
