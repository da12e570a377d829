"""Running a module's training loop on every rank: inputs to blocks, steps with state carried,
results back to global arrays.

:func:`run_rank` is what one rank does (over any :class:`~dtm_mpi.comm.interface.Comm`);
:func:`run_simulated` runs it on N simulated ranks in one process and assembles the global
outputs, which :func:`assemble` computes from the ranks' blocks with the redistribution plan to
a replicated layout (pending reductions completed in group order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dtm_mpi.comm.interface import Comm, CommStats
from dtm_mpi.errors import UsageError
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.nodes import Function, Module
from dtm_mpi.ir.types import Layout, TensorType
from dtm_mpi.kernels.devices import ArrayBackend
from dtm_mpi.plan.program import ExecPlan, compile_plan, mesh_for
from dtm_mpi.runtime.executor import Executor
from dtm_mpi.runtime.values import check_inputs, init_block
from dtm_mpi.sharding.blocks import local_block, local_offsets, local_shape
from dtm_mpi.sharding.collectives import apply_plan
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import plan_redistribute

if TYPE_CHECKING:
    from dtm_mpi.runtime.request import RunHooks

T = TypeVar("T")

__all__ = [
    "RankOutcome", "RunResult", "StepFeeder", "assemble", "check_output_keys", "initial_blocks",
    "output_values", "run_rank", "run_simulated", "run_steps", "summary_lines",
]  # fmt: skip


@dataclass(slots=True)
class RankOutcome:
    """One rank's blocks after the run: final parameter values and every step's results."""

    params: tuple[np.ndarray, ...]
    results: list[tuple[np.ndarray, ...]]
    stats: CommStats


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


class StepFeeder:
    """Puts a run's fed inputs (:class:`~dtm_mpi.runtime.request.RunHooks`) into this rank's
    parameter blocks before each step, and reports each step's scalar results."""

    def __init__(self, plan: ExecPlan, rank: int, hooks: RunHooks) -> None:
        entry = plan.entry_plan.function
        self.hooks, self.rank = hooks, rank
        index = {p.name.lstrip("%"): i for i, p in enumerate(entry.params)}
        self.slots: list[tuple[str, int, TensorType, tuple[slice, ...]]] = []
        for name in hooks.fed:
            if name not in index:
                raise UsageError(f"fed input {name!r} is not a parameter of @{entry.name}")
            t = entry.params[index[name]].type
            self.slots.append((name, index[name], t, local_block(t.shape, t.layout, plan.mesh, rank)))  # fmt: skip
        self.entry = entry

    def feed(self, step: int, blocks: list[np.ndarray], to_device: Callable[[np.ndarray], np.ndarray] = lambda a: a) -> None:  # fmt: skip
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
                raise UsageError(f"step {step}: the data loader gave {name!r} of shape {list(block.shape)} on rank {self.rank}; its block of {t} is {list(want)}")  # fmt: skip
            dtype = np_dtype(t.dtype)
            if block.dtype != dtype and not np.can_cast(block.dtype, dtype, "same_kind"):
                raise UsageError(f"step {step}: the data loader gave {name!r} as {block.dtype}; the input is {t.dtype}")  # fmt: skip
            blocks[i] = to_device(np.ascontiguousarray(block, dtype=dtype))

    def report(self, step: int, results: Sequence[Any], to_host: Callable[[Any], np.ndarray] = np.asarray) -> None:  # fmt: skip
        """Hand the step's complete scalar results to ``on_step``."""
        if self.hooks.on_step is None:
            return
        names = self.hooks.metric_names
        metrics: dict[str, float] = {}
        for i, (spec, value) in enumerate(zip(self.entry.results, results, strict=True)):
            if spec.type.shape == () and spec.type.layout.partial is None and spec.updates is None:  # fmt: skip
                metrics[names[i] if i < len(names) else f"result{i}"] = float(to_host(value))
        self.hooks.on_step(step, self.rank, metrics)


def run_rank(
    plan: ExecPlan,
    comm: Comm,
    inputs: Mapping[str, np.ndarray],
    *,
    steps: int = 1,
    backend: str | ArrayBackend = "numpy",
    hooks: RunHooks | None = None,
    deterministic: bool | None = None,
) -> RankOutcome:
    """Run ``steps`` steps of the entry function on this rank. ``inputs``: global arrays of
    (some) entry parameters, by name; the others get their declared init; ``hooks``: inputs
    fed each step, metrics reported after each step; ``deterministic``: the exact sums of
    deterministic mode (default: ``DTM_DETERMINISTIC``).

    Collective: call on all ranks."""
    args = initial_blocks(plan, comm.rank, inputs, fed=hooks.fed if hooks is not None else ())
    history: list[tuple[np.ndarray, ...]] = []
    feeder = StepFeeder(plan, comm.rank, hooks) if hooks is not None else None
    last = run_steps(
        Executor(plan, comm, backend, deterministic), args, steps, history=history if feeder is None else None,
        before_step=(lambda step: feeder.feed(step, args)) if feeder is not None else None,
        on_results=feeder.report if feeder is not None else None,
    )  # fmt: skip
    if feeder is not None:  # a training loop: keep the last step's results only
        history.append(last)
    return RankOutcome(tuple(args), history, comm.stats)


