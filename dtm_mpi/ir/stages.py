"""Pipeline stages of a forward pass: a function body cut into consecutive stages, and the
boundary routes between them (pure: IR in, a partition out).

A forward body (the ops of a model and its loss, before the reverse pass) is cut before given
op positions (:func:`partition_stages`); stage ``s`` runs the ops from its cut to the next.
Every value an op of one stage produces and an op of a later stage uses crosses on a
:class:`Route` from the producer's stage to each consumer's stage -- the next stage's input,
or a skip connection to a stage further on, planned alike. A parameter lives on the one stage
whose ops use it; the fed inputs go straight to every stage that uses them (each stage's
loader gives its blocks), so neither travels.

Refused with the user's line: a parameter used by two stages (tied weights across stages), a
stage without ops.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from dtm_mpi.errors import SourceSpan, UsageError, VerifyError
from dtm_mpi.ir.nodes import NO_SPAN, Function, MeshDecl, Module, Op, Param
from dtm_mpi.ir.types import ReduceOp, TensorType

__all__ = [
    "CLIP_TOTAL",
    "Route",
    "Stage",
    "StagePartition",
    "StagePass",
    "StagePasses",
    "StepStages",
    "partition_stages",
    "pass_module",
    "step_stages",
]


CLIP_TOTAL = "%clip.total"
"""The input of every stage's update pass when gradients are clipped by their global norm:
the square sum of every gradient of the step, each stage's added over the pipeline."""


@dataclass(frozen=True, slots=True)
class Route:
    """``value`` (of ``type``) made on stage ``src``, used on stages ``dst`` (each later)."""

    value: str
    type: TensorType
    src: int
    dst: tuple[int, ...]
    span: SourceSpan = NO_SPAN

    def __str__(self) -> str:
        to = ", ".join(map(str, self.dst))
        return f"{self.value}: {self.type} from stage {self.src} to stage {to}"


@dataclass(frozen=True, slots=True)
class Stage:
    """Stage ``index``: its ``ops`` (in order), the ``params`` and fed ``inputs`` they use,
    the routed values it ``receives`` and ``sends`` (names, in route order)."""

    index: int
    ops: tuple[Op, ...]
    params: tuple[str, ...]
    inputs: tuple[str, ...]
    receives: tuple[str, ...]
    sends: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StagePartition:
    stages: tuple[Stage, ...]
    routes: tuple[Route, ...]

    def stage_of(self, param: str) -> int:
        """The stage holding parameter ``param``."""
        for s in self.stages:
            if param in s.params:
                return s.index
        raise KeyError(param)

    def text(self) -> str:
        """One line per stage (its ops and parameters) and per route."""
        lines = []
        for s in self.stages:
            lines.append(
                f"stage {s.index}: {len(s.ops)} ops; parameters {', '.join(s.params) or 'none'}"
                + (f"; inputs {', '.join(s.inputs)}" if s.inputs else "")
            )
        lines += [f"route {r}" for r in self.routes]
        return "\n".join(lines) + "\n"


def partition_stages(
    params: Sequence[Param], body: Sequence[Op], cuts: Sequence[int], fed: Sequence[str] = ()
) -> StagePartition:
    """Cut ``body`` before the op positions ``cuts`` (increasing, inside the body): stage 0
    is ``body[:cuts[0]]``, the last ``body[cuts[-1]:]``. ``params``: the function's
    parameters; those named in ``fed`` (with or without ``%``) are the step's fed inputs."""
    bounds = [0, *cuts, len(body)]
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        if b <= a:
            raise UsageError(
                f"pipeline stage {s} has no ops (the cuts are at ops {list(cuts)} of {len(body)})"
            )
    fed_names = {"%" + n.lstrip("%") for n in fed}
    param_names = {p.name for p in params}
    made: set[str] = set()
    param_stage: dict[str, tuple[int, SourceSpan]] = {}
    stage_inputs: list[list[str]] = [[] for _ in range(len(bounds) - 1)]
    stage_params: list[list[str]] = [[] for _ in range(len(bounds) - 1)]
    for s in range(len(bounds) - 1):
        for op in body[bounds[s] : bounds[s + 1]]:
            for name in op.operands:
                if name in param_names:
                    _place_param(
                        name, s, op.span, fed_names, param_stage, stage_inputs, stage_params
                    )
                elif name not in made:
                    raise VerifyError(f"{name} is used before it is defined", op.span)
            made.update(op.results)
    routes = _crossings(
        [(s, op) for s in range(len(bounds) - 1) for op in body[bounds[s] : bounds[s + 1]]]
    )
    stages = tuple(
        Stage(
            s,
            tuple(body[bounds[s] : bounds[s + 1]]),
            tuple(stage_params[s]),
            tuple(stage_inputs[s]),
            tuple(r.value for r in routes if s in r.dst),
            tuple(r.value for r in routes if r.src == s),
        )
        for s in range(len(bounds) - 1)
    )
    return StagePartition(stages, routes)


