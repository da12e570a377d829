"""Mixed precision under real MPI (the MPI suite at 2, 3 and 4 ranks): a bf16 Llama over
``dp`` = the job's ranks follows the same step on one simulated rank (to bf16 rounding), and a
float32 checkpoint resumes in an f16 step with its loss scaler fresh (and back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from tests.frontend.test_mixed_precision import CFG, T, _loss

pytestmark = pytest.mark.mpi(min_size=2)
BATCH = 12


def _feed(step: int, regions: Any) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(step).integers(0, 96, (BATCH, T)).astype(np.int32)
    return {"ids": ids[regions["ids"]]}


def _step(n: int, precision: dtm.MixedPrecision | None) -> Any:
    return dtm.train_step(
        dtm.nn.Llama(CFG, axis="tp"),
        _loss,
        mesh=dtm.Mesh(dp=n, tp=1),
        inputs={"ids": dtm.Input((BATCH, T), "i32", ("dp", None))},
        optimizer=dtm.optim.AdamW(3e-3),
        precision=precision,
    )


def test_mixed_precision_under_mpi(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:
    n = comm.Get_size()
    bf16 = dtm.MixedPrecision()
    want = dtm.fit(_step(1, bf16), _feed, steps=3, sim=1, mesh={"dp": 1, "tp": 1}, quiet=True)
    got = dtm.fit(_step(n, bf16), _feed, steps=3, mesh={"dp": n, "tp": 1}, quiet=True)
    losses, wanted = [m["loss"] for m in got.metrics], [m["loss"] for m in want.metrics]
    all_ranks(np.allclose(losses, wanted, rtol=1e-2), f"bf16 at dp={n}: {losses} vs {wanted}")
    store = str(mpi_tmp_path / "s")
    mesh = {"dp": n, "tp": 1}
    save = dtm.CheckpointPolicy(store, every=2)
    dtm.fit(_step(n, None), _feed, steps=2, mesh=mesh, checkpoint=save, quiet=True)
    again = dtm.CheckpointPolicy(store, resume=True)
    f16 = _step(n, dtm.MixedPrecision(compute="f16"))
    rest = dtm.fit(f16, _feed, steps=4, mesh=mesh, checkpoint=again, quiet=True)
    all_ranks(
        [m["step"] for m in rest.metrics] == [2.0, 3.0]
        and rest.metrics[0]["loss_scale"] == 65536.0,
        f"the f16 resume from float32: {rest.metrics}",
    )
    back = dtm.fit(_step(n, None), _feed, steps=5, mesh=mesh, checkpoint=again, quiet=True)
    all_ranks([m["step"] for m in back.metrics] == [4.0], f"float32 after f16: {back.metrics}")
