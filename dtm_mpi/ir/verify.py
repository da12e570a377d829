"""The verifier: every decidable rule of the IR, checked before anything runs.

Rules (docs/spec/ir.md, "Verification"): meshes (unique names and axes, sizes >= 1); one entry
function; unique function names; no recursion; SSA (one definition, defined before use);
layouts (declared axes, each at most once per tensor, pending axes not also sharding); every
op's shape and sharding rule (its ``infer`` in the registry) against the declared result types;
capabilities declared and known; send/recv pairing; state parameters and their updates; returns
matching the signature.

``verify_errors`` collects the first error of each function (and the module-level ones);
``verify_module`` raises the first of them.
"""

from __future__ import annotations

from dtm_mpi.errors import SourceSpan, VerifyError
from dtm_mpi.ir.nodes import Function, InitKind, MeshDecl, Module, Op
from dtm_mpi.ir.ops._common import KNOWN_CAPABILITIES
from dtm_mpi.ir.parser import gc_paused
from dtm_mpi.ir.registry import OPS, OpContext, OpDef, OpKind, lookup_op
from dtm_mpi.ir.types import Partial, ReduceOp, TensorType

__all__ = ["check_layout", "function_mesh", "verify_errors", "verify_module"]


def _err(message: str, span: SourceSpan) -> VerifyError:
    return VerifyError(message, span)


def check_layout(t: TensorType, mesh: MeshDecl | None, span: SourceSpan, what: str) -> None:
    """A layout must name only declared axes, each at most once per tensor."""
    used = t.layout.used_axes
    if not used:
        return
    if mesh is None:
        raise _err(
            f"{what} {t} names mesh axes but the function has no mesh (add 'on @mesh')", span
        )
    seen: set[str] = set()
    for axis in used:
        if axis not in mesh.axis_names:
            raise _err(
                f"{what} {t} names axis {axis!r}, which mesh @{mesh.name} does not declare "
                f"(axes: {', '.join(mesh.axis_names)})",
                span,
            )
        if axis in seen:
            pending = t.layout.partial is not None and axis in t.layout.partial.axes
            rule = "pending and sharded at once" if pending else "used twice"
            raise _err(
                f"{what} {t}: mesh axis {axis!r} is {rule}; an axis may appear once per tensor",
                span,
            )
        seen.add(axis)


def _is_call(op: Op) -> bool:
    d = lookup_op(op.name)
    return d is not None and d.kind is OpKind.CALL


def function_mesh(module: Module, f: Function) -> MeshDecl | None:
    """The mesh a function runs on: the one it names, else the module's only mesh."""
    if f.mesh is not None:
        return module.mesh(f.mesh)
    return module.meshes[0] if len(module.meshes) == 1 else None


def _check_meshes(module: Module) -> None:
    names: dict[str, MeshDecl] = {}
    for mesh in module.meshes:
        if mesh.name in names:
            raise _err(
                f"mesh @{mesh.name} is declared twice (first at {names[mesh.name].span})", mesh.span
            )
        names[mesh.name] = mesh
        axes: set[str] = set()
        for i, (axis, size) in enumerate(mesh.axes):
            name_span, size_span = (
                mesh.axis_spans[i] if i < len(mesh.axis_spans) else (mesh.span, mesh.span)
            )
            if axis in axes:
                raise _err(f"mesh @{mesh.name} declares axis {axis!r} twice", name_span)
            if size < 1:
                raise _err(
                    f"mesh @{mesh.name} axis {axis!r} has size {size}; sizes must be >= 1",
                    size_span,
                )
            axes.add(axis)


