"""Gradient accumulation under real MPI (the MPI suite at 2, 3 and 4 ranks): the small GPT's
``train_step(accumulate=2)`` over ``dp`` = the job's ranks trains as the big batch on one
simulated rank, and its checkpoint resumes in a step without accumulation."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from tests.pipeline_case import T, gpt, lm_loss, token_batch

pytestmark = pytest.mark.mpi(min_size=2)
BATCH = 24  # two microbatches of 12 rows: divisible over 2, 3 and 4 ranks


def loader(step: int, regions: Mapping[str, tuple[slice, ...]]) -> dict[str, np.ndarray]:
    data = token_batch(BATCH, 500 + step)
    return {k: data[k][r] for k, r in regions.items()}


def _step(ranks: int, accumulate: int | None) -> Any:
    return dtm.train_step(
        gpt(),
        lm_loss,
        mesh=dtm.Mesh(dp=ranks, tp=1),
        inputs={k: dtm.Input((BATCH, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(lr=1e-2),
        accumulate=accumulate,
    )


def test_accumulation_under_mpi_trains_as_the_big_batch_and_resumes_without_it(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
    n = comm.Get_size()
    want = dtm.fit(_step(1, None), loader, steps=4, sim=1, mesh={"dp": 1, "tp": 1}, quiet=True)
    wanted = [m["loss"] for m in want.metrics]
    store = str(mpi_tmp_path / "store")
    got = dtm.fit(
        _step(n, 2),
        loader,
        steps=2,
        mesh={"dp": n, "tp": 1},
        checkpoint=dtm.CheckpointPolicy(store, every=2),
        quiet=True,
    )
    losses = [m["loss"] for m in got.metrics]
    all_ranks(
        np.allclose(losses, wanted[:2], rtol=1e-12),
        f"accumulated losses at dp={n} {losses} differ from the big batch's {wanted[:2]}",
    )
    rest = dtm.fit(
        _step(n, None),
        loader,
        steps=4,
        mesh={"dp": n, "tp": 1},
        checkpoint=dtm.CheckpointPolicy(store, resume=True),
        quiet=True,
    )
    tail = [m["loss"] for m in rest.metrics]
    all_ranks(
        np.allclose(tail, wanted[2:], rtol=1e-12),
        f"resumed without accumulation: {tail}, the uninterrupted run {wanted[2:]}",
    )


def test_zero3_with_accumulation_under_mpi_trains_as_the_big_batch(
    comm: Any, all_ranks: Any
) -> None:
    """Parameters sharded over dp (ZeRO-3) inside the one-stage pipeline accumulation runs
    as: the big batch's training on one simulated rank."""
    n = comm.Get_size()
    want = dtm.fit(_step(1, None), loader, steps=3, sim=1, mesh={"dp": 1, "tp": 1}, quiet=True)
    step = dtm.train_step(
        gpt(),
        lm_loss,
        mesh=dtm.Mesh(dp=n, tp=1),
        inputs={k: dtm.Input((BATCH, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(lr=1e-2),
        accumulate=2,
        shard_params="dp",
    )
    got = dtm.fit(step, loader, steps=3, mesh={"dp": n, "tp": 1}, quiet=True)
    losses = [m["loss"] for m in got.metrics]
    wanted = [m["loss"] for m in want.metrics]
    all_ranks(
        np.allclose(losses, wanted, rtol=1e-12),
        f"ZeRO-3 accumulated at dp={n}: {losses}, the big batch {wanted}",
    )
