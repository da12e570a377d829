"""Write a tiny Llama as a Hugging Face model directory (``config.json`` and
``model.safetensors``, random weights drawn as transformers initialises them: normal(0, 0.02),
norms at one), with dtm's own safetensors writer: nothing is downloaded, torch is not needed.
transformers' ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it.

    python examples/tiny_llama.py tiny-llama [--layers 2 --hidden 64 --heads 4 --kv-heads 2]
    dtm hf import tiny-llama store
    dtm hf check tiny-llama --mesh dp=1,tp=2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi import frontend as dtm
from dtm_mpi.io.hf_files import write_weights
from dtm_mpi.ir.types import DType


def tiny_config(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 8 * 8 or 8,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_tiny_llama(out: str | Path, config: dict[str, Any], seed: int = 0) -> Path:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    _, model = dtm.hf.model_for(config)
    rng = np.random.default_rng(seed)
    tensors = []
    for name, _, _, p in model.named_parameters():
        shape = tuple(p.shape)
        value = (
            np.ones(shape, np.float32)
            if len(shape) == 1
            else (0.02 * rng.standard_normal(shape)).astype(np.float32)
        )
        tensors.append((name, DType.F32, value))
    write_weights(d, "llama", tensors)
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", metavar="OUT")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    config = tiny_config(
        layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab
    )
    d = write_tiny_llama(a.out, config, a.seed)
    print(
        f"wrote {d}: a Llama of {a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} kv)"
    )


if __name__ == "__main__":
    main()