def _check_functions(module: Module) -> None:
    seen: dict[str, Function] = {}
    entries = []
    for f in module.functions:
        if f.name in seen:
            raise _err(
                f"function @{f.name} is defined twice (first at {seen[f.name].span})", f.span
            )
        seen[f.name] = f
        if f.entry:
            entries.append(f)
    if not entries:
        raise _err(
            f"module {module.name} has no entry function (mark one 'entry func')", module.span
        )
    if len(entries) > 1:
        raise _err(
            f"module has {len(entries)} entry functions; mark exactly one (first: @{entries[0].name})",
            entries[1].span,
        )
    # no recursion: the call graph must be acyclic
    calls = {
        f.name: [str(op.attr("callee")) for op in f.body if _is_call(op)] for f in module.functions
    }
    # iterative depth-first search (no Python recursion limit on long call chains)
    state: dict[str, int] = {}
    for root in calls:
        if root in state:
            continue
        path: list[str] = [root]
        stack: list[int] = [0]
        state[root] = 1
        while stack:
            name, k = path[-1], stack[-1]
            callees = calls[name]
            if k == len(callees):
                state[name] = 2
                path.pop()
                stack.pop()
                continue
            stack[-1] += 1
            callee = callees[k]
            if state.get(callee) == 1:
                cycle = " -> ".join(f"@{n}" for n in [*path[path.index(callee) :], callee])
                f = seen[name]
                op = next(o for o in f.body if _is_call(o) and o.attr("callee") == callee)
                raise _err(f"recursive call: {cycle}; the call graph must be acyclic", op.span)
            if callee in calls and callee not in state:
                state[callee] = 1
                path.append(callee)
                stack.append(0)


def _definition(f: Function, name: str) -> SourceSpan:
    """Where ``name`` is first defined in ``f`` (for the redefinition diagnostic)."""
    for p in f.params:
        if p.name == name:
            return p.span
    for op in f.body:
        for r, span in zip(op.results, op.result_spans, strict=True):
            if r == name:
                return span
    return f.span


def _verify_function(module: Module, f: Function) -> None:
    mesh = _check_header(module, f)
    env = _check_params(f, mesh)  # the type of every value defined so far
    _check_results(f, mesh)
    _check_body(module, f, mesh, env)
    _check_returns(f, env)


def _check_header(module: Module, f: Function) -> MeshDecl | None:
    """The function's mesh and capabilities; returns the mesh it runs on."""
    if f.mesh is not None and module.mesh(f.mesh) is None:
        raise _err(
            f"function @{f.name} runs on mesh @{f.mesh}, which the module does not declare",
            f.mesh_span,
        )
    mesh = function_mesh(module, f)
    for cap, span in zip(f.requires, f.requires_spans or [f.span] * len(f.requires), strict=False):
        if cap not in KNOWN_CAPABILITIES:
            raise _err(f"unknown capability {cap!r} (known: {', '.join(KNOWN_CAPABILITIES)})", span)
    for i, cap in enumerate(f.requires):
        if cap in f.requires[:i]:
            span = f.requires_spans[i] if i < len(f.requires_spans) else f.span
            raise _err(f"function @{f.name} lists capability {cap} twice", span)
    return mesh


def _check_params(f: Function, mesh: MeshDecl | None) -> dict[str, TensorType]:
    """The parameters (layouts, state, init dtypes); returns their types by name."""
    env: dict[str, TensorType] = {}
    for p in f.params:
        if p.name in env:
            raise _err(f"parameter {p.name} is declared twice", p.span)
        check_layout(p.type, mesh, p.type_span, f"parameter {p.name}:")
        if p.type.layout.partial is not None:
            raise _err(
                f"parameter {p.name} cannot be {p.type.layout.partial}; parameters hold complete values",
                p.type_span,
            )
        if p.state and not f.entry:
            raise _err(f"state parameter {p.name} is only allowed in the entry function", p.span)
        if (
            p.init is not None
            and p.init.kind in (InitKind.NORMAL, InitKind.UNIFORM)
            and not p.type.dtype.is_float
        ):
            raise _err(
                f"init {p.init.kind.value} of {p.name} needs a floating dtype; got {p.type.dtype}",
                p.span,
            )
        env[p.name] = p.type
    return env


