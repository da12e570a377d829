"""``dtm hf check``: a Hugging Face model directory run by transformers and by dtm on the same
seeded prompts, compared per position -- the parity test of the LLM models as a tool a user
runs on their own checkpoint.

For each prompt (ids drawn from a seeded generator over the vocabulary) both compute the
logits of every position: transformers with its eager attention in float32 on the CPU, dtm on
``sim`` simulated ranks of the mesh ``sizes`` from the memory-mapped weights. The figures: the
largest per-position KL(transformers || dtm) (in float64), the largest absolute logit
difference, and the greedy agreement (the share of positions where both pick the same next
token). ``passed`` applies the thresholds of the parity tests (KL < 1e-6, |difference| <= 1e-4
by default).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtm_mpi.errors import UsageError

__all__ = ["ParityReport", "check_parity", "kl_per_position"]


@dataclass(frozen=True, slots=True)
class ParityReport:
    architecture: str
    sizes: Mapping[str, int]
    prompts: int
    length: int
    max_kl: float
    max_abs: float
    greedy_agreement: float
    kl_limit: float
    abs_limit: float

    @property
    def passed(self) -> bool:
        return self.max_kl < self.kl_limit and self.max_abs <= self.abs_limit

    def text(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.sizes.items()) or "1 rank"
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{self.architecture} on {mesh}: {self.prompts} prompt(s) of {self.length} tokens\n"
            f"  max per-position KL   {self.max_kl:.3e}  (limit {self.kl_limit:g})\n"
            f"  max |logit difference| {self.max_abs:.3e}  (limit {self.abs_limit:g})\n"
            f"  greedy agreement      {100 * self.greedy_agreement:.2f}% of positions\n"
            f"{verdict}"
        )


def kl_per_position(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) over the last dim, in float64."""

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        out: np.ndarray = x - np.log(np.exp(x).sum(-1, keepdims=True))
        return out

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    kl: np.ndarray = (np.exp(lp) * (lp - lq)).sum(-1)
    return kl


def _transformers_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"dtm hf check runs transformers as the reference: install {' and '.join(missing)} "
            "(pip install 'dtm_mpi[llm]')"
        )
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32
        )
    except Exception as exc:  # transformers' own errors: name the directory
        raise UsageError(f"{path}: transformers cannot load it: {exc}") from None
    with torch.no_grad():
        logits: np.ndarray = model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
    return logits


def _dtm_logits(path: Path, ids: np.ndarray, sizes: Mapping[str, int]) -> tuple[str, np.ndarray]:
    from dtm_mpi.frontend.fit import fit
    from dtm_mpi.frontend.hf import load
    from dtm_mpi.frontend.mesh import Mesh
    from dtm_mpi.frontend.step_trace import Input
    from dtm_mpi.frontend.trace import forward_step

    hf = load(path, mesh=sizes, dtype="f32")
    batch = "dp" if "dp" in sizes else None
    step = forward_step(
        hf.model,
        lambda m, ids: m(ids),
        mesh=Mesh("m", **dict(sizes)),
        inputs={"ids": Input(ids.shape, "i32", (batch, None))},
    )
    res = fit(
        step,
        lambda s, r: {"ids": ids[r["ids"]]},
        steps=1,
        sim=math.prod(sizes.values()),
        mesh=dict(sizes),
        values=hf.weights,
        quiet=True,
    )
    return hf.architecture, res.tensors[0]["output"]


def check_parity(
    hf_dir: str | Path,
    *,
    sizes: Mapping[str, int] | None = None,
    prompts: int = 4,
    length: int = 32,
    seed: int = 0,
    kl_limit: float = 1e-6,
    abs_limit: float = 1e-4,
) -> ParityReport:
    """Compare transformers and dtm on ``prompts`` seeded prompts of ``length`` tokens, dtm on
    simulated ranks of the mesh ``sizes`` (default one rank, ``dp=1, tp=1``)."""
    from dtm_mpi.io.hf_files import read_config

    path = Path(hf_dir)
    sizes = dict(sizes or {"dp": 1, "tp": 1})
    if prompts < 1 or length < 1:
        raise UsageError(f"--prompts and --length must be >= 1; got {prompts} and {length}")
    config = read_config(path)
    vocab = int(config.get("vocab_size", 0))
    context = int(config.get("max_position_embeddings") or config.get("n_positions") or 0)
    if vocab < 1:
        raise UsageError(f"{path / 'config.json'}: no vocab_size")
    if context and length > context:
        raise UsageError(
            f"--length {length} is longer than the model's context ({context} positions, {path / 'config.json'})"
        )
    dp = sizes.get("dp", 1)
    if prompts % dp:
        raise UsageError(
            f"--prompts {prompts} must be a multiple of dp={dp} (the batch splits over dp)"
        )
    ids = np.random.default_rng(seed).integers(0, vocab, (prompts, length)).astype(np.int32)
    arch, got = _dtm_logits(path, ids, sizes)
    want = _transformers_logits(path, ids)
    if got.shape != want.shape:
        raise UsageError(
            f"the logits' shapes differ: dtm {list(got.shape)}, transformers {list(want.shape)}"
        )
    return ParityReport(
        arch,
        sizes,
        prompts,
        length,
        float(kl_per_position(want, got).max()),
        float(np.abs(got.astype(np.float64) - want).max()),
        float((got.argmax(-1) == want.argmax(-1)).mean()),
        kl_limit,
        abs_limit,
    )
