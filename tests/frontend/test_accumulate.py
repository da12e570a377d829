"""Gradient accumulation without a pipeline (``train_step(accumulate=K)``), on simulated
ranks: K microbatches per optimizer step equal the big batch's step (float64, to rounding;
bit for bit in deterministic mode), on one rank and over dp; checkpoints move both ways
between an accumulating run and one without; each misuse is one error naming what."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from tests.frontend.test_fit_pipeline import deterministic  # noqa: F401 (a fixture)
from tests.pipeline_case import T, gpt, lm_loss, token_batch

BATCH = 8


def loader(step: int, regions: Mapping[str, tuple[slice, ...]]) -> dict[str, np.ndarray]:
    data = token_batch(BATCH, 300 + step)
    return {k: data[k][r] for k, r in regions.items()}


def _step(accumulate: int | None = None, **kw: object) -> dtm.TracedStep:
    return dtm.train_step(
        gpt(),
        lm_loss,
        mesh=dtm.Mesh(dp=1, tp=1),
        inputs={k: dtm.Input((BATCH, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(lr=1e-2),
        clip_norm=0.5,
        accumulate=accumulate,
        **kw,  # type: ignore[arg-type]
    )


def _same(got: dtm.FitResult, want: dtm.FitResult, first: int = 0) -> None:
    np.testing.assert_allclose(
        [m["loss"] for m in got.metrics], [m["loss"] for m in want.metrics[first:]], rtol=1e-12
    )
    assert sorted(got.outputs) == sorted(want.outputs)
    for k, v in want.outputs.items():
        np.testing.assert_allclose(got.outputs[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize(("k", "ranks"), [(2, 1), (4, 1), (2, 2)])
def test_accumulated_microbatches_train_as_the_big_batch(k: int, ranks: int) -> None:
    want = dtm.fit(_step(), loader, steps=3, sim=1, quiet=True)
    got = dtm.fit(_step(k), loader, steps=3, sim=ranks, mesh={"dp": ranks}, quiet=True)
    _same(got, want)


def test_checkpoints_move_between_accumulating_and_plain_runs(tmp_path: Path) -> None:
    want = dtm.fit(_step(), loader, steps=4, sim=1, quiet=True)
    a = dtm.CheckpointPolicy(str(tmp_path / "a"), every=2)
    dtm.fit(_step(4), loader, steps=2, sim=2, mesh={"dp": 2}, checkpoint=a, quiet=True)
    again = dtm.CheckpointPolicy(str(tmp_path / "a"), resume=True)
    _same(dtm.fit(_step(), loader, steps=4, sim=1, checkpoint=again, quiet=True), want, 2)
    b = dtm.CheckpointPolicy(str(tmp_path / "b"), every=2)
    dtm.fit(_step(), loader, steps=2, sim=1, checkpoint=b, quiet=True)
    again = dtm.CheckpointPolicy(str(tmp_path / "b"), resume=True)
    got = dtm.fit(_step(2), loader, steps=4, sim=2, mesh={"dp": 2}, checkpoint=again, quiet=True)
    _same(got, want, 2)


@pytest.mark.parametrize(("k", "ranks"), [(2, 2), (4, 1)])
def test_in_deterministic_mode_accumulation_has_the_big_batch_bits(
    deterministic: object,  # noqa: F811
    k: int,
    ranks: int,
) -> None:
    want = dtm.fit(_step(), loader, steps=2, sim=1, quiet=True)
    got = dtm.fit(_step(k), loader, steps=2, sim=ranks, mesh={"dp": ranks}, quiet=True)
    assert [x["loss"] for x in got.metrics] == [x["loss"] for x in want.metrics]
    differ = [n for n, v in want.outputs.items() if got.outputs[n].tobytes() != v.tobytes()]
    assert not differ, differ


def test_misuse_is_one_error_naming_it() -> None:
    with pytest.raises(UsageError, match=r"accumulate=3: input 'ids' has 8 rows .* into 3"):
        _step(3)
    with pytest.raises(UsageError, match="accumulate must be a whole number >= 1; got 0"):
        _step(0)
    with pytest.raises(UsageError, match=r"Pipeline\(microbatches=4"):
        dtm.train_step(
            gpt(),
            lm_loss,
            mesh=dtm.Mesh(pp=1, dp=1),
            inputs={k: dtm.Input((BATCH, T), "i32") for k in ("ids", "tgt")},
            optimizer=dtm.optim.AdamW(),
            pipeline=dtm.Pipeline(microbatches=2),
            accumulate=2,
        )
    assert _step(1).pipeline is None  # K = 1: the plain step
