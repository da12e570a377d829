"""The LLM models against their numerics of record, Hugging Face transformers' modeling code
(parity as torchtitan checks it): tiny configs with random weights (nothing downloaded), saved
with ``save_pretrained`` and loaded with ``dtm.hf.load`` (memory-mapped safetensors), on
simulated ranks at 1 rank, tp=2, dp=2 and dp=2 x tp=2 (tp=4 with fewer kv heads: the kv
projections replicated):

* logits: per-position KL < 1e-6 and max |difference| <= 1e-4 in float32;
* the loss with ``labels=ids`` equal to HF's, and every gradient equal to torch autograd's
  through the HF model (relative 1e-5, in float64), also pipelined (pp=2, tp=2 x pp=2).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.frontend import functional as fn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="the parity tests need torch and transformers (the test and bench extras; make setup installs both)",
)

B, T, V = 2, 12, 96


def _hf_model(kind: str, dtype: str = "float32") -> Any:
    import torch
    import transformers

    torch.manual_seed({"llama": 0, "llama-tied": 1, "llama-mqa": 2, "gpt2": 3, "gpt2-erf": 4}[kind])
    if kind.startswith("llama"):
        cfg = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1 if kind == "llama-mqa" else 2,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=kind == "llama-tied",
            attn_implementation="eager",
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=V,
            n_positions=32,
            n_embd=64,
            n_layer=2,
            n_head=4,
            # transformers' "gelu" is the exact x Phi(x) (BERT-style); GPT-2's own the tanh form
            activation_function="gelu" if kind == "gpt2-erf" else "gelu_new",
            attn_implementation="eager",
        )
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 and 0)
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(getattr(torch, dtype)).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for kind in ("llama", "llama-tied", "llama-mqa", "gpt2", "gpt2-erf"):
        d = tmp_path_factory.mktemp(kind)
        _hf_model(kind).save_pretrained(d)
        out[kind] = d
    return out


def _ids(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)


def _hf_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()


def _dtm_logits(path: Path, ids: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
    hf = dtm.hf.load(path, mesh=sizes)
    step = dtm.forward_step(
        hf.model,
        lambda m, ids: m(ids),
        mesh=dtm.Mesh(**sizes),
        inputs={"ids": dtm.Input(ids.shape, "i32", ("dp", None))},
    )
    res = dtm.fit(
        step,
        lambda s, r: {"ids": ids[r["ids"]]},
        steps=1,
        sim=int(np.prod(list(sizes.values()))),
        mesh=sizes,
        values=hf.weights,
        quiet=True,
    )
    (got,) = res.tensors
    return got["output"]


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per position, in float64."""

    def logsm(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logsm(p_logits), logsm(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


MESHES = [
    {"dp": 1, "tp": 1},
    {"dp": 1, "tp": 2},
    {"dp": 2, "tp": 1},
    {"dp": 2, "tp": 2},
]


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: f"dp{s['dp']}xtp{s['tp']}")
@pytest.mark.parametrize("kind", ["llama", "llama-tied", "gpt2", "gpt2-erf"])
def test_logits_equal_transformers(
    saved: dict[str, Path], kind: str, sizes: dict[str, int]
) -> None:
    ids = _ids()
    want = _hf_logits(saved[kind], ids)
    got = _dtm_logits(saved[kind], ids, sizes)
    assert got.shape == want.shape == (B, T, V)
    assert _kl(want, got).max() < 1e-6
    assert np.abs(got - want).max() <= 1e-4


def test_more_ranks_than_kv_heads_replicate_the_kv_projections(saved: dict[str, Path]) -> None:
    """tp=4 with 1 kv head (multi-query attention): the stated layout, the same logits."""
    sizes = {"dp": 1, "tp": 4}
    hf = dtm.hf.load(saved["llama-mqa"], mesh=sizes)
    attn = hf.model.model.layers[0].self_attn  # type: ignore[attr-defined]
    assert not attn.kv_split and attn.k_proj.weight.type().layout.is_replicated
    ids = _ids(1)
    got = _dtm_logits(saved["llama-mqa"], ids, sizes)
    want = _hf_logits(saved["llama-mqa"], ids)
    assert _kl(want, got).max() < 1e-6 and np.abs(got - want).max() <= 1e-4


def _torch_grads(
    kind: str, ids: np.ndarray
) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    import torch

    model = _hf_model(kind, "float64")
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    x = torch.from_numpy(ids.astype(np.int64))
    out = model(x, labels=x)
    out.loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    return float(out.loss.detach()), weights, grads


GRAD_MESHES = [
    ("llama", {"pp": 1, "dp": 1, "tp": 1}),
    ("llama", {"pp": 1, "dp": 2, "tp": 2}),
    ("llama", {"pp": 2, "dp": 1, "tp": 1}),
    ("llama", {"pp": 2, "dp": 1, "tp": 2}),
    ("gpt2", {"pp": 1, "dp": 1, "tp": 1}),
    ("gpt2", {"pp": 1, "dp": 1, "tp": 2}),
    ("gpt2-erf", {"pp": 1, "dp": 2, "tp": 2}),
]


@pytest.mark.parametrize(
    ("kind", "sizes"),
    GRAD_MESHES,
    ids=[f"{k}-pp{s['pp']}xdp{s['dp']}xtp{s['tp']}" for k, s in GRAD_MESHES],
)
def test_loss_and_gradients_equal_torch_autograd(kind: str, sizes: dict[str, int]) -> None:
    """One SGD step with lr 1 in float64: each gradient is the weight less its update."""
    ids = np.random.default_rng(5).integers(0, V, (4, T)).astype(np.int32)
    loss, weights, grads = _torch_grads(kind, ids)
    from dtm_mpi.frontend.hf import model_for

    config = _hf_model(kind).config.to_dict()
    _, model = model_for(config, mesh=sizes, dtype="f64")
    pipeline = dtm.Pipeline(microbatches=2, schedule="1f1b") if sizes["pp"] > 1 else None
    step = dtm.train_step(
        model,
        lambda m, ids: fn.causal_lm_loss(m(ids), ids),
        mesh=dtm.Mesh(**sizes),
        inputs={"ids": dtm.Input(ids.shape, "i32", ("dp", None))},
        optimizer=dtm.optim.SGD(lr=1.0),
        pipeline=pipeline,
    )
    res = dtm.fit(
        step,
        lambda s, r: {"ids": ids[r["ids"]]},
        steps=1,
        sim=int(np.prod(list(sizes.values()))),
        mesh=sizes,
        values={n: weights[n] for n in step.params},
        quiet=True,
    )
    # HF computes the loss in float32 (``logits.float()``), dtm in the model's float64
    assert res.last("loss") == pytest.approx(loss, rel=1e-6)
    assert sorted(step.params) == sorted(n for n in grads if n in step.params)
    for name in step.params:
        mine = weights[name] - res.outputs[name]
        want = grads[name]
        scale = max(np.abs(want).max(), 1e-30)
        assert np.abs(mine - want).max() / scale < 1e-5, name


def test_bf16_checkpoint_loads_as_bf16_and_computes_close_to_float32(tmp_path: Path) -> None:
    """A bf16 checkpoint: bf16 parameters (widened exactly), logits near HF's float32 run of
    the same bf16 weights (the bf16 compute's rounding)."""
    import torch

    model = _hf_model("llama", "bfloat16")
    model.save_pretrained(tmp_path)
    hf = dtm.hf.load(tmp_path)
    assert hf.weights["model.norm.weight"].dtm_dtype.value == "bf16"
    assert hf.model.model.norm.weight.type().dtype.value == "bf16"  # type: ignore[attr-defined]
    ids = _ids(2)
    got = _dtm_logits(tmp_path, ids, {"dp": 1, "tp": 1})
    with torch.no_grad():
        want = model.float()(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    assert np.abs(got - want).max() < 0.05
