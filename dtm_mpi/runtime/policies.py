"""A run's options as policy objects: each option's default and check in one place, built the
same way by ``dtm run`` (:mod:`dtm_mpi.cli_exec`) and by :func:`~dtm_mpi.frontend.fit.fit`,
and read by the step loop (:mod:`dtm_mpi.runtime.step_loop`) in every run mode.

Constructing a policy checks it; its errors are *agreed* (decided from the options alone, the
same on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dtm_mpi.errors import agreed_usage
from dtm_mpi.kernels.backends import BACKEND_NAMES
from dtm_mpi.plan.schedule import ScheduleKind

if TYPE_CHECKING:
    from dtm_mpi.ir.stages import StepStages

__all__ = [
    "ACCUMULATE_AXIS",
    "CheckpointPolicy",
    "DevicePolicy",
    "PipelinePolicy",
    "ProgressPolicy",
    "ResizePolicy",
    "check_run_size",
    "checkpoint_policy",
    "progress_policy",
    "resize_policy",
    "run_settings",
]


def check_run_size(steps: int, sim: int | None = None) -> None:
    """A run's steps (``--steps``, at least one) and simulated ranks (``--sim``, at least one
    when given): agreed errors."""
    if steps < 1:
        raise agreed_usage(f"--steps must be >= 1; got {steps}")
    if sim is not None and sim < 1:
        raise agreed_usage(f"--sim needs at least 1 rank; got {sim}")


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """The run's state in a checkpoint store (``--store DIR``): saved after every ``every``
    steps (``--checkpoint-every``; None: only when the run stops on a signal), the last step
    too with ``save_final``; written in the background (``--checkpoint-async``); the store
    keeping its ``keep_last`` newest checkpoints (``--keep-last``) within ``quota`` bytes
    (``--quota``); the run starting from the newest checkpoint that verifies (``--resume``)."""

    store: str
    every: int | None = None
    resume: bool = False
    background: bool = False
    keep_last: int | None = None
    quota: int | None = None
    save_final: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise agreed_usage(f"--checkpoint-every must be >= 1; got {self.every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise agreed_usage(f"--keep-last must be >= 1; got {self.keep_last}")
        if self.quota is not None and self.quota < 1:
            raise agreed_usage(f"--quota must be >= 1 byte; got {self.quota}")

    @property
    def saves(self) -> bool:
        """Whether the run saves its state every N steps or after its last (a stop on a
        signal saves anyway)."""
        return self.every is not None or self.save_final

    def due(self, done: int, steps: int) -> bool:
        """Whether the state after step ``done`` (of ``steps``) is saved: every ``every``
        steps, and after the last with ``save_final``."""
        every = self.every
        return (every is not None and done % every == 0) or (done == steps and self.save_final)


def checkpoint_policy(
    store: str | None,
    *,
    every: int | None = None,
    resume: bool = False,
    background: bool = False,
    keep_last: int | None = None,
    quota: int | None = None,
    save_final: bool = False,
) -> CheckpointPolicy | None:
    """The checkpoint policy of these options (None without a store; an agreed error for an
    option that needs one)."""
    if store:
        return CheckpointPolicy(store, every, resume, background, keep_last, quota, save_final)
    if every is not None or resume:
        raise agreed_usage("--checkpoint-every and --resume need --store DIR")
    if background or keep_last is not None or quota is not None:
        raise agreed_usage("--checkpoint-async, --keep-last and --quota need --store DIR")
    return None


@dataclass(frozen=True, slots=True)
class ResizePolicy:
    """Live resizes of a run under MPI: planned after given steps (``at``: ``--resize-at
    STEP:MESH``, in increasing step order) and asked for while the job runs (``file``:
    ``--resize-file FILE``; the mesh written into it is read at a step's commit). A run that
    grows past the ranks it was launched with spawns ranks running ``relaunch`` (after
    ``python -m mpi4py``: the same command line, ``-m dtm_mpi run ...`` or the script calling
    :func:`~dtm_mpi.frontend.fit.fit`); None where the program cannot be started again (it
    then only shrinks and grows back)."""

    at: tuple[tuple[int, dict[str, int]], ...] = ()
    file: str | None = None
    relaunch: tuple[str, ...] | None = None

    def check(self, steps: int, binding: dict[str, int] | None) -> None:
        """The schedule against the run's steps and mesh binding (agreed errors)."""
        last = 0
        for step, sizes in self.at:
            if step <= last or step >= steps:
                raise agreed_usage(
                    f"--resize-at {step}: resizes come after steps 1 .. {steps - 1} (--steps {steps}), in increasing order"
                )
            _same_axes(f"--resize-at {step}", binding, sizes)
            last = step
        if self.file is not None:
            _same_axes("--resize-file", binding, binding or {})


def _same_axes(what: str, binding: dict[str, int] | None, sizes: dict[str, int]) -> None:
    if binding is None or set(sizes) != set(binding):
        raise agreed_usage(
            f"{what}: give --mesh, and bind the same axes at every resize ({', '.join(sorted(binding or {})) or 'none'} in --mesh, {', '.join(sorted(sizes)) or 'none'} here)"
        )


def resize_policy(
    at: tuple[tuple[int, dict[str, int]], ...] = (),
    file: str | None = None,
    relaunch: tuple[str, ...] | None = None,
) -> ResizePolicy | None:
    """The resize policy of these options (None when no resize is planned or asked for)."""
    return ResizePolicy(tuple(at), file, relaunch) if at or file else None


@dataclass(frozen=True, slots=True)
class DevicePolicy:
    """Where a rank computes and how its buffers travel: the array ``backend`` (``--backend``:
    numpy, cuda or hip; one rank per GPU), GPU-aware MPI (``gpu_aware``: ``--gpu-aware-mpi``
    auto, yes or no; None: ``DTM_GPU_AWARE_MPI``), refusing to run without it
    (``require_gpu_aware``: ``--require-gpu-aware-mpi``), and the plan's memory limit per rank
    (``max_bytes_per_rank``: ``--max-bytes-per-rank``)."""

    backend: str = "numpy"
    gpu_aware: str | None = None
    require_gpu_aware: bool = False
    max_bytes_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise agreed_usage(
                f"--backend must be one of {', '.join(BACKEND_NAMES)}; got {self.backend!r}"
            )
        if self.gpu_aware is not None and self.gpu_aware not in ("auto", "yes", "no"):
            raise agreed_usage(f"--gpu-aware-mpi must be auto, yes or no; got {self.gpu_aware!r}")
        if self.backend == "numpy" and (self.require_gpu_aware or self.gpu_aware):
            raise agreed_usage(
                "--gpu-aware-mpi and --require-gpu-aware-mpi need --backend cuda or hip"
            )
        if self.max_bytes_per_rank is not None and self.max_bytes_per_rank < 1:
            raise agreed_usage(f"--max-bytes-per-rank must be >= 1; got {self.max_bytes_per_rank}")

    def check_simulated(self) -> None:
        """Simulated ranks share one process and its numpy arrays (an agreed error else)."""
        if self.backend != "numpy":
            raise agreed_usage(
                f"the simulator (--sim) runs the numpy backend only; run --backend "
                f"{self.backend} under mpirun/srun (one rank per GPU)"
            )


@dataclass(frozen=True, slots=True)
class ProgressPolicy:
    """Rank 0's progress line every ``every`` steps (``--log-every``, ``fit(log_every=)``):
    the step's scalar results where the run reports them (a Python run's metrics), the mean
    step time since the last line, steps per second, and samples per second where a step
    takes ``samples`` samples."""

    every: int
    samples: int | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise agreed_usage(f"--log-every must be >= 1; got {self.every}")


def progress_policy(every: int | None, samples: int | None = None) -> ProgressPolicy | None:
    """The progress policy of ``--log-every`` (None: no progress lines)."""
    return ProgressPolicy(every, samples) if every is not None else None


ACCUMULATE_AXIS = "accum"
"""The mesh axis, of size 1, that a step accumulating gradients without a pipeline
(``train_step(accumulate=K)``) adds to its mesh and runs its one-stage pipeline over. It
changes no state: a checkpoint resumes with or without it (:func:`~dtm_mpi.runtime.
checkpoints.state_hashes`)."""


@dataclass(frozen=True, slots=True)
class PipelinePolicy:
    """The run's training step as pipeline stages over mesh axis ``axis`` (its size the
    number of pipeline ranks): ``microbatches`` per step (``--microbatches``), in schedule
    ``schedule`` (``--schedule``: gpipe, 1f1b, interleaved, zb-h1), ``chunks`` stages per
    rank (``interleaved``); ``stages(n, whole_batch)``: the step cut into ``n`` stages, for
    one microbatch or (deterministic mode's weight passes) the whole batch (the frontend
    traces them: :func:`~dtm_mpi.frontend.stage_split.step_stages_of`)."""

    stages: Callable[[int, bool], StepStages] = field(compare=False)
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    microbatches: int = 1
    chunks: int = 1
    axis: str = "pp"
    whole_batch: bool = True
    """Whether the step has whole-batch stages (``stages(n, True)``: a traced model's), which
    deterministic mode runs its weight passes on; False for an IR forward written per
    microbatch (deterministic mode then runs each microbatch's passes with exact sums)."""

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise agreed_usage(f"--microbatches must be >= 1; got {self.microbatches}")
        if self.chunks < 1:
            raise agreed_usage(f"chunks per pipeline rank must be >= 1; got {self.chunks}")
        if self.chunks > 1 and self.schedule is not ScheduleKind.INTERLEAVED:
            raise agreed_usage(
                f"{self.chunks} chunks per rank need the interleaved schedule; got {self.schedule.value}"
            )


def run_settings(
    *,
    integrity: bool,
    audit_every: int | None,
    quantize_allreduce: int | None,
    cli: bool,
) -> None:
    """The run options that are process settings (``dtm run --integrity --audit-every N
    --quantize-allreduce B``; ``fit(integrity=, audit_every=, quantize_allreduce=)``), each
    set as its ``DTM_*`` variable for this process and those it starts; a negative count is an
    agreed usage error naming the option as the caller spells it (``cli``: ``--audit-every``)."""
    from dtm_mpi.config import set_setting, switch_on

    if integrity:
        switch_on("integrity")
    for setting, option, value in (
        ("audit_every", "audit_every", audit_every),
        ("quant_allreduce", "quantize_allreduce", quantize_allreduce),
    ):
        if value is None:
            continue
        if value < 0:
            name = "--" + option.replace("_", "-") if cli else option
            raise agreed_usage(f"{name} must be >= 0; got {value}")
        set_setting(setting, value)