def _place_param(
    name: str,
    stage: int,
    span: SourceSpan,
    fed: set[str],
    param_stage: dict[str, tuple[int, SourceSpan]],
    stage_inputs: list[list[str]],
    stage_params: list[list[str]],
) -> None:
    if name in fed:  # each stage's loader gives its blocks of a fed input
        if name not in stage_inputs[stage]:
            stage_inputs[stage].append(name)
        return
    first = param_stage.get(name)
    if first is None:
        param_stage[name] = (stage, span)
        stage_params[stage].append(name)
    elif first[0] != stage:
        raise VerifyError(
            f"parameter {name} is used on pipeline stage {first[0]} (line {first[1].line}) and on stage {stage} here: "
            "a parameter lives on one stage (weights tied across stages are not supported)",
            span,
        )


# --- the passes of a training step's stages ---------------------------------------------


@dataclass(frozen=True, slots=True)
class StagePass:
    """One pass of a stage: its ``function`` (a parameter named as the value it carries,
    complete: a pending sum travels finished and is made pending again inside), and the
    values its results carry (``carries``, in result order)."""

    function: Function
    carries: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StagePasses:
    """Stage ``index``'s passes for one microbatch: ``forward`` (its parameters, fed inputs
    and received activations in; the activations it sends, the loss on the last stage, then
    the values its backward passes use out), ``input_grad`` (what the previous stages wait
    for: the gradients it sends, then values its weight pass uses) and ``weight_grad`` (the
    gradients of its parameters, in ``params`` order); ``update``, once per step, the
    optimizer's: the parameters, their gradients (named ``<parameter>.grad``) and the
    optimizer's state in, the new values of the parameters and the state out (None: the
    step only computes gradients)."""

    index: int
    params: tuple[str, ...]
    forward: StagePass
    input_grad: StagePass
    weight_grad: StagePass
    update: StagePass | None = None
    square_sum: StagePass | None = None
    """With clipping by the global norm: the sum of the squares of the stage's gradients
    (named ``<parameter>.grad``), added over the pipeline into the ``%clip.total`` the update
    pass takes."""
    reduce_grads: StagePass | None = None
    """Where the weight pass returns gradients still pending (their sums over the data-
    parallel ranks deferred: each microbatch's local sums are added, and reduced once per
    step): the reductions, once per step after the schedule. Its parameters are the pending
    values (named as in the weight pass) and its ``carries`` the parameters whose gradients
    its results are. Its parameters are pending, which IR parameters never are: it is
    compiled unverified (:func:`reduce_module`), from ops the verified step made."""

    def all(self) -> tuple[StagePass, ...]:
        """Every pass of the stage (those it has)."""
        passes = (
            self.forward,
            self.input_grad,
            self.weight_grad,
            self.update,
            self.square_sum,
            self.reduce_grads,
        )
        return tuple(p for p in passes if p is not None)


@dataclass(frozen=True, slots=True)
class StepStages:
    """A training step's forward cut into stages (``partition``, the activation routes),
    the gradient routes (``grad_routes``: a cotangent from a later stage to an earlier one)
    and each stage's passes; ``loss``: the (scaled) loss value, returned by the last stage's
    forward."""

    partition: StagePartition
    params: tuple[Param, ...]
    grad_routes: tuple[Route, ...]
    passes: tuple[StagePasses, ...]
    loss: str
    microbatch: str | None = None
    """The fed input that stands for ``microbatch_index`` in the passes (the runtime gives
    each microbatch its number, ``step x microbatches + k``); None: the step has none."""


