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

import numpy as np

from dtm_mpi.comm.interface import Comm, CommStats
from dtm_mpi.errors import UsageError
from dtm_mpi.ir.nodes import InitKind, Module
from dtm_mpi.ir.types import Layout, TensorType
from dtm_mpi.plan.program import ExecPlan, compile_plan, mesh_for
from dtm_mpi.runtime.executor import Executor
from dtm_mpi.runtime.values import check_input, init_block
from dtm_mpi.sharding.blocks import local_block, local_offsets, local_shape
from dtm_mpi.sharding.collectives import apply_plan
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import plan_redistribute

__all__ = [
    "RankOutcome", "RunResult", "assemble", "check_inputs", "initial_blocks", "run_rank",
    "run_simulated",
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

    params: dict[str, np.ndarray]
    results: list[tuple[np.ndarray, ...]]
    stats: list[CommStats] = field(default_factory=list)

    def outputs(self) -> dict[str, np.ndarray]:
        """What ``dtm run -o`` writes: the last step's results as ``result0``, ``result1``,
        ... and the final value of every state parameter by name."""
        out = {f"result{i}": v for i, v in enumerate(self.results[-1])} if self.results else {}
        out.update(self.params)
        return out


def check_inputs(module: Module, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs that match entry parameters, checked and converted (shape, dtype); a name
    matching no parameter is an error naming the parameters."""
    entry = module.entry
    assert entry is not None
    names = {p.name.lstrip("%"): p for p in entry.params}
    out: dict[str, np.ndarray] = {}
    for key, value in inputs.items():
        if key not in names:
            raise UsageError(
                f"input {key!r} matches no parameter of @{entry.name} (parameters: "
                f"{', '.join(names) or 'none'})"
            )
        out[key] = check_input(key, names[key].type, np.asarray(value), "the inputs")
    for key, p in names.items():
        if key not in out and (p.init is None or p.init.kind is InitKind.STORE):
            how = "is 'init store' (the tensor store is issue #6)" if p.init else "has no init"
            raise UsageError(
                f"parameter {p.name} of @{entry.name} {how} and no input supplies it; give it "
                f"with -i/--input (.npy named {key}.npy, .npz or .h5 holding {key!r})"
            )
    return out


def run_rank(
    plan: ExecPlan,
    comm: Comm,
    inputs: Mapping[str, np.ndarray],
    *,
    steps: int = 1,
    backend: str = "numpy",
) -> RankOutcome:
    """Run ``steps`` steps of the entry function on this rank. ``inputs``: global arrays of
    (some) entry parameters, by name; the others get their declared init.

    Collective: call on all ranks."""
    entry = plan.entry_plan.function
    args = initial_blocks(plan, comm.rank, inputs)
    index = {p.name: i for i, p in enumerate(entry.params)}
    executor = Executor(plan, comm, backend)
    history: list[tuple[np.ndarray, ...]] = []
    for step in range(steps):
        results = executor.run(args, step)
        history.append(results)
        for spec, value in zip(entry.results, results, strict=True):
            if spec.updates is not None:
                args[index[spec.updates]] = value
    return RankOutcome(tuple(args), history, comm.stats)


def initial_blocks(plan: ExecPlan, rank: int, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """This rank's blocks of the entry parameters: from ``inputs`` (global arrays by name)
    where given, else from each parameter's init."""
    mesh = plan.mesh
    blocks: list[np.ndarray] = []
    for p in plan.entry_plan.function.params:
        t = p.type
        key = p.name.lstrip("%")
        if key in inputs:
            block = inputs[key][local_block(t.shape, t.layout, mesh, rank)]
            blocks.append(np.array(block, order="C"))
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
    backend: str = "numpy",
    timeout_s: float = 60.0,
) -> RunResult:
    """Run a *verified* module on ``nranks`` simulated ranks and return global values."""
    from dtm_mpi.comm.sim import run_ranks

    if nranks < 1:
        raise UsageError(f"--sim needs at least 1 rank; got {nranks}")
    if steps < 1:
        raise UsageError(f"--steps must be >= 1; got {steps}")
    given = check_inputs(module, inputs or {})
    mesh = mesh_for(module, nranks, binding)
    plan = compile_plan(module, mesh)
    outcomes = run_ranks(
        mesh,
        lambda comm: run_rank(plan, comm, given, steps=steps, backend=backend),
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
        for s in range(steps)
    ]
    return RunResult(params, results, [o.stats for o in outcomes])
