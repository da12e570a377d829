"""examples/llama.py under real ``mpirun`` at 2 ranks: the layers over pp=2 (1F1B), then a
resume from that checkpoint with the heads over tp=2, the export to a Hugging Face directory
and the continuation of a prompt, which transformers' greedy generate from the export equals
(the example's quality run is in the note and docs/PERFORMANCE.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi_env import mpirun_env

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
LLAMA = str(Path(__file__).resolve().parents[2] / "examples" / "llama.py")
HAS_HF = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers"))


def llama(tmp_path: Path, mesh: str, *args: str) -> str:
    cmd = ["mpirun", "--timeout", "240", "--bind-to", "none", "-n", "2", sys.executable]
    cmd += ["-m", "mpi4py", LLAMA, "--quiet", "--mesh", mesh, "--store", str(tmp_path / "S")]
    proc = subprocess.run(
        [*cmd, "--val-batches", "1", *args],
        capture_output=True,
        text=True,
        timeout=270,
        env=mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="90"),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(not HAS_HF, reason="needs torch, transformers and tokenizers (the llm extra)")
def test_the_llama_example_trains_over_pp_resumes_over_tp_exports_and_transformers_agrees(
    tmp_path: Path,
) -> None:
    first = llama(
        tmp_path, "pp=2,dp=1,tp=1", "--schedule", "1f1b", "--microbatches", "2", "--steps", "4"
    )
    assert "validation loss" in first, first
    out_dir = tmp_path / "out"
    out = llama(
        tmp_path,
        "dp=1,tp=2",
        *("--steps", "8", "--resume", "--export", str(out_dir), "--generate", "12"),
    )
    assert "resumed from" in out and "after step 4" in out, out
    loss = float(re.search(r"validation loss ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert 0 < loss < math.log(256) + 0.5, out  # at most a uniform guess over the bytes
    assert "exported step 8" in out, out
    assert "transformers generates the same 12 tokens" in out, out
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert (out_dir / "tokenizer.json").is_file()


@pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None,
    reason="token files are written with the tokenizers package (the llm extra)",
)
def test_the_recipe_switches_run_together_from_a_token_file_under_mpirun(tmp_path: Path) -> None:
    """bf16 with float32 masters, selective recomputation, parameters sharded over dp, a
    cosine schedule with warmup, accumulation over 2
    microbatches, a token file (its validation split beside it) and a metrics file, at dp=2;
    a resume continues the curve and appends to the metrics."""
    from dtm_mpi.frontend.token_data import prepare_tokens

    sys.path.insert(0, str(Path(LLAMA).parent))
    from llama import write_byte_tokenizer  # type: ignore[import-not-found]

    assert write_byte_tokenizer(tmp_path / "tok")
    text = tmp_path / "corpus.txt"
    text.write_text(Path(LLAMA).read_text() * 4)
    prepare_tokens(
        [text], tmp_path / "tok" / "tokenizer.json", tmp_path / "t.bin", val_fraction=0.1
    )
    metrics = tmp_path / "m.jsonl"
    recipe = ["--precision", "bf16", "--recompute", "selective", "--fsdp"]
    recipe += ["--lr-schedule", "cosine", "--warmup", "2"]
    recipe += ["--accumulate", "2", "--data", str(tmp_path / "t.bin"), "--metrics", str(metrics)]
    recipe += ["--lr-total", "6"]  # (the schedule is part of the program: the same on resume)
    out = llama(tmp_path, "dp=2,tp=1", *recipe, "--steps", "4")
    assert "validation loss" in out and "tokens/s" in out and "MFU" in out, out
    more = llama(tmp_path, "dp=2,tp=1", *recipe, "--steps", "6", "--resume")
    assert "resumed from" in more and "after step 4" in more, more
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    assert lines[0]["lr"] < lines[1]["lr"] and lines[5]["lr"] < lines[2]["lr"]  # warmup, decay
    assert all(x["tokens_per_s"] > 0 and 0 < x["mfu"] < 1 and x["loss"] > 0 for x in lines)
