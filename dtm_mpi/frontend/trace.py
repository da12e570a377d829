"""Tracing Python into IR modules: a training step (forward, reverse pass, optimizer) and an
evaluation step.

:func:`train_step` traces ``loss_fn(model, **inputs)`` into the entry function of a new
module: the inputs are its plain parameters (fed each step), the model's parameters and the
optimizer's state are ``state`` parameters with their ``init``, and the results are the loss,
the metrics, then the new parameters and state (``updates``). The module is verified and in
canonical form (``dtm fmt`` leaves its text unchanged), and its hash depends only on the code
and the arguments, so every rank -- and every later run, on any mesh -- traces the same
program. :func:`eval_step` traces a forward-only function of the same model (no state: the
weights are inputs).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtm_mpi.errors import PropagationWarning, UsageError, VerifyError
from dtm_mpi.frontend.layers import Module as Layer
from dtm_mpi.frontend.loss_scale import METRICS as SCALER_METRICS
from dtm_mpi.frontend.loss_scale import STATE as SCALER_STATE
from dtm_mpi.frontend.loss_scale import LossScaler
from dtm_mpi.frontend.lr_schedule import Schedule
from dtm_mpi.frontend.mesh import Mesh, require_axis
from dtm_mpi.frontend.optim import Optimizer, clip_by_global_norm, square_sum
from dtm_mpi.frontend.precision import MixedPrecision, parse_precision
from dtm_mpi.frontend.recompute import Recompute, check_recompute, rewrite_recompute
from dtm_mpi.frontend.step_trace import Input, split_outputs, trace_model
from dtm_mpi.frontend.tensor import (
    Tensor,
    Tracer,
    trace_error,
    tracing,
)
from dtm_mpi.frontend.traced_params import regather
from dtm_mpi.ir import module_hash, print_module
from dtm_mpi.ir.autodiff import backward
from dtm_mpi.ir.build import Value
from dtm_mpi.ir.nodes import Module, Param
from dtm_mpi.ir.registry import required_version
from dtm_mpi.ir.types import DType, TensorType
from dtm_mpi.ir.verify import verify_module

if TYPE_CHECKING:
    from dtm_mpi.frontend.stage_split import Pipeline
    from dtm_mpi.runtime.policies import PipelinePolicy

__all__ = ["Input", "TracedStep", "eval_step", "forward_step", "train_results", "train_step"]


@dataclass(frozen=True)
class TracedStep:
    """A traced, verified module and the roles of its entry parameters and results."""

    module: Module
    inputs: tuple[str, ...]
    """Entry parameters fed each step (names without ``%``)."""
    params: tuple[str, ...]
    """The model's parameters (``state``), by path."""
    state: tuple[str, ...] = ()
    """The optimizer's state parameters."""
    metrics: tuple[str, ...] = ()
    """Names of the leading results (``loss`` first for a training step)."""
    mesh: Mesh = field(default_factory=lambda: Mesh(x=1))
    pipeline: PipelinePolicy | None = None
    """A pipelined step's stages, schedule and microbatches (None: not pipelined)."""
    tensors: tuple[str, ...] = ()
    """The names of the leading results that are tensors handed back whole each step
    (:func:`forward_step`), not scalar metrics."""
    schedule: Schedule | None = None
    """The optimizer's learning-rate schedule (None: a constant rate): :func:`fit` reports
    ``schedule.lr(step)`` as the metric ``lr`` each step (the step computes the same factor
    from ``step_index``; the metric is not a result of the module, so a pipelined and an
    unpipelined step stay one program)."""
    fallbacks: tuple[str, ...] = ()
    """Where sharding propagation gave up on a split value (``file:line: what``; each also a
    :class:`~dtm_mpi.errors.PropagationWarning` when traced; ``dtm explain`` lists them)."""
    identity: Module | None = None
    """The module whose program identifies the step's state in checkpoints where it is not
    ``module`` (a mixed-precision step: the same step without the policy, so that a
    checkpoint resumes across precision choices)."""
    precision: MixedPrecision | None = None
    recompute: Recompute = "none"
    fresh: tuple[str, ...] = ()
    """State that starts from its init where a resumed checkpoint lacks it (an f16 step's
    loss scaler)."""
    retrace: Callable[..., TracedStep] | None = field(default=None, compare=False)
    """The same step traced again with some arguments changed (keywords of
    :func:`train_step`): what ``dtm explain`` compares the recomputation choices with."""

    @property
    def text(self) -> str:
        return print_module(self.module)

    @property
    def hash(self) -> str:
        return module_hash(self.module)

    def input_type(self, name: str) -> TensorType:
        entry = self.module.entry
        assert entry is not None
        for p in entry.params:
            if p.name == "%" + name:
                return p.type
        raise UsageError(f"no input {name!r} (inputs: {', '.join(self.inputs)})")


