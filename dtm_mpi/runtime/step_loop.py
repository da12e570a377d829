"""The step loop: what one rank does from its first step to its last, the same loop for
``dtm run --sim``, ``dtm run`` under ``mpirun``/``srun`` and :func:`~dtm_mpi.frontend.fit.fit`
in both modes.

A step runs the entry function (:class:`~dtm_mpi.runtime.executor.Executor`), then every state
parameter takes the result that ``updates`` it (spec §7.3: all updates of a step take effect
together). Around that, a run selects policies, each optional and visibly absent (``None``)
when not selected:

* **feed** (:class:`Feed`): a Python run's loader gives this rank's blocks of the fed inputs
  before each step; the step's scalar results are reported after it commits;
* **commit agreement** (:class:`CommitAgreement`): every rank finished the step before its
  updates apply, and the flags any rank raised (:data:`STOP_FLAG`, :data:`RESIZE_FLAG`) are
  seen by all at the same step;
* **checkpoints** (:class:`Checkpoints`, with its :class:`~dtm_mpi.runtime.policies.CheckpointPolicy`):
  the state saved when the policy says it is due, or when the run stops;
* **stop on signal** (:class:`StopSignal`): a signal asks every rank to stop after the same
  step, the state saved (:class:`~dtm_mpi.errors.RunStopped`);
* **live resize**: planned (``resize_at``) or requested (``resize_requested``) resizes end the
  loop after a step with :attr:`LoopEnd.resize`; the launcher moves the state and starts a new
  loop on the new mesh;
* **replica audit** (:class:`~dtm_mpi.runtime.audit.ReplicaAudit`): every N steps, and
  before every checkpoint, each replicated state tensor's checksum compared across its
  replicas (a divergence is one error on every rank, and no checkpoint takes it);
* **progress** (:class:`Progress`): rank 0's step time and throughput every N steps;
* **phase**: where the rank is (``step N``), for the agreed error of a failure.

The failure agreement (one error on every rank) and the output publication are the
launchers': they wrap the loop, whatever it selects.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dtm_mpi.config import get_config
from dtm_mpi.console import say
from dtm_mpi.errors import RunStopped, UsageError
from dtm_mpi.faults import flip_state, maybe_fail
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.types import ReduceOp, TensorType
from dtm_mpi.runtime.values import BlockSource
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.steps import allreduce_spec

if TYPE_CHECKING:
    from dtm_mpi.comm.interface import Comm
    from dtm_mpi.ir.nodes import Module
    from dtm_mpi.plan.program import ExecPlan
    from dtm_mpi.runtime.audit import ReplicaAudit
    from dtm_mpi.runtime.data_position import DataPosition
    from dtm_mpi.runtime.policies import CheckpointPolicy, ProgressPolicy

__all__ = [
    "RESIZE_FLAG",
    "STOP_FLAG",
    "Checkpoints",
    "CommCommit",
    "CommitAgreement",
    "Feed",
    "LoopEnd",
    "Progress",
    "RunHooks",
    "StepLoop",
    "StepRunner",
    "StopSignal",
]

STOP_FLAG, RESIZE_FLAG = 1, 2
"""The bits a rank may raise in a step's commit agreement: a stop signal, a resize request."""

FeedFn = Callable[[int, "Mapping[str, tuple[slice, ...]]"], "Mapping[str, np.ndarray]"]
"""``feed(step, regions)``: this rank's blocks of the fed inputs for ``step``: for each input
name, the block of the step's global value at ``regions[name]`` (a loader reads only those)."""


