"""A pipelined (or unpipelined) training job for the tests: the float64 GPT of
``tests/pipeline_case.py`` trained by ``fit()`` with AdamW on seeded token batches, under
``mpirun`` or on simulated ranks (``--sim N``); the final state written to ``-o`` (rank 0).

    mpirun -n 4 python -m mpi4py tests/pipeline_fit_job.py --mesh pp=2,tp=2 --schedule zb-h1 \\
        --microbatches 4 --steps 3 -o out.npz
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtm_mpi import frontend as dtm
from dtm_mpi.console import write_line
from dtm_mpi.errors import DtmError
from dtm_mpi.runtime.policies import checkpoint_policy
from dtm_mpi.runtime.request import parse_resize
from dtm_mpi.sharding.mesh import parse_mesh_binding
from tests.pipeline_case import T, gpt, lm_loss, token_batch

BATCH = 8


def loader(step: int, regions: Mapping[str, tuple[slice, ...]]) -> dict[str, np.ndarray]:
    data = token_batch(BATCH, 100 + step)
    return {k: data[k][r] for k, r in regions.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="pp=1")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sim", type=int, default=None)
    ap.add_argument("--store", default=None)
    ap.add_argument("--every", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--splits", default=None, help="layer paths, comma-separated")
    ap.add_argument("--resize-at", action="append", default=[], help="STEP:MESH (repeatable)")
    ap.add_argument(
        "--rank1-splits",
        default=None,
        help="other splits on rank 1 only (a boundary mismatch injected into one rank)",
    )
    ap.add_argument("-o", dest="out", default=None)
    args = ap.parse_args(argv)
    inputs = {k: dtm.Input((BATCH, T), "i32", ("dp", None)) for k in ("ids", "tgt")}
    pipeline = None
    if args.schedule is not None:
        chunks = 2 if args.schedule == "interleaved" else 1
        splits = args.splits
        if args.rank1_splits is not None and os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
            splits = args.rank1_splits
        pipeline = dtm.Pipeline(
            args.microbatches,
            args.schedule,
            chunks,
            tuple(splits.split(",")) if splits else None,
        )
    step = dtm.train_step(
        gpt(),
        lm_loss,
        mesh=dtm.Mesh(pp=1, dp=1, tp=1),
        inputs=inputs,
        optimizer=dtm.optim.AdamW(lr=1e-2),
        clip_norm=0.5,
        pipeline=pipeline,
    )
    res = dtm.fit(
        step,
        loader,
        steps=args.steps,
        sim=args.sim,
        mesh=parse_mesh_binding(args.mesh),
        checkpoint=checkpoint_policy(args.store, every=args.every, resume=args.resume),
        resize=dtm.ResizePolicy(at=tuple(parse_resize(r) for r in args.resize_at))
        if args.resize_at
        else None,
        quiet=True,
        log_every=args.log_every,
    )
    losses = [m["loss"] for m in res.metrics]
    write_line(f"losses {' '.join(x.hex() for x in losses)}")  # (one write: lines stay apart)
    if res.outputs and args.out:
        np.savez(args.out, **res.outputs)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except DtmError as err:
        write_line(f"pipeline job: {err}")
        sys.exit(1)
