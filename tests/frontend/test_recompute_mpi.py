"""Activation recomputation under real MPI (the MPI suite at 2, 3 and 4 ranks): a Llama over
``dp`` = the job's ranks with ``recompute="full"`` and ``"selective"`` gives the losses and
the final state of the step without it, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from tests.frontend.test_recompute import CFG, T, _loss

pytestmark = pytest.mark.mpi(min_size=2)
BATCH = 12  # divides over 2, 3 and 4 ranks


def _feed(step: int, regions: Any) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(step).integers(0, 64, (BATCH, T)).astype(np.int32)
    return {"ids": ids[regions["ids"]]}


def test_recomputation_under_mpi_has_the_same_bits(comm: Any, all_ranks: Any) -> None:
    n = comm.Get_size()
    runs = {}
    for choice in ("none", "selective", "full"):
        step = dtm.train_step(
            dtm.nn.Llama(CFG, axis="tp", dtype="f64"),
            _loss,
            mesh=dtm.Mesh(dp=n, tp=1),
            inputs={"ids": dtm.Input((BATCH, T), "i32", ("dp", None))},
            optimizer=dtm.optim.AdamW(1e-2),
            recompute=choice,
        )
        runs[choice] = dtm.fit(step, _feed, steps=2, mesh={"dp": n, "tp": 1}, quiet=True)
    want = runs["none"]
    for choice in ("selective", "full"):
        got = runs[choice]
        same = [m["loss"] for m in got.metrics] == [m["loss"] for m in want.metrics] and all(
            got.outputs[k].tobytes() == v.tobytes() for k, v in want.outputs.items()
        )
        all_ranks(same, f"recompute={choice} at dp={n} differs from the step without it")
