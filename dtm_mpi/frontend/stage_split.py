"""Pipeline stages from the frontend: a model's forward cut before named layers.

``splits`` name layers by their path in the model (``blocks.2``: the third block; the paths of
:meth:`~dtm_mpi.frontend.layers.Module.named_layers`). Tracing records where each layer call's ops
start; stage ``k + 1`` starts at the first op of the first call of ``splits[k]``, so the
stages are consecutive runs of the traced forward (:func:`dtm_mpi.ir.stages.partition_stages`
then finds the routes between them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dtm_mpi.config import get_config
from dtm_mpi.errors import UsageError, VerifyError
from dtm_mpi.frontend.layers import Module as Layer
from dtm_mpi.frontend.mesh import Mesh
from dtm_mpi.frontend.optim import Optimizer, clip_scale, square_sum
from dtm_mpi.frontend.precision import MixedPrecision
from dtm_mpi.frontend.recompute import Recompute, rewrite_recompute
from dtm_mpi.frontend.step_trace import Input, split_outputs, trace_model
from dtm_mpi.frontend.tensor import Tensor, Tracer, trace_error, tracing
from dtm_mpi.frontend.traced_params import regather
from dtm_mpi.ir.autodiff import backward
from dtm_mpi.ir.build import FunctionBuilder
from dtm_mpi.ir.nodes import MeshDecl, Param
from dtm_mpi.ir.stages import (
    CLIP_TOTAL,
    StagePartition,
    StagePass,
    StepStages,
    partition_stages,
    step_stages,
)
from dtm_mpi.ir.types import DType, TensorType

if TYPE_CHECKING:
    from dtm_mpi.plan.schedule import ScheduleKind
    from dtm_mpi.runtime.policies import PipelinePolicy

__all__ = [
    "Pipeline",
    "check_pipeline",
    "even_splits",
    "forward_stages",
    "microbatch_inputs",
    "pipeline_policy",
    "stage_cuts",
    "step_stages_of",
    "with_updates",
]


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A training step run as pipeline stages over the mesh axis ``axis`` (its size at run
    time is the number of pipeline ranks): ``microbatches`` per step, schedule ``schedule``
    (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``), ``chunks`` stages per rank
    (``interleaved``), cut before the layers ``splits`` names (``blocks.2``; None: the
    model's longest list of layers cut evenly into as many stages as the run has)."""

    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    splits: tuple[str, ...] | None = None
    axis: str = "pp"


