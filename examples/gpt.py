"""A character-level GPT written with the dtm_mpi frontend, trained on text that ships with
Python itself (the standard library's own source files): 2 transformer blocks, attention heads
and MLP split over ``tp``, a vocab-parallel embedding and cross-entropy, AdamW; the batch over
``dp``. Its validation loss is compared with the bigram baseline measured on the same split.

    python examples/gpt.py --sim 4 --mesh dp=2,tp=2 --steps 400
    mpirun -n 4 python -m mpi4py examples/gpt.py --mesh dp=2,tp=2 --steps 400 --store S --checkpoint-every 200
    mpirun -n 3 python -m mpi4py examples/gpt.py --mesh dp=1,tp=3 --steps 600 --store S --resume
    mpirun -n 4 python -m mpi4py examples/gpt.py --mesh pp=2,dp=1,tp=2 --microbatches 4 --schedule 1f1b
    mpirun -n 4 python -m mpi4py examples/gpt.py --mesh pp=2,dp=2,tp=1 --microbatches 4 --schedule interleaved --layers 4

With a ``pp`` axis (or ``--schedule``) the step runs as pipeline stages: the blocks cut evenly
over ``pp``, ``--microbatches`` per step in the schedule named (gpipe, 1f1b, interleaved with
two stages per rank: ``--layers`` at least twice ``pp``, zb-h1); its checkpoints resume with
or without a pipeline (and the same ``--layers``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
from collections.abc import Mapping

import numpy as np

from dtm_mpi import frontend as dtm
from dtm_mpi.frontend import functional as fn
from dtm_mpi.runtime.policies import checkpoint_policy
from dtm_mpi.sharding.mesh import parse_mesh_binding

SOURCES = (
    "json",
    "textwrap.py",
    "string.py",
    "functools.py",
    "collections",
    "argparse.py",
    "csv.py",
    "dataclasses.py",
)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # printable ASCII; anything else is "?"
BATCH, CONTEXT, DIM, HEADS, LAYERS = 24, 64, 96, 6, 2


def source_files() -> list[str]:
    """The paths of the standard library sources above, in order."""
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for name in SOURCES:
        path = os.path.join(root, name)
        files += (
            [path]
            if path.endswith(".py")
            else sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py"))
        )
    return files


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """The standard library sources above as character ids, split 90/10 (train/validation)."""
    texts = []
    for f in source_files():
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    index = {c: i for i, c in enumerate(CHARS)}
    unknown = index["?"]
    ids = np.array([index.get(c, unknown) for c in "\n".join(texts)], dtype=np.int32)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:]


def bigram_loss(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/char) on ``val`` of the add-one-smoothed bigram model of ``train``."""
    counts = np.ones((vocab, vocab))
    np.add.at(counts, (train[:-1], train[1:]), 1)
    probs = counts / counts.sum(axis=1, keepdims=True)
    return float(-np.log(probs[val[:-1], val[1:]]).mean())


class Windows:
    """Batches of ``BATCH`` windows of ``CONTEXT`` characters (inputs and the next-character
    targets) at offsets drawn from the step number: the same on every rank and every run.
    A rank reads only the windows (and positions) of its block."""

    def __init__(self, data: np.ndarray, seed: int, fixed: bool = False) -> None:
        self.data, self.seed, self.fixed = data, seed, fixed

    def offsets(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0 if self.fixed else 1, step])
        return rng.integers(0, len(self.data) - CONTEXT - 1, BATCH)

    def __call__(
        self, step: int, regions: Mapping[str, tuple[slice, ...]]
    ) -> dict[str, np.ndarray]:
        starts = self.offsets(step)
        out = {}
        for name, (rows, cols) in regions.items():
            shift = 1 if name == "tgt" else 0
            idx = starts[rows, None] + np.arange(cols.start, cols.stop)[None, :] + shift
            out[name] = self.data[idx]
        return out


def gpt_model(layers: int = LAYERS) -> dtm.nn.GPT:
    return dtm.nn.GPT(len(CHARS), CONTEXT, DIM, HEADS, layers)


def loss_fn(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
    logits = m(ids)
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


INPUTS = {
    "ids": dtm.Input((BATCH, CONTEXT), "i32", ("dp", None)),
    "tgt": dtm.Input((BATCH, CONTEXT), "i32", ("dp", None)),
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="dp=2,tp=2")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sim", type=int, default=None)
    ap.add_argument("--store", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--schedule", default=None, help="gpipe, 1f1b, interleaved, zb-h1")
    ap.add_argument(
        "--layers", type=int, default=LAYERS, help="transformer blocks (interleaved: >= 2 x pp)"
    )
    args = ap.parse_args(argv)
    sizes = parse_mesh_binding(args.mesh)
    mesh = dtm.Mesh(pp=1, dp=2, tp=2)
    pipeline = None
    if sizes.get("pp", 1) > 1 or args.schedule is not None:
        schedule = args.schedule or "1f1b"
        chunks = 2 if schedule == "interleaved" else 1
        pipeline = dtm.Pipeline(args.microbatches, schedule, chunks)
    train, val = corpus()
    model = gpt_model(args.layers)
    step = dtm.train_step(
        model,
        loss_fn,
        mesh=mesh,
        inputs=INPUTS,
        clip_norm=1.0,
        name="gpt",
        optimizer=dtm.optim.AdamW(lr=args.lr, weight_decay=0.01),
        pipeline=pipeline,
    )
    res = dtm.fit(
        step,
        Windows(train, seed=1),
        steps=args.steps,
        sim=args.sim,
        mesh=sizes,
        checkpoint=checkpoint_policy(args.store, every=args.checkpoint_every, resume=args.resume),
        quiet=args.quiet,
        log_every=50 if args.quiet else None,
    )
    rank0 = bool(res.outputs)
    val_loss = float("nan")
    if args.store or args.sim:
        ev = dtm.eval_step(
            model,
            loss_fn,
            mesh=mesh,
            inputs=INPUTS,
            name="gpt_eval",
            weights_from_store=args.store is not None,
        )
        weights = None if args.store else {k: v for k, v in res.outputs.items() if k in ev.params}
        out = dtm.fit(
            ev,
            Windows(val, seed=2, fixed=True),
            steps=args.val_batches,
            sim=args.sim,
            mesh=sizes,
            checkpoint=checkpoint_policy(args.store),
            quiet=True,
            values=weights,
        )
        val_loss = float(np.mean([m["loss"] for m in out.metrics])) if out.metrics else float("nan")
    if rank0:
        base = bigram_loss(train, val, len(CHARS))
        print(
            f"corpus: {len(train)} train / {len(val)} validation characters from the standard library ({sysconfig.get_paths()['stdlib']})"
        )
        if math.isnan(val_loss):
            print("validation: give --store (or --sim)")
        else:
            verdict = "below" if val_loss < base else "NOT below"
            print(
                f"step {args.steps}: train loss {res.last('loss'):.4f}, validation loss {val_loss:.4f} nats/char, {verdict} the bigram baseline {base:.4f}"
            )
    return 0


if __name__ == "__main__":
    from dtm_mpi.console import write_line
    from dtm_mpi.errors import DtmError

    try:
        sys.exit(main(sys.argv[1:]))
    except DtmError as err:
        write_line(f"gpt: {err}")  # one write: ranks' lines stay apart
        sys.exit(1)
