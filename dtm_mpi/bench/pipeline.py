"""``dtm bench pipeline``: pipelined training steps per schedule, measured against the plan.

Run under the launcher, one pipeline stage group per rank (``mpirun -n 2 python -m mpi4py -m
dtm_mpi bench pipeline``): a float32 GPT of ``layers`` blocks cut into as many stages as ranks
(``pp`` = the ranks; ``interleaved``: two stages per rank), trained with AdamW for ``warmup``
then ``steps`` timed steps per schedule, every schedule in the same processes. Per schedule:

* ``ms/step``: the median over the timed steps of the slowest rank's step time;
* ``bubble``: the measured idle share of the schedule: the time the ranks wait (in receives,
  in the last wait for their sends to be taken, and after their last action until the
  slowest rank's) over ``ranks x the schedule's time``, the schedule's time being the slowest
  rank's from its first action to its last send taken (the optimizer's update and the loss's
  publication after it are not the schedule's), median over the steps;
* ``predicted``: the bubble of the schedule's time-line under the pass times measured in the
  same run (the mean F, I and W time of each stage, plus the ranks' time neither in a pass
  nor waiting, spread over the compute actions: :func:`~dtm_mpi.plan.schedule.time_schedule`),
  and the relative difference; more ranks than cores make the measurement meaningless (marked);
* ``held`` and ``act MiB``: the most microbatch activations a rank holds at once by the plan,
  and what they take (the held values' local bytes);
* ``RSS MiB``: what one more step takes on top of the process's resident memory at its start
  (sampled every millisecond: :class:`~dtm_mpi.bench.rss.RssPeak`), the most of any rank;
* with torch installed (and without ``--no-torch``), ``torch.distributed.pipelining`` over gloo
  on the same GPT, weights, stages, microbatches and schedule in the same processes
  (:mod:`dtm_mpi.bench.pipeline_torch`): its step time, RSS and the ratio; the first step's
  loss of both is printed (the same model: they agree to float32 rounding).

The first row is the same model and batch without a pipeline on one rank (the others wait);
the cost model's transfer and receiving times are measured before each schedule's steps
through its own communicator (the runtime's send, driven by its send thread, and receive):
the receiving time is the median time a rank takes to receive a boundary block that has
already arrived, the transfer time half the median round trip of one block between ranks 0
and 1 less that.
"""

from __future__ import annotations

import csv
import itertools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dtm_mpi.bench.train_models import gpt_loss
from dtm_mpi.errors import UsageError
from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["PipelineRow", "run_pipeline_bench"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True, slots=True)
class PipelineRow:
    schedule: str
    ranks: int
    stages: int
    microbatches: int
    ms_per_step: float
    bubble: float
    predicted: float
    held: int
    act_mib: float
    rss_mib: float = 0.0
    torch_ms: float | None = None
    torch_rss_mib: float | None = None
    transfer_us: float = 0.0
    receive_us: float = 0.0

    @property
    def rel_diff(self) -> float:
        return (self.bubble - self.predicted) / self.predicted if self.predicted > 0 else 0.0