def run_steps(
    executor: Executor,
    blocks: list[np.ndarray],
    steps: int,
    *,
    first: int = 0,
    before_step: Callable[[int], None] | None = None,
    commit: Callable[[int], None] | None = None,
    after_step: Callable[[int], None] | None = None,
    history: list[tuple[np.ndarray, ...]] | None = None,
    on_results: Callable[[int, tuple[np.ndarray, ...]], None] | None = None,
) -> tuple[np.ndarray, ...]:
    """Run the entry function ``steps`` times on this rank's ``blocks`` of its parameters,
    replacing each state parameter by the result that ``updates`` it after every step (spec
    §7.3: all updates of a step take effect together). ``commit(step)`` runs before the
    updates are applied (under MPI: the agreement that every rank finished the step),
    ``on_results(step, results)`` then, ``after_step(step)`` after (e.g. a checkpoint of the new state); ``first`` is the first
    step's index (a resumed run continues the step count); ``history`` collects every step's
    results. Returns the last step's results.

    Collective: call on all ranks."""
    entry = executor.plan.entry_plan.function
    index = {p.name: i for i, p in enumerate(entry.params)}
    results: tuple[np.ndarray, ...] = ()
    for step in range(first, steps):
        if before_step is not None:
            before_step(step)
        results = executor.run(blocks, step)
        if commit is not None:
            commit(step)
        if on_results is not None:
            on_results(step, results)
        if history is not None:
            history.append(results)
        for spec, value in zip(entry.results, results, strict=True):
            if spec.updates is not None:
                blocks[index[spec.updates]] = value
        if after_step is not None:
            after_step(step)
    return results


def check_output_keys(entry: Function) -> None:
    """Refuse an entry function whose outputs would share a key in the ``-o`` file: a
    parameter named like a result key (``%result0`` beside result 0) would overwrite it."""
    results = {f"result{i}" for i in range(len(entry.results))}
    for p in entry.params:
        key = p.name.lstrip("%")
        if key in results:
            where = f"{p.span.file}:{p.span.line}:{p.span.col}: " if p.span.line > 0 else ""
            raise UsageError(
                f"{where}parameter {p.name} of @{entry.name} would be written as {key!r}, the key of "
                f"result {key.removeprefix('result')} of the output file: results and "
                "parameters never share a key; rename the parameter"
            )


def output_values(
    entry: Function, results: Sequence[T], params: Sequence[T]
) -> list[tuple[str, TensorType, T]]:
    """What ``dtm run -o`` writes, as (name, type, value): the last step's results as
    ``result0``, ``result1``, ... and the final value of every entry parameter by name
    (never the same key twice: :func:`check_output_keys`)."""
    check_output_keys(entry)
    named = [
        (f"result{i}", spec.type, v)
        for i, (spec, v) in enumerate(zip(entry.results, results, strict=True))
    ]
    named += [(p.name.lstrip("%"), p.type, v) for p, v in zip(entry.params, params, strict=True)]
    return named


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
    mesh = plan.mesh
    blocks: list[np.ndarray] = []
    for p in plan.entry_plan.function.params:
        t = p.type
        key = p.name.lstrip("%")
        if key in inputs:
            block = inputs[key][local_block(t.shape, t.layout, mesh, rank)]
            blocks.append(np.array(block, order="C"))
        elif local is not None and key in local:
            blocks.append(np.array(local[key], order="C"))
        elif key in fed:  # a loader gives it before each step
            blocks.append(np.zeros(local_shape(t.shape, t.layout, mesh, rank), dtype=np_dtype(t.dtype)))  # fmt: skip
        else:
            offsets = local_offsets(t.shape, t.layout, mesh, rank)
            blocks.append(init_block(p, offsets, local_shape(t.shape, t.layout, mesh, rank)))
    return blocks


def assemble(t: TensorType, mesh: MeshShape, blocks: Sequence[np.ndarray]) -> np.ndarray:
    """The global value of ``t`` from every rank's block (in rank order)."""
    plan = plan_redistribute(t, Layout.replicated(t.rank), mesh)
    return apply_plan(plan, mesh, list(blocks))[0]


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
) -> RunResult:
    """Run a *verified* module on ``nranks`` simulated ranks and return global values
    (``deterministic``: as :func:`run_rank`)."""
    from dtm_mpi.comm.sim import run_ranks

    if nranks < 1:
        raise UsageError(f"--sim needs at least 1 rank; got {nranks}")
    if steps < 1:
        raise UsageError(f"--steps must be >= 1; got {steps}")
    given = check_inputs(module, inputs or {}, fed=hooks.fed if hooks is not None else ())
    mesh = mesh_for(module, nranks, binding)
    plan = compile_plan(module, mesh)
    outcomes = run_ranks(
        mesh,
        lambda comm: run_rank(
            plan,
            comm,
            given,
            steps=steps,
            backend=backend,
            hooks=hooks,
            deterministic=deterministic,
        ),
        timeout_s=timeout_s,
    )
    entry = plan.entry_plan.function
    params = {
        p.name.lstrip("%"): assemble(p.type, mesh, [o.params[i] for o in outcomes])
        for i, p in enumerate(entry.params)
    }
    results = [
        tuple(
            assemble(spec.type, mesh, [o.results[s][j] for o in outcomes])
            for j, spec in enumerate(entry.results)
        )
        for s in range(len(outcomes[0].results))
    ]
    return RunResult(entry, params, results, [o.stats for o in outcomes])