def _finish(
    tr: Tracer, name: str, mesh: Mesh, results: list[Value | tuple[Value, str | None]]
) -> Module:
    """The verified module, with the user's lines as its ops' spans (so a plan or run error
    names them). Its text is its canonical form (parsing it gives the module back: tested)."""
    f = tr.b.function(name, results, entry=True)
    module = Module(required_version(f.body), tr.b.module.name, (mesh.ir(),), (f,))
    try:
        verify_module(module)
    except VerifyError as err:  # a bug of the frontend, not of the user's code
        raise AssertionError(f"the traced module does not verify: {err}") from err
    return module


def _fallbacks(tr: Tracer) -> tuple[str, ...]:
    """The builder's notes of where propagation gave up, once per place and message, each
    warned at the user's line as it is first met."""
    out: list[str] = []
    for span, message in tr.b.gave_up:
        line = f"{span.file}:{span.line}: {message}"
        if line not in out:
            out.append(line)
            warnings.warn_explicit(message, PropagationWarning, span.file, span.line)
    return tuple(out)


def train_results(
    tr: Tracer,
    weights: Sequence[tuple[str, Value]],
    scalars: Sequence[tuple[str, Tensor]],
    optimizer: Optimizer,
    clip_norm: float | None,
    recompute: Recompute = "none",
    model: Layer | None = None,
    grad_norm: bool = False,
    precision: MixedPrecision | None = None,
) -> tuple[list[Value | tuple[Value, str | None]], list[Param]]:
    """The results of a training step whose forward ``tr`` traced (``scalars``: the loss
    first, then metrics; ``weights``: the trained parameters by path): the scalars, then the
    new values of the weights and of the optimizer's state parameters (each ``updates`` its
    parameter), after the reverse pass, clipping to global norm ``clip_norm`` and
    ``optimizer``'s update; and the optimizer's new state parameters. ``recompute``: the
    blocks of ``model`` recompute their activations in the reverse pass
    (:mod:`dtm_mpi.frontend.recompute`). ``grad_norm``: the gradients' global 2-norm (before
    clipping: the clip's own) is a result after the scalars. ``precision`` with
    ``compute="f16"``: dynamic loss scaling (:mod:`dtm_mpi.frontend.loss_scale`), its
    ``loss_scale`` and ``skipped`` after the scalars, its state after the optimizer's."""
    loss = scalars[0][1]
    if tr.b.mesh is not None:
        optimizer.check_mesh(tr.b.mesh.axis_names)
    scaler = None
    seed = loss
    if precision is not None and precision.compute_dtype is DType.F16:
        with tracing(tr):
            scaler = LossScaler.traced(tr, precision.init_scale, precision.growth_interval)
            seed = scaler.seed(loss)
    n_scaler = len(tr.b.params)
    forward = len(tr.b.ops)
    with tracing(tr):
        origins: list[int] = []
        grads_v = backward(
            tr.b,
            list(tr.b.ops),
            seed.value,
            [v for _, v in weights],
            stop=tr.detached,
            layouts=[optimizer.grad_layout(v.type) for _, v in weights],
            origins=origins,
        )
        if recompute != "none":
            assert model is not None
            rewrite_recompute(tr, model, forward, origins, recompute)
        regather(tr, forward)
        grads = [Tensor(g, tr) for g in grads_v]
        if scaler is not None:
            grads = scaler.unscale(grads)
        norm = None
        if clip_norm is not None:
            grads, norm = clip_by_global_norm(grads, clip_norm)
        elif grad_norm:
            norm = square_sum(grads).sqrt()
        n_before = len(tr.b.params)
        news = optimizer.update(tr, [(p, Tensor(v, tr)) for p, v in weights], grads)
        opt_params = tr.b.params[n_before:]
        if len(news) != len(weights) + len(opt_params):
            raise AssertionError("the optimizer returned a value per parameter and per state")
        # each new value in its parameter's layout (``updates`` needs the same type)
        targets = [v for _, v in weights] + [tr.b.value(p.name) for p in opt_params]
        news = [
            n if n.type == v.type else n.redistribute(v.type.layout)
            for n, v in zip(news, targets, strict=True)
        ]
        scaled: tuple[list[tuple[Value, str]], list[Value]] = ([], [])
        if scaler is not None:  # an overflow keeps every state as it was
            news = scaler.guard(news, [Tensor(v, tr) for v in targets])
            scaled = scaler.updates()
    results: list[Value | tuple[Value, str | None]] = [t.value for _, t in scalars]
    if grad_norm:
        assert norm is not None
        results.append(norm.value)
    results += scaled[1]
    results += [(n.value, v.name) for n, v in zip(news, targets, strict=True)]
    results += [(v, name) for v, name in scaled[0]]
    opt_params = [*opt_params, *tr.b.params[n_scaler - 3 : n_scaler]] if scaler else opt_params
    return results, list(opt_params)


