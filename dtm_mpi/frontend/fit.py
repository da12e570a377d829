"""Running traced steps from Python: one call, on simulated ranks or the ranks of the job.

:func:`fit` runs a :class:`~dtm_mpi.frontend.trace.TracedStep` through the same launcher as
``dtm run`` (:func:`dtm_mpi.runtime.runner.run_request`): with ``sim=N`` on N simulated ranks in
this process, otherwise under ``mpirun``/``srun`` on every rank of the job (every rank calls
it) with the handshake, the bounded waits, checkpoints in the parallel-HDF5 store and
``resume``. Each step, every rank's loader is asked for *its* blocks of the step's batch only
(:class:`ArrayLoader` reads just those rows). Every rank gets the metrics of every step; rank
0 shows a progress bar (tqdm; ``quiet`` for batch jobs; ``log_every`` for progress lines) and
gets the final parameters.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.config import get_config
from dtm_mpi.console import say
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.run_report import Peak, RunMeter, StepCost, peak_flops, step_cost
from dtm_mpi.frontend.trace import TracedStep
from dtm_mpi.runtime.data_position import DataPosition
from dtm_mpi.runtime.policies import CheckpointPolicy, DevicePolicy, ResizePolicy
from dtm_mpi.runtime.values import BlockSource

__all__ = [
    "ArrayLoader",
    "CheckpointPolicy",
    "DevicePolicy",
    "FitResult",
    "ResizePolicy",
    "fit",
]


class ArrayLoader:
    """Batches of ``batch_size`` rows drawn from arrays sharing their first dim (numpy
    arrays or memmaps): step ``s`` takes rows ``[k B, (k+1) B)`` of epoch ``s // K``'s
    permutation (``K`` whole batches per epoch; seeded: the same on every rank and in every
    run, so a resumed run sees the batches the uninterrupted one would). A rank is given the
    regions of the global batch its blocks cover and reads only those rows."""

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not arrays:
            raise UsageError("ArrayLoader needs at least one array")
        lengths = {k: len(v) for k, v in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise UsageError(f"ArrayLoader: the arrays have different lengths {lengths}")
        self.arrays = dict(arrays)
        self.n = next(iter(lengths.values()))
        if not 1 <= batch_size <= self.n:
            raise UsageError(f"batch_size must be 1..{self.n}; got {batch_size}")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.per_epoch = self.n // batch_size
        self._order: tuple[int, np.ndarray] | None = None

    def rows(self, step: int) -> np.ndarray:
        """The row indices of step ``step``'s batch."""
        epoch, k = divmod(step, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(self.n)
                if self.shuffle
                else np.arange(self.n)
            )
            self._order = (epoch, order)
        return self._order[1][k * self.batch_size : (k + 1) * self.batch_size]

    def __call__(
        self, step: int, regions: Mapping[str, tuple[slice, ...]]
    ) -> dict[str, np.ndarray]:
        rows = self.rows(step)
        out = {}
        for name, region in regions.items():
            if not region:
                raise UsageError(
                    f"input {name!r} is a scalar: ArrayLoader draws rows of arrays; feed a scalar with a loader function"
                )
            if name not in self.arrays:
                raise UsageError(
                    f"the loader has no array {name!r} (it has {', '.join(self.arrays)})"
                )
            out[name] = np.asarray(self.arrays[name][rows[region[0]]][(slice(None), *region[1:])])
        return out


@dataclass
class FitResult:
    """What a run gives back: the metrics on every rank, the outputs on rank 0."""

    metrics: list[dict[str, float]] = field(default_factory=list)
    """Each step's scalar results by name, with ``step`` (0-based); the same on every rank."""
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    """Rank 0 (elsewhere empty): the final value of every entry parameter (weights, optimizer
    state) and the last step's results (``result0``, ...), global arrays."""
    tensors: list[dict[str, np.ndarray]] = field(default_factory=list)
    """Each step's tensor results by name (a :func:`~dtm_mpi.frontend.trace.forward_step`'s),
    whole, on every rank; empty where ``fit`` was given ``on_tensors``."""
    timings: list[dict[str, float]] = field(default_factory=list)
    """Rank 0 (elsewhere empty): each step's ``step``, wall time ``step_s`` (the first
    step's includes the run's setup), ``tokens_per_s``, ``mfu`` (where the peak is known)
    and ``rss_gib`` (:mod:`dtm_mpi.frontend.run_report`)."""
    cost: StepCost | None = None
    """The tokens and model FLOPs of one step, and the peak MFU divides by (rank 0)."""
    peak: Peak | None = None

    def last(self, name: str) -> float:
        return self.metrics[-1][name]