@dataclass(frozen=True, slots=True)
class RunHooks:
    """What a run started from Python (not the command line) adds: the inputs fed each step,
    where every rank hands the per-step metrics and rank 0 the final outputs."""

    feed: FeedFn | None = None
    fed: tuple[str, ...] = ()
    """The entry parameters ``feed`` supplies (names without ``%``)."""
    on_step: Callable[[int, int, dict[str, float]], Mapping[str, float] | None] | None = None
    """Every rank, after each step committed: the step, the rank and the step's complete
    scalar results by name (the same on every rank); what it returns (figures such as the
    learning rate, tokens/s, MFU) joins them in the progress line."""
    metric_names: tuple[str, ...] = ()
    """Names of the leading scalar results (else ``result0``, ...)."""
    on_outputs: Callable[[dict[str, np.ndarray]], None] | None = None
    """Rank 0, at the end: the outputs (what ``-o`` would write), instead of printing them."""
    values: Mapping[str, np.ndarray | BlockSource] | None = None
    """Global values of (other) entry parameters, as ``-i`` files would give them (each
    rank takes its block)."""
    on_tensors: Callable[[int, int, dict[str, np.ndarray]], None] | None = None
    """Every rank, after each step committed: the step, the rank and the step's replicated
    tensor results (not scalars, not state updates) by name, whole on every rank."""
    data: DataPosition | None = None
    """The loader, where it can say where it stands: its position saved in every checkpoint
    and checked on resume (:mod:`dtm_mpi.runtime.data_position`)."""
    identity: Module | None = None
    """The module whose program identifies the run's state in its checkpoints, where it is
    not the run's own (a mixed-precision step's: the step without the policy)."""
    fresh: tuple[str, ...] = ()
    """State parameters (names without ``%``) that start from their init where a resumed
    checkpoint lacks them (a loss scaler's: a checkpoint of a step without one resumes)."""


class Feed:
    """The feed policy: puts a run's fed inputs (:class:`RunHooks`) into this rank's parameter
    blocks before each step, and reports each step's scalar results once it committed."""

    def __init__(
        self,
        plan: ExecPlan,
        rank: int,
        hooks: RunHooks,
        to_device: Callable[[np.ndarray], Any] = lambda a: a,
        to_host: Callable[[Any], np.ndarray] = np.asarray,
    ) -> None:
        entry = plan.entry_plan.function
        self.hooks, self.rank = hooks, rank
        self.to_device, self.to_host = to_device, to_host
        index = {p.name.lstrip("%"): i for i, p in enumerate(entry.params)}
        self.slots: list[tuple[str, int, TensorType, tuple[slice, ...]]] = []
        for name in hooks.fed:
            if name not in index:
                raise UsageError(f"fed input {name!r} is not a parameter of @{entry.name}")
            t = entry.params[index[name]].type
            self.slots.append(
                (name, index[name], t, local_block(t.shape, t.layout, plan.mesh, rank))
            )
        self.entry = entry

    def feed(self, step: int, blocks: list[Any]) -> None:
        """Replace the fed inputs' blocks by the loader's blocks for ``step`` (checked)."""
        if self.hooks.feed is None or not self.slots:
            return
        got = self.hooks.feed(step, {name: region for name, _, _, region in self.slots})
        for name, i, t, region in self.slots:
            if name not in got:
                raise UsageError(
                    f"step {step}: the data loader gave no {name!r} (rank {self.rank})"
                )
            want = tuple(r.stop - r.start for r in region)
            block = np.asarray(got[name])
            if block.shape != want:
                raise UsageError(
                    f"step {step}: the data loader gave {name!r} of shape {list(block.shape)} on rank {self.rank}; its block of {t} is {list(want)}"
                )
            dtype = np_dtype(t.dtype)
            if block.dtype != dtype and not np.can_cast(block.dtype, dtype, "same_kind"):
                raise UsageError(
                    f"step {step}: the data loader gave {name!r} as {block.dtype}; the input is {t.dtype}"
                )
            blocks[i] = self.to_device(np.ascontiguousarray(block, dtype=dtype))

    def report(self, step: int, results: Sequence[Any]) -> dict[str, float] | None:
        """Hand the step's complete scalar results to ``on_step`` and its replicated tensor
        results to ``on_tensors``; returns the scalars (None without ``on_step``)."""
        hooks = self.hooks
        if hooks.on_step is None and hooks.on_tensors is None:
            return None
        names = hooks.metric_names
        metrics: dict[str, float] = {}
        tensors: dict[str, np.ndarray] = {}
        for i, (spec, value) in enumerate(zip(self.entry.results, results, strict=True)):
            t = spec.type
            if spec.updates is not None or t.layout.partial is not None:
                continue
            key = names[i] if i < len(names) else f"result{i}"
            if t.shape == ():
                metrics[key] = float(self.to_host(value))
            elif hooks.on_tensors is not None and t.layout.is_replicated:
                tensors[key] = np.asarray(self.to_host(value))
        shown: Mapping[str, float] | None = None
        if hooks.on_step is not None:
            shown = hooks.on_step(step, self.rank, metrics)
        if hooks.on_tensors is not None and tensors:
            hooks.on_tensors(step, self.rank, tensors)
        return {**metrics, **shown} if shown else metrics


