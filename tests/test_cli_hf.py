"""``dtm hf import|export|check``: a Hugging Face directory into a store and back bit for bit
(f32 and bf16), a failed check writing nothing to the store, and -- with torch and
transformers -- import, train 10 steps from the store on tp=2, export, and transformers loads
the export and gives the trained dtm model's logits; ``dtm hf check`` passes on a model and
its verdict is the exit status."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.cli import main
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.io import hf_files
from dtm_mpi.io.store import list_checkpoints
from dtm_mpi.ir.types import DType
from tests.frontend.test_hf_load import CONFIG, _write
from tests.test_cli_run import dtm as dtm_cli
from tests.test_cli_run import one_line_error

HAS_HF = (
    importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("transformers") is not None
)
needs_hf = pytest.mark.skipif(
    not HAS_HF, reason="needs torch and transformers (the llm extra; make setup installs both)"
)


def test_import_then_export_gives_the_same_tensors(tmp_path: Path) -> None:
    src = tmp_path / "src"
    weights = _write(src, CONFIG)
    (src / "tokenizer.json").write_text("{}")
    store = tmp_path / "store"
    assert main(["hf", "import", str(src), str(store)]) == 0
    assert json.loads((store / "hf" / "config.json").read_text())["hidden_size"] == 32
    assert main(["hf", "export", str(store), str(tmp_path / "out"), "--max-shard-size", "20K"]) == 0
    out = tmp_path / "out"
    assert (out / hf_files.INDEX_NAME).is_file() and (out / "tokenizer.json").is_file()
    got = hf_files.open_weights(out, "llama")
    assert set(got) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_bf16_stays_bf16(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    config = {**CONFIG, "torch_dtype": "bfloat16"}
    (src / "config.json").write_text(json.dumps(config))
    _, model = dtm.hf.model_for(config)
    rng = np.random.default_rng(0)
    values = {}
    for name, _, _, p in model.named_parameters():
        v = rng.standard_normal(p.shape).astype(np.float32)
        values[name] = (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    hf_files.write_weights(src, "llama", [(n, DType.BF16, v) for n, v in values.items()])
    store = tmp_path / "store"
    assert main(["hf", "import", str(src), str(store)]) == 0
    assert main(["hf", "export", str(store), str(tmp_path / "out")]) == 0
    got = hf_files.open_weights(tmp_path / "out", "llama")
    for name, value in values.items():
        assert got[name].dtm_dtype is DType.BF16
        np.testing.assert_array_equal(np.asarray(got[name]), value)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_a_failed_import_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write(src, CONFIG, drop="model.norm.weight")
    store = tmp_path / "store"
    with pytest.raises(UsageError, match=r"'model\.norm\.weight' is missing"):
        main(["hf", "import", str(src), str(store)])
    assert not store.exists() or not list_checkpoints(store)


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    _write(src, CONFIG)
    (src / "config.json").write_text(
        json.dumps({**CONFIG, "architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    )
    code, _, err = dtm_cli(capsys, "hf", "import", str(src), str(tmp_path / "store"))
    assert code == 2
    assert "MambaForCausalLM, mamba is not supported" in one_line_error(err)
    code, _, err = dtm_cli(capsys, "hf", "export", str(tmp_path / "nostore"), str(tmp_path / "out"))
    assert code == 2 and "nostore" in one_line_error(err)


def test_export_needs_the_config(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write(src, CONFIG)
    store = tmp_path / "store"
    assert main(["hf", "import", str(src), str(store)]) == 0
    (store / "hf" / "config.json").unlink()
    with pytest.raises(UsageError, match="--config"):
        main(["hf", "export", str(store), str(tmp_path / "out")])
    assert (
        main(
            [
                "hf",
                "export",
                str(store),
                str(tmp_path / "out"),
                "--config",
                str(src / "config.json"),
            ]
        )
        == 0
    )
    wider = {**CONFIG, "intermediate_size": 64}
    (tmp_path / "wider").mkdir()
    (tmp_path / "wider" / "config.json").write_text(json.dumps(wider))
    with pytest.raises(
        UsageError,
        match=r"gate_proj\.weight' has shape \[48, 32\], but the config gives it \[64, 32\]",
    ):
        main(
            ["hf", "export", str(store), str(tmp_path / "o2"), "--config", str(tmp_path / "wider")]
        )


def _hf_llama(d: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)


def _hf_logits(d: Path, ids: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    with torch.no_grad():
        logits: np.ndarray = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    return logits


def _hf_loss(d: Path, ids: np.ndarray) -> float:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    x = torch.from_numpy(ids.astype(np.int64))
    with torch.no_grad():
        return float(model(x, labels=x).loss)


@needs_hf
def test_import_train_export_transformers_gives_the_trained_logits(tmp_path: Path) -> None:
    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "out"
    _hf_llama(src)
    assert main(["hf", "import", str(src), str(store)]) == 0
    sizes = {"dp": 1, "tp": 2}
    hf = dtm.hf.load(src, mesh=sizes)
    data = np.random.default_rng(0).integers(0, 64, (8, 2, 12)).astype(np.int32)
    inputs: dict[str, Any] = {"ids": dtm.Input((2, 12), "i32")}
    step = dtm.train_step(
        hf.model,
        lambda m, ids: fn.causal_lm_loss(m(ids), ids),
        mesh=dtm.Mesh(**sizes),
        inputs=inputs,
        optimizer=dtm.optim.AdamW(lr=3e-3, weight_decay=0.0),
        weights_from_store=True,
    )
    res = dtm.fit(
        step,
        lambda s, r: {"ids": data[s % 8][r["ids"]]},
        steps=10,
        sim=2,
        mesh=sizes,
        checkpoint=dtm.CheckpointPolicy(str(store), save_final=True),
        quiet=True,
    )
    losses = [m["loss"] for m in res.metrics]
    assert losses[-1] < losses[0]  # it trained, from the imported weights
    assert abs(losses[0] - _hf_loss(src, data[0])) < 1e-5  # step 0 ran the imported weights
    assert main(["hf", "export", str(store), str(out)]) == 0
    trained = res.outputs
    assert trained is not None
    ids = data[0]
    fwd = dtm.forward_step(hf.model, lambda m, ids: m(ids), mesh=dtm.Mesh(**sizes), inputs=inputs)
    got = dtm.fit(
        fwd,
        lambda s, r: {"ids": ids[r["ids"]]},
        steps=1,
        sim=2,
        mesh=sizes,
        values={k: v for k, v in trained.items() if k in hf.weights},
        quiet=True,
    ).tensors[0]["output"]
    before = _hf_logits(src, ids)
    after = _hf_logits(out, ids)
    assert np.abs(after - before).max() > 1e-3  # the export holds the trained weights
    assert np.abs(after - got).max() <= 1e-4


@needs_hf
def test_check_passes_and_its_verdict_is_the_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _hf_llama(tmp_path / "m")
    assert (
        main(
            [
                "hf",
                "check",
                str(tmp_path / "m"),
                "--mesh",
                "dp=1,tp=2",
                "--prompts",
                "2",
                "--length",
                "8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert (
        "max per-position KL" in text and "greedy agreement      100.00%" in text and "PASS" in text
    )
    with pytest.raises(UsageError, match="longer than the model's context"):
        main(["hf", "check", str(tmp_path / "m"), "--length", "33"])


@needs_hf
def test_the_readme_sequence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/tiny_llama.py, dtm hf import, export, check: as the README shows them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    tiny, store, out = tmp_path / "tiny-llama", tmp_path / "store", tmp_path / "out-llama"
    subprocess.run(
        [sys.executable, str(root / "examples" / "tiny_llama.py"), str(tiny)], check=True
    )
    assert main(["hf", "import", str(tiny), str(store)]) == 0
    assert main(["hf", "export", str(store), str(out)]) == 0
    capsys.readouterr()
    assert (
        main(["hf", "check", str(out), "--mesh", "dp=1,tp=2", "--prompts", "2", "--length", "16"])
        == 0
    )
    assert "PASS" in capsys.readouterr().out
    argv = ["generate", str(store), "--prompt", "The text", "--max-new", "16", "--sim", "2"]
    assert main([*argv, "--mesh", "dp=1,tp=2"]) == 0
    assert "text: The text" in capsys.readouterr().out