class _Bar:
    """Rank 0's progress bar (tqdm): the step's metrics, step time and throughput."""

    def __init__(self, total: int, samples: int) -> None:
        self.total, self.samples = total, samples
        self.bar: Any = None

    def __call__(self, step: int, metrics: dict[str, float], figures: dict[str, float]) -> None:
        dt = figures["step_s"]
        if self.bar is None:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(
                total=self.total, initial=step, file=sys.stderr, dynamic_ncols=True, unit="step"
            )
        self.bar.set_postfix(
            {
                **{k: f"{v:.4g}" for k, v in metrics.items()},
                "ms": f"{dt * 1e3:.1f}",
                "samples/s": f"{self.samples / dt:.0f}",
                **_shown(figures),
            },
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _shown(figures: Mapping[str, float]) -> dict[str, str]:
    """The throughput figures the progress bar and line show."""
    out = {"tok/s": f"{figures['tokens_per_s']:.0f}"}
    if "mfu" in figures:
        out["mfu"] = f"{100 * figures['mfu']:.2f}%"
    return out


def fit(
    step: TracedStep,
    loader: Callable[[int, Mapping[str, tuple[slice, ...]]], Mapping[str, np.ndarray]],
    *,
    steps: int,
    sim: int | None = None,
    mesh: Mapping[str, int] | None = None,
    checkpoint: CheckpointPolicy | None = None,
    resize: ResizePolicy | None = None,
    device: DevicePolicy | None = None,
    log_every: int | None = None,
    quiet: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_tensors: Callable[[int, dict[str, np.ndarray]], None] | None = None,
    values: Mapping[str, np.ndarray | BlockSource] | None = None,
    integrity: bool = False,
    audit_every: int | None = None,
    quantize_allreduce: int | None = None,
    metrics_file: str | os.PathLike[str] | None = None,
    tensorboard: str | os.PathLike[str] | None = None,
) -> FitResult:
    """Run ``steps`` steps of ``step`` (a training step updates its state; an evaluation
    step is run once or more on fed inputs), feeding ``loader(step, regions)`` each step.

    ``sim``: simulated ranks in this process (None: the ranks of the MPI job; call on every
    rank). ``mesh``: axis sizes binding the module's mesh (as ``dtm run --mesh``). The options
    are the policy objects ``dtm run`` builds from its command line
    (:mod:`dtm_mpi.runtime.policies`, where each option's default and check live):

    * ``checkpoint`` (:class:`~dtm_mpi.runtime.policies.CheckpointPolicy`: store, every N
      steps, resume, background writes, keep-last, quota), in both modes; a training step
      saves after its last step too (an evaluation step's ``init store`` weights are read from
      its store; an evaluation step saves nothing unless asked every N steps). Under MPI, SIGUSR1 (or a scheduler's SIGTERM) stops every rank after the same
      step and saves the state; the process then exits with code 75 ("saved, requeue me"; a
      policy with ``resume=True`` continues). Simulated ranks stop alike.
    * ``resize`` (:class:`~dtm_mpi.runtime.policies.ResizePolicy`: ``at`` steps and a request
      ``file``), live resizes under MPI: ranks that leave wait inside ``fit`` until the run
      ends; ranks beyond those launched are spawned running this script again with its
      arguments (``python -m mpi4py SCRIPT ARGS``; ``relaunch`` defaults to that), whose
      ``fit`` call joins the run (the handshake checks it traced the same module) and returns
      the metrics of the steps it took part in.
    * ``device`` (:class:`~dtm_mpi.runtime.policies.DevicePolicy`: backend, GPU-aware MPI,
      memory limit per rank; default numpy).
    * ``log_every``: rank 0's progress line every N steps (the metrics, step time, steps and
      samples per second; :class:`~dtm_mpi.runtime.policies.ProgressPolicy`); ``quiet``: no
      progress bar.

    ``on_tensors(step, tensors)``: every rank, after each step, a forward step's tensor
    results by name, whole (instead of keeping them in ``FitResult.tensors``).
    ``values``: global values of other parameters (an evaluation step's weights), by name.
    ``integrity``: payload integrity mode (as ``DTM_INTEGRITY=1``, for this process and its
    later runs): point-to-point payloads carry their sender's CRC32C, checked on receipt.
    ``audit_every``: the replica audit every N steps (as ``DTM_AUDIT_EVERY=N``): each
    replicated state tensor's CRC32C compared across its replicas, and before every checkpoint.
    ``quantize_allreduce``: sum allreduces of 1,024 or more floats (the gradients) as int8
    blocks of this size with error feedback (as ``DTM_QUANT_ALLREDUCE``; bound: io/WIRE.md §6;
    not in deterministic mode). ``metrics_file``: rank 0 appends each step's metrics, wall
    time, tokens/s, MFU and peak memory to this JSON-lines file (``dtm plot metrics`` draws
    it; :mod:`dtm_mpi.frontend.run_report` says how each is measured). ``tensorboard``: the
    same figures as scalars in a new TensorBoard event file in this directory (written
    without TensorBoard; ``tensorboard --logdir`` reads it). Option errors are
    raised on every rank alike, before anything runs."""
    from dataclasses import replace

    from dtm_mpi.runtime.policies import progress_policy, run_settings
    from dtm_mpi.runtime.request import RunRequest
    from dtm_mpi.runtime.runner import run_request
    from dtm_mpi.runtime.step_loop import RunHooks

    run_settings(
        integrity=integrity,
        audit_every=audit_every,
        quantize_allreduce=quantize_allreduce,
        cli=False,
    )
    if metrics_file is not None:  # (rank 0 writes it; every rank checks where, alike)
        parent = Path(metrics_file).parent
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"metrics file {metrics_file}: {parent} is not a directory")
    if tensorboard is not None and Path(tensorboard).exists() and not Path(tensorboard).is_dir():
        raise UsageError(f"tensorboard directory {tensorboard}: not a directory")
    if get_config().explain:  # dtm explain SCRIPT.py: the plan of this run, then the end
        sys.stdout.write(explain_fit(step, mesh, sim))
        raise SystemExit(0)
    result = FitResult()
    first = step.inputs[0] if step.inputs else None
    samples = (
        step.input_type(first).shape[0] if first is not None and step.input_type(first).shape else 1
    )
    bar = None if quiet else _Bar(steps, samples)
    meter: list[RunMeter] = []  # rank 0's, made at its first report
    started = time.perf_counter()

    def report(i: int, rank: int, metrics: dict[str, float]) -> dict[str, float] | None:
        if rank != 0 and sim is not None:  # simulated ranks share this process: rank 0 reports
            return None
        extra = {"lr": step.schedule.lr(i)} if step.schedule is not None else {}
        metrics = {**metrics, **extra}  # (the rate the step computed from its step index)
        result.metrics.append({"step": float(i), **metrics})
        if rank != 0:
            return None
        if not meter:
            meter.append(
                _meter(step, result, device, mesh, sim, started, metrics_file, tensorboard)
            )
        figures = meter[0].step(i, metrics)
        result.timings.append({"step": float(i), **figures})
        if bar is not None:
            bar(i, metrics, figures)
        if on_step is not None:
            on_step(i, metrics)
        line = {"tok/s": figures["tokens_per_s"]}  # (the progress line's figures)
        if "mfu" in figures:
            line["mfu%"] = 100 * figures["mfu"]
        return {**extra, **line}

    def keep(outputs: dict[str, np.ndarray]) -> None:
        result.outputs.update(outputs)

    def tensors(i: int, rank: int, named: dict[str, np.ndarray]) -> None:
        if rank != 0 and sim is not None:  # simulated ranks share this process: rank 0's
            return
        if on_tensors is not None:
            on_tensors(i, named)
        else:
            result.tensors.append(named)

    hooks = RunHooks(
        loader,
        step.inputs,
        report,
        step.metrics,
        keep,
        values=dict(values) if values else None,
        on_tensors=tensors if step.tensors else None,
        data=loader if isinstance(loader, DataPosition) else None,
        identity=step.identity,
        fresh=step.fresh,
    )

    entry = step.module.entry
    # a training step's state is saved after its last step; a forward step's (a decode
    # step's caches) only where the policy asks every N steps
    trains = (
        entry is not None and not step.tensors and any(r.updates is not None for r in entry.results)
    )

    def request() -> RunRequest:
        return RunRequest(
            f"<traced {step.module.name}>",
            binding=dict(mesh) if mesh else None,
            steps=steps,
            sim=sim,
            module=step.module,
            hooks=hooks,
            device=device if device is not None else DevicePolicy(),
            checkpoint=(
                replace(checkpoint, save_final=True)
                if checkpoint is not None and trains
                else checkpoint
            ),
            resize=(
                resize
                if resize is None or resize.relaunch is not None
                else replace(resize, relaunch=_relaunch())
            ),
            progress=progress_policy(log_every, samples),
            pipeline=step.pipeline,
        )

    try:
        code = run_request(request, sim)
    finally:
        if bar is not None:
            bar.close()
        if meter:
            meter[0].close()
    if code != 0:  # stopped on a signal after saving (75: "requeue me"), or ended: end the job
        raise SystemExit(code)
    return result


