"""A token file and a learning-rate schedule under real MPI (the MPI suite at 2, 3 and 4 ranks):
``dtm.fit`` of the small GPT over ``dp`` = the job's ranks, fed by a ``TokenLoader`` (each rank
reads its rows) with a cosine schedule, gives the losses and rates of the same training on one
simulated rank; stopped after two steps with a checkpoint and resumed, it continues the stream
and the curve (the losses of the uninterrupted run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from tests.frontend.test_token_data import WORDS, word_tokenizer
from tests.pipeline_case import VOCAB, T, gpt, lm_loss

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.skipif(
        importlib.util.find_spec("tokenizers") is None,
        reason="token files are written with the `tokenizers` package (make setup installs it)",
    ),
]
BATCH = 12  # divides over 2, 3 and 4 ranks


def _step(ranks: int) -> Any:
    return dtm.train_step(
        gpt(),
        lm_loss,
        mesh=dtm.Mesh(dp=ranks, tp=1),
        inputs={k: dtm.Input((BATCH, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(dtm.optim.schedule("cosine", peak=0.02, warmup=1, total=4)),
    )


def test_token_fed_scheduled_training_under_mpi_equals_one_rank_and_resumes(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
    from dtm_mpi.frontend.token_data import prepare_tokens

    n = comm.Get_size()
    bin_path = mpi_tmp_path / "t.bin"
    if comm.Get_rank() == 0:
        rng = np.random.default_rng(2)
        doc = mpi_tmp_path / "doc.txt"
        doc.write_text(" ".join(WORDS[j] for j in rng.integers(0, VOCAB - 1, 2000)))
        prepare_tokens([doc], word_tokenizer(mpi_tmp_path), bin_path)
    comm.Barrier()
    loader = dtm.TokenLoader(bin_path, context=T, batch=BATCH, seed=1, names={"tgt": "labels"})
    step = _step(n)
    want = dtm.fit(_step(1), loader, steps=4, sim=1, mesh={"dp": 1, "tp": 1}, quiet=True)
    full = dtm.fit(step, loader, steps=4, mesh={"dp": n, "tp": 1}, quiet=True)
    losses = [m["loss"] for m in full.metrics]
    all_ranks(
        np.allclose(losses, [m["loss"] for m in want.metrics], rtol=1e-10),
        f"losses at dp={n} {losses} differ from one rank's {[m['loss'] for m in want.metrics]}",
    )
    all_ranks([m["lr"] for m in full.metrics] == [m["lr"] for m in want.metrics], "the rates")
    store = str(mpi_tmp_path / "store")
    dtm.fit(
        step,
        loader,
        steps=2,
        mesh={"dp": n, "tp": 1},
        checkpoint=dtm.CheckpointPolicy(store, every=2),
        quiet=True,
    )
    rest = dtm.fit(
        step,
        loader,
        steps=4,
        mesh={"dp": n, "tp": 1},
        checkpoint=dtm.CheckpointPolicy(store, resume=True),
        quiet=True,
    )
    got = [m["loss"] for m in rest.metrics]
    all_ranks(
        [m["step"] for m in rest.metrics] == [2.0, 3.0]
        and np.allclose(got, losses[2:], rtol=1e-10),
        f"the resumed steps {rest.metrics} differ from the uninterrupted run's {full.metrics[2:]}",
    )
    other = dtm.TokenLoader(bin_path, context=T, batch=BATCH, seed=2, names={"tgt": "labels"})
    from dtm_mpi.errors import UsageError

    try:
        dtm.fit(
            step,
            other,
            steps=6,
            mesh={"dp": n, "tp": 1},
            checkpoint=dtm.CheckpointPolicy(store, resume=True),
            quiet=True,
        )
        refused = ""
    except UsageError as exc:
        refused = str(exc)
    all_ranks("seed 1 (now 2)" in refused, f"another seed's resume was not refused: {refused!r}")
