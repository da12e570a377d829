"""``dtm bench generate``: greedy decoding with a key/value cache, dtm against transformers'
``generate`` on the same CPU, from the same Hugging Face directory.

A Llama of random weights (normal(0, 0.02), norms at one; ``--layers``, ``--hidden``, heads
``hidden / 64`` with half as many kv heads, vocabulary ``--vocab``) is written to a temporary
directory. dtm runs ``dtm generate DIR --ids ... --max-new N --eos -1`` as its own process
tree: 1 rank with one BLAS thread, and ``mpirun -n 2`` on ``dp=1,tp=2`` (one thread each);
transformers runs ``model.generate(do_sample=False)`` in this process with ``torch`` at 1 and 2
threads (the same cores). Both sides report the first token's time (the prompt and one new
token: dtm decodes the prompt a position at a time, with no batched prefill; transformers'
prefill is one forward; for dtm also the part of it before its first step, planning and
reading the weights, which transformers does before its clock starts) and the decode rate
after it (dtm: its own count; transformers:
``(N - 1) / (t(N) - t(1))``); the best of ``--repeat`` runs each. The greedy ids of the two
sides must agree: the table says whether they do.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.frontend.hf_store import write_random_model

__all__ = ["run_generate_bench"]

_LINE = re.compile(
    r"first after ([0-9.]+) s \(trace [0-9.]+ s, setup ([0-9.]+) s\), then ([0-9.]+) tokens/s"
)


@dataclass(frozen=True, slots=True)
class _Run:
    who: str
    first_s: float
    tokens_per_s: float
    ids: tuple[int, ...]
    setup_s: float | None = None  # dtm: planning and reading the weights, in first_s


def _config(layers: int, hidden: int, vocab: int, context: int) -> dict[str, Any]:
    heads = max(hidden // 64, 1)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 8 * 8,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 2, 1),
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _dtm_run(d: Path, ids: np.ndarray, n: int, ranks: int, mpirun: list[str]) -> _Run:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    args = ["generate", str(d), "--ids", " ".join(map(str, ids)), "--max-new", str(n)]
    args += ["--eos", "-1"]
    cmd = [sys.executable, "-m", "dtm_mpi", *args]
    if ranks > 1:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [*mpirun, "--oversubscribe", "--bind-to", "none", "-n", str(ranks)]
        cmd += [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", *args]
        cmd += ["--mesh", f"dp=1,tp={ranks}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    out = proc.stdout + proc.stderr
    got = _LINE.search(out)
    words = next((ln.split()[1:] for ln in out.splitlines() if ln.startswith("ids:")), None)
    if proc.returncode != 0 or got is None or words is None:
        raise RuntimeError(
            f"dtm generate at {ranks} rank(s) failed (exit {proc.returncode}):\n{out}"
        )
    return _Run(
        f"dtm {ranks} rank(s)" + (f" tp={ranks}" if ranks > 1 else ""),
        float(got.group(1)),
        float(got.group(3)),
        tuple(int(w) for w in words),
        float(got.group(2)),
    )


def _hf_run(d: Path, ids: np.ndarray, n: int, threads: int) -> _Run | str:
    try:
        import torch
        import transformers
    except ImportError as exc:
        return f"no transformers run: {exc}; install the 'llm' extra"
    torch.set_num_threads(threads)
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    x = torch.from_numpy(ids.astype(np.int64)[None, :])

    def timed(k: int) -> tuple[float, Any]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t0, out

    timed(2)  # warm-up
    first, _ = timed(1)
    total, out = timed(n)
    rate = (n - 1) / max(total - first, 1e-9)
    return _Run(
        f"transformers {threads} thread(s)", first, rate, tuple(out[0, len(ids) :].tolist())
    )


def run_generate_bench(
    *,
    layers: int = 4,
    hidden: int = 256,
    vocab: int = 2048,
    prompt: int = 16,
    new: int = 64,
    repeat: int = 3,
    ranks: tuple[int, ...] = (1, 2),
    with_torch: bool = True,
    mpirun: str = "mpirun",
) -> str:
    """The benchmark's table (the module doc)."""
    config = _config(layers, hidden, vocab, 2 * (prompt + new))
    ids = np.random.default_rng(1).integers(0, vocab, prompt)
    runs: list[_Run] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dtm-bench-generate-") as tmp:
        d = Path(tmp)
        write_random_model(d, config)
        for n in ranks:
            best = [_dtm_run(d, ids, new, n, mpirun.split()) for _ in range(repeat)]
            runs.append(max(best, key=lambda b: b.tokens_per_s))
        if with_torch:
            for t in ranks:
                got = [_hf_run(d, ids, new, t) for _ in range(repeat)]
                if isinstance(got[0], str):
                    notes.append(got[0])
                    break
                runs.append(
                    max((g for g in got if isinstance(g, _Run)), key=lambda b: b.tokens_per_s)
                )
    base = next((r for r in runs if r.who.startswith("transformers 1")), None)
    head = (
        f"greedy generation: Llama {layers} layers, hidden {hidden}, "
        f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} kv), vocab {vocab}; "
        f"prompt {prompt}, {new} new tokens; best of {repeat}"
    )
    rows = [
        head,
        f"{'run':<28}{'first token s':>14}{'of it setup':>12}{'decode tok/s':>14}{'vs HF 1 thr':>13}  ids",
    ]
    for r in runs:
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        same = "-" if base is None else ("same" if r.ids == base.ids else "DIFFER")
        setup = "-" if r.setup_s is None else f"{r.setup_s:.3f}"
        rows.append(
            f"{r.who:<28}{r.first_s:>14.3f}{setup:>12}{r.tokens_per_s:>14.1f}{ratio:>13}  {same}"
        )
    return "\n".join([*rows, *notes])
