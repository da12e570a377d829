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

import math
from collections.abc import Mapping
from dataclasses import dataclass

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.nodes import Function, MeshDecl
from dtm_mpi.ir.stages import StepStages, pass_module, reduce_module
from dtm_mpi.plan.program import ExecPlan, compile_plan
from dtm_mpi.plan.schedule import (
    PipelineShape,
    Schedule,
    ScheduleKind,
    ScheduleTiming,
    StageCosts,
    Transfer,
    plan_schedule,
    schedule_text,
    time_schedule,
)
from dtm_mpi.sharding.blocks import Pin, local_shape
from dtm_mpi.sharding.mesh import MeshShape

__all__ = [
    "PipelinePlan",
    "RankMemory",
    "StageMemory",
    "boundary_bundles",
    "explain_pipeline",
    "pipeline_signature",
    "plan_pipeline",
    "rank_memory",
    "stage_memory",
    "stage_plans",
]


def stage_plans(stages: StepStages, mesh: MeshDecl, shape: MeshShape) -> dict[str, ExecPlan]:
    """Every pass of every stage compiled for ``shape``, by function name (pure: the same on
    every rank)."""
    return {
        sp.function.name: compile_plan(
            (reduce_module if sp is s.reduce_grads else pass_module)(
                sp.function, mesh, sp.function.name
            ),
            shape,
        )
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
    whole: StepStages | None = None
    """Deterministic mode: the same stages traced on the whole batch, whose forward and
    weight passes run once per step over every microbatch's values (the last stage's forward
    gives the loss)."""
    whole_passes: Mapping[str, ExecPlan] | None = None
    """Those passes compiled, by function name."""

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
    whole: StepStages | None = None,
) -> PipelinePlan:
    """The plan of running ``entry`` (the unpipelined training step, whose state and fed
    inputs the run keeps) as ``stages`` under schedule ``kind`` on the mesh ``bound``
    (``mesh`` declared); ``fed``: the inputs a loader gives each step. Refused, naming what:
    a mesh without ``axis``, a stage count that is not ``pp x chunks``, state laid out over the
    pipeline axis, state the stages do not hold (or hold with another type), and fed inputs
    whose blocks do not split into the microbatches. ``whole``: deterministic mode's
    whole-batch stages (their forward and weight passes are compiled too)."""
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
    whole_passes = None
    if whole is not None:
        whole_passes = {}
        for s, w in zip(stages.passes, whole.passes, strict=True):
            for mine, theirs in ((s.weight_grad, w.weight_grad), (s.forward, w.forward)):
                _check_alike(s.index, mine.function, theirs.function)
            for sp in (w.weight_grad, w.forward):
                name = sp.function.name
                whole_passes[name] = compile_plan(pass_module(sp.function, mesh, name), bound)
    return PipelinePlan(
        stages, schedule, axis, stage_plans(stages, mesh, bound), pins, whole, whole_passes
    )


def _check_alike(stage: int, micro: Function, whole: Function) -> None:
    """Deterministic mode feeds ``whole`` (a pass traced on the whole batch) every
    microbatch's values of ``micro``'s parameters, matched by position: the two must be the
    same ops in the same order (a microbatch of one row can trace to other layouts, and
    so other ops, than the whole batch)."""
    ops_a = [op.name for op in micro.body]
    ops_b = [op.name for op in whole.body]
    same = (
        ops_a == ops_b
        and len(micro.params) == len(whole.params)
        and len(micro.results) == len(whole.results)
        and all(
            x.type.dtype == y.type.dtype
            and len(x.type.shape) == len(y.type.shape)
            and x.type.layout.partial == y.type.layout.partial
            for x, y in zip(micro.params, whole.params, strict=True)
        )
    )
    if not same:
        at = next((i for i, (a, b) in enumerate(zip(ops_a, ops_b, strict=False)) if a != b), None)
        where = (
            f" (op {at}: {ops_a[at]} for a microbatch, {ops_b[at]} for the whole batch)"
            if at is not None
            else ""
        )
        raise UsageError(
            f"deterministic mode: stage {stage}'s {micro.name} traces to other ops for a microbatch than for the whole batch{where}; "
            "make each microbatch at least 2 rows (a larger batch or fewer microbatches)"
        )


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