def _meter(
    step: TracedStep,
    result: FitResult,
    device: DevicePolicy | None,
    mesh: Mapping[str, int] | None,
    sim: int | None,
    started: float,
    metrics_file: str | os.PathLike[str] | None,
    tensorboard: str | os.PathLike[str] | None,
) -> RunMeter:
    """Rank 0's meter of the run (its cost and peak kept in ``result``)."""
    import math

    result.cost = cost = step_cost(step)
    ranks = sim if sim is not None else math.prod(mesh.values()) if mesh else step.mesh.size
    backend = (device or DevicePolicy()).backend
    try:
        result.peak = peak_flops(cost.dtype, backend, ranks, simulated=sim is not None)
    except UsageError as exc:  # no MFU, said once; the run goes on
        say(f"fit: {exc}")
    got = RunMeter(cost, result.peak, metrics_file, tensorboard)
    got.t = started
    return got


def explain_fit(step: TracedStep, mesh: Mapping[str, int] | None, sim: int | None) -> str:
    """What :func:`fit` would run (``dtm explain SCRIPT.py``, ``DTM_EXPLAIN=1``): the plan of
    ``step`` on the mesh ``mesh`` binds (``sim`` ranks, else the product of its sizes); for a
    pipelined step, its stages, what each pipeline rank holds and the schedule's time-line."""
    import math

    from dtm_mpi.plan.explain import explain_text
    from dtm_mpi.plan.pipeline import explain_pipeline
    from dtm_mpi.plan.program import compile_plan, mesh_for
    from dtm_mpi.runtime.pipeline_step import plan_pipelined_run

    binding = dict(mesh) if mesh else None
    nranks = sim if sim is not None else math.prod(binding.values()) if binding else step.mesh.size
    plan = compile_plan(step.module, mesh_for(step.module, nranks, binding))
    gave_up = ""
    if step.fallbacks:
        lines = "".join(f"  {f}\n" for f in step.fallbacks)
        gave_up = (
            f"where sharding propagation gave up (the op ran on replicated values):\n{lines}\n"
        )
    if step.pipeline is None:
        return explain_text(plan) + gave_up + _recompute_lines(step, plan.mesh)
    pipeline = plan_pipelined_run(step.pipeline, plan, fed=step.inputs)
    head = f"module {step.module.name} on mesh {plan.mesh} ({plan.mesh.size} ranks), pipelined\n"
    return head + explain_pipeline(pipeline, plan.mesh) + gave_up


def _recompute_lines(step: TracedStep, mesh: Any) -> str:
    """A training step's peak per rank under each activation recomputation choice (the
    step traced again with each; its own marked)."""
    from dtm_mpi.frontend.recompute import CHOICES
    from dtm_mpi.plan.cost import function_cost
    from dtm_mpi.plan.explain import human_bytes
    from dtm_mpi.plan.program import compile_plan

    if step.retrace is None or not isinstance(step.recompute, str):
        return ""
    lines = ["activation recomputation (train_step(recompute=...)), peak memory per rank:"]
    for choice in CHOICES:
        other = step if choice == step.recompute else step.retrace(recompute=choice)
        plan = compile_plan(other.module, mesh)
        peak = max(function_cost(plan, plan.entry_plan).peak)
        mark = "  (this step)" if choice == step.recompute else ""
        lines.append(f"  {choice:<10} {human_bytes(int(peak))}{mark}")
    return "\n".join(lines) + "\n"


def _relaunch() -> tuple[str, ...] | None:
    """This program's command line, for the ranks a live resize spawns: the script file and
    its arguments (None when Python was not started on a script: ``-c``, interactive)."""
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.isfile(script):
        return None
    return (os.path.abspath(script), *sys.argv[1:])
