"""A small Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU; Hugging Face's
parameter names) trained from scratch with the dtm_mpi frontend on the bytes of text that ships
with Python (the standard library sources ``examples/gpt.py`` reads): heads, kv heads, MLP and
vocabulary over ``tp``, the batch over ``dp``, the layers over ``pp``; AdamW with clipping;
checkpoints that resume on another mesh. ``--export DIR`` writes the trained model as a Hugging
Face directory (config.json, model.safetensors, a byte-level tokenizer.json) and ``--generate
N`` continues a prompt from the store with dtm and, where transformers is installed, from the
export with transformers' greedy ``generate``: the two must give the same tokens.

    python examples/llama.py --sim 4 --mesh dp=2,tp=2 --steps 300 --store S
    mpirun -n 4 python -m mpi4py examples/llama.py --mesh dp=2,tp=2 --steps 300 --store S --checkpoint-every 100
    mpirun -n 2 python -m mpi4py examples/llama.py --mesh dp=1,tp=2 --steps 400 --store S --resume --export OUT --generate 32
    mpirun -n 4 python -m mpi4py examples/llama.py --mesh pp=2,dp=1,tp=2 --microbatches 4 --schedule 1f1b --store S
    dtm generate S --prompt "def " --max-new 32        # the store is a model for dtm's tools too

The training recipe's switches: ``--precision bf16`` (float32 masters, bf16 compute),
``--recompute selective`` (or ``full``: activation recomputation per layer), ``--fsdp``
(parameters sharded over dp, inside pipeline stages too: dp x tp x pp),
``--lr-schedule cosine --warmup 20`` (also ``linear``, ``wsd``; ``--lr-floor``),
``--accumulate 2`` (gradient accumulation), ``--data tokens.bin`` (a token file of
``dtm data prepare``; its ``.val.bin`` beside it for validation; the model's vocabulary is
the file's), ``--metrics FILE`` (JSON lines: loss, lr, tokens/s, MFU; ``dtm plot metrics``)
and ``--tensorboard DIR`` (the same as TensorBoard scalars):

    mpirun -n 2 python -m mpi4py examples/llama.py --mesh dp=2,tp=1 --precision bf16 \
        --recompute selective --lr-schedule cosine --warmup 20 --accumulate 2 \
        --data tokens.bin --metrics m.jsonl
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi import frontend as dtm
from dtm_mpi.comm.handles import world_rank
from dtm_mpi.frontend import functional as fn
from dtm_mpi.frontend.hf_store import export_checkpoint, save_hf_files
from dtm_mpi.runtime.policies import checkpoint_policy
from dtm_mpi.sharding.mesh import parse_mesh_binding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import source_files  # the same text as the GPT example

BATCH, CONTEXT = 16, 64
PROMPT = "def "


def config(layers: int, vocab: int = 256) -> dict[str, Any]:
    """The model, as the fields of a Hugging Face ``config.json``: one token per byte (or
    the ``vocab`` of a token file)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2 * CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """The standard library sources as UTF-8 bytes (token ids 0..255), split 90/10."""
    chunks = [Path(f).read_bytes() for f in source_files()]
    ids = np.frombuffer(b"\n".join(chunks), dtype=np.uint8).astype(np.int32)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:]


