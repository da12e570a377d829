"""GPT-3 175B (96 layers, hidden 12,288, 96 heads, sequence 2,048, vocabulary 51,200) on
1,024 ranks as Megatron lays it out (tp=8, pp=16, dp=8): a configuration to *plan*, not to run
on this machine. ``dtm explain`` prints each stage's layers and memory, each pipeline rank's
state and peak activations, the schedule's time-line and its predicted bubble:

    dtm explain examples/gpt_175b.py -- --schedule 1f1b --microbatches 64
    dtm explain examples/gpt_175b.py -- --schedule interleaved --mesh pp=16,dp=8,tp=8

The model is the frontend's ``nn.GPT`` (what ``examples/gpt.py`` trains), float32, AdamW; the
tests compare the plan's per-rank memory with the closed forms of Korthikanti et al. 2022.
"""

from __future__ import annotations

import argparse
import sys

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.sharding.mesh import parse_mesh_binding

LAYERS, HIDDEN, HEADS, SEQUENCE = 96, 12288, 96, 2048
VOCAB = 51200  # GPT-2's 50,257 tokens padded to a multiple of 1,024, as Megatron pads them
MESH = "pp=16,dp=8,tp=8"


def loss_fn(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
    logits = m(ids)
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def gpt_step(
    schedule: str = "1f1b",
    microbatches: int = 64,
    micro_batch: int = 1,
    dp: int = 8,
    layers: int = LAYERS,
) -> dtm.TracedStep:
    """The pipelined training step: ``microbatches`` of ``micro_batch`` sequences per data
    parallel rank (a global batch of ``dp x microbatches x micro_batch``)."""
    batch = dp * microbatches * micro_batch
    inputs = {
        "ids": dtm.Input((batch, SEQUENCE), "i32", ("dp", None)),
        "tgt": dtm.Input((batch, SEQUENCE), "i32", ("dp", None)),
    }
    chunks = 2 if schedule == "interleaved" else 1
    return dtm.train_step(
        dtm.nn.GPT(VOCAB, SEQUENCE, HIDDEN, HEADS, layers),
        loss_fn,
        mesh=dtm.Mesh(pp=1, dp=1, tp=1),
        inputs=inputs,
        optimizer=dtm.optim.AdamW(lr=6e-5, weight_decay=0.1),
        clip_norm=1.0,
        name="gpt_175b",
        pipeline=dtm.Pipeline(microbatches, schedule, chunks),
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=MESH)
    ap.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb-h1")
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args(argv)
    from dtm_mpi.config import get_config

    if not get_config().explain:
        raise UsageError(
            "this configuration needs 1,024 ranks with about 90 GiB each: plan it with "
            "`dtm explain examples/gpt_175b.py`"
        )
    sizes = parse_mesh_binding(args.mesh)
    step = gpt_step(args.schedule, args.microbatches, args.micro_batch, sizes.get("dp", 1))

    def no_data(step: int, regions: object) -> dict[str, object]:
        raise UsageError("examples/gpt_175b.py plans; run it with dtm explain")

    dtm.fit(step, no_data, steps=1, mesh=sizes)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    from dtm_mpi.console import write_line
    from dtm_mpi.errors import DtmError

    try:
        sys.exit(main(sys.argv[1:]))
    except DtmError as err:
        write_line(f"gpt_175b: {err}")
        sys.exit(1)