def step_stages(
    params: Sequence[Param],
    body: Sequence[Op],
    n_forward: int,
    origins: Sequence[int],
    partition: StagePartition,
    loss: str,
    grads: Sequence[tuple[str, str]],
    mesh: MeshDecl,
    *,
    defer_reductions: bool = False,
) -> StepStages:
    """The passes of each stage of a step whose ``body`` is a forward pass (its first
    ``n_forward`` ops, cut as ``partition``) followed by its reverse pass, each reverse op's
    origin given (:func:`~dtm_mpi.ir.autodiff.backward`'s ``origins``); ``grads``: (parameter,
    its gradient value) in the order the reverse pass took them to their layouts.
    ``defer_reductions``: a gradient the reverse pass completes from a pending sum by an
    ``allreduce`` (then layout changes) leaves the weight pass pending, and the stage's
    ``reduce_grads`` pass completes it once per step (a ``reduce_scatter``'s, a gradient
    stored split, stays in the weight pass: its sums held stay 1/size of the axis)."""
    bounds = _op_stages(partition, n_forward)
    stage_of_op = bounds + [
        bounds[o] if o >= 0 else partition.stage_of(grads[-1 - o][0]) for o in origins
    ]
    if len(stage_of_op) != len(body):
        raise ValueError(f"{len(origins)} origins for {len(body) - n_forward} reverse ops")
    by_name = {p.name: p for p in params}
    types = {n: t for op in body for n, t in zip(op.results, op.result_types, strict=True)}
    types.update({p.name: p.type for p in params})
    # (a reverse op reads forward values only of its own stage: those were received there)
    grad_routes = _crossings(list(zip(stage_of_op[n_forward:], body[n_forward:], strict=True)))
    passes = tuple(
        _passes(
            s,
            partition,
            body,
            n_forward,
            stage_of_op,
            grad_routes,
            loss,
            grads,
            by_name,
            types,
            mesh,
            defer_reductions,
        )
        for s in range(len(partition.stages))
    )
    return StepStages(partition, tuple(params), grad_routes, passes, loss)


def _crossings(ops: Sequence[tuple[int, Op]]) -> tuple[Route, ...]:
    """The routes of ``ops`` (each with its stage, in order): every value one of them makes
    that an op of another stage uses, in the order of first such use."""
    made: dict[str, tuple[int, TensorType, SourceSpan]] = {}  # value -> (stage, type, span)
    used_by: dict[str, set[int]] = {}
    for s, op in ops:
        for name in op.operands:
            if name in made and made[name][0] != s:
                used_by.setdefault(name, set()).add(s)
        for name, t in zip(op.results, op.result_types, strict=True):
            made[name] = (s, t, op.span)
    return tuple(
        Route(name, made[name][1], made[name][0], tuple(sorted(dst)), made[name][2])
        for name, dst in used_by.items()
    )


def _op_stages(partition: StagePartition, n_forward: int) -> list[int]:
    out = [s.index for s in partition.stages for _ in s.ops]
    if len(out) != n_forward:
        raise ValueError(f"the partition has {len(out)} ops; the forward pass {n_forward}")
    return out