def boundary_bundles(stages: StepStages) -> dict[tuple[Transfer, int], tuple[str, ...]]:
    """What crosses each stage boundary, keyed as the schedule's transfers are (what, the
    sending stage): the activations stage ``s`` sends to ``s + 1`` are every route made on
    stage ``s`` or before and used after it (a skip connection is relayed stage by stage),
    the gradients ``s`` sends to ``s - 1`` likewise backwards."""
    n = len(stages.passes)
    out: dict[tuple[Transfer, int], tuple[str, ...]] = {}
    for s in range(n):
        out[(Transfer.ACT, s)] = tuple(
            r.value for r in stages.partition.routes if r.src <= s < max(r.dst)
        )
        out[(Transfer.GRAD, s)] = tuple(
            r.value for r in stages.grad_routes if r.src >= s > min(r.dst)
        )
    return out


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Bytes one rank holds for a stage: its parameters, their summed gradients, the
    optimizer's state, and one microbatch's held activations (what the forward pass keeps for
    the backward passes, and the received or fed values they read; boundary values it sends
    not counted)."""

    params: int
    grads: int
    optimizer: int
    held: int


def _bytes(t: object, mesh: MeshShape, rank: int) -> int:
    from dtm_mpi.ir.types import TensorType

    assert isinstance(t, TensorType)
    return math.prod(local_shape(t.shape, t.layout, mesh, rank)) * np_dtype(t.dtype).itemsize


def stage_memory(stages: StepStages, index: int, mesh: MeshShape, rank: int) -> StageMemory:
    """:class:`StageMemory` of stage ``index`` on ``rank`` of ``mesh`` (pure)."""
    s = stages.passes[index]
    types = {p.name: p.type for p in stages.params}
    params = sum(_bytes(types[n], mesh, rank) for n in s.params)
    state = s.update.carries if s.update is not None else s.params
    optimizer = sum(_bytes(types[n], mesh, rank) for n in state if n not in s.params)
    sent = set(boundary_bundles(stages)[(Transfer.ACT, index)]) | {stages.loss}
    f = s.forward
    held = sum(
        _bytes(r.type, mesh, rank)
        for name, r in zip(f.carries, f.function.results, strict=True)
        if name not in sent
    )
    # what the stage received (or was fed) for a microbatch and its reverse passes read
    later = {p.name for sp in (s.input_grad, s.weight_grad) for p in sp.function.params}
    own = set(s.params)
    held += sum(
        _bytes(p.type, mesh, rank)
        for p in f.function.params
        if p.name in later and p.name not in own
    )
    return StageMemory(params, params, optimizer, held)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one rank of pipeline coordinate ``coord`` holds at its peak: its ``stages``
    (index and :class:`StageMemory` each) and ``peak`` microbatches' held activations of its
    largest stage (as the schedule's time-line counts them); bytes."""

    coord: int
    rank: int
    stages: tuple[tuple[int, StageMemory], ...]
    peak: int

    @property
    def params(self) -> int:
        return sum(m.params for _, m in self.stages)

    @property
    def grads(self) -> int:
        return sum(m.grads for _, m in self.stages)

    @property
    def optimizer(self) -> int:
        return sum(m.optimizer for _, m in self.stages)

    @property
    def held(self) -> int:
        return max((m.held for _, m in self.stages), default=0)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def activations(self) -> int:
        return self.peak * self.held

    @property
    def total(self) -> int:
        return self.state + self.activations


