"""Llama 3.1 8B and 70B (Meta's config.json fields) as training steps to *plan*, not to run on
this machine: ``dtm explain`` prints each rank's parameters, gradients, optimizer state and
peak activations on any mesh, with the parameters sharded over ``dp`` (ZeRO-3, as FSDP does)
unless ``--no-fsdp``:

    dtm explain examples/llama3.py -- --size 8b --mesh dp=8,tp=1            # torchtitan's 8-GPU run
    dtm explain examples/llama3.py -- --size 8b --mesh dp=64,tp=8 --local-batch 1
    dtm explain examples/llama3.py -- --size 70b --mesh pp=8,dp=16,tp=8 --microbatches 16
    dtm explain examples/llama3.py -- --size 70b --mesh pp=8,dp=16,tp=8 --microbatches 16 \
        --local-batch 16 --recompute full --precision bf16   # torchtitan's 70B recipe's shape

The step is the frontend's ``dtm.nn.Llama`` with Hugging Face's parameter names, AdamW,
clipping at 1.0, sequences of ``--seq`` tokens, ``--local-batch`` sequences per data-parallel
rank; ``--recompute`` (activation recomputation per layer) and ``--precision bf16`` (float32
masters, bf16 compute) as the training recipe switches them; the parameters sharded over dp
inside the pipeline's stages too (ZeRO-3 x pp x tp).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.sharding.mesh import parse_mesh_binding

_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_key_value_heads": 8,
    "torch_dtype": "float32",
}
CONFIGS: dict[str, dict[str, Any]] = {
    "8b": {
        **_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "70b": {
        **_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
}


def loss_fn(m: dtm.nn.Llama, ids: dtm.Tensor) -> dtm.Tensor:
    return fn.causal_lm_loss(m(ids), ids)


def llama_step(
    size: str,
    sizes: dict[str, int],
    *,
    seq: int = 8192,
    local_batch: int = 2,
    microbatches: int = 1,
    schedule: str = "1f1b",
    fsdp: bool = True,
    recompute: str = "none",
    precision: str = "f32",
) -> dtm.TracedStep:
    """The training step of Llama 3.1 ``size`` for a mesh of these axis sizes."""
    config = CONFIGS[size]
    dp = sizes.get("dp", 1)
    inputs = {"ids": dtm.Input((dp * local_batch, seq), "i32", ("dp", None))}
    pipeline = None
    if sizes.get("pp", 1) > 1:
        pipeline = dtm.Pipeline(microbatches, schedule, 2 if schedule == "interleaved" else 1)
    return dtm.train_step(
        dtm.nn.Llama.for_mesh(config, sizes),
        loss_fn,
        mesh=dtm.Mesh(pp=1, dp=1, tp=1),
        inputs=inputs,
        optimizer=dtm.optim.AdamW(lr=3e-4, weight_decay=0.1),
        clip_norm=1.0,
        name=f"llama3_{size}",
        pipeline=pipeline,
        shard_params="dp" if fsdp and dp > 1 else None,
        recompute=recompute,
        precision=dtm.MixedPrecision() if precision == "bf16" else None,
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="8b", choices=sorted(CONFIGS))
    ap.add_argument("--mesh", default="dp=8,tp=1")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--local-batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb-h1")
    ap.add_argument("--no-fsdp", action="store_true", help="parameters replicated over dp")
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--precision", choices=("f32", "bf16"), default="f32")
    args = ap.parse_args(argv)
    from dtm_mpi.config import get_config

    if not get_config().explain:
        raise UsageError(
            "this configuration needs GPUs with tens of GiB each: plan it with "
            "`dtm explain examples/llama3.py`"
        )
    sizes = parse_mesh_binding(args.mesh)
    step = llama_step(
        args.size,
        sizes,
        seq=args.seq,
        local_batch=args.local_batch,
        microbatches=args.microbatches,
        schedule=args.schedule,
        fsdp=not args.no_fsdp,
        recompute=args.recompute,
        precision=args.precision,
    )

    def no_data(step: int, regions: object) -> dict[str, object]:
        raise UsageError("examples/llama3.py plans; run it with dtm explain")

    dtm.fit(step, no_data, steps=1, mesh=sizes)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    from dtm_mpi.console import write_line
    from dtm_mpi.errors import DtmError

    try:
        sys.exit(main(sys.argv[1:]))
    except DtmError as err:
        write_line(f"llama3: {err}")
        sys.exit(1)