def write_byte_tokenizer(d: Path) -> bool:
    """A byte-level ``tokenizer.json`` in ``d`` whose id of each byte is its value (GPT-2's
    byte-to-character table, no merges), so ``dtm generate --prompt`` and transformers read
    text; False where the ``tokenizers`` package is missing."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = dict(zip(printable, map(chr, printable), strict=True))
    extra = iter(range(256, 512))
    table = {b: chars.get(b) or chr(next(extra)) for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in table.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return True


class Windows:
    """``BATCH`` windows of ``CONTEXT`` bytes at offsets drawn from the step number (the same
    on every rank and every run; fixed for validation); a rank reads only its block."""

    def __init__(self, data: np.ndarray, seed: int, fixed: bool = False) -> None:
        self.data, self.seed, self.fixed = data, seed, fixed

    def __call__(
        self, step: int, regions: Mapping[str, tuple[slice, ...]]
    ) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0 if self.fixed else 1, step])
        starts = rng.integers(0, len(self.data) - CONTEXT, BATCH)
        rows, cols = regions["ids"]
        idx = starts[rows, None] + np.arange(cols.start, cols.stop)[None, :]
        return {"ids": self.data[idx]}


def loss_fn(m: dtm.nn.Llama, ids: dtm.Tensor) -> dtm.Tensor:
    return fn.causal_lm_loss(m(ids), ids)


INPUTS = {"ids": dtm.Input((BATCH, CONTEXT), "i32", ("dp", None))}


def unigram_loss(train: np.ndarray, val: np.ndarray) -> float:
    """Cross-entropy (nats/byte) on ``val`` of the add-one-smoothed byte frequencies of
    ``train``: what a model that learned nothing about order reaches."""
    p = (np.bincount(train, minlength=256) + 1.0) / (len(train) + 256)
    return float(-np.log(p[val]).mean())


def transformers_tokens(hf_dir: str, prompt: np.ndarray, n: int) -> np.ndarray | None:
    """transformers' greedy continuation from the exported directory (None: not installed)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    x = torch.from_numpy(prompt.astype(np.int64))
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return np.asarray(out[:, prompt.shape[1] :].numpy())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="dp=2,tp=2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sim", type=int, default=None)
    ap.add_argument("--store", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--schedule", default=None, help="gpipe, 1f1b, interleaved, zb-h1")
    ap.add_argument("--val-batches", type=int, default=4)
    ap.add_argument("--export", default=None, metavar="DIR", help="write a Hugging Face directory")
    ap.add_argument("--generate", type=int, default=0, metavar="N", help="tokens after the prompt")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--precision", choices=("f32", "bf16"), default="f32")
    ap.add_argument(
        "--lr-schedule", choices=("constant", "cosine", "linear", "wsd"), default="constant"
    )
    ap.add_argument("--warmup", type=int, default=0, help="warmup steps of --lr-schedule")
    ap.add_argument("--lr-floor", type=float, default=0.1, help="the end rate, x --lr")
    ap.add_argument(
        "--lr-total",
        type=int,
        default=None,
        help="the steps the schedule spans (default --steps; the schedule is part of the "
        "program, so a run resumed with more --steps keeps the first run's --lr-total)",
    )
    ap.add_argument("--accumulate", type=int, default=None, metavar="K")
    ap.add_argument("--data", default=None, metavar="BIN", help="a token file (dtm data prepare)")
    ap.add_argument("--metrics", default=None, metavar="FILE", help="JSON lines per step")
    ap.add_argument(
        "--tensorboard", default=None, metavar="DIR", help="TensorBoard event file in DIR"
    )
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    ap.add_argument(
        "--fsdp", action="store_true", help="parameters sharded over dp (ZeRO-3), pipelines too"
    )
    args = ap.parse_args(argv)
    sizes = parse_mesh_binding(args.mesh)
    if (args.export or args.generate) and not args.store:
        ap.error("--export and --generate read the trained model from --store DIR")
    rank0 = args.sim is not None or world_rank() == 0
    loader: Any = None
    val_loader: Any = None
    vocab = 256
    if args.data is not None:  # the model's vocabulary is the token file's
        loader = dtm.TokenLoader(args.data, context=CONTEXT, batch=BATCH, seed=1)
        vocab = loader.file.vocab_size
        val_path = Path(args.data).with_name(f"{Path(args.data).stem}.val{Path(args.data).suffix}")
        if val_path.is_file():
            val_loader = dtm.TokenLoader(val_path, context=CONTEXT, batch=BATCH, seed=2)
    cfg = config(args.layers, vocab)
    if args.store and rank0 and not args.resume:
        # the store describes its model, as `dtm hf import` leaves it: export and generate read it
        save_hf_files(args.store, cfg)
        write_byte_tokenizer(Path(args.store) / "hf")
    pipeline = None
    if sizes.get("pp", 1) > 1 or args.schedule is not None:
        schedule = args.schedule or "1f1b"
        pipeline = dtm.Pipeline(args.microbatches, schedule, 2 if schedule == "interleaved" else 1)
    model = dtm.nn.Llama.for_mesh(cfg, sizes)
    lr: Any = args.lr
    if args.lr_schedule != "constant" or args.warmup:
        lr = dtm.optim.schedule(
            args.lr_schedule,
            peak=args.lr,
            total=args.lr_total or args.steps,
            warmup=args.warmup,
            floor=args.lr_floor,
        )
    step = dtm.train_step(
        model,
        loss_fn,
        mesh=dtm.Mesh(pp=1, dp=2, tp=2),
        inputs=INPUTS,
        clip_norm=1.0,
        name="llama",
        optimizer=dtm.optim.AdamW(lr=lr, weight_decay=0.01),
        pipeline=pipeline,
        accumulate=args.accumulate,
        shard_params="dp" if args.fsdp else None,
        precision=dtm.MixedPrecision() if args.precision == "bf16" else None,
        recompute=args.recompute,
    )
    train, val = corpus()
    if loader is None:
        loader = Windows(train, seed=1)
    if val_loader is None and args.data is None:
        val_loader = Windows(val, seed=2, fixed=True)
    policy = checkpoint_policy(
        args.store, every=args.checkpoint_every, resume=args.resume, save_final=True
    )
    res = dtm.fit(
        step,
        loader,
        steps=args.steps,
        sim=args.sim,
        mesh=sizes,
        checkpoint=policy,
        quiet=args.quiet,
        log_every=50 if args.quiet else None,
        metrics_file=args.metrics,
        tensorboard=args.tensorboard,
    )
    val_loss = float("nan")
    if args.store and val_loader is not None:
        ev = dtm.eval_step(
            model,
            loss_fn,
            mesh=dtm.Mesh(pp=1, dp=2, tp=2),
            inputs=INPUTS,
            name="llama_eval",
            weights_from_store=True,
        )
        out = dtm.fit(
            ev,
            val_loader,
            steps=args.val_batches,
            sim=args.sim,
            mesh=sizes,
            checkpoint=checkpoint_policy(args.store),
            quiet=True,
        )
        val_loss = float(np.mean([m["loss"] for m in out.metrics])) if out.metrics else val_loss
    if rank0 and res.timings:
        tps = float(np.median([t["tokens_per_s"] for t in res.timings[1:] or res.timings]))
        mfu = [t["mfu"] for t in res.timings[1:] or res.timings if "mfu" in t]
        shown = f", MFU {100 * float(np.median(mfu)):.2f}%" if mfu else ""
        peak = f" (peak: {res.peak.source})" if res.peak is not None else ""
        print(f"throughput: {tps:.0f} tokens/s (median step){shown}{peak}")
    if rank0 and args.data is not None:
        print(
            f"step {args.steps}: train loss {res.last('loss'):.4f}"
            + ("" if math.isnan(val_loss) else f", validation loss {val_loss:.4f}")
        )
    elif rank0:
        base = unigram_loss(train, val)
        print(f"corpus: {len(train)} train / {len(val)} validation bytes of the standard library")
        if math.isnan(val_loss):
            print(
                f"step {args.steps}: train loss {res.last('loss'):.4f} (validation: give --store)"
            )
        else:
            verdict = "below" if val_loss < base else "NOT below"
            print(
                f"step {args.steps}: train loss {res.last('loss'):.4f}, validation loss "
                f"{val_loss:.4f} nats/byte, {verdict} the byte-frequency baseline {base:.4f}"
            )
        if args.export:
            done = export_checkpoint(Path(args.store), args.export)
            print(f"exported step {done.step} to {args.export} ({done.tensors} tensors)")
    if not args.generate:
        return 0
    # every rank of the job decodes: the pp ranks join dp, one copy of the prompt per dp block
    gen_sizes = {"dp": sizes.get("dp", 1) * sizes.get("pp", 1), "tp": sizes.get("tp", 1)}
    prompt = np.frombuffer(PROMPT.encode(), dtype=np.uint8).astype(np.int64)[None, :]
    prompt = np.repeat(prompt, gen_sizes["dp"], axis=0)
    decode = dtm.nn.Llama.for_mesh(cfg, gen_sizes)
    ours = dtm.generate(
        decode, None, prompt, args.generate, sizes=gen_sizes, sim=args.sim, store=args.store
    )
    if not rank0:
        return 0
    text = bytes(int(t) for t in ours[0]).decode("utf-8", errors="replace")
    print(f"dtm generate: {PROMPT!r} -> {text!r}")
    print("ids: " + " ".join(map(str, ours[0])))
    if args.export:
        theirs = transformers_tokens(args.export, prompt, args.generate)
        if theirs is None:
            print("transformers is not installed: no comparison")
        elif np.array_equal(theirs, ours):
            print(f"transformers generates the same {args.generate} tokens from {args.export}")
        else:
            print("transformers generates other tokens: " + " ".join(map(str, theirs[0])))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
