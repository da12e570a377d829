"""``dtm generate``: text in, text out with a model directory's tokenizer; the new ids equal
transformers' greedy ``generate`` from the directory (simulated tp=2) and from a store of
``dtm hf import`` under real mpirun at 2 ranks, the store left as it was; bad sources,
tokenizers and prompts are one error naming them, agreed on every rank."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.cli import main
from dtm_mpi.cli_generate import prompt_ids
from dtm_mpi.errors import UsageError
from tests.frontend.test_generate import hf_llama
from tests.frontend.test_hf_load import CONFIG, _write
from tests.mpi_env import dtm_job
from tests.test_cli_run import dtm as dtm_cli
from tests.test_cli_run import one_line_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny_llama import write_tokenizer

HAS_HF = all(
    importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "tokenizers")
)
needs_hf = pytest.mark.skipif(
    not HAS_HF,
    reason="needs torch, transformers and tokenizers (the llm extra; make setup installs them)",
)
PROMPT = "The text is wrapped to the width"


def _hf_model(d: Path) -> None:
    hf_llama(d, vocab=128, bos_token_id=1, eos_token_id=2)
    assert write_tokenizer(d, 128) is not None


def _hf_greedy(d: Path, ids: list[int], n: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return [int(t) for t in out[0, len(ids) :]]


def _ids_line(out: str) -> list[int]:
    line = next(ln for ln in out.splitlines() if ln.startswith("ids: "))
    return [int(w) for w in line[5:].split()]


@needs_hf
def test_text_prompt_gives_transformers_tokens_and_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer

    d = tmp_path / "m"
    _hf_model(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    assert prompt[0] == 1 and max(prompt) < 128  # BOS first, ids in the vocabulary
    want = _hf_greedy(d, prompt, 12)
    code, out, err = dtm_cli(
        capsys, "generate", str(d), "--prompt", PROMPT, "--max-new", "12", "--eos", "-1",
        "--sim", "2", "--mesh", "dp=1,tp=2",
    )  # fmt: skip
    assert code == 0, err
    assert _ids_line(out) == want
    assert f"text: {tok.decode(prompt + want)}" in out
    assert "tokens/s" in out


@pytest.mark.slow
@needs_hf
def test_store_under_mpirun_gives_the_same_tokens_and_writes_nothing(tmp_path: Path) -> None:
    d, store = tmp_path / "m", tmp_path / "store"
    _hf_model(d)
    assert main(["hf", "import", str(d), str(store)]) == 0
    before = sorted(p.name for p in store.iterdir())
    ids = [1, 5, 9, 33, 7]
    want = _hf_greedy(d, ids, 10)
    proc = dtm_job(
        2, "generate", str(store), "--ids", " ".join(map(str, ids)), "--max-new", "10",
        "--eos", "-1", "--mesh", "dp=1,tp=2",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("ids: ") == 1  # rank 0 speaks
    assert _ids_line(proc.stdout) == want
    assert sorted(p.name for p in store.iterdir()) == before  # no checkpoint written


def test_bad_sources_and_prompts_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "m"
    _write(d, CONFIG)  # a Llama directory without a tokenizer
    cases = [
        (["generate", str(tmp_path), "--ids", "1 2"], "neither a Hugging Face model directory"),
        (["generate", str(d), "--prompt", "hi"], "has no tokenizer.json: give the prompt as --ids"),
        (["generate", str(d), "--ids", "1 x 2"], "--ids: 'x' is not a token id"),
        (["generate", str(d), "--ids", "1 2 3", "--max-new", "40"], "need 43 positions; the model has 32"),
        (["generate", str(d), "--ids", "1 99", "--max-new", "4"], "outside the vocabulary 0 .. 39"),
        (["generate", str(d), "--ids", "1", "--temperature", "0", "--max-new", "4"], "--temperature must be > 0"),
    ]  # fmt: skip
    for argv, message in cases:
        code, _, err = dtm_cli(capsys, *argv, "--sim", "1")
        assert code == 2, (argv, err)
        assert message in one_line_error(err), argv
    heads = CONFIG["num_attention_heads"]
    code, _, err = dtm_cli(
        capsys, "generate", str(d), "--ids", "1", "--sim", "3", "--mesh", "dp=1,tp=3"
    )
    assert code == 2 and heads % 3, err
    line = one_line_error(err)  # the config's file, not a line of dtm's own code
    assert line.startswith(f"dtm: error: {d / 'config.json'}: num_attention_heads {heads} "), line
    assert "does not split over tp=3" in line
    (d / "tokenizer.json").write_text("{not json")
    code, _, err = dtm_cli(capsys, "generate", str(d), "--prompt", "hi", "--sim", "1")
    assert code == 2
    line = one_line_error(err)
    assert str(d / "tokenizer.json") in line and "not a tokenizer" in line


def test_ids_from_text_and_npy(tmp_path: Path) -> None:
    assert prompt_ids("1, 2 3").tolist() == [[1, 2, 3]]
    np.save(tmp_path / "p.npy", np.array([[4, 5], [6, 7]], np.int32))
    assert prompt_ids(str(tmp_path / "p.npy")).tolist() == [[4, 5], [6, 7]]
    np.save(tmp_path / "f.npy", np.ones(3, np.float32))
    with pytest.raises(UsageError, match="want integer ids"):
        prompt_ids(str(tmp_path / "f.npy"))
    with pytest.raises(UsageError, match="no such file"):
        prompt_ids(str(tmp_path / "missing.npy"))


@pytest.mark.slow
def test_a_bad_tokenizer_under_mpirun_is_one_agreed_error(tmp_path: Path) -> None:
    d = tmp_path / "m"
    _write(d, CONFIG)
    (d / "tokenizer.json").write_text("{not json")
    proc = dtm_job(2, "generate", str(d), "--prompt", "hi", "--mesh", "dp=1,tp=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "not a tokenizer" in out and "aborting the job" not in out and "Traceback" not in out


def test_explain_prints_the_decode_plan_without_running(tmp_path: Path) -> None:
    import subprocess

    d = tmp_path / "m"
    _write(d, CONFIG)
    cmd = [sys.executable, "-m", "dtm_mpi", "generate", str(d), "--ids", "1 2 3"]
    cmd += ["--max-new", "4", "--mesh", "dp=1,tp=2", "--explain"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.startswith("module decode on mesh [dp=1, tp=2] (2 ranks)"), out[:500]
    assert "peak memory:" in out and "allreduce sum on tp" in out
    assert "ids:" not in out and "tokens/s" not in out  # planned, not run
