"""``dtm.hf.load`` without torch: a Llama directory written by ``write_weights`` (random
weights) loads under the checkpoint's names and its logits equal a numpy reference of the
Llama equations (float64) at 1 rank and tp=2; a missing tensor, a shape the config
disagrees with, a tensor the model does not use, an unsupported architecture, activation or
rope type is one error naming it. The rotary frequencies with the llama3 scaling follow its
published formula."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.llm import rope_inv_freq
from dtm_mpi.io import hf_files
from dtm_mpi.ir.types import DType

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 40,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _write(
    d: Path, config: dict[str, Any], drop: str | None = None, extra: bool = False
) -> dict[str, np.ndarray]:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    _, model = dtm.hf.model_for(config)
    rng = np.random.default_rng(0)
    weights = {
        name: (
            rng.standard_normal(p.shape) * (0.3 if len(p.shape) > 1 else 0.1) + (len(p.shape) == 1)
        ).astype(np.float32)
        for name, _, _, p in model.named_parameters()
    }
    out = {k: v for k, v in weights.items() if k != drop}
    items = [(k, DType.F32, v) for k, v in out.items()]
    if extra:
        items.append(("model.layers.0.self_attn.q_norm.weight", DType.F32, np.ones(8, np.float32)))
    hf_files.write_weights(d, "llama", items)
    return weights


def _reference_logits(w: dict[str, np.ndarray], c: dict[str, Any], ids: np.ndarray) -> np.ndarray:
    """The Llama equations in float64 (RMSNorm, rotary halves, grouped-query causal
    attention, SwiGLU), written from the model's definition."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    h, kvh = c["num_attention_heads"], c["num_key_value_heads"]
    e = c["hidden_size"] // h
    b, t = ids.shape

    def norm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return g * x / np.sqrt((x * x).mean(-1, keepdims=True) + c["rms_norm_eps"])

    inv = 1.0 / c["rope_theta"] ** (np.arange(0, e, 2) / e)
    ang = np.outer(np.arange(t), inv)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rot(x: np.ndarray) -> np.ndarray:
        x1, x2 = x[..., : e // 2], x[..., e // 2 :]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    x = f["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = norm(x, f[p + "input_layernorm.weight"])
        q = (y @ f[p + "self_attn.q_proj.weight"].T).reshape(b, t, h, e).transpose(0, 2, 1, 3)
        k = (y @ f[p + "self_attn.k_proj.weight"].T).reshape(b, t, kvh, e).transpose(0, 2, 1, 3)
        v = (y @ f[p + "self_attn.v_proj.weight"].T).reshape(b, t, kvh, e).transpose(0, 2, 1, 3)
        q, k = rot(q), rot(k)
        k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(e) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(0, 2, 1, 3).reshape(b, t, h * e) @ f[p + "self_attn.o_proj.weight"].T
        y = norm(x, f[p + "post_attention_layernorm.weight"])
        g = y @ f[p + "mlp.gate_proj.weight"].T
        u = y @ f[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ f[p + "mlp.down_proj.weight"].T
    return norm(x, f["model.norm.weight"]) @ f["lm_head.weight"].T


@pytest.mark.parametrize("sizes", [{"dp": 1, "tp": 1}, {"dp": 1, "tp": 2}], ids=["1rank", "tp2"])
def test_loaded_llama_logits_equal_the_reference(tmp_path: Path, sizes: dict[str, int]) -> None:
    weights = _write(tmp_path / "m", CONFIG)
    hf = dtm.hf.load(tmp_path / "m", mesh=sizes)
    assert hf.architecture == "llama" and set(hf.weights) == set(weights)
    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (2, 7)).astype(np.int32)
    step = dtm.forward_step(
        hf.model,
        lambda m, ids: m(ids),
        mesh=dtm.Mesh(**sizes),
        inputs={"ids": dtm.Input(ids.shape, "i32")},
    )
    res = dtm.fit(
        step,
        lambda s, r: {"ids": ids[r["ids"]]},
        steps=1,
        sim=sizes["tp"],
        mesh=sizes,
        values=hf.weights,
        quiet=True,
    )
    got = res.tensors[0]["output"]
    want = _reference_logits(weights, CONFIG, ids)
    assert got.shape == want.shape == (2, 7, CONFIG["vocab_size"])
    assert np.abs(got - want).max() <= 1e-4


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "m", CONFIG, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(UsageError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        dtm.hf.load(tmp_path / "m")


def test_a_shape_the_config_disagrees_with_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "m", CONFIG)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**CONFIG, "intermediate_size": 64}))
    with pytest.raises(
        UsageError,
        match=r"gate_proj\.weight' has shape \[48, 32\], but the config gives it \[64, 32\]",
    ):
        dtm.hf.load(tmp_path / "m")


def test_a_tensor_the_model_does_not_use_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "m", CONFIG, extra=True)
    with pytest.raises(UsageError, match=r"q_norm\.weight"):
        dtm.hf.load(tmp_path / "m")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
            "Qwen3MoeForCausalLM",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
        ({"torch_dtype": "float8_e4m3fn"}, "float8_e4m3fn"),
        ({"num_attention_heads": 5}, "not a multiple"),
    ],
    ids=["architecture", "activation", "rope-type", "rope-fields", "dtype", "heads"],
)
def test_an_unsupported_config_is_named(
    tmp_path: Path, change: dict[str, Any], needle: str
) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIG, **change}))
    with pytest.raises(UsageError, match=needle) as info:
        dtm.hf.load(d)
    assert "config.json" in str(info.value)


def test_llama3_rope_scaling_follows_its_formula() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    got = rope_inv_freq(128, 500000.0, scaling)
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    wavelen = 2 * math.pi / base
    want = np.empty_like(base)
    for i, (f, w) in enumerate(zip(base, wavelen, strict=True)):
        if w < 8192 / 4.0:  # high frequencies: kept
            want[i] = f
        elif w > 8192 / 1.0:  # low frequencies: divided by the factor
            want[i] = f / 8.0
        else:  # between: interpolated
            s = (8192 / w - 1.0) / (4.0 - 1.0)
            want[i] = (1 - s) * f / 8.0 + s * f
    assert got.dtype == np.float32 and got.shape == (64,)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0] == np.float32(base[0]) and got[-1] < base[-1] / 7.9  # both ends of the band
