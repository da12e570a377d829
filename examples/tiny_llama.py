"""Write a tiny Llama as a Hugging Face model directory (``config.json`` and
``model.safetensors``, random weights drawn as transformers initialises them: normal(0, 0.02),
norms at one), with dtm's own safetensors writer: nothing is downloaded, torch is not needed.
transformers' ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it.

    python examples/tiny_llama.py tiny-llama [--layers 2 --hidden 64 --heads 4 --kv-heads 2]
    dtm hf import tiny-llama store
    dtm hf check tiny-llama --mesh dp=1,tp=2
    dtm generate tiny-llama --prompt "The text" --max-new 16 --sim 2 --mesh dp=1,tp=2
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dtm_mpi.frontend.hf_store import write_random_model


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
    return write_random_model(out, config, seed)


def write_tokenizer(out: str | Path, vocab: int) -> Path | None:
    """A ``tokenizer.json`` of ``vocab`` ids (BPE over characters with a SentencePiece-style
    space marker, trained on the text of Python's own ``textwrap`` module; ``<unk>`` 0, ``<s>``
    1 -- added before each text, as Llama's tokenizer does -- and ``</s>`` 2), or None where
    the ``tokenizers`` package is missing."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    except ImportError:
        return None
    import textwrap

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    text = Path(textwrap.__file__).read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    path = Path(out) / "tokenizer.json"
    tok.save(str(path))
    return path


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
    tok = write_tokenizer(d, a.vocab)
    print(
        f"wrote {d}: a Llama of {a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} kv)"
        + (
            ", with a tokenizer.json"
            if tok
            else " (no tokenizer.json: `tokenizers` is not installed)"
        )
    )


if __name__ == "__main__":
    main()
