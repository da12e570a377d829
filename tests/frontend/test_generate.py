"""Generation with a key/value cache (``Llama.decode`` traced once, its caches the step's
state): greedy tokens equal transformers' ``generate(do_sample=False)`` for 32 new tokens;
sampling is seeded (the same seed, the same tokens); a prompt past the context, ids outside
the vocabulary are errors. On 1 rank, tp=2 and dp=2 x tp=2 (simulated ranks: threads, each
waiting for the token rank 0 chooses)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.generate import Sampling, generate
from tests.frontend.test_hf_load import CONFIG, _write

HAS_HF = (
    importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("transformers") is not None
)


def hf_llama(d: Path, *, vocab: int, **more: Any) -> Any:
    """A small transformers Llama with distinct logits (weights normal(0, 0.3): the default
    init makes them nearly equal), saved to ``d``; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        **more,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(d)
    return model


@pytest.mark.skipif(not HAS_HF, reason="needs torch and transformers (make setup installs both)")
@pytest.mark.parametrize(
    "sizes",
    [{"dp": 1, "tp": 1}, {"dp": 1, "tp": 2}, {"dp": 2, "tp": 2}],
    ids=["1rank", "tp2", "dp2xtp2"],
)
def test_greedy_tokens_equal_transformers(tmp_path: Path, sizes: dict[str, int]) -> None:
    import torch

    model = hf_llama(tmp_path, vocab=64)
    prompt = np.random.default_rng(0).integers(0, 64, (2, 5)).astype(np.int32)
    want = model.generate(
        torch.from_numpy(prompt.astype(np.int64)),
        max_new_tokens=32,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )[:, 5:].numpy()
    hf = dtm.hf.load(tmp_path, mesh=sizes)
    got = generate(hf.model, hf.weights, prompt, 32, sizes=sizes, sim=sizes["dp"] * sizes["tp"])
    np.testing.assert_array_equal(got, want)


def test_sampling_is_seeded_and_bad_requests_are_named(tmp_path: Path) -> None:
    _write(tmp_path / "m", CONFIG)
    hf = dtm.hf.load(tmp_path / "m")
    prompt = np.array([[1, 2, 3]], np.int32)
    how = Sampling(greedy=False, temperature=0.8, top_k=5, seed=3)
    a = generate(hf.model, hf.weights, prompt, 6, sim=1, sampling=how)
    b = generate(hf.model, hf.weights, prompt, 6, sim=1, sampling=how)
    assert a.shape == (1, 6) and (a == b).all() and ((a >= 0) & (a < 40)).all()
    with pytest.raises(UsageError, match="need 35 positions; the model has 32"):
        generate(hf.model, hf.weights, prompt, 32, sim=1)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        generate(hf.model, hf.weights, np.array([[40]]), 2, sim=1)


def test_state_carries_between_steps_and_must_be_assigned() -> None:
    from dtm_mpi.frontend import functional as fn

    class Empty(dtm.nn.Module):
        pass

    def count(m: dtm.nn.Module, x: dtm.Tensor) -> dtm.Tensor:
        c = fn.state("count", (2,))
        fn.assign(c, c + x)
        return c

    step = dtm.forward_step(
        Empty(), count, mesh=dtm.Mesh(dp=1), inputs={"x": dtm.Input((2,), "f32")}
    )
    res = dtm.fit(
        step,
        lambda s, r: {"x": np.full(2, s + 1, np.float32)},
        steps=3,
        sim=1,
        mesh={"dp": 1},
        quiet=True,
    )
    assert [float(t["output"][0]) for t in res.tensors] == [0.0, 1.0, 3.0]

    def unassigned(m: dtm.nn.Module, x: dtm.Tensor) -> dtm.Tensor:
        return fn.state("count", (2,)) + x

    with pytest.raises(UsageError, match="never assigned"):
        dtm.forward_step(
            Empty(), unassigned, mesh=dtm.Mesh(dp=1), inputs={"x": dtm.Input((2,), "f32")}
        )