def train_step(
    model: Layer,
    loss_fn: Callable[..., Any],
    *,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    optimizer: Optimizer,
    clip_norm: float | None = None,
    seed: int = 0,
    name: str = "train",
    pipeline: Pipeline | None = None,
    shard_params: str | None = None,
    weights_from_store: bool = False,
    accumulate: int | None = None,
    precision: MixedPrecision | None = None,
    recompute: Recompute = "none",
    grad_norm: bool = False,
) -> TracedStep:
    """Trace one training step of ``model``: ``loss_fn(model, **inputs)`` returns the loss
    (a float scalar) or (loss, {metric: scalar}); the gradients of the loss with respect to
    every parameter come from the reverse pass, optionally clipped to global norm
    ``clip_norm``, and ``optimizer`` emits the update.

    ``pipeline`` (:class:`~dtm_mpi.frontend.stage_split.Pipeline`): the step runs as stages
    over a mesh axis, in microbatches and a schedule; its state and module are this step's
    (checkpoints move between pipelined and unpipelined runs).

    ``shard_params`` (a mesh axis, e.g. ``"dp"``; ZeRO-3, FSDP): every parameter not already
    split over that axis is stored split along its first dim too and gathered (an
    ``allgather``) where a layer uses it; its gradient arrives reduce-scattered to the stored
    layout, and the optimizer's state and update follow it: parameters, gradients and
    optimizer state are each 1/size of the axis per rank. The values are the unsharded step's
    (bit for bit in deterministic mode) and checkpoints move between the two.

    ``weights_from_store``: the parameters start from the latest checkpoint of the run's
    store (declared ``init store``; read by name, each rank its blocks, written on any mesh:
    e.g. a Hugging Face checkpoint brought in by ``dtm hf import``) instead of their inits;
    the optimizer's state starts as its init.

    ``accumulate`` (K): gradient accumulation without a pipeline: each step runs K
    microbatches (the fed inputs cut along their first dim, each ``B / K`` rows) through the
    forward and reverse passes one after another, holding one microbatch's activations, the
    gradients summed, then one optimizer update: the big batch's step (to float rounding; bit
    for bit in deterministic mode, where K is a power of two). It runs as a pipeline of one
    stage over a mesh axis ``accum`` of size 1 added to ``mesh`` (the same module and
    checkpoints as the step without it).

    ``precision`` (:class:`~dtm_mpi.frontend.precision.MixedPrecision`): master weights and
    optimizer state in its ``master`` dtype (the model's), each use of a parameter a copy in
    its ``compute`` dtype, the gradients reduced in ``master``, the loss in float32 (module
    doc of :mod:`dtm_mpi.frontend.precision`); the state is the step's without the policy,
    and checkpoints move between the two.

    ``recompute`` (``"none"``, ``"full"``, ``"selective"`` or ``keep(op_name) -> bool``):
    each block of the model (its longest list of layers) recomputes its activations in the
    reverse pass instead of holding them (:mod:`dtm_mpi.frontend.recompute`): the same bits,
    less memory, more compute; pipelined steps recompute inside each stage's reverse passes.

    ``grad_norm``: the step also reports the gradients' global 2-norm (before clipping) as
    the metric ``grad_norm`` (a pipelined or accumulating step: with ``clip_norm``, whose
    norm it is); the state is the step's without it."""
    check_recompute(recompute)
    if precision is not None:
        parse_precision(precision)
    retrace = functools.partial(
        train_step,
        model,
        loss_fn,
        mesh=mesh,
        inputs=inputs,
        optimizer=optimizer,
        clip_norm=clip_norm,
        seed=seed,
        name=name,
        pipeline=pipeline,
        shard_params=shard_params,
        weights_from_store=weights_from_store,
        accumulate=accumulate,
        precision=precision,
        recompute=recompute,
        grad_norm=grad_norm,
    )
    if accumulate is not None:
        mesh, pipeline = _accumulation(accumulate, mesh, inputs, pipeline, shard_params)
    if shard_params is not None:
        require_axis(f"shard_params={shard_params!r}", shard_params, mesh.axis_names)
    if pipeline is not None:
        from dtm_mpi.frontend.stage_split import check_pipeline

        check_pipeline(pipeline, mesh)
    tr, _, weights, out = trace_model(
        model,
        loss_fn,
        mesh,
        inputs,
        name,
        weights_as_state=True,
        seed=seed,
        shard_params=shard_params,
        from_store=weights_from_store,
        precision=precision,
    )
    named = split_outputs(out, "loss")
    scalars = []
    for key, t in named:
        if t.shape != () or not t.dtype.is_float:
            raise trace_error(f"{key} must be a float scalar; it is {t.type}")
        with tracing(tr):
            done = t.complete()
            if precision is not None and done.dtype in (DType.BF16, DType.F16):
                done = done.cast(DType.F32)  # the loss and metrics reported in float32
            scalars.append((key, done))
    if any(k == "lr" for k, _ in scalars) and isinstance(optimizer.lr, Schedule):
        raise UsageError(
            "the loss function returns a metric named 'lr', the name of the schedule's "
            "learning rate each step reports; rename it"
        )
    if grad_norm and any(k == "grad_norm" for k, _ in scalars):
        raise UsageError(
            "the loss function returns a metric named 'grad_norm', the name of the gradient "
            "norm grad_norm=True reports; rename it"
        )
    if grad_norm and pipeline is not None and clip_norm is None:
        raise UsageError(
            "grad_norm=True in a pipelined or accumulating step needs clip_norm: the norm it "
            "reports is the clip's, summed over the stages"
        )
    f16 = precision is not None and precision.compute_dtype is DType.F16
    if f16 and pipeline is not None:
        raise UsageError(
            "MixedPrecision compute='f16' (dynamic loss scaling) in a pipelined or accumulating "
            "step is not supported yet; use compute='bf16' there"
        )
    results, opt_params = train_results(
        tr, weights, scalars, optimizer, clip_norm, recompute, model, grad_norm, precision
    )
    module = _finish(tr, "train_step", mesh, results)
    policy = None
    if pipeline is not None:
        from dtm_mpi.frontend.stage_split import pipeline_policy

        if len(scalars) > 1:
            raise UsageError(
                f"a pipelined step reports its loss only; the loss function also returns {', '.join(k for k, _ in scalars[1:])}"
            )
        policy = pipeline_policy(
            pipeline,
            model,
            loss_fn,
            mesh=mesh,
            inputs=inputs,
            optimizer=optimizer,
            clip_norm=clip_norm,
            seed=seed,
            name=name,
            precision=precision,
            recompute=recompute,
            shard_params=shard_params,
        )
    identity = None
    if precision is not None or recompute != "none" or grad_norm:  # the state's: without
        identity = retrace(precision=None, recompute="none", grad_norm=False).module
    return TracedStep(
        module,
        tuple(inputs),
        tuple(p for p, _ in weights),
        tuple(p.name.lstrip("%") for p in opt_params),
        tuple(k for k, _ in scalars)
        + (("grad_norm",) if grad_norm else ())
        + (SCALER_METRICS if f16 else ()),
        mesh,
        policy,
        schedule=optimizer.lr if isinstance(optimizer.lr, Schedule) else None,
        fallbacks=_fallbacks(tr),
        identity=identity,
        precision=precision,
        recompute=recompute,
        retrace=retrace,
        fresh=SCALER_STATE if f16 else (),
    )