def _check_results(f: Function, mesh: MeshDecl | None) -> None:
    """The declared results: layouts, and each state update once, of its parameter's type."""
    state_params = {p.name: p.type for p in f.params if p.state}
    updated: set[str] = set()
    for r in f.results:
        check_layout(r.type, mesh, r.span, "result type")
        if r.updates is None:
            continue
        if not f.entry:
            raise _err(f"'updates {r.updates}' is only allowed in the entry function", r.span)
        if r.updates not in state_params:
            raise _err(
                f"result updates {r.updates}, which is not a state parameter of @{f.name}", r.span
            )
        if r.updates in updated:
            raise _err(f"state parameter {r.updates} is updated by two results", r.span)
        if r.type != state_params[r.updates]:
            raise _err(
                f"result updating {r.updates} must have its type {state_params[r.updates]}; got {r.type}",
                r.span,
            )
        updated.add(r.updates)


def _check_body(
    module: Module, f: Function, mesh: MeshDecl | None, env: dict[str, TensorType]
) -> None:
    """Every op of the body in order (``env`` gains the values it defines), and the pairing
    of the point-to-point ops."""
    pending_sends: dict[tuple[object, ...], tuple[TensorType, SourceSpan]] = {}
    layout_ok: set[int] = set()  # ids of result types whose layout passed check_layout
    inferred_cache: dict[tuple[object, ...], tuple[TensorType, ...]] = {}
    lookup_op("call")  # loads the registry
    get_def = OPS.get
    for op in f.body:
        opdef = get_def(op.name)
        assert opdef is not None
        try:
            operand_types = [env[n] for n in op.operands]
        except KeyError:
            for name, span in zip(op.operands, op.operand_spans, strict=True):
                if name not in env:
                    raise _err(f"use of undefined value {name}", span) from None
            raise
        _check_op_header(module, f, op, opdef, env)
        for t, span in zip(op.result_types, op.type_spans, strict=True):
            if id(t) not in layout_ok:
                check_layout(t, mesh, span, "result type")
                layout_ok.add(id(t))
        _check_rule(module, mesh, op, opdef, operand_types, inferred_cache)
        if opdef.kind in (OpKind.SEND, OpKind.RECV):
            _pair_p2p(module, mesh, op, opdef, operand_types, pending_sends)
        for name, t in zip(op.results, op.result_types, strict=True):
            env[name] = t
    for _, span in pending_sends.values():
        raise _err(
            "send has no matching recv (same axis, coordinates and tag) later in the function", span
        )


def _check_op_header(
    module: Module, f: Function, op: Op, opdef: OpDef, env: dict[str, TensorType]
) -> None:
    """An op's result names (new, once each), its IR version and its capability."""
    results = op.results
    if opdef.n_results >= 0 and len(results) != opdef.n_results:
        raise _err(f"{op.name} has {opdef.n_results} result(s); got {len(results)}", op.span)
    for i, name in enumerate(results):
        if name in env or (i and name in results[:i]):
            span = op.result_spans[i]
            if name in results[:i]:
                raise _err(f"value {name} is defined twice by one {op.name}", span)
            raise _err(
                f"value {name} is already defined at {_definition(f, name)}; SSA values "
                "are defined once",
                span,
            )
    since = opdef.since_for(op)
    if since > module.version:
        v, m = ".".join(map(str, since)), ".".join(map(str, module.version))
        what, span = op.name, op.span
        if since > opdef.since:  # a newer attribute of an older op
            written = set(opdef.optional_operands(op))
            key = next(
                k
                for k, s in opdef.attr_since
                if s == since and (op.attr(k) is not None or k in written)
            )
            kind = "operand" if key in written else "attribute"
            what, span = f"{op.name}'s {kind} {key}", op.attr_span(key)
        raise _err(
            f"{what} is new in IR dtm {v}; this module declares dtm {m} (write 'dtm {v}' in its header)",
            span,
        )
    if opdef.capability is not None and opdef.capability not in f.requires:
        raise _err(
            f"{op.name} needs capability {opdef.capability}; declare it on @{f.name} with "
            f"'requires [{opdef.capability}]'",
            op.span,
        )