def _passes(
    s: int,
    partition: StagePartition,
    body: Sequence[Op],
    n_forward: int,
    stage_of_op: Sequence[int],
    grad_routes: tuple[Route, ...],
    loss: str,
    grads: Sequence[tuple[str, str]],
    params: dict[str, Param],
    types: dict[str, TensorType],
    mesh: MeshDecl,
    defer: bool = False,
) -> StagePasses:
    stage = partition.stages[s]
    fwd = list(stage.ops)
    back = [body[i] for i in range(n_forward, len(body)) if stage_of_op[i] == s]
    sends = [r.value for r in grad_routes if r.src == s]
    # the input-gradient pass: the reverse ops the sent gradients depend on
    need, inputs_ops = set(sends), []
    for op in reversed(back):
        if need.intersection(op.results):
            inputs_ops.append(op)
            need.update(op.operands)
    in_pass = set(map(id, inputs_ops))
    inputs_ops.reverse()
    weight_ops = [op for op in back if id(op) not in in_pass]
    # values made from constants alone (a causal mask, a fill, a zero) are made again where
    # a reverse pass uses them instead of being held from an earlier pass per microbatch
    free = _free_ops([*fwd, *inputs_ops])  # (the input-gradient pass makes its own)
    weight_ops = _remade(weight_ops, free)
    inputs_ops = _remade(inputs_ops, free)
    own = [p for p in stage.params]
    grad_of = dict(grads)
    mine = [grad_of[p] for p in own if p in grad_of]  # in the stage's parameter order
    made_f = {n for op in fwd for n in op.results}
    made_i = {n for op in inputs_ops for n in op.results}
    given = [*own, *stage.inputs, *stage.receives]  # what the forward pass starts from
    recv_grads = [r.value for r in grad_routes if s in r.dst]
    held = _used_from(inputs_ops + weight_ops, made_f)  # forward values the reverse ops use
    made_w = {n for op in weight_ops for n in op.results}
    to_w = _used_from(weight_ops, made_i)
    to_w += [g for g in mine if g in made_i and g not in to_w]  # (a gradient made by I)
    f_out = [*stage.sends, *([loss] if loss in made_f else []), *held]
    forward = _function(f"stage{s}_forward", given, fwd, f_out, params, types, mesh)
    i_in = _used_from(inputs_ops, set(given) | made_f | set(recv_grads))
    input_grad = _function(
        f"stage{s}_input_grad", i_in, inputs_ops, [*sends, *to_w], params, types, mesh
    )
    w_pool = set(given) | made_f | made_i | set(recv_grads)
    w_in = _used_from(weight_ops, w_pool)
    w_in += [g for g in mine if g not in made_w and g not in w_in]  # passed through
    chains = _pending_chains(weight_ops, mine, types) if defer else {}
    in_chain = {id(op) for _, ops in chains.values() for op in ops}
    weight_grad = _function(
        f"stage{s}_weight_grad",
        w_in,
        [op for op in weight_ops if id(op) not in in_chain],
        [chains[g][0] if g in chains else g for g in mine],
        params,
        types,
        mesh,
        pending={chains[g][0] for g in chains},
    )
    reduce_grads = None
    if chains:
        grad_param = {g: p for p, g in grads}
        reduce_grads = _reduce_pass(f"stage{s}_reduce_grads", chains, grad_param, types, mesh)
        weight_grad = replace(weight_grad, carries=tuple(mine))
    return StagePasses(s, tuple(own), forward, input_grad, weight_grad, reduce_grads=reduce_grads)


_LAYOUT_CHANGES = frozenset({"allreduce", "reduce_scatter", "redistribute", "allgather"})
"""The ops a reverse pass takes a gradient to its parameter's layout with."""


def _pending_chains(
    ops: Sequence[Op], grads: Sequence[str], types: Mapping[str, TensorType]
) -> dict[str, tuple[str, list[Op]]]:
    """For each gradient of ``grads`` that ``ops`` make from a pending sum by layout changes
    alone (used by nothing else): the pending value and those ops, in order."""
    made = {n: op for op in ops for n in op.results}
    uses: dict[str, int] = {}
    for user in ops:
        for n in user.operands:
            uses[n] = uses.get(n, 0) + 1
    out: dict[str, tuple[str, list[Op]]] = {}
    for g in grads:
        if uses.get(g, 0) or grads.count(g) > 1:
            continue
        chain: list[Op] = []
        v = g
        while (op := made.get(v)) is not None and op.name in _LAYOUT_CHANGES:
            if len(op.operands) != 1 or len(op.results) != 1:
                break
            chain.insert(0, op)
            src = op.operands[0]
            partial = types[src].layout.partial
            if partial is not None:
                # a sum completed by an allreduce; a reduce_scatter (a gradient stored split:
                # ZeRO) runs per microbatch, so that the sums held stay 1/size of the axis
                if partial.op is ReduceOp.SUM and op.name == "allreduce":
                    out[g] = (src, chain)
                break
            if uses.get(src, 0) != 1:
                break
            v = src
    return out