def _accumulation(
    k: int,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    pipeline: Pipeline | None,
    shard_params: str | None,
) -> tuple[Mesh, Pipeline | None]:
    """``train_step(accumulate=k)``'s mesh and pipeline (checked): K microbatches of a
    one-stage pipeline over the axis :data:`~dtm_mpi.runtime.policies.ACCUMULATE_AXIS`, of
    size 1, added to ``mesh``."""
    from dtm_mpi.frontend.stage_split import Pipeline as OneStage
    from dtm_mpi.runtime.policies import ACCUMULATE_AXIS

    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UsageError(f"accumulate must be a whole number >= 1; got {k!r}")
    if pipeline is not None:
        raise UsageError(
            "accumulate= is for a step without a pipeline; a pipelined step accumulates its "
            f"microbatches: Pipeline(microbatches={k * pipeline.microbatches}, ...)"
        )
    for key, spec in inputs.items():
        shape = tuple(spec.shape)
        rows = shape[0] if shape else None
        if rows is None or rows % k:
            raise UsageError(
                f"accumulate={k}: input {key!r} has {rows if rows is not None else 'no'} rows "
                f"(its first dim), which do not cut into {k} microbatches"
            )
    if k == 1:
        return mesh, None
    if ACCUMULATE_AXIS in mesh.axis_names:
        raise UsageError(
            f"accumulate: the mesh already has an axis {ACCUMULATE_AXIS!r}, the one "
            "accumulation adds; rename it"
        )
    wider = Mesh(mesh.name, **{ACCUMULATE_AXIS: 1}, **dict(mesh.axes))
    return wider, OneStage(microbatches=k, schedule="1f1b", axis=ACCUMULATE_AXIS)