def run_pipeline_bench(
    schedules: Sequence[str],
    *,
    microbatches: int,
    steps: int,
    warmup: int,
    layers: int,
    dim: int,
    batch: int,
    seq: int,
    csv_path: str | None = None,
    with_torch: bool = True,
) -> str | None:
    """Run the benchmark on every rank of the job (collective); rank 0 returns the table."""
    from mpi4py import MPI

    from dtm_mpi import frontend as dtm
    from dtm_mpi.bench.pipeline_torch import TorchPipelines, torch_available
    from dtm_mpi.bench.rss import RssPeak, return_freed_memory
    from dtm_mpi.bench.train_models import initial_state
    from dtm_mpi.comm.handshake import agree_gemm
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.config import blas_threads_share, get_config
    from dtm_mpi.frontend.stage_split import step_stages_of
    from dtm_mpi.kernels.devices import limit_blas_threads
    from dtm_mpi.plan.pipeline import stage_plans
    from dtm_mpi.plan.schedule import PipelineShape, parse_schedule, plan_schedule
    from dtm_mpi.runtime.mpirun import pipeline_groups
    from dtm_mpi.runtime.pipeline_step import PipelineRank

    world = MPI.COMM_WORLD
    p, rank = int(world.Get_size()), int(world.Get_rank())
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    threads = blas_threads_share(int(node.Get_size())) or max(
        1, (os.cpu_count() or 1) // int(node.Get_size())
    )
    node.Free()
    limit_blas_threads(threads)  # dtm's ranks and torch's alike
    config = get_config()
    agree_gemm(world, config.gemm, timeout_s=config.timeout_s)  # one GEMM provider per job
    kinds = [parse_schedule(s) for s in schedules]
    if steps < 1 or warmup < 0:
        raise UsageError(f"--steps must be >= 1 and --warmup >= 0; got {steps}, {warmup}")
    vocab = 64
    rng = np.random.default_rng(0)
    data = {k: rng.integers(0, vocab, size=(batch, seq)).astype(np.int32) for k in ("ids", "tgt")}
    inputs = {k: dtm.Input((batch, seq), "i32", ("dp", None)) for k in data}
    mesh = dtm.Mesh(pp=p, dp=1, tp=1)
    shape = MeshShape((("pp", p), ("dp", 1), ("tp", 1)))
    rows: list[PipelineRow] = []
    first_loss: float | None = None  # the first schedule's first step
    plain = dtm.train_step(
        dtm.nn.GPT(vocab, seq, dim, 4, layers),
        gpt_loss,
        mesh=dtm.Mesh(dp=1, tp=1),
        inputs=inputs,
        optimizer=dtm.optim.AdamW(lr=1e-3),
    )
    if rank == 0:  # the same model and batch unpipelined, on one rank (the others wait)
        rows.append(_unpipelined(plain, data, steps, warmup))
    world.Barrier()
    boundary = np.zeros(max(1, batch // microbatches) * seq * dim, np.float32)
    runs: list[tuple[Any, Any, Any]] = []  # (runner, its batch blocks, session) per schedule
    peer = None
    try:
        for kind in kinds:
            chunks = 2 if kind.value == "interleaved" else 1
            n_stages = p * chunks
            if layers % n_stages:
                raise UsageError(
                    f"--layers {layers} do not split into {n_stages} stages ({kind.value})"
                )
            splits = [f"blocks.{k * layers // n_stages}" for k in range(1, n_stages)]
            stages = step_stages_of(
                dtm.nn.GPT(vocab, seq, dim, 4, layers),
                gpt_loss,
                mesh=mesh,
                inputs=inputs,
                splits=splits,
                microbatches=microbatches,
                optimizer=dtm.optim.AdamW(lr=1e-3),
            )
            schedule = plan_schedule(kind, PipelineShape(p, microbatches, chunks))
            session = MpiSession(shape, timeout_s=config.timeout_s, world=world, join=False)
            plans = stage_plans(stages, mesh.ir(), shape)
            session.join_mesh(pipeline_groups(plans))
            runner = PipelineRank(stages, schedule, mesh.ir(), shape, MpiComm(session), plans=plans)
            mine = runner.batch_blocks(data)
            runs.append((runner, mine, session))
            # a boundary block's one-way time the way the run moves it (the runtime's send,
            # driven by its send thread, and a bounded receive): this schedule's transfer cost
            transfer = _boundary_costs(runner.comm, rank, boundary) if p > 1 else (0.0, 0.0)
            for i in range(warmup):
                loss = runner.step(mine, i).loss
                first_loss = loss if first_loss is None else first_loss
            runner.seconds.clear()
            walls, scheduled, busy, waits, spans = [], [], [], [], []
            for i in range(steps):
                world.Barrier()
                start = time.perf_counter()
                before = sum(sum(v) for v in runner.seconds.values())
                loss = runner.step(mine, warmup + i).loss
                first_loss = loss if first_loss is None else first_loss
                walls.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
                scheduled.append(world.allreduce(runner.schedule_seconds, op=MPI.MAX))
                busy.append(world.allreduce(sum(sum(v) for v in runner.seconds.values()) - before))
                waits.append(world.allreduce(runner.waited_seconds))
                spans.append(world.allreduce(runner.schedule_seconds))
            seconds = world.gather(runner.seconds, root=0)
            held_bytes = world.gather(runner.held_bytes(), root=0)
            if rank == 0:
                assert seconds is not None and held_bytes is not None
                rows.append(
                    _row(
                        kind.value,
                        schedule,
                        stages,
                        seconds,
                        held_bytes,
                        (walls, scheduled, busy, waits, spans),
                        p,
                        transfer,
                    )
                )
        losses = f"first step's loss: dtm {first_loss or float('nan'):.6f}"
        timings = {}
        if with_torch and torch_available():  # the peer's step times, in the same processes
            dims = {"vocab": vocab, "context": seq, "dim": dim, "heads": 4, "layers": layers}
            peer = TorchPipelines(
                world, initial_state(plain), dims, data, microbatches=microbatches, threads=threads
            )
            timings = {k.value: peer.time(k.value, steps=steps, warmup=warmup) for k in kinds}
            first = next(iter(timings.values()), None)
            losses += f", torch {first.first_loss:.6f}" if first is not None else ""
        elif with_torch:
            losses += " (torch is not installed: no peer)"
        # memory last: the allocator then returns freed memory (slower: after every timing)
        return_freed_memory()
        for i, (kind, (runner, mine, _)) in enumerate(zip(kinds, runs, strict=True)):
            with RssPeak() as peak:
                runner.step(mine, warmup + steps)
            rss = world.allreduce(peak.above, op=MPI.MAX) / 2**20
            torch_rss = peer.rss(kind.value) if peer is not None else None
            if rank == 0:
                t = timings.get(kind.value)
                rows[i + 1] = replace(
                    rows[i + 1],
                    rss_mib=rss,
                    torch_ms=t.ms_per_step if t is not None else None,
                    torch_rss_mib=torch_rss,
                )
    finally:
        if peer is not None:
            peer.close()
        for _, _, session in runs:
            session.close()
    if rank != 0:
        return None
    if csv_path:
        _write_csv(csv_path, rows)
    return _table(rows, p) + "\n" + losses


def _boundary_costs(comm: Any, rank: int, buf: np.ndarray, rounds: int = 20) -> tuple[float, float]:
    """The cost model's ``(transfer, receive)`` for a boundary block ``buf`` moved through
    ``comm`` (the runtime's point to point, its sends driven by the send thread) between ranks
    0 and 1 (the others wait), the same on every rank: ``receive``, the median time rank 1
    takes to receive a block whose send was posted before its receive starts (the copy in,
    and above MPI's eager size the rendezvous), and ``transfer``, half the median round trip
    less that."""
    trips, takes = [], []
    tag = 32000  # (below the reserved tags; no step is running)
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            comm.send(buf, 1, tag)
            comm.recv(buf.shape, buf.dtype, 1, tag)
        elif rank == 1:
            got = comm.recv(buf.shape, buf.dtype, 0, tag)
            comm.send(got, 0, tag)
        comm.flush()
        trips.append(time.perf_counter() - start)
    ready = np.zeros(1, np.uint8)
    for _ in range(rounds):  # a block that is there before its receive starts
        if rank == 0:
            comm.send(buf, 1, tag)
            comm.send(ready, 1, tag + 1)  # (after the block, whose send is then posted)
        elif rank == 1:
            comm.recv(ready.shape, ready.dtype, 0, tag + 1)
            time.sleep(0.001)
            start = time.perf_counter()
            comm.recv(buf.shape, buf.dtype, 0, tag)
            takes.append(time.perf_counter() - start)
        comm.flush()
    half = np.array([statistics.median(trips) / 2 if rank == 0 else 0.0])
    take = np.array([statistics.median(takes) if rank == 1 else 0.0])
    one_way = float(comm.broadcast(half, ("pp",), 0)[0])
    receive = float(comm.broadcast(take, ("pp",), 1)[0])
    return max(0.0, one_way - receive), receive


def _unpipelined(step: Any, data: dict[str, np.ndarray], steps: int, warmup: int) -> PipelineRow:
    """The step without a pipeline on one rank (the one step loop on one simulated rank): its
    median step time."""
    from dtm_mpi.runtime.simulate import run_simulated
    from dtm_mpi.runtime.step_loop import RunHooks

    marks: list[float] = []  # after each step: step 0 only starts the clock
    hooks = RunHooks(on_step=lambda i, rank, metrics: marks.append(time.perf_counter()))
    run_simulated(
        step.module, 1, inputs=data, steps=warmup + steps + 1, hooks=hooks, deterministic=False
    )
    times = [b - a for a, b in itertools.pairwise(marks)][warmup:]
    return PipelineRow("none (1 rank)", 1, 1, 1, statistics.median(times) * 1e3, 0.0, 0.0, 0, 0.0)


def _row(
    name: str,
    schedule: Any,
    stages: Any,
    seconds: list[dict[Any, list[float]]],
    held_bytes: list[int],
    times: tuple[list[float], ...],
    p: int,
    transfer: tuple[float, float],
) -> PipelineRow:
    from dtm_mpi.plan.schedule import Compute, StageCosts, Work, time_schedule

    walls, scheduled, busy, waits, spans = times
    # the ranks' time neither in passes nor waiting (the runtime's own work between actions:
    # posting sends, bookkeeping) is busy time too: spread over the compute actions
    computes = [a for acts in schedule.actions for a in acts if isinstance(a, Compute)]
    other = statistics.median(
        max(0.0, t - b - w) for t, b, w in zip(spans, busy, waits, strict=True)
    )
    each = other / max(1, len(computes))
    split = any(a.work is not Work.B and a.work is not Work.F for a in computes)
    costs = []
    for s in range(len(stages.passes)):
        mean = {
            w: statistics.fmean(t) for r in seconds for (st, w), t in r.items() if st == s and t
        }
        extra = each if split else each / 2  # (a B action runs the I and W passes)
        costs.append(
            StageCosts(
                mean.get(Work.F, 0.0) + each,
                mean.get(Work.I, 0.0) + extra,
                mean.get(Work.W, 0.0) + extra,
                *transfer,
            )
        )
    timing = time_schedule(schedule, costs)
    step = statistics.median(walls)
    # the bubble: the ranks' idle share of the schedule (the slowest rank's): the time each
    # waits for the pipeline, and after its last action until the slowest rank's
    measured = statistics.median(
        (w + p * t - sp) / (p * t) for w, t, sp in zip(waits, scheduled, spans, strict=True)
    )
    held = max(timing.peak_held)
    return PipelineRow(
        name,
        p,
        schedule.shape.stages,
        schedule.shape.microbatches,
        step * 1e3,
        measured,
        timing.bubble,
        held,
        held * max(held_bytes) / 2**20,
        transfer_us=transfer[0] * 1e6,
        receive_us=transfer[1] * 1e6,
    )


def _table(rows: Sequence[PipelineRow], p: int) -> str:
    cores = os.cpu_count() or 1
    note = (
        f" (oversubscribed: {p} ranks on {cores} cores; the bubble is not meaningful)"
        if p > cores
        else ""
    )
    lines = [
        f"dtm bench pipeline: {p} rank(s){note}",
        f"{'schedule':<14} {'stages':>6} {'m':>3} {'ms/step':>9} {'bubble':>7} {'predicted':>9} {'diff':>6} {'held':>5} {'act MiB':>8} {'RSS MiB':>8} {'torch ms':>9} {'torch/dtm':>9} {'torch RSS':>9}",
    ]
    for r in rows:
        peer = (
            f" {r.torch_ms:>9.2f} {r.torch_ms / r.ms_per_step:>9.2f} {r.torch_rss_mib or 0.0:>9.1f}"
            if r.torch_ms is not None
            else f" {'-':>9} {'-':>9} {'-':>9}"
        )
        lines.append(
            f"{r.schedule:<14} {r.stages:>6} {r.microbatches:>3} {r.ms_per_step:>9.2f} {r.bubble:>7.1%} {r.predicted:>9.1%} {r.rel_diff:>+6.0%} {r.held:>5} {r.act_mib:>8.2f} {r.rss_mib:>8.1f}"
            + peer
        )
    costs = ", ".join(
        f"{r.schedule} {r.transfer_us:.0f} + {r.receive_us:.0f}" for r in rows if r.ranks > 1
    )
    if costs:
        lines.append(f"boundary block, transfer + receive (us, measured): {costs}")
    return "\n".join(lines)


def _write_csv(path: str, rows: Sequence[PipelineRow]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            [
                "schedule",
                "ranks",
                "stages",
                "microbatches",
                "ms_per_step",
                "bubble",
                "predicted",
                "held",
                "act_mib",
                "rss_mib",
                "torch_ms_per_step",
                "torch_rss_mib",
                "transfer_us",
                "receive_us",
            ]
        )
        for r in rows:
            w.writerow(
                [
                    r.schedule,
                    r.ranks,
                    r.stages,
                    r.microbatches,
                    f"{r.ms_per_step:.4f}",
                    f"{r.bubble:.4f}",
                    f"{r.predicted:.4f}",
                    r.held,
                    f"{r.act_mib:.4f}",
                    f"{r.rss_mib:.4f}",
                    "" if r.torch_ms is None else f"{r.torch_ms:.4f}",
                    "" if r.torch_rss_mib is None else f"{r.torch_rss_mib:.4f}",
                    f"{r.transfer_us:.2f}",
                    f"{r.receive_us:.2f}",
                ]
            )