def _check_rule(
    module: Module,
    mesh: MeshDecl | None,
    op: Op,
    opdef: OpDef,
    operand_types: list[TensorType],
    cache: dict[tuple[object, ...], tuple[TensorType, ...]],
) -> None:
    """The op's declared result types against its rule's.

    The rule is a pure function of (op, attributes, operand and declared types) for one
    function (mesh and module fixed); repeated layers hit ``cache``. Types are keyed by
    identity (the type parser shares equal types; every key type stays alive in the module
    while this runs), only successful inferences are kept, and ops with float or literal
    attributes are not cached (see OpDef.exact_attrs)."""
    key: tuple[object, ...] | None = None
    if opdef.exact_attrs:
        key = (op.name, op.attrs, *map(id, operand_types), None, *map(id, op.result_types))
        try:
            if key in cache:
                return
        except TypeError:  # an unhashable attribute (never from the parser)
            key = None
    ctx = OpContext(op, operand_types, op.result_types, mesh, module)
    inferred = opdef.infer(ctx)
    if opdef.n_results < 0 and len(inferred) != len(op.result_types):
        raise _err(
            f"{op.name} gives {len(inferred)} result(s); {len(op.result_types)} declared", op.span
        )
    for i, (want, got) in enumerate(zip(inferred, op.result_types, strict=True)):
        if want != got:
            raise ctx.result_error(i, f"result type is {got} but the rule gives {want}")
    if key is not None:
        cache[key] = inferred


def _pair_p2p(
    module: Module,
    mesh: MeshDecl | None,
    op: Op,
    opdef: OpDef,
    operand_types: list[TensorType],
    pending: dict[tuple[object, ...], tuple[TensorType, SourceSpan]],
) -> None:
    """A send waits in ``pending`` for the recv of the same axis, coordinates and tag, which
    must come later and receive its value as a pending sum over the axis."""
    pair = (op.attr("axis"), op.attr("src"), op.attr("dst"), op.attr("tag"))
    if opdef.kind is OpKind.SEND:
        if pair in pending:
            raise _err(
                f"a send on the same axis, coordinates and tag is still unmatched (at {pending[pair][1]})",
                op.span,
            )
        pending[pair] = (operand_types[0], op.span)
        return
    if pair not in pending:
        raise _err("recv has no earlier send on the same axis, coordinates and tag", op.span)
    sent, _ = pending.pop(pair)
    axis = str(op.attr("axis")[0])  # type: ignore[index]
    want_t = sent.with_layout(sent.layout.with_partial(Partial(ReduceOp.SUM, (axis,))))
    if op.result_types[0] != want_t:
        raise OpContext(op, operand_types, op.result_types, mesh, module).result_error(
            0, f"recv of a sent {sent} must be {want_t}; got {op.result_types[0]}"
        )


def _check_returns(f: Function, env: dict[str, TensorType]) -> None:
    """The returned values: as many as the results, each of its result's type."""
    if len(f.returns) != len(f.results):
        raise _err(
            f"@{f.name} returns {len(f.returns)} value(s) but declares {len(f.results)} result(s)",
            f.return_span,
        )
    for i, (name, span, r) in enumerate(zip(f.returns, f.return_spans, f.results, strict=True)):
        if name not in env:
            raise _err(f"use of undefined value {name}", span)
        if env[name] != r.type:
            raise _err(
                f"returned value {i} ({name}) is {env[name]} but the result type is {r.type}",
                span,
            )


def verify_errors(module: Module) -> list[VerifyError]:
    """Every error found: module-level ones, then the first one of each function."""
    with gc_paused():
        return _verify_errors(module)


def _verify_errors(module: Module) -> list[VerifyError]:
    errors: list[VerifyError] = []
    for check in (_check_meshes, _check_functions):
        try:
            check(module)
        except VerifyError as err:
            errors.append(err)
    for f in module.functions:
        try:
            _verify_function(module, f)
        except VerifyError as err:
            errors.append(err)
    errors.sort(key=lambda e: (e.span.line, e.span.col))
    return errors


def verify_module(module: Module) -> None:
    """Raise the first :class:`VerifyError` of ``module``, if any (others on ``.others``)."""
    errors = verify_errors(module)
    if errors:
        first = errors[0]
        first.others = errors[1:]  # type: ignore[attr-defined]
        raise first
