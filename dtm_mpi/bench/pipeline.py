"""``dtm bench pipeline``: pipelined training steps per schedule, measured against the plan.

Run under the launcher, one pipeline stage group per rank (``mpirun -n 2 python -m mpi4py -m
dtm_mpi bench pipeline``): a float32 GPT of ``layers`` blocks cut into as many stages as ranks
(``pp`` = the ranks; ``interleaved``: two stages per rank), trained with AdamW for ``warmup``
then ``steps`` timed steps per schedule, every schedule in the same processes. Per schedule:

* ``ms/step``: the median over the timed steps of the slowest rank's step time;
* ``bubble``: the measured idle share, ``1 - (sum of the ranks' pass times) / (ranks x step
  time)``, median over the steps;
* ``predicted``: the bubble of the schedule's time-line under the pass times measured in the
  same run (the mean F, I and W time of each stage: :func:`~dtm_mpi.plan.schedule.time_schedule`),
  and the relative difference; more ranks than cores make the measurement meaningless (marked);
* ``held`` and ``act MiB``: the most microbatch activations a rank holds at once by the plan,
  and what they take (the held values' local bytes).

The first row is the same model and batch without a pipeline on one rank (the others wait);
the cost model's transfer time is half the median round trip of one boundary block between
ranks 0 and 1, measured first.
"""

from __future__ import annotations

import csv
import itertools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
) -> str | None:
    """Run the benchmark on every rank of the job (collective); rank 0 returns the table."""
    from mpi4py import MPI

    from dtm_mpi import frontend as dtm
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.config import get_config
    from dtm_mpi.frontend.stage_split import step_stages_of
    from dtm_mpi.plan.schedule import PipelineShape, parse_schedule, plan_schedule
    from dtm_mpi.runtime.pipeline_step import PipelineRank, pipeline_groups, stage_plans

    world = MPI.COMM_WORLD
    p, rank = int(world.Get_size()), int(world.Get_rank())
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
    if rank == 0:  # the same model and batch unpipelined, on one rank (the others wait)
        model = dtm.nn.GPT(vocab, seq, dim, 4, layers)
        rows.append(_unpipelined(model, inputs, data, steps, warmup))
    world.Barrier()
    # a boundary block's one-way time (half a ping-pong): the cost model's transfer time
    boundary = np.zeros(max(1, batch // microbatches) * seq * dim, np.float32)
    transfer = _one_way(world, boundary) if p > 1 else 0.0
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
        session = MpiSession(shape, timeout_s=get_config().timeout_s, world=world, join=False)
        try:
            plans = stage_plans(stages, mesh.ir(), shape)
            session.join_mesh(pipeline_groups(plans))
            comm = MpiComm(session)
            runner = PipelineRank(stages, schedule, mesh.ir(), shape, comm, plans=plans)
            data = runner.batch_blocks(data)
            for i in range(warmup):
                runner.step(data, i)
            runner.seconds.clear()
            walls, busy = [], []
            for i in range(steps):
                world.Barrier()
                start = time.perf_counter()
                before = sum(sum(v) for v in runner.seconds.values())
                runner.step(data, warmup + i)
                walls.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
                busy.append(world.allreduce(sum(sum(v) for v in runner.seconds.values()) - before))
            seconds = world.gather(runner.seconds, root=0)
            held_bytes = world.gather(runner.held_bytes(), root=0)
        finally:
            session.close()
        if rank == 0:
            assert seconds is not None and held_bytes is not None
            rows.append(
                _row(kind.value, schedule, stages, seconds, held_bytes, walls, busy, p, transfer)
            )
    if rank != 0:
        return None
    if csv_path:
        _write_csv(csv_path, rows)
    return _table(rows, p)


def _one_way(world: Any, buf: np.ndarray, rounds: int = 20) -> float:
    """Half the median round trip of ``buf`` between ranks 0 and 1 (the others wait)."""
    rank = int(world.Get_rank())
    trips = []
    for _ in range(rounds):
        world.Barrier()
        start = time.perf_counter()
        if rank == 0:
            world.Send(buf, dest=1, tag=7)
            world.Recv(buf, source=1, tag=7)
        elif rank == 1:
            world.Recv(buf, source=0, tag=7)
            world.Send(buf, dest=0, tag=7)
        trips.append(time.perf_counter() - start)
    return float(world.bcast(statistics.median(trips) / 2, root=0))


def _unpipelined(
    model: Any, inputs: Any, data: dict[str, np.ndarray], steps: int, warmup: int
) -> PipelineRow:
    """The step without a pipeline on one rank (the one step loop on one simulated rank): its
    median step time."""
    from dtm_mpi import frontend as dtm
    from dtm_mpi.runtime.simulate import run_simulated
    from dtm_mpi.runtime.step_loop import RunHooks

    step = dtm.train_step(
        model,
        gpt_loss,
        mesh=dtm.Mesh(dp=1, tp=1),
        inputs=inputs,
        optimizer=dtm.optim.AdamW(lr=1e-3),
    )
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
    walls: list[float],
    busy: list[float],
    p: int,
    transfer: float,
) -> PipelineRow:
    from dtm_mpi.plan.schedule import StageCosts, Work, time_schedule

    costs = []
    for s in range(len(stages.passes)):
        mean = {
            w: statistics.fmean(t) for r in seconds for (st, w), t in r.items() if st == s and t
        }
        costs.append(
            StageCosts(
                mean.get(Work.F, 0.0), mean.get(Work.I, 0.0), mean.get(Work.W, 0.0), transfer
            )
        )
    timing = time_schedule(schedule, costs)
    step = statistics.median(walls)
    measured = statistics.median(1.0 - b / (p * w) for b, w in zip(busy, walls, strict=True))
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
        f"{'schedule':<14} {'stages':>6} {'m':>3} {'ms/step':>9} {'bubble':>7} {'predicted':>9} {'diff':>6} {'held':>5} {'act MiB':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.schedule:<14} {r.stages:>6} {r.microbatches:>3} {r.ms_per_step:>9.2f} {r.bubble:>7.1%} {r.predicted:>9.1%} {r.rel_diff:>+6.0%} {r.held:>5} {r.act_mib:>8.2f}"
        )
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
                ]
            )