def _reduce_pass(
    name: str,
    chains: Mapping[str, tuple[str, list[Op]]],
    grad_param: Mapping[str, str],
    types: Mapping[str, TensorType],
    mesh: MeshDecl,
) -> StagePass:
    """The once-per-step pass completing the deferred gradients: each pending value in
    (a parameter of its pending type), its layout changes, the gradient out."""
    from dtm_mpi.ir.build import FunctionBuilder

    b = FunctionBuilder(
        mesh, names=[n for _, ops in chains.values() for op in ops for n in op.results]
    )
    outs = []
    for g, (pending, ops) in chains.items():
        b.add_param(pending, types[pending])
        for op in ops:
            b.append(op)
        outs.append(b.value(g))
    f = b.function(name, outs)
    return StagePass(f, tuple(grad_param[g] for g in chains))


def _free_ops(ops: Sequence[Op]) -> list[Op]:
    """The ops of ``ops`` whose values depend on no input of the pass (constants, ``iota``
    and what local ops and layout changes make of them alone): cheap to make again."""
    from dtm_mpi.ir.registry import OpKind, lookup_op

    free: list[Op] = []
    made: set[str] = set()
    for op in ops:
        d = lookup_op(op.name)
        if d is None or d.kind not in (OpKind.LOCAL, OpKind.REDIST):
            continue
        if all(n in made for n in op.operands):
            free.append(op)
            made.update(op.results)
    return free


def _remade(ops: list[Op], free: Sequence[Op]) -> list[Op]:
    """``ops`` after the ``free`` ops that make the free values they use (in order)."""
    made = {n for op in ops for n in op.results}
    need = {n for op in ops for n in op.operands if n not in made}
    chain: list[Op] = []
    for op in reversed(free):
        if need.intersection(op.results):
            chain.append(op)
            need.update(op.operands)
    return [*reversed(chain), *ops]


def _used_from(ops: Sequence[Op], pool: set[str]) -> list[str]:
    """The values of ``pool`` that ``ops`` use and do not make, in first-use order."""
    made: set[str] = set()
    out: list[str] = []
    for op in ops:
        for n in op.operands:
            if n in pool and n not in made and n not in out:
                out.append(n)
        made.update(op.results)
    return out


def _function(
    name: str,
    inputs: Sequence[str],
    ops: Sequence[Op],
    returns: Sequence[str],
    params: dict[str, Param],
    types: dict[str, TensorType],
    mesh: MeshDecl,
    *,
    pending: Collection[str] = (),
) -> StagePass:
    """The pass ``name``: ``ops`` as a function of the values ``inputs``, returning the
    values ``returns``; a pending value is passed in and out complete (except the returns
    named in ``pending``: the local sums a deferred reduction adds)."""
    from dtm_mpi.ir.build import FunctionBuilder, Value

    b = FunctionBuilder(mesh, names=[n for op in ops for n in op.results])
    env: dict[str, Value] = {}
    for n in inputs:
        t = types[n]
        span = params[n].span if n in params else NO_SPAN
        v = b.add_param(n, t.with_layout(t.layout.with_partial(None)), span=span)
        env[n] = b.to_layout(v, t.layout, span=span) if t.layout.partial is not None else v
    for op in ops:
        names = tuple(n if n not in b.types else b.fresh(n) for n in op.results)
        copied = replace(op, results=names, operands=tuple(env[x].name for x in op.operands))
        env.update(zip(op.results, b.append(copied), strict=True))
    outs = [env[n] if n in pending else b.complete(env[n]) for n in returns]
    return StagePass(b.function(name, outs), tuple(returns))


def reduce_module(f: Function, mesh: MeshDecl, name: str) -> Module:
    """The module of a ``reduce_grads`` pass (:class:`StagePasses`): its parameters are
    pending, which the verifier refuses of every IR parameter, so it is not verified; its
    ops are the verified step's own (the layout changes that completed those gradients)."""
    from dtm_mpi.ir.registry import required_version

    return Module(required_version(f.body), name, (mesh,), (replace(f, entry=True),))


def pass_module(f: Function, mesh: MeshDecl, name: str) -> Module:
    """A verified module whose entry function is the pass ``f`` (what a rank compiles and
    runs for that pass; a pass that does not verify is a bug of the cut, raised here)."""
    from dtm_mpi.ir.registry import required_version
    from dtm_mpi.ir.verify import verify_module

    module = Module(required_version(f.body), name, (mesh,), (replace(f, entry=True),))
    verify_module(module)
    return module