def eval_step(
    model: Layer,
    metric_fn: Callable[..., Any],
    *,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    seed: int = 0,
    name: str = "eval",
    weights_from_store: bool = False,
) -> TracedStep:
    """Trace ``metric_fn(model, **inputs)`` (a scalar, (loss, {name: scalar}) or {name:
    scalar}) with the model's weights as plain parameters: given as values to :func:`fit`,
    or with ``weights_from_store`` declared ``init store`` (read by name from the latest
    checkpoint of the run's store, written on any mesh). What to run on held-out data."""
    tr, _, weights, out = trace_model(
        model,
        metric_fn,
        mesh,
        inputs,
        name,
        weights_as_state=False,
        seed=seed,
        from_store=weights_from_store,
    )
    named = split_outputs(out, "metric")
    results: list[Value | tuple[Value, str | None]] = []
    with tracing(tr):
        for key, t in named:
            if t.shape != ():
                raise trace_error(f"metric {key} must be a scalar; it is {t.type}")
            results.append(t.complete().value)
    module = _finish(tr, "eval_step", mesh, results)
    return TracedStep(
        module,
        tuple(inputs),
        tuple(p for p, _ in weights),
        (),
        tuple(k for k, _ in named),
        mesh,
        fallbacks=_fallbacks(tr),
    )


def forward_step(
    model: Layer,
    fn: Callable[..., Any],
    *,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    seed: int = 0,
    name: str = "forward",
    weights_from_store: bool = False,
) -> TracedStep:
    """Trace ``fn(model, **inputs)`` returning tensors -- a tensor (named ``output``), a
    tuple of them (``output0``, ...) or ``{name: tensor}`` -- with the model's weights as plain
    parameters (as :func:`eval_step`: given as ``values`` to :func:`~dtm_mpi.frontend.fit.fit`,
    or ``init store`` with ``weights_from_store``). Each result is gathered whole (a pending
    sum completed, every split dim gathered: the ``allgather`` is in the module), so every
    rank gets the global value of every result of every step (``FitResult.tensors``, or the
    ``on_tensors`` callback of ``fit``), on any mesh.

    The logits of a language model: ``forward_step(model, lambda m, ids: m(ids), ...)``."""
    tr, _, weights, out = trace_model(
        model,
        fn,
        mesh,
        inputs,
        name,
        weights_as_state=False,
        seed=seed,
        from_store=weights_from_store,
    )
    if isinstance(out, Tensor):
        named = [("output", out)]
    elif isinstance(out, tuple) and out and all(isinstance(t, Tensor) for t in out):
        named = [(f"output{i}", t) for i, t in enumerate(out)]
    elif isinstance(out, Mapping) and out and all(isinstance(t, Tensor) for t in out.values()):
        named = [(str(k), t) for k, t in out.items()]
    else:
        raise UsageError(
            f"the forward function must return a tensor, a tuple of tensors or {{name: tensor}}; got {type(out).__name__}"
        )
    with tracing(tr):
        results: list[Value | tuple[Value, str | None]] = [
            t.redistribute([None] * t.ndim).value for _, t in named
        ]
        for state_name, new in tr.updates:  # assign(): the state's value at the next step
            want = tr.b.types[state_name]
            moved = new if new.type == want else new.redistribute(want.layout)
            results.append((moved.value, state_name))
    missing = [p.name for p in tr.b.params if p.state and p.name not in dict(tr.updates)]
    if missing:
        raise UsageError(f"state {missing[0]} is never assigned (assign(state, new_value))")
    module = _finish(tr, "forward_step", mesh, results)
    names = tuple(k for k, _ in named)
    states = tuple(n.lstrip("%") for n, _ in tr.updates)
    return TracedStep(
        module,
        tuple(inputs),
        tuple(p for p, _ in weights),
        states,
        names,
        mesh,
        tensors=names,
        fallbacks=_fallbacks(tr),
    )
