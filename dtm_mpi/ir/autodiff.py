"""Reverse-mode automatic differentiation of IR functions (pure: IR in, IR out).

:func:`backward` walks a function body from its last op to its first and applies each op's
gradient rule from the registry (``OpDef.grad``; :mod:`dtm_mpi.ir.grad_context`), emitting
the backward pass into the same :class:`~dtm_mpi.ir.build.FunctionBuilder`. Collectives are
differentiated like any other op (the adjoint of a layout change is the inverse layout
change), cotangents reaching a value twice are added, and each gradient is finally taken to
its parameter's layout (pending sums completed: the data-parallel allreduce appears here).
``call`` ops are inlined first. A gradient that would have to flow through an op without a
rule (``quantize``, ``send``, ...) is a :class:`~dtm_mpi.errors.GradientError` at that op.

:func:`grad_module` is what ``dtm grad FILE --wrt ...`` prints: the module with one more
function, ``@NAME_grad``, returning the function's results and then the gradients.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from dtm_mpi.errors import GradientError, SourceSpan, UsageError
from dtm_mpi.ir.build import FunctionBuilder, Value, complete_layout
from dtm_mpi.ir.grad_context import GradContext
from dtm_mpi.ir.nodes import NO_SPAN, Function, Module, Op
from dtm_mpi.ir.registry import OpKind, lookup_op, required_version
from dtm_mpi.ir.types import Layout
from dtm_mpi.ir.verify import function_mesh, verify_module

__all__ = ["backward", "copy_body", "grad_function", "grad_module"]


def copy_body(
    b: FunctionBuilder, module: Module, f: Function, args: Mapping[str, Value]
) -> dict[str, Value]:
    """Append ``f``'s body to ``b`` with its parameters bound to ``args`` (by name), calls
    inlined and values renamed where a name is taken; returns every value of ``f`` by its
    name in ``f``."""
    env: dict[str, Value] = dict(args)
    for op in f.body:
        operands = [env[n] for n in op.operands]
        if op.name == "call":
            callee = module.function(str(op.attr("callee")))
            assert callee is not None
            inner = copy_body(
                b, module, callee, {p.name: v for p, v in zip(callee.params, operands, strict=True)}
            )
            for name, ret in zip(op.results, callee.returns, strict=True):
                env[name] = inner[ret]
            continue
        names = tuple(b.fresh(n) for n in op.results)
        copied = replace(op, results=names, operands=tuple(v.name for v in operands))
        for name, v in zip(op.results, b.append(copied), strict=True):
            env[name] = v
    return env


def backward(
    b: FunctionBuilder,
    body: Sequence[Op],
    loss: Value,
    wrt: Sequence[Value],
    *,
    stop: Collection[str] = (),
    origins: list[int] | None = None,
    layouts: Sequence[Layout | None] | None = None,
) -> list[Value]:
    """Emit into ``b`` the gradients of ``loss`` (a float scalar computed by ``body``, ops
    already in ``b``) with respect to ``wrt``, each in its value's type (a zero constant
    where the loss does not depend on it). No gradient flows into the values named in
    ``stop`` (treated as constants: the frontend's ``detach``). ``origins``, when given,
    receives one entry per emitted op: the position in ``body`` of the op whose gradient rule
    emitted it (the seed: the op computing ``loss``), or ``-1 - k`` for the ops taking the
    gradient of ``wrt[k]`` to its value's layout (what pipeline stages are cut by).
    ``layouts[k]``, when given and not None, is the layout the gradient of ``wrt[k]`` is
    emitted in instead (a sharded optimizer's: a pending sum lands there by
    ``reduce_scatter``)."""

    def emitted(before: int, origin: int) -> None:
        if origins is not None:
            origins.extend([origin] * (len(b.ops) - before))

    if loss.type.shape != () or not loss.type.dtype.is_float:
        raise GradientError(
            f"the differentiated value {loss.name} must be a float scalar; it is {loss.type}",
            _span_of(body, loss.name),
        )
    reached = {w.name for w in wrt}  # float values that depend on a differentiated input
    sends: set[tuple[object, ...]] = set()  # transfers whose sent value depends on one
    for op in body:
        key = (op.attr("axis"), op.attr("src"), op.attr("dst"), op.attr("tag"))
        if op.name == "send" and op.operands[0] in reached:
            sends.add(key)
        from_send = op.name == "recv" and key in sends
        if (from_send or any(n in reached for n in op.operands)) and not any(
            n in stop for n in op.results
        ):
            reached.update(
                n for n, t in zip(op.results, op.result_types, strict=True) if t.dtype.is_float
            )
    cts: dict[str, Value] = {}
    if loss.name in reached:
        before = len(b.ops)
        cts[loss.name] = b.constant(1.0, loss.type)
        emitted(before, next(i for i, op in enumerate(body) if loss.name in op.results))
    base = max((int(t) for op in body if isinstance(t := op.attr("tag"), int)), default=-1) + 1
    returned: set[tuple[object, ...]] = set()  # forward transfers whose cotangent was sent back
    for at in reversed(range(len(body))):
        op = body[at]
        out = tuple(cts.get(n) for n in op.results)
        opdef = lookup_op(op.name)
        assert opdef is not None
        key = (op.attr("axis"), op.attr("src"), op.attr("dst"), op.attr("tag"))
        if opdef.kind is OpKind.SEND:
            if key not in returned:
                continue  # nothing reached the paired recv
        elif all(ct is None for ct in out):
            continue
        elif opdef.kind is OpKind.RECV:
            if key not in sends:
                continue  # the sent value needs no gradient
            returned.add(key)
        wants = tuple(n in reached and b.types[n].dtype.is_float for n in op.operands)
        if not any(wants) and opdef.kind is not OpKind.RECV:
            continue
        if opdef.grad is None:
            raise GradientError(
                f"{op.name} has no gradient rule, and the gradient of {loss.name} must flow through it to {', '.join(n for n, w in zip(op.operands, wants, strict=True) if w)}",
                op.span,
            )
        before = len(b.ops)
        ctx = GradContext(
            b,
            op,
            tuple(b.value(n) for n in op.operands),
            tuple(b.value(n) for n in op.results),
            out,
            wants,
            lambda tag: base + tag,
        )
        for name, want, ct in zip(op.operands, wants, opdef.grad(ctx), strict=True):
            if not want or ct is None:
                continue
            have = cts.get(name)
            cts[name] = ct if have is None else b.apply1("add", [have, ct], span=op.span, hint="g")
        emitted(before, at)
    grads = []
    for k, w in enumerate(wrt):
        ct = cts.get(w.name)
        layout = layouts[k] if layouts is not None else None
        target = w.type.with_layout(
            layout if layout is not None else complete_layout(w.type.layout)
        )
        before = len(b.ops)
        if ct is None:
            grads.append(b.constant(0, target))
        else:
            grads.append(b.to_layout(ct, target.layout))
        emitted(before, -1 - k)
    return grads


def _span_of(body: Sequence[Op], name: str) -> SourceSpan:
    for op in body:
        if name in op.results:
            return op.span
    return NO_SPAN


def grad_function(module: Module, name: str, wrt: Sequence[str], *, loss: int = 0) -> Function:
    """A function ``@NAME_grad`` taking ``@NAME``'s parameters (no state, no init) and
    returning its results followed by the gradients of result ``loss`` with respect to the
    parameters ``wrt`` (names with or without ``%``)."""
    f = module.function(name)
    if f is None:
        raise UsageError(f"no function @{name} in module {module.name}")
    if not 0 <= loss < len(f.results):
        raise UsageError(
            f"@{name} has {len(f.results)} result(s); there is no result {loss} to differentiate"
        )
    params = {p.name: p for p in f.params}
    wanted = ["%" + w.lstrip("%") for w in wrt]
    for w in wanted:
        if w not in params:
            raise UsageError(
                f"@{name} has no parameter {w} (parameters: {', '.join(params) or 'none'})"
            )
        if not params[w].type.dtype.is_float:
            raise UsageError(
                f"parameter {w} of @{name} is {params[w].type.dtype}; only float parameters have gradients"
            )
    b = FunctionBuilder(function_mesh(module, f), module_name=module.name)
    b.module = module
    args = {p.name: b.add_param(p.name, p.type, span=p.span) for p in f.params}
    env = copy_body(b, module, f, args)
    outs = [env[r] for r in f.returns]
    grads = backward(b, list(b.ops), outs[loss], [args[w] for w in wanted])
    g = b.function(f"{name}_grad", [*outs, *grads], requires=f.requires)
    return g


def grad_module(module: Module, name: str, wrt: Sequence[str], *, loss: int = 0) -> Module:
    """``module`` with :func:`grad_function`'s function added (verified)."""
    g = grad_function(module, name, wrt, loss=loss)
    if module.function(g.name) is not None:
        raise UsageError(f"module {module.name} already has a function @{g.name}")
    out = Module(
        required_version(g.body, module.version),
        module.name,
        module.meshes,
        (*module.functions, g),
        module.span,
    )
    verify_module(out)
    return out
