"""GPT weights between dtm and PyTorch through safetensors: weights trained here, exported with
``dtm store export``, load into the same GPT written in PyTorch (dtm_mpi/bench/train_torch.py,
parameter for parameter) and give the same loss on the next batch to float32 rounding; the
same file imported into a fresh store starts a run here whose first loss is that loss again."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.io.interop import export_tensors, import_tensors
from dtm_mpi.io.store import committed_name, read_latest
from dtm_mpi.io.tools import read_manifest, read_tensor
from dtm_mpi.runtime.policies import checkpoint_policy
from tests.test_cli_store import comm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch is not installed (the bench extra)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("safetensors") is None,
        reason="safetensors is not installed (the interop extra)",
    ),
]
DIMS = {"vocab": 32, "context": 16, "dim": 32, "heads": 2, "layers": 2}
BATCH = 4


def _step() -> Any:
    from dtm_mpi import frontend as dtm
    from dtm_mpi.bench.train_models import gpt_loss

    spec = dtm.Input((BATCH, DIMS["context"]), "i32", ("dp", None))
    model = dtm.nn.GPT(DIMS["vocab"], DIMS["context"], DIMS["dim"], DIMS["heads"], DIMS["layers"])
    return dtm.train_step(
        model,
        gpt_loss,
        mesh=dtm.Mesh(dp=1, tp=1),
        inputs={"ids": spec, "tgt": spec},
        optimizer=dtm.optim.AdamW(lr=3e-3),
    )


def _batch(i: int, regions: Any = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([8, i])
    ids = rng.integers(0, DIMS["vocab"], (BATCH, DIMS["context"] + 1)).astype(np.int32)
    return {"ids": np.ascontiguousarray(ids[:, :-1]), "tgt": np.ascontiguousarray(ids[:, 1:])}


def test_trained_weights_give_the_same_loss_in_pytorch_and_come_back(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from dtm_mpi import frontend as dtm
    from dtm_mpi.bench.train_torch import _gpt_module

    store = tmp_path / "s"
    step = _step()
    dtm.fit(step, _batch, steps=3, sim=1, checkpoint=checkpoint_policy(str(store)), quiet=True)
    # the loss of the trained weights on batch 3: one more step (its loss comes before its update)
    more = dtm.fit(
        step,
        _batch,
        steps=4,
        sim=1,
        checkpoint=checkpoint_policy(str(store), resume=True),
        quiet=True,
    )
    want = more.metrics[-1]["loss"]
    assert more.metrics[-1]["step"] == 3

    ckpt = store / committed_name(3)
    weights = [  # the model's parameters: not the optimizer's state (moments, step counter)
        a.name
        for a in read_manifest(ckpt).artifacts
        if not a.name.startswith("opt.") and a.dtype.value.startswith("f")
    ]
    out = tmp_path / "gpt.safetensors"
    export_tensors(store, out, names=weights, step=3)
    loaded = load_file(str(out))
    assert sorted(loaded) == sorted(weights)
    model = _gpt_module({k: v.numpy() for k, v in loaded.items()}, dims=DIMS)
    b = _batch(3)
    with torch.no_grad():
        logits = model(torch.from_numpy(b["ids"]))
        theirs = torch.nn.functional.cross_entropy(
            logits.reshape(-1, DIMS["vocab"]), torch.from_numpy(b["tgt"]).long().reshape(-1)
        )
    assert float(theirs) == pytest.approx(want, rel=2e-6, abs=2e-6)

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    import_tensors(fresh, out, comm())
    latest = read_latest(fresh)
    assert latest is not None
    values = {w: read_tensor(fresh / committed_name(latest), w) for w in weights}
    again = dtm.fit(step, lambda i, r: _batch(3 + i), steps=2, sim=1, values=values, quiet=True)
    assert again.metrics[0]["loss"] == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert again.metrics[1]["loss"] < again.metrics[0]["loss"] + 0.5  # it trains on
