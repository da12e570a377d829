"""The plan of a pipelined run: a training step's stages (:mod:`dtm_mpi.ir.stages`) placed on
the ``pp`` axis of the run's mesh, their schedule (:mod:`dtm_mpi.plan.schedule`), every pass
compiled, and where each piece of the step's state lives (pure: every rank computes the same
plan from the step, its stages and the mesh).

The run's state is the unpipelined step's (the same entry parameters, the same names): a
stage's parameters and their optimizer state are *pinned* to the ranks of its ``pp``
coordinate (:data:`~dtm_mpi.sharding.blocks.Pin`), in the step's layouts over the other
axes; the fed inputs are every rank's (each stage uses the ones it needs). Checkpoints,
outputs and resumes take a pinned value's blocks from its ranks only, so a pipelined run's
checkpoint restores onto any mesh (another ``pp``, or none) and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.nodes import Function, MeshDecl
from dtm_mpi.ir.stages import StepStages, pass_module
from dtm_mpi.plan.program import ExecPlan, compile_plan
from dtm_mpi.plan.schedule import (
    PipelineShape,
    Schedule,
    ScheduleKind,
    StageCosts,
    plan_schedule,
)
from dtm_mpi.sharding.blocks import Pin, local_shape
from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["PipelinePlan", "plan_pipeline", "stage_plans"]


def stage_plans(stages: StepStages, mesh: MeshDecl, shape: MeshShape) -> dict[str, ExecPlan]:
    """Every pass of every stage compiled for ``shape``, by function name (pure: the same on
    every rank)."""
    return {
        sp.function.name: compile_plan(pass_module(sp.function, mesh, sp.function.name), shape)
        for s in stages.passes
        for sp in s.all()
    }


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """A pipelined run on one mesh: its ``stages``, their ``schedule`` over the ``axis``,
    every pass compiled (``passes``, by function name) and the ``pins`` of the step's state
    (entry parameter name without ``%`` -> the ``(axis, coordinate)`` of the ranks holding
    it; the fed inputs are not pinned)."""

    stages: StepStages
    schedule: Schedule
    axis: str
    passes: Mapping[str, ExecPlan]
    pins: Mapping[str, Pin]

    def pin_of(self, name: str) -> Pin | None:
        """The pin of entry parameter ``name`` (with or without ``%``), None if not pinned."""
        return self.pins.get(name.lstrip("%"))


def plan_pipeline(
    entry: Function,
    stages: StepStages,
    kind: ScheduleKind,
    shape: PipelineShape,
    mesh: MeshDecl,
    bound: MeshShape,
    *,
    axis: str = "pp",
    fed: tuple[str, ...] = (),
    costs: tuple[StageCosts, ...] | None = None,
) -> PipelinePlan:
    """The plan of running ``entry`` (the unpipelined training step, whose state and fed
    inputs the run keeps) as ``stages`` under schedule ``kind`` on the mesh ``bound``
    (``mesh`` declared); ``fed``: the inputs a loader gives each step. Refused, naming what:
    a mesh without ``axis``, a stage count that is not ``pp x chunks``, state laid out over the
    pipeline axis, state the stages do not hold (or hold with another type), and fed inputs
    whose blocks do not split into the microbatches."""
    if axis not in bound.axis_names:
        raise UsageError(f"the mesh {bound} has no pipeline axis {axis!r}")
    p = bound.axis_size(axis)
    if p != shape.ranks:
        raise UsageError(
            f"the schedule is for {shape.ranks} pipeline ranks; the mesh has {axis}={p}"
        )
    if len(stages.passes) != shape.stages:
        raise UsageError(
            f"the model is cut into {len(stages.passes)} stage(s); {axis}={p} with {shape.chunks} chunk(s) per rank runs {shape.stages}"
        )
    schedule = plan_schedule(kind, shape, costs)
    held: dict[str, tuple[int, Function]] = {}  # state name -> (stage, the pass holding it)
    types = {p.name: p.type for p in stages.params}
    for s in stages.passes:
        names = s.update.carries if s.update is not None else s.params
        for name in names:
            held[name] = (s.index, s.forward.function)
    pins: dict[str, Pin] = {}
    micro = {p.name: p.type for s in stages.passes for p in s.forward.function.params}
    for param in entry.params:
        t, name = param.type, param.name
        if axis in t.layout.used_axes:
            raise UsageError(
                f"{name} is laid out over {axis!r} ({t.layout}): the pipeline axis holds stages, not shards"
            )
        if name.lstrip("%") in fed:
            _check_microbatches(name, t.shape, micro.get(name), shape.microbatches, bound)
            continue
        if name not in held:
            raise UsageError(f"{name} of @{entry.name} is held by no pipeline stage")
        if types.get(name, t) != t:
            raise UsageError(
                f"{name} is {t} in @{entry.name} but {types[name]} in its stage: the stages were traced from another step"
            )
        pins[name.lstrip("%")] = (axis, shape.rank_of(held[name][0]))
    missing = sorted(set(held) - {p.name for p in entry.params})
    if missing:
        raise UsageError(
            f"the stages hold {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, which @{entry.name} does not have"
        )
    return PipelinePlan(stages, schedule, axis, stage_plans(stages, mesh, bound), pins)


def _check_microbatches(
    name: str,
    whole: tuple[int, ...],
    micro: object,
    microbatches: int,
    bound: MeshShape,
) -> None:
    """Every rank's block of fed input ``name`` (``whole``) splits into ``microbatches``
    blocks of the stages' microbatch input, along the first dimension."""
    from dtm_mpi.ir.types import TensorType

    if not isinstance(micro, TensorType):
        return  # no stage reads it
    if not whole or whole[0] != micro.shape[0] * microbatches:
        raise UsageError(
            f"input {name}: {list(whole)} is not {microbatches} microbatches of {list(micro.shape)}"
        )
    for rank in range(bound.size):
        mine = local_shape(whole, micro.layout, bound, rank)
        part = local_shape(micro.shape, micro.layout, bound, rank)
        if mine[0] != part[0] * microbatches:
            raise UsageError(
                f"input {name}: rank {rank}'s block of {mine[0]} row(s) does not split into {microbatches} microbatches of {part[0]} (make the batch a multiple of {microbatches} x the axes of its first dimension)"
            )