def even_splits(model: Layer, stages: int) -> list[str]:
    """The splits cutting ``model``'s longest list of layers (``blocks.0`` .. ``blocks.L-1``)
    into ``stages`` runs of as equal length as can be (an error naming the list when it has
    fewer layers than stages)."""
    lists: dict[str, list[str]] = {}
    for path, _ in model.named_layers():
        head, _, tail = path.rpartition(".")
        if tail.isdigit():
            lists.setdefault(head, []).append(path)
    if stages == 1:
        return []
    if not lists:
        raise UsageError(
            f"the model has no list of layers to cut into {stages} pipeline stages: give Pipeline(splits=[...])"
        )
    head, layers = max(lists.items(), key=lambda kv: len(kv[1]))
    if len(layers) < stages:
        raise UsageError(
            f"{stages} pipeline stages need at least {stages} layers in {head!r}; it has {len(layers)} (fewer stages, or Pipeline(splits=[...]))"
        )
    return [layers[(k * len(layers)) // stages] for k in range(1, stages)]


def check_pipeline(pipeline: Pipeline, mesh: Mesh) -> ScheduleKind:
    """``pipeline``'s axis is one of ``mesh``'s and its schedule is known (its kind)."""
    from dtm_mpi.plan.schedule import parse_schedule

    if pipeline.axis not in mesh.axis_names:
        raise UsageError(
            f"Pipeline(axis={pipeline.axis!r}): the mesh {mesh} has no such axis (declare it, e.g. Mesh({pipeline.axis}=1, ...); --mesh binds its size)"
        )
    return parse_schedule(pipeline.schedule)


def pipeline_policy(
    pipeline: Pipeline,
    model: Layer,
    loss_fn: Callable[..., Any],
    *,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    optimizer: Optimizer,
    clip_norm: float | None,
    seed: int,
    name: str,
    precision: MixedPrecision | None = None,
    recompute: Recompute = "none",
    shard_params: str | None = None,
) -> PipelinePolicy:
    """The run policy of ``pipeline`` (checked now: the axis in ``mesh``, the schedule's
    name): its stages traced by :func:`step_stages_of` when the run knows how many."""
    from dtm_mpi.runtime.policies import PipelinePolicy

    kind = check_pipeline(pipeline, mesh)
    traced: dict[tuple[int, bool], StepStages] = {}

    def stages(n: int, whole_batch: bool = False) -> StepStages:
        if (n, whole_batch) not in traced:
            splits = list(pipeline.splits) if pipeline.splits is not None else even_splits(model, n)
            if len(splits) + 1 != n:
                raise UsageError(
                    f"Pipeline(splits=...) cuts the model into {len(splits) + 1} stages; the run has {n} ({pipeline.axis} x {pipeline.chunks} chunk(s) per rank)"
                )
            traced[(n, whole_batch)] = step_stages_of(
                model,
                loss_fn,
                mesh=mesh,
                inputs=inputs,
                splits=splits,
                microbatches=pipeline.microbatches,
                optimizer=optimizer,
                clip_norm=clip_norm,
                seed=seed,
                name=name,
                whole_batch=whole_batch,
                precision=precision,
                recompute=recompute,
                shard_params=shard_params,
            )
        return traced[(n, whole_batch)]

    return PipelinePolicy(stages, kind, pipeline.microbatches, pipeline.chunks, pipeline.axis)


def stage_cuts(
    model: Layer, entered: Sequence[tuple[int, str]], splits: Sequence[str]
) -> list[int]:
    """The op positions at which the stages after ``splits`` start (``entered``: the
    tracer's (op position, layer path) of every layer call, in call order)."""
    paths = [p for p, _ in model.named_layers()]
    cuts: list[int] = []
    for k, split in enumerate(splits):
        if split not in paths:
            shown = ", ".join(p for p in paths if p.count(".") <= 1)
            raise UsageError(
                f"pipeline split {split!r}: the model has no layer with this path (its layers: {shown})"
            )
        if split in splits[:k]:
            raise UsageError(f"pipeline split {split!r} is given twice")
        first = next((at for at, path in entered if path == split), None)
        if first is None:
            raise UsageError(
                f"pipeline split {split!r}: the traced function never calls this layer"
            )
        if cuts and first <= cuts[-1]:
            raise UsageError(
                f"pipeline splits follow the forward order: {split!r} runs before {splits[k - 1]!r}"
            )
        cuts.append(first)
    return cuts


def forward_stages(
    model: Layer,
    loss_fn: Callable[..., Any],
    *,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    splits: Sequence[str],
    seed: int = 0,
    name: str = "train",
) -> StagePartition:
    """Trace ``loss_fn(model, **inputs)`` (as :func:`~dtm_mpi.frontend.trace.train_step`
    does, up to the loss and metrics) and cut its forward into ``len(splits) + 1`` stages
    before the layers ``splits`` name."""
    tr, _, _, out = trace_model(
        model, loss_fn, mesh, inputs, name, weights_as_state=True, seed=seed
    )
    with tracing(tr):
        for _, t in split_outputs(out, "loss"):
            t.complete()
    return _cut(tr, model, splits, inputs)


def _cut(
    tr: Tracer, model: Layer, splits: Sequence[str], inputs: Mapping[str, Input]
) -> StagePartition:
    """The traced forward so far cut before ``splits`` (a located error at the user's line)."""
    cuts = stage_cuts(model, tr.entered, splits)
    try:
        return partition_stages(tr.b.params, tr.b.ops, cuts, fed=tuple(inputs))
    except VerifyError as err:
        raise trace_error(err) from None


def microbatch_inputs(inputs: Mapping[str, Input], microbatches: int) -> dict[str, Input]:
    """The fed inputs of one of ``microbatches`` microbatches: each split along its first
    dimension (a size that is not a multiple of ``microbatches`` is an error naming it)."""
    if microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1; got {microbatches}")
    out = {}
    for key, spec in inputs.items():
        shape = tuple(spec.shape)
        if not shape or shape[0] % microbatches:
            raise UsageError(
                f"input {key!r}: its first dimension ({shape[0] if shape else 'a scalar'}) is not a multiple of {microbatches} microbatches"
            )
        out[key] = Input((shape[0] // microbatches, *shape[1:]), spec.dtype, spec.layout)
    return out


def step_stages_of(
    model: Layer,
    loss_fn: Callable[..., Any],
    *,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    splits: Sequence[str],
    microbatches: int = 1,
    optimizer: Optimizer | None = None,
    clip_norm: float | None = None,
    seed: int = 0,
    name: str = "train",
    whole_batch: bool = False,
    precision: MixedPrecision | None = None,
    recompute: Recompute = "none",
    shard_params: str | None = None,
) -> StepStages:
    """The forward and reverse passes of a training step cut into ``len(splits) + 1``
    stages, for one of ``microbatches`` microbatches (the fed inputs split along their first
    dimension, the loss scaled by ``1 / microbatches``, so that the loss and the parameter
    gradients of the step are the sums over its microbatches); with ``optimizer``, each
    stage's update pass too (its state parameters join the step's), the gradients first clipped
    to global norm ``clip_norm`` as :func:`~dtm_mpi.frontend.trace.train_step` clips them (each
    stage's square sum added over the pipeline). ``whole_batch``: the same passes traced on
    the whole batch (its loss not scaled: its gradients are the sums over the microbatches'),
    whose weight-gradient passes deterministic mode runs once per step over every
    microbatch's held values."""
    micro = microbatch_inputs(inputs, microbatches)
    tr, _, weights, out = trace_model(
        model,
        loss_fn,
        mesh,
        dict(inputs) if whole_batch else micro,
        name,
        weights_as_state=True,
        seed=seed,
        precision=precision,
        shard_params=shard_params,
    )
    with tracing(tr):
        loss = split_outputs(out, "loss")[0][1].complete()
        if precision is not None and loss.dtype in (DType.BF16, DType.F16):
            loss = loss.cast(DType.F32)  # as train_step reports it
        if microbatches > 1:  # (on the whole batch by 1: the same ops, the unscaled loss)
            loss = loss * (1.0 if whole_batch else 1.0 / microbatches)
    n_forward = len(tr.b.ops)
    partition = _cut(tr, model, splits, inputs)
    origins: list[int] = []
    with tracing(tr):
        grads = backward(
            tr.b,
            list(tr.b.ops),
            loss.value,
            [v for _, v in weights],
            stop=tr.detached,
            origins=origins,
        )
        if recompute != "none":  # inside each stage's reverse passes
            origins = rewrite_recompute(tr, model, n_forward, origins, recompute)
        if shard_params is not None:  # ZeRO-3: the reverse passes gather the parameters again
            origins = regather(tr, n_forward, origins)
    stages = step_stages(
        tr.b.params,
        tr.b.ops,
        n_forward,
        origins,
        partition,
        loss.value.name,
        [(v.name, g.name) for (_, v), g in zip(weights, grads, strict=True)],
        mesh.ir(),
        # the data-parallel sums of the gradients once per step, not per microbatch (not in
        # deterministic mode, whose weight passes run on the whole batch)
        defer_reductions=not whole_batch and not get_config().deterministic,
    )
    return with_updates(stages, mesh.ir(), optimizer, clip_norm)


def with_updates(
    stages: StepStages, mesh: MeshDecl, optimizer: Optimizer | None, clip_norm: float | None
) -> StepStages:
    """``stages`` with each stage's optimizer pass (its state parameters join the step's),
    the gradients first clipped to global norm ``clip_norm`` as
    :func:`~dtm_mpi.frontend.trace.train_step` clips them (each stage's square sum added over
    the pipeline); ``stages`` itself without an optimizer."""
    if optimizer is None:
        if clip_norm is not None:
            raise UsageError("clip_norm needs an optimizer")
        return stages
    by_name = {p.name: p for p in stages.params}
    passes, states = [], []
    for s in stages.passes:
        params = [by_name[n] for n in s.params]
        sq = _square_sum_pass(mesh, params, s.index) if clip_norm is not None else None
        clip = (clip_norm, sq.function.results[0].type) if clip_norm is not None and sq else None
        update, opt = _update_pass(mesh, params, optimizer, s.index, clip)
        passes.append(replace(s, update=update, square_sum=sq))
        states += opt
    return replace(stages, passes=tuple(passes), params=(*stages.params, *states))


def _square_sum_pass(mesh: MeshDecl, params: Sequence[Param], stage: int) -> StagePass:
    """The square sum of each of the stage's gradients (named ``<parameter>.grad``), one
    result per parameter (``<parameter>.sqsum``): the runtime adds every stage's in the
    step's parameter order, as :func:`~dtm_mpi.frontend.optim.square_sum` adds them
    unpipelined (so the total has the same bits)."""
    b = FunctionBuilder(mesh, module_name=f"stage{stage}_square_sum")
    tr = Tracer(b)
    sums = []
    with tracing(tr):
        for p in params:
            g = Tensor(b.add_param(f"{p.name}.grad", p.type), tr)
            sums.append(square_sum([g]))
    f = b.function(f"stage{stage}_square_sum", [t.value for t in sums])
    return StagePass(f, tuple(f"{p.name}.sqsum" for p in params))


def _update_pass(
    mesh: MeshDecl,
    params: Sequence[Param],
    optimizer: Optimizer,
    stage: int,
    clip: tuple[float, TensorType] | None,
) -> tuple[StagePass, list[Param]]:
    """Stage ``stage``'s optimizer step, traced as :func:`~dtm_mpi.frontend.trace.train_step`
    traces it (the same state names, so checkpoints match), and its new state parameters;
    ``clip``: the global norm to clip to, and the type of the square sum it is given."""
    b = FunctionBuilder(mesh, module_name=f"stage{stage}_update")
    tr = Tracer(b)
    weights = [(p.name.lstrip("%"), b.add_param(p.name, p.type)) for p in params]
    grads = [Tensor(b.add_param(f"{p.name}.grad", p.type), tr) for p in params]
    total = Tensor(b.add_param(CLIP_TOTAL, clip[1]), tr) if clip is not None else None
    n_before = len(b.params)
    with tracing(tr):
        if clip is not None and total is not None:
            scale, _ = clip_scale(total, clip[0])
            grads = [g * scale for g in grads]
        news = optimizer.update(tr, [(path, Tensor(v, tr)) for path, v in weights], grads)
        opt = list(b.params[n_before:])
        targets = [v for _, v in weights] + [b.value(p.name) for p in opt]
        news = [
            n if n.type == v.type else n.redistribute(v.type.layout)
            for n, v in zip(news, targets, strict=True)
        ]
    f = b.function(f"stage{stage}_update", [n.value for n in news])
    return StagePass(f, tuple(v.name for v in targets)), opt