class StepRunner(Protocol):
    """What runs a step on one rank: the :class:`~dtm_mpi.runtime.executor.Executor` of the
    plan, or a pipelined run's :class:`~dtm_mpi.runtime.pipeline_step.PipelineExecutor`
    (the state of the same entry function, its stages run in their schedule)."""

    @property
    def plan(self) -> ExecPlan: ...

    @property
    def rank(self) -> int: ...

    def run(self, blocks: list[Any], step: int) -> tuple[Any, ...]: ...


class CommitAgreement(Protocol):
    """The commit-agreement policy: every rank finished step ``step`` (collective); returns
    the OR of the flags every rank raised."""

    def agree(self, step: int, flags: int) -> int: ...


class CommCommit:
    """The commit agreement over a communication interface (the simulated ranks; under MPI
    the session's bounded agreement is the policy): each flag's maximum over every rank, by
    one allreduce over the whole mesh."""

    def __init__(self, comm: Comm) -> None:
        self.comm, self.axes = comm, comm.mesh.axis_names
        self.spec = allreduce_spec(comm.mesh, comm.rank, self.axes, ReduceOp.MAX, 2)

    def agree(self, step: int, flags: int) -> int:
        raised = np.array([flags & STOP_FLAG, flags & RESIZE_FLAG], dtype=np.int64)
        seen = self.comm.allreduce(raised, self.axes, self.spec)
        return int(seen[0]) | int(seen[1])


class StopSignal(Protocol):
    """The stop-on-signal policy: the signal number that asked this rank to stop, if any."""

    def asked(self) -> int | None: ...


class Checkpoints(Protocol):
    """The checkpoint policy (``policy``: when) and its store: saves the state after a step
    (collective)."""

    @property
    def policy(self) -> CheckpointPolicy: ...

    def save(self, done: int, blocks: list[Any], *, sync: bool = False) -> str: ...


