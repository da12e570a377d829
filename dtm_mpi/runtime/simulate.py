"""Running a module's training loop on every rank: inputs to blocks, steps with state carried,
results back to global arrays.

:func:`run_rank` is what one rank does (over any :class:`~dtm_mpi.comm.interface.Comm`);
:func:`run_simulated` runs it on N simulated ranks in one process and assembles the global
outputs, which :func:`assemble` computes from the ranks' blocks with the redistribution plan to
a replicated layout (pending reductions completed in group order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dtm_mpi.comm.interface import Comm, CommStats
from dtm_mpi.errors import RunStopped, UsageError
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.nodes import Function, Module
from dtm_mpi.ir.types import Layout, TensorType
from dtm_mpi.kernels.devices import ArrayBackend
from dtm_mpi.plan.outputs import output_values
from dtm_mpi.plan.program import ExecPlan, compile_plan, mesh_for
from dtm_mpi.runtime.audit import replica_audit
from dtm_mpi.runtime.executor import Executor
from dtm_mpi.runtime.policies import check_run_size
from dtm_mpi.runtime.step_loop import (
    CommCommit,
    Feed,
    Progress,
    RunHooks,
    StepLoop,
    StepRunner,
    StopSignal,
)
from dtm_mpi.runtime.values import check_inputs, init_block
from dtm_mpi.sharding.blocks import Pin, holds, local_block, local_offsets, local_shape
from dtm_mpi.sharding.collectives import apply_plan
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import plan_redistribute

if TYPE_CHECKING:
    from dtm_mpi.io.checkpoint import CheckpointStore
    from dtm_mpi.plan.pipeline import PipelinePlan
    from dtm_mpi.runtime.policies import CheckpointPolicy, PipelinePolicy, ProgressPolicy


__all__ = [
    "RankOutcome",
    "RunResult",
    "assemble",
    "held_blocks",
    "initial_blocks",
    "output_pins",
    "run_rank",
    "run_simulated",
    "summary_lines",
]


@dataclass(slots=True)
class RankOutcome:
    """One rank's blocks after the run: final parameter values and every step's results."""

    params: tuple[np.ndarray | None, ...]
    """None where a pipelined run pins the parameter to other ranks (and in its results)."""
    results: list[tuple[np.ndarray | None, ...]]
    stats: CommStats
    stopped: RunStopped | None = None
    """The stop every rank agreed on after the same step (its state saved), if one was asked."""


@dataclass(slots=True)
class RunResult:
    """Global values after a run: final parameters (state included) by name (without ``%``),
    each step's results, and each rank's communication statistics."""

    entry: Function
    params: dict[str, np.ndarray]
    results: list[tuple[np.ndarray, ...]]
    stats: list[CommStats] = field(default_factory=list)

    def outputs(self) -> dict[str, np.ndarray]:
        """What ``dtm run -o`` writes (:func:`output_values`)."""
        named = output_values(self.entry, self.results[-1], list(self.params.values()))
        return {name: v for name, _, v in named}


def run_rank(
    plan: ExecPlan,
    comm: Comm,
    inputs: Mapping[str, np.ndarray],
    *,
    steps: int = 1,
    first: int = 0,
    backend: str | ArrayBackend = "numpy",
    hooks: RunHooks | None = None,
    deterministic: bool | None = None,
    checkpoint: CheckpointPolicy | None = None,
    store: CheckpointStore | None = None,
    progress: ProgressPolicy | None = None,
    stop: StopSignal | None = None,
    pipeline: PipelinePlan | None = None,
) -> RankOutcome:
    """Run steps ``first`` .. ``steps - 1`` of the entry function on this rank (the step loop,
    :class:`~dtm_mpi.runtime.step_loop.StepLoop`). ``inputs``: global arrays of (some) entry
    parameters, by name; the others get their declared init; ``hooks``: inputs fed each step,
    metrics reported after each step; ``deterministic``: the exact sums of deterministic mode
    (default: ``DTM_DETERMINISTIC``); ``checkpoint``: its saves gathered to rank 0, which
    writes them into ``store`` (:class:`~dtm_mpi.runtime.checkpoints.GatheredCheckpoints`);
    ``progress``: rank 0's progress lines; ``stop``: a stop request (a signal) ends
    the run after the step every rank agrees on (:class:`~dtm_mpi.runtime.step_loop.CommCommit`),
    the state saved (the outcome's ``stopped``); ``pipeline``: the step's stages run as planned
    (:class:`~dtm_mpi.runtime.pipeline_step.PipelineExecutor`; this rank holds its stages'
    state only, None in the others' places).

    Collective: call on all ranks."""
    from dtm_mpi.kernels.devices import numpy_backend
    from dtm_mpi.runtime.checkpoints import GatheredCheckpoints
    from dtm_mpi.runtime.pipeline_step import PipelineExecutor

    pins = pipeline.pins if pipeline is not None else None
    args = held_blocks(
        plan, comm.rank, inputs, fed=hooks.fed if hooks is not None else (), pins=pins
    )
    executor: StepRunner
    if pipeline is not None:
        executor, arrays = PipelineExecutor(plan, pipeline, comm), numpy_backend()
    else:
        executor = Executor(plan, comm, backend, deterministic)
        arrays = executor.backend
    history: list[tuple[np.ndarray | None, ...]] = []
    checkpoints = None
    if checkpoint is not None and _saves(checkpoint, stop):
        checkpoints = GatheredCheckpoints(
            comm,
            plan,
            checkpoint,
            store if comm.rank == 0 else None,
            arrays,
            pins,
            data=hooks.data if hooks is not None else None,
            identity=hooks.identity if hooks is not None else None,
        )
    loop = StepLoop(
        executor,
        steps,
        feed=Feed(plan, comm.rank, hooks) if hooks is not None else None,
        commit=CommCommit(comm) if stop is not None else None,
        checkpoints=checkpoints,
        stop=stop,
        history=history if hooks is None else None,
        progress=Progress(progress, steps) if progress is not None and comm.rank == 0 else None,
        audit=replica_audit(comm, plan.entry_plan.function, pins, arrays.to_host),
    )
    try:
        end = loop.run(args, first)
    except RunStopped as stopped:  # every rank after the same step, the state saved
        return RankOutcome(tuple(args), [], comm.stats, stopped)
    finally:
        if checkpoints is not None:
            checkpoints.finish_pending()
    if hooks is not None or not history:  # a training loop: keep the last step's results only
        history = [end.results]
    return RankOutcome(tuple(args), history, comm.stats)


def _saves(checkpoint: CheckpointPolicy, stop: StopSignal | None) -> bool:
    """Whether a simulated run writes checkpoints: every N steps, or when a stop is asked."""
    return checkpoint.saves or stop is not None


def output_pins(entry: Function, pins: Mapping[str, Pin]) -> dict[str, Pin]:
    """The pins of a pipelined run's outputs (:func:`output_values`' names): each state
    parameter's, and its update's result's."""
    out = {
        f"result{i}": pins[spec.updates.lstrip("%")]
        for i, spec in enumerate(entry.results)
        if spec.updates is not None and spec.updates.lstrip("%") in pins
    }
    out.update(
        {
            p.name.lstrip("%"): pins[p.name.lstrip("%")]
            for p in entry.params
            if p.name.lstrip("%") in pins
        }
    )
    return out


def summary_lines(outputs: Mapping[str, np.ndarray]) -> list[str]:
    """One line per output: name, dtype, shape and mean (what ``dtm run`` prints)."""
    lines = []
    for name, value in outputs.items():
        summary = f"mean {float(value.astype('float64').mean()):.6g}" if value.size else "empty"
        lines.append(f"{name:>12}  {value.dtype}{list(value.shape)}  {summary}")
    return lines


def initial_blocks(
    plan: ExecPlan,
    rank: int,
    inputs: Mapping[str, np.ndarray],
    local: Mapping[str, np.ndarray] | None = None,
    fed: Sequence[str] = (),
) -> list[np.ndarray]:
    """This rank's blocks of the entry parameters: from ``inputs`` (global arrays by name)
    where given, else from ``local`` (this rank's blocks by name, e.g. restored from a
    checkpoint store), else zeros for the inputs a loader feeds (``fed``), else from each
    parameter's init."""
    blocks = held_blocks(plan, rank, inputs, local, fed)
    return [b for b in blocks if b is not None]


def held_blocks(
    plan: ExecPlan,
    rank: int,
    inputs: Mapping[str, np.ndarray],
    local: Mapping[str, np.ndarray] | None = None,
    fed: Sequence[str] = (),
    pins: Mapping[str, Pin] | None = None,
) -> list[np.ndarray | None]:
    """:func:`initial_blocks`, with None for each parameter pinned (``pins``) to ranks this
    one is not (a pipelined run's stage state)."""
    mesh = plan.mesh
    blocks: list[np.ndarray | None] = []
    for p in plan.entry_plan.function.params:
        t = p.type
        key = p.name.lstrip("%")
        if not holds(mesh, rank, (pins or {}).get(key)):
            blocks.append(None)
        elif key in inputs:
            block = inputs[key][local_block(t.shape, t.layout, mesh, rank)]
            blocks.append(np.array(block, order="C"))
        elif local is not None and key in local:
            blocks.append(np.array(local[key], order="C"))
        elif key in fed:  # a loader gives it before each step
            blocks.append(
                np.zeros(local_shape(t.shape, t.layout, mesh, rank), dtype=np_dtype(t.dtype))
            )
        else:
            offsets = local_offsets(t.shape, t.layout, mesh, rank)
            blocks.append(init_block(p, offsets, local_shape(t.shape, t.layout, mesh, rank)))
    return blocks


def assemble(
    t: TensorType,
    mesh: MeshShape,
    blocks: Sequence[np.ndarray | None],
    pin: Pin | None = None,
) -> np.ndarray:
    """The global value of ``t`` from every rank's block (in rank order); with ``pin``, from
    the blocks of the ranks at that (axis, coordinate) (the others hold none)."""
    if pin is not None:  # the pinned ranks, in rank order: the mesh with that axis of size 1
        blocks = [b for r, b in enumerate(blocks) if holds(mesh, r, pin)]
        mesh = MeshShape(tuple((a, 1 if a == pin[0] else n) for a, n in mesh.axes))
    held = [b for b in blocks if b is not None]
    if len(held) != mesh.size:
        raise UsageError(f"{t}: {mesh.size - len(held)} of the {mesh.size} blocks are missing")
    plan = plan_redistribute(t, Layout.replicated(t.rank), mesh)
    return apply_plan(plan, mesh, held)[0]


def run_simulated(
    module: Module,
    nranks: int,
    *,
    binding: dict[str, int] | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    steps: int = 1,
    backend: str | ArrayBackend = "numpy",
    timeout_s: float = 60.0,
    hooks: RunHooks | None = None,
    deterministic: bool | None = None,
    checkpoint: CheckpointPolicy | None = None,
    progress: ProgressPolicy | None = None,
    stop: StopSignal | None = None,
    pipeline: PipelinePolicy | None = None,
) -> RunResult:
    """Run a *verified* module on ``nranks`` simulated ranks and return global values
    (``deterministic``, ``checkpoint``, ``progress``, ``stop``: as :func:`run_rank`; with
    ``checkpoint.resume`` the run starts from the newest checkpoint of its store that
    verifies, written on any mesh). Raises :class:`~dtm_mpi.errors.RunStopped` when a stop
    was agreed (rank 0's: it names the saved checkpoint)."""
    from dtm_mpi.comm.handles import self_comm
    from dtm_mpi.comm.sim import run_ranks
    from dtm_mpi.runtime.checkpoints import open_store, restore_globals

    check_run_size(steps, nranks)
    first = 0
    if checkpoint is not None and checkpoint.resume:  # every parameter from the checkpoint
        given, first = restore_globals(
            checkpoint,
            module,
            steps,
            hooks.data if hooks is not None else None,
            hooks.identity if hooks is not None else None,
            hooks.fresh if hooks is not None else (),
        )
    else:
        given = check_inputs(module, inputs or {}, fed=hooks.fed if hooks is not None else ())
    mesh = mesh_for(module, nranks, binding)
    plan = compile_plan(module, mesh)
    pplan = None
    if pipeline is not None:
        from dtm_mpi.runtime.pipeline_step import plan_pipelined_run

        name = backend if isinstance(backend, str) else backend.name
        pplan = plan_pipelined_run(
            pipeline, plan, fed=hooks.fed if hooks is not None else (), backend=name
        )
    store = None
    if checkpoint is not None and _saves(checkpoint, stop):
        store = open_store(checkpoint, self_comm())
    try:
        outcomes = run_ranks(
            mesh,
            lambda comm: run_rank(
                plan,
                comm,
                given,
                steps=steps,
                first=first,
                backend=backend,
                hooks=hooks,
                deterministic=deterministic,
                checkpoint=checkpoint,
                store=store,
                progress=progress,
                stop=stop,
                pipeline=pplan,
            ),
            timeout_s=timeout_s,
        )
    finally:
        if store is not None:
            store.close()
    if outcomes[0].stopped is not None:  # (every rank agreed on it)
        raise outcomes[0].stopped
    entry = plan.entry_plan.function
    pins = pplan.pins if pplan is not None else {}
    params = {
        p.name.lstrip("%"): assemble(
            p.type, mesh, [o.params[i] for o in outcomes], pins.get(p.name.lstrip("%"))
        )
        for i, p in enumerate(entry.params)
    }
    results = [
        tuple(
            assemble(
                spec.type,
                mesh,
                [o.results[s][j] for o in outcomes],
                pins.get(spec.updates.lstrip("%")) if spec.updates is not None else None,
            )
            for j, spec in enumerate(entry.results)
        )
        for s in range(len(outcomes[0].results))
    ]
    return RunResult(entry, params, results, [o.stats for o in outcomes])
