"""Train a tensor- and data-parallel MLP on the digits data set (1,797 8x8 images bundled with
scikit-learn), written with the dtm_mpi frontend.

    mpirun -n 4 python examples/digits.py --mesh dp=2,tp=2 --steps 300 --store S --checkpoint-every 150
    mpirun -n 3 python examples/digits.py --mesh dp=1,tp=3 --steps 300 --store S --resume
    python examples/digits.py --sim 4 --mesh dp=2,tp=2 --steps 300       # simulated ranks

The model, loss, optimizer and data split are fixed by the arguments, so every run traces the
same module (the resume check compares its hash). After the last step the held-out accuracy is
measured by an evaluation step that reads the weights from the store's latest checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from dtm_mpi import frontend as dtm
from dtm_mpi.frontend import functional as fn
from dtm_mpi.runtime.policies import checkpoint_policy, resize_policy
from dtm_mpi.runtime.request import parse_resize
from dtm_mpi.sharding.mesh import parse_mesh_binding

BATCH = 64
HIDDEN = 256


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # scikit-learn's 8x8 digits, read from the CSV it ships: the values of
    # ``sklearn.datasets.load_digits()`` without importing scikit-learn (2.6 s of CPU per rank).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("digits.py: needs scikit-learn's digits data (pip install scikit-learn)")
    csv_gz = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(csv_gz, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    x = (table[:, :-1] / 16.0).astype(np.float32)
    y = table[:, -1].astype(np.int32)
    order = np.random.default_rng(1234).permutation(len(x))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def model() -> dtm.nn.Module:
    return dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(64, HIDDEN), fn.gelu, dtm.nn.RowParallelLinear(HIDDEN, 10)
    )


def loss_fn(
    m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor
) -> tuple[dtm.Tensor, dict[str, dtm.Tensor]]:
    logits = m(x)
    return fn.cross_entropy(logits, y), {"acc": fn.accuracy(logits, y)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="dp=2,tp=2", help="axis sizes, e.g. dp=2,tp=2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sim", type=int, default=None, help="simulated ranks in this process")
    ap.add_argument("--store", default=None, help="checkpoint store directory")
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--checkpoint-async", action="store_true", help="write checkpoints meanwhile")
    ap.add_argument("--keep-last", type=int, default=None, help="keep the K newest checkpoints")
    ap.add_argument("--quota", type=int, default=None, help="refuse a checkpoint above BYTES")
    ap.add_argument(
        "--resize-at",
        action="append",
        default=[],
        metavar="STEP:MESH",
        help="under MPI: after step STEP, continue on the mesh bound as MESH (live; repeatable)",
    )
    ap.add_argument("--plot", default=None, help="write the loss/accuracy curves here (PNG)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (batch jobs)")
    ap.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="split AdamW's update and state over dp (ZeRO-1/2: reduce-scatter, allgather)",
    )
    ap.add_argument(
        "--shard-params",
        action="store_true",
        help="store the weights split over dp too, gathered where used (ZeRO-3)",
    )
    ap.add_argument(
        "-o", "--out", default=None, help="write the final weights and optimizer state here (.npz)"
    )
    args = ap.parse_args(argv)
    sizes = parse_mesh_binding(args.mesh)
    mesh = dtm.Mesh(dp=2, tp=2)  # the declared mesh; --mesh binds the sizes of this run
    xs, ys, xt, yt = data()
    net = model()
    step = dtm.train_step(
        net,
        loss_fn,
        mesh=mesh,
        optimizer=dtm.optim.AdamW(
            lr=args.lr, weight_decay=1e-4, shard="dp" if args.shard_optimizer else None
        ),
        inputs={
            "x": dtm.Input((BATCH, 64), "f32", ("dp", None)),
            "y": dtm.Input((BATCH,), "i32", ("dp",)),
        },
        name="digits",
        shard_params="dp" if args.shard_params else None,
    )
    res = dtm.fit(
        step,
        dtm.ArrayLoader({"x": xs, "y": ys}, BATCH, seed=7),
        steps=args.steps,
        sim=args.sim,
        mesh=sizes,
        checkpoint=checkpoint_policy(
            args.store,
            every=args.checkpoint_every,
            resume=args.resume,
            background=args.checkpoint_async,
            keep_last=args.keep_last,
            quota=args.quota,
        ),
        resize=resize_policy(tuple(parse_resize(text) for text in args.resize_at)),
        quiet=args.quiet,
        log_every=50 if args.quiet else None,
    )
    rank0 = bool(res.outputs)  # rank 0 holds the outputs (every rank has the metrics)
    if rank0 and args.store:
        _append_metrics(os.path.join(args.store, "metrics.csv"), res.metrics)
    # held out: under MPI the weights come from the store (rank 0 alone holds the outputs)
    acc = _held_out(net, mesh, sizes, xt, yt, args, res) if args.store or args.sim else float("nan")
    if rank0 and args.out:
        np.savez(args.out, **res.outputs)
    if rank0:
        held = (
            f"held-out accuracy {acc:.4f} ({len(yt)} images)"
            if not np.isnan(acc)
            else "held-out accuracy: give --store (or --sim)"
        )
        print(f"step {args.steps}: train loss {res.last('loss'):.4f}, {held}", flush=True)
        if args.plot:
            _plot(
                os.path.join(args.store, "metrics.csv") if args.store else None,
                res.metrics,
                args.plot,
            )
            print(f"wrote {args.plot}", flush=True)
    return 0


def _held_out(
    net: dtm.nn.Module,
    mesh: dtm.Mesh,
    sizes: dict[str, int],
    xt: np.ndarray,
    yt: np.ndarray,
    args: argparse.Namespace,
    res: dtm.FitResult,
) -> float:
    """Accuracy on the held-out images: an evaluation step over all of them at once, its
    weights read from the store's latest checkpoint (or, simulated, the final weights)."""
    ev = dtm.eval_step(
        net,
        lambda m, x, y: {"acc": fn.accuracy(m(x), y)},
        mesh=mesh,
        name="digits_eval",
        inputs={
            "x": dtm.Input(xt.shape, "f32", ("dp", None)),
            "y": dtm.Input(yt.shape, "i32", ("dp",)),
        },
        weights_from_store=args.store is not None,
    )
    weights = None if args.store else {k: v for k, v in res.outputs.items() if k in ev.params}
    out = dtm.fit(
        ev,
        dtm.ArrayLoader({"x": xt, "y": yt}, len(yt), shuffle=False),
        steps=1,
        sim=args.sim,
        mesh=sizes,
        checkpoint=checkpoint_policy(args.store),
        quiet=True,
        values=weights,
    )
    return out.last("acc") if out.metrics else float("nan")


def _append_metrics(path: str, rows: list[dict[str, float]]) -> None:
    new = not os.path.exists(path)
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["step", "loss", "acc"])
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in ("step", "loss", "acc")})


def _plot(csv_path: str | None, rows: list[dict[str, float]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if csv_path and os.path.exists(csv_path):
        with open(csv_path) as fh:
            rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(fh)]
    steps = [r["step"] + 1 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["acc"] for r in rows], color="tab:orange", alpha=0.6, label="batch accuracy")
    ax2.set_ylabel("accuracy")
    fig.legend(loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    from dtm_mpi.console import write_line
    from dtm_mpi.errors import DtmError

    try:
        sys.exit(main(sys.argv[1:]))
    except DtmError as err:  # one line (the same on every rank for a distributed failure)
        write_line(f"digits: {err}")  # one write: ranks' lines stay apart
        sys.exit(1)
