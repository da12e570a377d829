"""Training an IR forward function (``dtm run FILE.dtm --train OPT``), pipelined over a
``pp`` axis when its mesh has one.

FILE's entry function is the forward of **one microbatch**: its parameters are the weights
(``state``, floating, each with an ``init``, ``init store`` or a ``-i`` value: every one is
trained), its first result is the loss (a float scalar), any further results are metrics
(float scalars; a pipelined step reports its loss only), and it updates nothing itself. The
data is drawn in the program: ``%mb = microbatch_index`` (IR 1.2) numbers the microbatches
over the run (``step x M + k``), so ``random ... offset %mb`` gives every microbatch its own.

:func:`ir_train_step` makes the training step: the forward, its reverse pass
(:func:`~dtm_mpi.ir.autodiff.backward`), clipping and the optimizer, as
:func:`~dtm_mpi.frontend.trace.train_step` makes a Python model's (the same state names, so
checkpoints move between the two). With a ``pp`` axis in the mesh the step runs as pipeline
stages: the forward cut before the ops that make the values ``splits`` names (``--split
%h2``: stage 2 starts at the op defining ``%h2``), or, by default, before the first use of
the parameters that divide the parameter elements evenly; the stages, their reverse passes,
routes and schedule are the frontend's (:mod:`dtm_mpi.ir.stages`,
:mod:`dtm_mpi.runtime.pipeline_step`). ``pp=1`` with ``--microbatches M`` is gradient
accumulation over M microbatches.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dtm_mpi.config import get_config
from dtm_mpi.errors import UsageError, VerifyError
from dtm_mpi.frontend.mesh import Mesh
from dtm_mpi.frontend.optim import SGD, Adam, AdamW, Optimizer
from dtm_mpi.frontend.stage_split import with_updates
from dtm_mpi.frontend.tensor import Tensor, Tracer, tracing
from dtm_mpi.frontend.trace import TracedStep, train_results
from dtm_mpi.ir.autodiff import backward, copy_body
from dtm_mpi.ir.build import FunctionBuilder, Value
from dtm_mpi.ir.nodes import Function, MeshDecl, Module, Op
from dtm_mpi.ir.registry import required_version
from dtm_mpi.ir.stages import StepStages, partition_stages, step_stages
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.ir.verify import function_mesh, verify_module

if TYPE_CHECKING:
    from dtm_mpi.runtime.policies import PipelinePolicy

__all__ = ["IrTraining", "ir_step_stages", "ir_train_step", "parse_optimizer"]

OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


@dataclass(frozen=True, slots=True)
class IrTraining:
    """How ``dtm run --train`` trains an IR forward: ``optimizer``, gradients clipped to
    global norm ``clip_norm``; over the mesh axis ``axis`` (when the mesh has it) as pipeline
    stages: ``microbatches`` per step, schedule ``schedule``, ``chunks`` stages per rank,
    cut before the ops making ``splits`` (None: evenly by parameter elements)."""

    optimizer: Optimizer
    clip_norm: float | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    splits: tuple[str, ...] | None = None
    axis: str = "pp"


def parse_optimizer(text: str) -> Optimizer:
    """``NAME:key=value,...`` (``--train``): ``sgd:lr=0.05,momentum=0.9``,
    ``adam:lr=1e-3``, ``adamw:lr=1e-3,weight_decay=0.01,betas=0.9/0.999``."""
    name, _, args = text.partition(":")
    cls = OPTIMIZERS.get(name.strip().lower())
    if cls is None:
        raise UsageError(
            f"--train {text!r}: the optimizer is one of {', '.join(OPTIMIZERS)} (e.g. sgd:lr=0.05,momentum=0.9)"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kw: dict[str, object] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, val = (s.strip() for s in item.partition("="))
        if not eq or key not in fields:
            raise UsageError(
                f"--train {text!r}: {name} takes {', '.join(fields)} as key=value, comma-separated; got {item!r}"
            )
        try:
            kw[key] = tuple(float(v) for v in val.split("/")) if key == "betas" else float(val)
        except ValueError:
            raise UsageError(f"--train {text!r}: {key}={val!r} is not a number") from None
        if key == "betas" and len(kw[key]) != 2:  # type: ignore[arg-type]
            raise UsageError(f"--train {text!r}: betas are two numbers, e.g. betas=0.9/0.999")
    missing = [
        n
        for n, f in fields.items()
        if n not in kw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UsageError(f"--train {text!r}: {name} needs {', '.join(f'{n}=...' for n in missing)}")
    return cls(**kw)


def _forward(module: Module) -> tuple[Function, MeshDecl]:
    """The entry function of ``module`` as a forward to train, and its mesh (errors located
    in the file)."""
    f = module.entry
    if f is None:
        raise UsageError(f"module {module.name} has no entry function")
    mesh = function_mesh(module, f)
    if mesh is None:
        raise VerifyError(f"@{f.name} runs on no mesh: a trained function needs one", f.span)
    for r in f.results:
        if r.updates is not None:
            raise VerifyError(
                f"@{f.name} updates {r.updates} itself: --train makes the update (the entry function is the forward, its first result the loss)",
                r.span,
            )
    if not f.results:
        raise VerifyError(
            f"@{f.name} returns nothing: --train needs the loss as its first result", f.span
        )
    for i, r in enumerate(f.results):
        what = "the loss (result 0)" if i == 0 else f"result {i} (a metric)"
        if r.type.shape != () or not r.type.dtype.is_float:
            raise VerifyError(f"{what} of @{f.name} must be a float scalar; it is {r.type}", r.span)
    for p in f.params:
        if not p.state or not p.type.dtype.is_float:
            raise VerifyError(
                f"parameter {p.name} of @{f.name}: every parameter of a trained forward is a floating state parameter (a weight); "
                "draw the data in the program (random ... offset from microbatch_index)",
                p.span,
            )
    return f, mesh


def _copied(
    module: Module, f: Function, mesh: MeshDecl
) -> tuple[Tracer, list[tuple[str, Value]], dict[str, Value]]:
    """``f``'s parameters and body in a new builder (calls inlined): the tracer, the weights
    by name, and every value of ``f`` by its name there."""
    b = FunctionBuilder(mesh, module_name=module.name)
    b.module = module
    args = {
        p.name: b.add_param(p.name, p.type, state=True, init=p.init, span=p.span) for p in f.params
    }
    env = copy_body(b, module, f, args)
    return Tracer(b), [(n.lstrip("%"), v) for n, v in args.items()], env


def ir_train_step(module: Module, training: IrTraining) -> TracedStep:
    """The training step of ``module``'s entry function (a forward, see the module's doc):
    a verified module whose entry returns the loss, the metrics, then the new weights and
    optimizer state; with a ``training.axis`` axis in its mesh, the pipeline policy that runs
    it as stages."""
    f, mesh = _forward(module)
    tr, weights, env = _copied(module, f, mesh)
    with tracing(tr):
        scalars = [
            ("loss" if i == 0 else f"result{i}", Tensor(env[name], tr).complete())
            for i, name in enumerate(f.returns)
        ]
    results, opt = train_results(tr, weights, scalars, training.optimizer, training.clip_norm)
    g = tr.b.function(f"{f.name}_train", results, entry=True, requires=f.requires)
    step_module = Module(required_version(g.body, module.version), module.name, (mesh,), (g,))
    verify_module(step_module)
    policy = None
    if training.axis in dict(mesh.axes):
        if len(scalars) > 1:
            raise VerifyError(
                f"a pipelined step reports its loss only; @{f.name} also returns {len(scalars) - 1} metric(s)",
                f.results[1].span,
            )
        policy = _policy(module, training)
    elif training.microbatches > 1 or training.splits:
        raise UsageError(
            f"--microbatches and --split run the step as pipeline stages over a {training.axis!r} axis; the mesh @{mesh.name} has none (declare {training.axis}=1 for gradient accumulation)"
        )
    return TracedStep(
        step_module,
        (),
        tuple(n for n, _ in weights),
        tuple(p.name.lstrip("%") for p in opt),
        tuple(k for k, _ in scalars),
        Mesh(mesh.name, **dict(mesh.axes)),
        policy,
    )


def _policy(module: Module, training: IrTraining) -> PipelinePolicy:
    from dtm_mpi.plan.schedule import parse_schedule
    from dtm_mpi.runtime.policies import PipelinePolicy

    kind = parse_schedule(training.schedule)
    made: dict[int, StepStages] = {}

    def stages(n: int, whole_batch: bool = False) -> StepStages:
        if n not in made:  # (never asked for the whole batch: whole_batch=False below)
            made[n] = ir_step_stages(module, training, n)
        return made[n]

    return PipelinePolicy(
        stages,
        kind,
        training.microbatches,
        training.chunks,
        training.axis,
        whole_batch=False,  # written per microbatch: no whole-batch passes
    )


def ir_step_stages(module: Module, training: IrTraining, n: int) -> StepStages:
    """The passes of ``module``'s training step cut into ``n`` pipeline stages, for one of
    ``training.microbatches`` microbatches (the loss scaled by ``1 / microbatches``, so that
    the step's loss and gradients are sums over its microbatches), each stage with its
    optimizer pass; ``microbatch_index`` is a fed input the runtime numbers."""
    f, mesh = _forward(module)
    tr, weights, env = _copied(module, f, mesh)
    b = tr.b
    starts = _statement_starts(module, f)  # (positions before microbatch_index ops go)
    counter, gone = _microbatch_input(b)
    m = training.microbatches
    with tracing(tr):
        loss = Tensor(env[f.returns[0]], tr).complete()
        if m > 1:
            loss = loss * (1.0 / m)
    n_forward = len(b.ops)
    if training.splits is None:
        cuts = _even_cuts(b.ops, weights, n, f)
    else:
        if len(training.splits) + 1 != n:
            raise UsageError(
                f"--split cuts @{f.name} into {len(training.splits) + 1} stages; the run has {n} ({training.axis} x {training.chunks} chunk(s) per rank)"
            )
        cuts = _split_cuts(starts, gone, training.splits, f)
    partition = partition_stages(b.params, b.ops, cuts, fed=(counter,) if counter else ())
    origins: list[int] = []
    with tracing(tr):
        grads = backward(b, list(b.ops), loss.value, [v for _, v in weights], origins=origins)
    stages = step_stages(
        b.params,
        b.ops,
        n_forward,
        origins,
        partition,
        loss.value.name,
        [(v.name, g.name) for (_, v), g in zip(weights, grads, strict=True)],
        mesh,
        defer_reductions=not get_config().deterministic,
    )
    stages = replace(stages, microbatch=counter)
    return with_updates(stages, mesh, training.optimizer, training.clip_norm)


def _microbatch_input(b: FunctionBuilder) -> tuple[str | None, list[int]]:
    """Every ``microbatch_index`` op of ``b`` replaced by one fed input (its name; None when
    there is none): a pipeline's runtime gives each microbatch its number. Also the
    positions the removed ops had."""
    gone = [i for i, op in enumerate(b.ops) if op.name == "microbatch_index"]
    if not gone:
        return None, []
    made = {b.ops[i].results[0] for i in gone}
    name = b.fresh("microbatch_index")
    b.add_param(name, TensorType(DType.I64, (), Layout(())))
    b.ops = [
        replace(op, operands=tuple(name if o in made else o for o in op.operands))
        for op in b.ops
        if op.name != "microbatch_index"
    ]
    return name, gone


def _inlined(module: Module, f: Function) -> int:
    """How many ops ``f``'s body is once its calls are inlined (as ``copy_body`` does)."""
    total = 0
    for op in f.body:
        callee = module.function(str(op.attr("callee"))) if op.name == "call" else None
        total += _inlined(module, callee) if callee is not None else 1
    return total


def _statement_starts(module: Module, f: Function) -> dict[str, int]:
    """Where each statement of ``f`` starts among the inlined ops, by the values it makes (a
    call's results: its first inlined op)."""
    starts: dict[str, int] = {}
    at = 0
    for op in f.body:
        for r in op.results:
            starts[r] = at
        callee = module.function(str(op.attr("callee"))) if op.name == "call" else None
        at += _inlined(module, callee) if callee is not None else 1
    return starts


def _split_cuts(
    starts: dict[str, int], gone: Sequence[int], splits: Sequence[str], f: Function
) -> list[int]:
    """The op positions where the statements making the values ``splits`` names (in ``f``)
    start, in increasing order (``gone``: positions of ops removed since, before which the
    cuts move down)."""
    params = {p.name for p in f.params}
    cuts: list[int] = []
    for k, text in enumerate(splits):
        name = "%" + text.strip().lstrip("%")
        if name in params:
            raise UsageError(
                f"--split {text}: {name} is a parameter of @{f.name}; name a value an op makes"
            )
        if name not in starts:
            raise UsageError(f"--split {text}: @{f.name} makes no value {name}")
        at = starts[name] - bisect.bisect_left(gone, starts[name])
        if cuts and at <= cuts[-1]:
            raise UsageError(
                f"--split values follow the forward order: {name} is made before {splits[k - 1]}"
            )
        if at == 0:
            raise UsageError(
                f"--split {text}: {name} is made by the first op; stage 0 would have none"
            )
        cuts.append(at)
    return cuts


def _even_cuts(
    ops: Sequence[Op], weights: Sequence[tuple[str, Value]], n: int, f: Function
) -> list[int]:
    """``n - 1`` cuts, each before the first use of a parameter, that make the largest
    stage's parameter elements as small as can be (the parameters first used by one op
    stay together)."""
    sizes = {v.name: math.prod(v.type.shape) for _, v in weights}
    units: dict[int, int] = {}  # op position -> elements of the parameters it uses first
    seen: set[str] = set()
    for i, op in enumerate(ops):
        for o in op.operands:
            if o in sizes and o not in seen:
                seen.add(o)
                units[i] = units.get(i, 0) + max(sizes[o], 1)
    at, elems = list(units), list(units.values())
    if len(at) < n:
        raise UsageError(
            f"@{f.name} cannot be cut into {n} stages by its parameters (they are first used at {len(at)} op(s)); give the cuts with --split VALUE"
        )

    def pieces(cap: int) -> list[int]:  # greedy: the unit indices that start a new stage
        starts, total = [], 0
        for k, e in enumerate(elems):
            if total + e > cap and total > 0:
                starts.append(k)
                total = 0
            total += e
        return starts

    lo, hi = max(elems), sum(elems)
    while lo < hi:  # the least capacity that needs at most n stages
        mid = (lo + hi) // 2
        if len(pieces(mid)) + 1 <= n:
            hi = mid
        else:
            lo = mid + 1
    starts = pieces(lo)
    while len(starts) + 1 < n:  # fewer stages than asked: split the largest that can split
        bounds = [0, *starts, len(elems)]
        spans = [(sum(elems[a:b]), a, b) for a, b in itertools.pairwise(bounds) if b - a > 1]
        _, a, b = max(spans)
        half, acc, cut = sum(elems[a:b]) / 2, 0, a + 1
        for k in range(a, b - 1):
            acc += elems[k]
            cut = k + 1
            if acc >= half:
                break
        starts = sorted([*starts, cut])
    return [at[k] for k in starts]
