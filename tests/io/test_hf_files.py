"""Hugging Face safetensors directories without the safetensors package: the files written by
``write_weights`` read back by ``open_weights`` (one file and shards with an index; f32, f16,
bf16), blocks read from the mapped file, the names of each architecture in both directions,
and every malformed file one error naming the file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import UsageError
from dtm_mpi.io import hf_files
from dtm_mpi.ir.types import DType


def _bf16_values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """binary32 values that are bf16 values (the low 16 bits zero)."""
    v = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _tensors() -> list[tuple[str, DType, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        ("model.embed_tokens.weight", DType.F32, rng.standard_normal((10, 4)).astype(np.float32)),
        ("model.norm.weight", DType.F16, rng.standard_normal(4).astype(np.float16)),
        ("lm_head.weight", DType.BF16, _bf16_values((10, 4), 1)),
    ]


def test_one_file_round_trips_f32_f16_bf16(tmp_path: Path) -> None:
    written = hf_files.write_weights(tmp_path, "llama", _tensors())
    assert [p.name for p in written] == ["model.safetensors"]
    got = hf_files.open_weights(tmp_path, "llama")
    assert sorted(got) == sorted(n for n, _, _ in _tensors())
    for name, dtype, value in _tensors():
        t = got[name]
        assert t.shape == value.shape
        want = value.astype(np.float32) if dtype is DType.BF16 else value
        np.testing.assert_array_equal(np.asarray(t), want)
    # bf16 comes back as binary32 holding the bf16 values
    assert got["lm_head.weight"].dtype == np.float32
    assert got["model.norm.weight"].dtype == np.float16


def test_a_block_is_read_from_the_mapped_file(tmp_path: Path) -> None:
    hf_files.write_weights(tmp_path, "llama", _tensors())
    t = hf_files.open_weights(tmp_path, "llama")["lm_head.weight"]
    np.testing.assert_array_equal(t[3:7, 1:3], _bf16_values((10, 4), 1)[3:7, 1:3])


def test_shards_with_an_index_round_trip(tmp_path: Path) -> None:
    written = hf_files.write_weights(tmp_path, "llama", _tensors(), max_shard_bytes=50)
    names = sorted(p.name for p in written)
    assert hf_files.INDEX_NAME in names
    assert "model-00001-of-00003.safetensors" in names and hf_files.SINGLE_NAME not in names
    index = json.loads((tmp_path / hf_files.INDEX_NAME).read_text())
    assert set(index["weight_map"]) == {n for n, _, _ in _tensors()}
    got = hf_files.open_weights(tmp_path, "llama")
    np.testing.assert_array_equal(np.asarray(got["model.embed_tokens.weight"]), _tensors()[0][2])
    # writing again in one file removes the stale index
    hf_files.write_weights(tmp_path, "llama", _tensors())
    assert not (tmp_path / hf_files.INDEX_NAME).exists()


def test_gpt2_names_both_ways() -> None:
    assert (
        hf_files.to_model_name("gpt2", "h.0.attn.c_attn.weight")
        == "transformer.h.0.attn.c_attn.weight"
    )
    assert hf_files.to_model_name("gpt2", "transformer.wte.weight") == "transformer.wte.weight"
    assert hf_files.to_model_name("gpt2", "lm_head.weight") is None  # tied to wte
    assert hf_files.to_model_name("gpt2", "transformer.h.3.attn.bias") is None  # a mask buffer
    assert hf_files.to_hf_name("gpt2", "transformer.h.0.mlp.c_fc.weight") == (
        "transformer.h.0.mlp.c_fc.weight",
        "identity",
    )
    assert hf_files.to_model_name("llama", "model.layers.0.self_attn.rotary_emb.inv_freq") is None


def test_unprefixed_gpt2_files_load_under_the_model_names(tmp_path: Path) -> None:
    w = np.ones((3, 2), np.float32)
    hf_files.write_weights(
        tmp_path, "llama", [("wte.weight", DType.F32, w)]
    )  # "*" -> "*": as given
    got = hf_files.open_weights(tmp_path, "gpt2")
    assert list(got) == ["transformer.wte.weight"]


def _raw(path: Path, data: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\x01\x02", "shorter than its 8-byte header length"),
        ((1000).to_bytes(8, "little") + b"{}", "beyond the file"),
        ((4).to_bytes(8, "little") + b"nope", "header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ],
    ids=["short", "header-beyond-file", "not-json", "not-object"],
)
def test_a_malformed_file_names_the_file(tmp_path: Path, data: bytes, needle: str) -> None:
    d = _raw(tmp_path / "m", data)
    with pytest.raises(UsageError, match=needle) as info:
        hf_files.open_weights(d, "llama")
    assert str(d / "model.safetensors") in str(info.value)


def test_data_beyond_the_file_names_the_tensor(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    d = _raw(tmp_path / "m", len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(UsageError, match="'w'"):
        hf_files.open_weights(d, "llama")


def test_an_index_naming_a_tensor_its_file_lacks(tmp_path: Path) -> None:
    hf_files.write_weights(tmp_path, "llama", _tensors(), max_shard_bytes=50)
    index = json.loads((tmp_path / hf_files.INDEX_NAME).read_text())
    index["weight_map"]["model.layers.0.mlp.up_proj.weight"] = "model-00001-of-00003.safetensors"
    (tmp_path / hf_files.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(UsageError, match=r"up_proj\.weight"):
        hf_files.open_weights(tmp_path, "llama")


def test_no_weights_and_no_config_are_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"no model\.safetensors"):
        hf_files.open_weights(tmp_path, "llama")
    with pytest.raises(UsageError, match=r"config\.json: no such file"):
        hf_files.read_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(UsageError, match="not a readable JSON file"):
        hf_files.read_config(tmp_path)


def test_an_unsupported_architecture_is_named() -> None:
    with pytest.raises(UsageError, match="MixtralForCausalLM"):
        hf_files.architecture({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})
    assert hf_files.architecture({"model_type": "llama"}) == "llama"
