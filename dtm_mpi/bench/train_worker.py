"""One measured run of ``dtm bench train`` (started by :mod:`dtm_mpi.bench.train`, under
``mpirun`` for several ranks): ``--impl dtm`` (the frontend's step in dtm's training loop),
``numpy`` (the floor, one process) or ``torch-single``/``torch-ddp``/``torch-tp`` (the peer).
Each rank writes ``OUT.<rank>``: a JSON object with its step times (seconds, after the
warm-up steps), the losses, its seconds in communication (dtm: the plan's collectives and
point-to-point calls), and its peak resident memory.

    python -m dtm_mpi.bench.train_worker --impl numpy --model mlp --steps 8 --out F
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

import numpy as np

from dtm_mpi.bench.proc import status_kib
from dtm_mpi.bench.train_models import MODELS, SHARDING, initial_state, numpy_floor

__all__ = ["TimedComm", "main"]


class _TimedHandle:
    """A started collective whose wait adds its seconds to ``comm``'s. (A class of its own:
    one defined per call, closing over the handle, lived in a reference cycle until the
    cyclic garbage collector ran, holding every overlapped collective's result: the MLP at
    dp=2 with overlap grew to 631 MiB of RSS against 210, and ran slower.)"""

    __slots__ = ("comm", "handle")

    def __init__(self, handle: Any, comm: TimedComm) -> None:
        self.handle, self.comm = handle, comm

    def test(self) -> bool:
        return bool(self.handle.test())

    def wait(self) -> Any:
        t1 = time.perf_counter()
        try:
            return self.handle.wait()
        finally:
            self.comm.seconds += time.perf_counter() - t1


class TimedComm:
    """A communicator that adds up the seconds spent in its calls (what the plan's
    communication costs this rank, waiting for the others included); everything else is
    the wrapped communicator's."""

    TIMED = (
        "allgather",
        "allreduce",
        "reduce_scatter",
        "exchange",
        "broadcast",
        "send",
        "recv",
        "flush",
    )

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seconds = 0.0
        for name in self.TIMED:
            setattr(self, name, self._timed(getattr(inner, name)))

    def _timed(self, fn: Any) -> Any:
        clock = time.perf_counter

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - t0

        return call

    def start_allreduce(self, *args: Any) -> Any:
        """Started (timed), and waited for through a handle whose wait is timed too."""
        return self._started(self._inner.start_allreduce, args)

    def start_allgather(self, *args: Any) -> Any:
        """Started (timed), and waited for through a handle whose wait is timed too."""
        return self._started(self._inner.start_allgather, args)

    def _started(self, start: Any, args: tuple[Any, ...]) -> Any:
        t0 = time.perf_counter()
        handle = start(*args)
        self.seconds += time.perf_counter() - t0
        return _TimedHandle(handle, self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _run_dtm(
    model: str,
    sizes: dict[str, int],
    steps: int,
    warmup: int,
    shard: str | None = None,
    params: str | None = None,
) -> dict[str, Any]:
    from mpi4py import MPI

    from dtm_mpi.comm.handshake import agree_gemm
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.config import get_config
    from dtm_mpi.kernels.backends import parse_backend
    from dtm_mpi.kernels.devices import open_backend
    from dtm_mpi.plan.cost import local_bytes
    from dtm_mpi.plan.program import compile_plan, mesh_for
    from dtm_mpi.runtime.mpirun import plan_groups, run_loop
    from dtm_mpi.runtime.request import RunRequest
    from dtm_mpi.runtime.step_loop import RunHooks

    world = MPI.COMM_WORLD
    n = int(world.Get_size())
    spec = MODELS[model]
    step = spec.build(shard, params)
    plan = compile_plan(step.module, mesh_for(step.module, n, sizes))
    rank = int(world.Get_rank())
    state_bytes = sum(
        local_bytes(p.type, plan.mesh, rank)
        for p in step.module.entry.params
        if p.name.startswith("%opt.")
    )
    marks: list[float] = []
    losses: list[float] = []
    comm_marks: list[float] = []
    timed: list[TimedComm] = []

    def feed(s: int, regions: Any) -> dict[str, np.ndarray]:
        data = spec.batch_data(s)
        return {k: data[k][r] for k, r in regions.items()}

    rss: list[tuple[float, int]] = []

    def on_step(s: int, rank: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        if not rss or now - rss[-1][0] >= 5.0:  # the soak's trace: every 5 s
            rss.append((now, status_kib("VmRSS") * 1024))
        marks.append(now)
        comm_marks.append(timed[0].seconds if timed else 0.0)
        losses.append(float(metrics[step.metrics[0]]))

    hooks = RunHooks(feed, tuple(step.inputs), on_step=on_step, metric_names=tuple(step.metrics))
    config = get_config()
    session = MpiSession(plan.mesh, timeout_s=config.timeout_s, world=world, join=False)
    agree_gemm(world, config.gemm, timeout_s=config.timeout_s)  # one GEMM provider per job
    try:
        session.join_mesh(plan_groups(plan, config.deterministic))
        comm = TimedComm(
            MpiComm(session, deterministic=config.deterministic, max_msg_elems=config.max_msg_elems)
        )
        timed.append(comm)
        request = RunRequest("<bench>", module=step.module, steps=warmup + steps, hooks=hooks)
        world.Barrier()
        start = time.perf_counter()
        run_loop(
            session,
            comm,
            plan,
            request,
            int(world.Get_rank()),
            open_backend(parse_backend("numpy")),
        )
    finally:
        session.close()
    points = [start, *marks]
    times = [b - a for a, b in itertools.pairwise(points)][warmup:]
    comms = [b - a for a, b in itertools.pairwise([0.0, *comm_marks])][warmup:]
    trace = [(t - start, b) for t, b in rss]
    return {
        "times": times,
        "comm": comms,
        "losses": losses,
        "ops": len(plan.entry_plan.ops),
        "opt_state_bytes": state_bytes,
        "rss_trace": trace,
    }


def _run_numpy(model: str, steps: int, warmup: int) -> dict[str, Any]:
    spec = MODELS[model]
    floor = numpy_floor(model, initial_state(spec.build()))
    times, losses = [], []
    for s in range(warmup + steps):
        batch = spec.batch_data(s)
        t0 = time.perf_counter()
        losses.append(floor.step(batch))
        times.append(time.perf_counter() - t0)
    return {"times": times[warmup:], "comm": [0.0] * steps, "losses": losses}


def _run_torch(model: str, mode: str, steps: int, warmup: int, rendezvous: str) -> dict[str, Any]:
    from dtm_mpi.bench.train_torch import TorchPeer, torch_module

    torch = torch_module()
    dist = torch.distributed

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    rank, ranks = 0, 1
    if mode != "single":
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
        ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
        dist.init_process_group(  # (a file, not a port: no race with other jobs for it)
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=ranks
        )
    spec = MODELS[model]
    peer = TorchPeer(model, initial_state(spec.build()), mode, rank, ranks)
    times, losses = [], []
    if mode != "single":
        dist.barrier()
    for s in range(warmup + steps):
        batch = spec.batch_data(s)
        t0 = time.perf_counter()
        losses.append(peer.step(batch))
        times.append(time.perf_counter() - t0)
    if mode != "single":  # (after a failed step the error ends the job, not a barrier)
        dist.barrier()  # every rank done with the last step (the process ends in main)
    return {"times": times[warmup:], "comm": [], "losses": losses, "rank": rank}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dtm_mpi.bench.train_worker")
    ap.add_argument(
        "--impl",
        required=True,
        choices=(*SHARDING, "numpy", "torch-single", "torch-ddp", "torch-tp"),
    )
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--mesh", default="dp=1,tp=1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rendezvous", default="", help="torch's rendezvous file (not there yet)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank = 0
    if args.impl in SHARDING:
        from mpi4py import MPI

        from dtm_mpi.sharding.mesh import parse_mesh_binding

        rank = int(MPI.COMM_WORLD.Get_rank())
        shard, params = SHARDING[args.impl]
        got = _run_dtm(
            args.model, parse_mesh_binding(args.mesh), args.steps, args.warmup, shard, params
        )
    elif args.impl == "numpy":
        got = _run_numpy(args.model, args.steps, args.warmup)
    else:
        got = _run_torch(
            args.model, args.impl.removeprefix("torch-"), args.steps, args.warmup, args.rendezvous
        )
        rank = int(got.pop("rank"))
    got["rss"] = status_kib("VmHWM") * 1024  # the peak resident memory
    with open(f"{args.out}.{rank}", "w", encoding="utf-8") as fh:
        json.dump(got, fh)
    if args.impl in ("torch-ddp", "torch-tp"):
        # gloo's process group aborted the process in 1 of some 10 runs when torch tore it down
        # ("terminate called without an active exception"): the figures are written, every
        # rank passed the barrier, so the process ends without the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
