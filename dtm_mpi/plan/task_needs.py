"""What each task of a graph needs, from its program (io/TASKS.md §3): checked against the
graph and turned into :class:`~dtm_mpi.plan.task_plan.TaskNeeds`.

Every rank computes the same from the same files. Errors are
:class:`~dtm_mpi.errors.TaskGraphError` located in the graph file: a program that does not load
or verify, an input naming no entry parameter, a parameter neither given nor initialised, an
output key that is no result or parameter, a mesh that does not bind, and a consumer whose
parameter has another dtype or global shape than the tensor its producer writes (the store is
mesh-independent: layouts may differ).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtm_mpi.errors import DtmError, TaskGraphError
from dtm_mpi.io.task_graph import TaskGraph, TaskSpec, task_deps
from dtm_mpi.plan.outputs import output_types
from dtm_mpi.plan.task_plan import TaskNeeds, TaskPlan

if TYPE_CHECKING:
    from dtm_mpi.ir.nodes import Module
    from dtm_mpi.ir.types import TensorType
    from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["TaskProgram", "describe_tasks", "output_type", "plan_graph"]


@dataclass(frozen=True, slots=True)
class TaskProgram:
    """A task with its loaded program and bound mesh."""

    spec: TaskSpec
    module: Module
    mesh: MeshShape
    needs: TaskNeeds

    def input_type(self, param: str) -> TensorType:
        entry = self.module.entry
        assert entry is not None
        return next(p.type for p in entry.params if p.name.lstrip("%") == param)


def output_type(module: Module, key: str) -> TensorType | None:
    """The type of output ``key`` of ``module``'s entry function (``resultN`` or a parameter's
    final value: :mod:`dtm_mpi.plan.outputs`), None when it has no such output."""
    entry = module.entry
    assert entry is not None
    return output_types(entry).get(key)


def describe_tasks(graph: TaskGraph, load: Callable[[str], Module]) -> tuple[TaskProgram, ...]:
    """Load every task's program with ``load`` (path -> verified module, raising a
    :class:`~dtm_mpi.errors.DtmError`), check it against the graph, bind its mesh and cost it
    (file order)."""
    deps = task_deps(graph.tasks)
    progs: dict[str, TaskProgram] = {}
    for t in graph.tasks:
        progs[t.name] = _describe(t, deps[t.name], load)
    writers = graph.producers()
    for t in graph.tasks:
        consumer = progs[t.name]
        for param, tensor in t.inputs:
            producer = writers.get(tensor)
            if producer is None:
                continue
            key = next(k for k, v in producer.outputs if v == tensor)
            have = output_type(progs[producer.name].module, key)
            want = consumer.input_type(param)
            assert have is not None
            if have.dtype != want.dtype or have.shape != want.shape:
                raise TaskGraphError(
                    f"{t.at('inputs.' + param)}: task {t.name!r}: parameter %{param} is "
                    f"{_type_text(want)}, but tensor {tensor!r} is {_type_text(have)} "
                    f"(written by task {producer.name!r} as {key}, {producer.at('outputs.' + key)})"
                )
    return tuple(progs[t.name] for t in graph.tasks)


def _type_text(t: TensorType) -> str:
    return f"{t.dtype.value}[{','.join(map(str, t.shape))}]"


def _describe(t: TaskSpec, deps: tuple[str, ...], load: Callable[[str], Module]) -> TaskProgram:
    from dtm_mpi.ir.verify import function_mesh
    from dtm_mpi.plan.cost import function_cost
    from dtm_mpi.plan.program import compile_plan, mesh_for

    def fail(key: str, message: str) -> TaskGraphError:
        return TaskGraphError(f"{t.at(key)}: task {t.name!r}: {message}")

    try:
        module = load(str(t.program))
    except DtmError as exc:
        raise fail("program", f"program {t.program}: {exc}") from None
    entry = module.entry
    if entry is None:
        raise fail("program", f"program {t.program} has no entry function")
    params = {p.name.lstrip("%"): p for p in entry.params}
    given = dict(t.inputs)
    for name in given:
        if name not in params:
            raise fail(
                f"inputs.{name}",
                f"@{entry.name} of {t.program} has no parameter %{name} "
                f"(it has: {', '.join('%' + p for p in params) or 'none'})",
            )
    for name, p in params.items():
        if name not in given and p.init is None:
            raise fail(
                "inputs",
                f"parameter %{name} of @{entry.name} has no init: give it an input "
                f'(inputs = {{ {name} = "TENSOR" }})',
            )
    for key, _ in t.outputs:
        if output_type(module, key) is None:
            results = ", ".join(f"result{i}" for i in range(len(entry.results)))
            raise fail(
                f"outputs.{key}",
                f"{key!r} is no output of @{entry.name} (its results: {results or 'none'}; "
                "or a parameter's final value by name)",
            )
    decl = function_mesh(module, entry)
    if decl is None and t.binding:
        raise fail("mesh", f"program {t.program} declares no mesh for @{entry.name}")
    binding = t.binding or {}
    ranks = math.prod(binding.get(a, n) for a, n in decl.axes) if decl is not None else 1
    try:
        mesh = mesh_for(module, ranks, t.binding)
        plan = compile_plan(module, mesh)
    except DtmError as exc:
        raise fail("mesh" if t.binding else "program", str(exc)) from None
    cost = function_cost(plan, plan.entry_plan)
    peak = max(v + k for v, k in zip(cost.peak, cost.retained, strict=True))
    needs = TaskNeeds(
        t.name,
        deps,
        ranks,
        peak,
        sum(cost.sent) * t.steps,
        t.backend != "numpy",
    )
    return TaskProgram(t, module, mesh, needs)


def plan_graph(
    graph: TaskGraph,
    load: Callable[[str], Module],
    *,
    job_ranks: int,
    capacity: int | None = None,
    devices: int = 0,
) -> tuple[tuple[TaskProgram, ...], TaskPlan]:
    """The programs (:func:`describe_tasks`) and the plan (:func:`~dtm_mpi.plan.task_plan.
    plan_tasks`) of ``graph`` for a job; a task that fits nowhere is located at its name in the
    graph file. Pure: the same files give the same plan on every rank."""
    from dtm_mpi.errors import TaskPlacementError
    from dtm_mpi.plan.task_plan import plan_tasks

    progs = describe_tasks(graph, load)
    try:
        plan = plan_tasks(
            [p.needs for p in progs], job_ranks=job_ranks, capacity=capacity, devices=devices
        )
    except TaskPlacementError as exc:  # at the task's place in the graph file
        spec = next(p.spec for p in progs if p.spec.name == exc.task)
        raise TaskGraphError(f"{spec.span}: {exc}") from None
    return progs, plan