class Progress:
    """Rank 0's progress line (:class:`~dtm_mpi.runtime.policies.ProgressPolicy`): every
    ``policy.every`` steps and after the last, the step's reported scalar results (a Python
    run's metrics), the mean step time since the last line, steps per second and, where a
    step's sample count is known, samples per second."""

    def __init__(self, policy: ProgressPolicy, steps: int) -> None:
        self.every, self.samples, self.steps = policy.every, policy.samples, steps
        self.since, self.count = time.perf_counter(), 0

    def step_done(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        self.count += 1
        if (step + 1) % self.every and step + 1 != self.steps:
            return
        now = time.perf_counter()
        per = (now - self.since) / max(1, self.count)
        rate = 1.0 / per if per > 0 else float("inf")
        parts = [" ".join(f"{k} {v:.4g}" for k, v in (metrics or {}).items())]
        parts.append(f"{per * 1e3:.3f} ms/step, {rate:.1f} steps/s")
        if self.samples:
            parts.append(f"{self.samples * rate:.0f} samples/s")
        say(f"step {step + 1}/{self.steps}: " + ", ".join(p for p in parts if p))
        self.since, self.count = now, 0


@dataclass(frozen=True, slots=True)
class LoopEnd:
    """How a loop ended: after step ``done`` (the steps done so far, from step 0), with the
    last step's ``results``; before the last step only for a resize: to the mesh binding
    ``resize`` planned (``--resize-at``), or ``resize_requested`` (read the request)."""

    done: int
    results: tuple[Any, ...]
    resize: dict[str, int] | None = None
    resize_requested: bool = False


@dataclass(slots=True)
class StepLoop:
    """One rank's steps ``first`` .. ``steps - 1`` on its ``blocks`` of the entry parameters,
    with the selected policies (module doc); :meth:`run` is collective."""

    executor: StepRunner
    steps: int
    feed: Feed | None = None
    commit: CommitAgreement | None = None
    checkpoints: Checkpoints | None = None
    stop: StopSignal | None = None
    resize_at: Sequence[tuple[int, dict[str, int]]] = ()
    resize_requested: Callable[[], bool] | None = None
    progress: Progress | None = None
    phase: Callable[[str], None] | None = None
    history: list[tuple[Any, ...]] | None = None
    audit: ReplicaAudit | None = None
    updates: list[tuple[int, int]] = field(init=False, default_factory=list)
    """(result, parameter) index pairs: the state updates of a step (from the entry function)."""

    def __post_init__(self) -> None:
        entry = self.executor.plan.entry_plan.function
        index = {p.name: i for i, p in enumerate(entry.params)}
        self.updates = [
            (j, index[spec.updates])
            for j, spec in enumerate(entry.results)
            if spec.updates is not None
        ]

    def run(self, blocks: list[Any], first: int = 0) -> LoopEnd:
        """Run the steps from ``first`` on ``blocks`` (replaced by each step's state updates);
        ends after the last step, or after a step where a resize is asked (planned, or
        requested and agreed), or raises :class:`~dtm_mpi.errors.RunStopped` after the state
        was saved when a stop was agreed.

        Collective: call on all ranks."""
        planned = {s: b for s, b in self.resize_at}
        results: tuple[Any, ...] = ()
        faults = bool(get_config().faults)
        for step in range(first, self.steps):
            if self.phase is not None:
                self.phase(f"step {step}")
            if faults:  # DTM_FAULT=RANK:step:KIND
                maybe_fail(self.executor.rank, "step")
            if self.feed is not None:
                self.feed.feed(step, blocks)
            results = self.executor.run(blocks, step)
            flags = self._commit(step)
            metrics = self.feed.report(step, results) if self.feed is not None else None
            if self.history is not None:
                self.history.append(results)
            for j, i in self.updates:
                blocks[i] = results[j]
            done = step + 1
            if faults and step == first:  # DTM_FAULT=RANK:state:flip
                flip_state(self.executor.rank, blocks, self._state())
            if self.progress is not None:
                self.progress.step_done(step, metrics)
            saving = self.checkpoints is not None and self.checkpoints.policy.due(done, self.steps)
            stopping = bool(flags & STOP_FLAG) and done < self.steps
            resizing = done < self.steps and bool(flags & RESIZE_FLAG or done in planned)
            last = done == self.steps  # (the outputs are taken from one replica each)
            if self.audit is not None and (
                self.audit.due(done) or saving or stopping or resizing or last
            ):  # before a checkpoint, a resize's move or the outputs could take a divergence
                self.audit.check(done, blocks)
            if stopping:  # (after the last step: just finish)
                self._stopped(done, blocks)
            if saving:
                assert self.checkpoints is not None
                self.checkpoints.save(done, blocks)
            if resizing:
                return LoopEnd(done, results, planned.get(done), bool(flags & RESIZE_FLAG))
        return LoopEnd(self.steps, results)

    def _state(self) -> list[tuple[int, str]]:
        """The state parameters' positions among the blocks, and their names (those the
        audit compares, when it runs: a flip elsewhere has no replica to show it)."""
        entry = self.executor.plan.entry_plan.function
        if self.audit is not None:
            return [(a.index, a.name) for a in self.audit.audited]
        return [(i, entry.params[i].name.lstrip("%")) for _, i in self.updates]

    def _commit(self, step: int) -> int:
        if self.commit is None:
            return 0
        asked = STOP_FLAG if self.stop is not None and self.stop.asked() is not None else 0
        if self.resize_requested is not None and self.resize_requested():
            asked |= RESIZE_FLAG  # (one rank reads the request: one answer, agreed)
        return self.commit.agree(step, asked)

    def _stopped(self, done: int, blocks: list[Any]) -> None:
        path = (
            self.checkpoints.save(done, blocks, sync=True) if self.checkpoints is not None else None
        )
        signum = self.stop.asked() if self.stop is not None else None
        name = signal.Signals(signum).name if signum is not None else "a peer's signal"
        raise RunStopped(done, name, path)