def rank_memory(
    plan: PipelinePlan, mesh: MeshShape, timing: ScheduleTiming | None = None
) -> tuple[RankMemory, ...]:
    """Per pipeline coordinate, :class:`RankMemory` of its first rank on ``mesh`` (pure);
    ``timing``: the schedule's time-line when the caller has it."""
    shape = plan.schedule.shape
    peaks = (timing or time_schedule(plan.schedule)).peak_held
    out = []
    for c in range(shape.ranks):
        rank = next(r for r in range(mesh.size) if mesh.index_along(r, (plan.axis,)) == c)
        mine = tuple(
            (s.index, stage_memory(plan.stages, s.index, mesh, rank))
            for s in plan.stages.passes
            if shape.rank_of(s.index) == c
        )
        out.append(RankMemory(c, rank, mine, peaks[c]))
    return tuple(out)


def _layer_of(param: str) -> str:
    """The layer a parameter belongs to, as far as its first list index (``blocks.3``) or its
    first name (``tok``)."""
    parts = param.lstrip("%").split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _mib(n: int) -> str:
    from dtm_mpi.plan.explain import human_bytes

    return human_bytes(n)


def explain_pipeline(plan: PipelinePlan, mesh: MeshShape, width: int = 160) -> str:
    """What a pipelined run does and holds: per stage, its rank along the pipeline axis, its
    parameters, gradients, optimizer state and one microbatch's held activations (on the
    first rank of its stage); per pipeline rank, the predicted peak of held microbatches and
    their bytes; the schedule's time-line (unit pass costs: F = I = W) and its bubble."""
    shape = plan.schedule.shape
    axis = plan.axis
    timing = time_schedule(plan.schedule)
    lines = [
        f"pipeline over {axis}={shape.ranks}: {shape.stages} stage(s), {shape.microbatches} "
        f"microbatch(es) per step, schedule {plan.schedule.kind.value}",
        "stage  rank  layers                     params      grads  optimizer  held/microbatch",
    ]
    ranks = rank_memory(plan, mesh, timing)
    names = {s.index: s.params for s in plan.stages.passes}
    rows = sorted(((i, m.coord, mem) for m in ranks for i, mem in m.stages), key=lambda r: r[0])
    for index, c, mem in rows:
        layers = list(dict.fromkeys(_layer_of(n) for n in names[index]))
        shown = ", ".join(layers) if len(layers) <= 3 else f"{layers[0]} .. {layers[-1]}"
        lines.append(
            f"{index:>5}  {c:>4}  {shown[:24]:<24} {_mib(mem.params):>11} {_mib(mem.grads):>10} "
            f"{_mib(mem.optimizer):>10} {_mib(mem.held):>16}"
        )
    lines.append("per pipeline rank (its first rank): state, peak held microbatches, activations")
    for m in ranks:
        lines.append(
            f"  {axis}={m.coord} (rank {m.rank}): state {_mib(m.state)}, held {m.peak} x "
            f"{_mib(m.held)} = {_mib(m.activations)} activations, total {_mib(m.total)}"
        )
    lines.append(schedule_text(plan.schedule, timing, width))
    return "\n".join(lines) + "\n"


def pipeline_signature(plan: PipelinePlan) -> tuple[str, ...]:
    """What every rank of a pipelined run must plan alike, one line each: the schedule, then
    every value crossing every stage boundary with its type and the user's line that made it
    (the handshake compares them before any data moves: a rank whose stages differ -- other
    splits, another model -- is a located error, not a hang or a wrong block)."""
    shape = plan.schedule.shape
    lines = [
        f"schedule {plan.schedule.kind.value} over {plan.axis}={shape.ranks}: {shape.stages} stages, {shape.microbatches} microbatches"
    ]
    routes = {r.value: r for r in (*plan.stages.partition.routes, *plan.stages.grad_routes)}
    for (what, stage), values in sorted(
        boundary_bundles(plan.stages).items(), key=lambda kv: (kv[0][1], kv[0][0].value)
    ):
        to = stage + 1 if what is Transfer.ACT else stage - 1
        for value in values:
            r = routes[value]
            lines.append(
                f"stage {stage} -> {to} {what.value}: {value} {r.type} (made at {r.span.file}:{r.span.line}:{r.span.col})"
            )
    return tuple(lines)
