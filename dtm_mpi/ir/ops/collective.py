"""Collectives over named mesh axes, paired point-to-point transfers, redistribute and call.

In the global view every collective is the identity on values; what changes is the layout:

* ``allreduce OP %x on A``: %x is ``partial(OP: ...)`` over (at least) A; the result is no
  longer pending over A;
* ``allgather %x on A``: A are the innermost axes sharding one dim of %x; the result no longer
  shards that dim over A;
* ``reduce_scatter OP %x on A dim D``: pending over A becomes sharded over A on dim D;
* ``broadcast %x on A root R``: every rank takes the block of the rank at coordinate R of A
  (%x must be neither sharded nor pending over A);
* ``all_to_all %x on A from I to J``: the sharding over A moves from dim I to dim J;
* ``send %x on A from S to T tag N`` / ``%y = recv on A from S to T tag N : type``: the ranks
  at coordinate S of axis A send their block to the ranks at T (same other coordinates). The
  received value is ``partial(sum: A)``: the sent block at T, zeros elsewhere. Every send pairs
  with exactly one later recv of the same (A, S, T, N) in the same function;
* ``redistribute %x : type``: the same global value in another layout (planned later);
* ``call @f(%a, ...) : types``: the results of function @f.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.ir.build import Value
from dtm_mpi.ir.grad_context import GradContext
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import dim_index, mesh_axes_attr
from dtm_mpi.ir.registry import OpContext, OpKind, register_op
from dtm_mpi.ir.types import Layout, Partial, ReduceOp, TensorType

_REDUCE_ENUM = "enum(sum|max|min|prod)"


def _identity(op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
    return (xs[0],)


def _d_layout(c: GradContext) -> tuple[Value]:
    """The adjoint of a layout change is the identity on global values: the cotangent passes
    unchanged. A cotangent may have any layout, so nothing moves here; where a consumer's
    rule or the parameter's layout needs another one, the builder converts it there (an
    allgather's adjoint becomes a slice, or a reduce-scatter where the cotangent is a pending
    sum; a reduce-scatter's an allgather; a completed sum's the identity on the replicated
    cotangent). Cotangents are of global values, so a pending max or min is no different."""
    return (c.g,)


def _pending(ctx: OpContext, axes: tuple[str, ...]) -> Partial:
    t = ctx.operand_types[0]
    op = ReduceOp(ctx.attr("op"))
    p = t.layout.partial
    if p is None or p.op is not op or not set(axes) <= set(p.axes):
        have = str(p) if p else "not pending"
        raise ctx.operand_error(
            0, f"operand must be partial({op.value}: ...) over {','.join(axes)}; it is {have}"
        )
    return p


@register_op(
    "allreduce",
    f"$op:{_REDUCE_ENUM} $x:operand on $axes:axes",
    reference=_identity,
    kind=OpKind.REDIST,
    doc="complete a pending reduction over mesh axes",
    grad=_d_layout,
)
def _allreduce(ctx: OpContext) -> tuple[TensorType, ...]:
    axes = mesh_axes_attr(ctx, "axes")
    p = _pending(ctx, axes)
    return (
        ctx.operand_types[0].with_layout(ctx.operand_types[0].layout.with_partial(p.without(axes))),
    )


def _strip_inner(
    ctx: OpContext, t: TensorType, axes: tuple[str, ...], what: str
) -> tuple[int, tuple[tuple[str, ...], ...]]:
    dim = t.layout.dim_of_axis(axes[0])
    if dim is None:
        raise ctx.operand_error(0, f"operand is not sharded over {axes[0]!r}; nothing to {what}")
    held = t.layout.dims[dim]
    if held[len(held) - len(axes) :] != axes:
        raise ctx.operand_error(
            0,
            f"{','.join(axes)} must be the innermost axes of dim {dim}, which is sharded "
            f"over ({','.join(held)})",
        )
    dims = list(t.layout.dims)
    dims[dim] = held[: len(held) - len(axes)]
    return dim, tuple(dims)


@register_op(
    "allgather",
    "$x:operand on $axes:axes",
    reference=_identity,
    kind=OpKind.REDIST,
    doc="gather the blocks of a sharded dim over mesh axes",
    grad=_d_layout,
)
def _allgather(ctx: OpContext) -> tuple[TensorType, ...]:
    axes = mesh_axes_attr(ctx, "axes")
    t = ctx.operand_types[0]
    _, dims = _strip_inner(ctx, t, axes, "gather")
    return (t.with_layout(t.layout.with_dims(dims)),)


@register_op(
    "reduce_scatter",
    f"$op:{_REDUCE_ENUM} $x:operand on $axes:axes dim $dim:int",
    reference=_identity,
    kind=OpKind.REDIST,
    doc="complete a pending reduction, leaving dim sharded",
    grad=_d_layout,
)
def _reduce_scatter(ctx: OpContext) -> tuple[TensorType, ...]:
    axes = mesh_axes_attr(ctx, "axes")
    t = ctx.operand_types[0]
    p = _pending(ctx, axes)
    dim = dim_index(ctx, "dim", int(ctx.attr("dim")), t.rank)
    dims = list(t.layout.dims)
    dims[dim] = dims[dim] + axes
    return (t.with_layout(Layout(tuple(dims), p.without(axes))),)


@register_op(
    "broadcast",
    "$x:operand on $axes:axes root $root:int",
    reference=_identity,
    kind=OpKind.BROADCAST,
    doc="every rank takes the root's block along mesh axes",
    grad=_d_layout,
)
def _broadcast(ctx: OpContext) -> tuple[TensorType, ...]:
    axes = mesh_axes_attr(ctx, "axes")
    t = ctx.operand_types[0]
    for a in axes:
        if a in t.layout.used_axes:
            raise ctx.operand_error(
                0, f"operand is sharded or pending over {a!r}; broadcast needs it replicated there"
            )
    n = 1
    for a in axes:
        n *= ctx.axis_size(a)
    root = int(ctx.attr("root"))
    if not 0 <= root < n:
        raise ctx.attr_error(
            "root", f"root {root} is out of range 0..{n - 1} for axes {','.join(axes)}"
        )
    return (t,)


@register_op(
    "all_to_all",
    "$x:operand on $axes:axes from $src:int to $dst:int",
    reference=_identity,
    kind=OpKind.REDIST,
    doc="move the sharding over mesh axes from one dim to another",
    grad=_d_layout,
)
def _all_to_all(ctx: OpContext) -> tuple[TensorType, ...]:
    axes = mesh_axes_attr(ctx, "axes")
    t = ctx.operand_types[0]
    src = dim_index(ctx, "src", int(ctx.attr("src")), t.rank)
    dst = dim_index(ctx, "dst", int(ctx.attr("dst")), t.rank)
    if src == dst:
        raise ctx.attr_error("dst", "from and to must be different dims")
    dim, dims_t = _strip_inner(ctx, t, axes, "move")
    if dim != src:
        raise ctx.attr_error("src", f"{','.join(axes)} shard dim {dim}, not dim {src}")
    dims = list(dims_t)
    dims[dst] = dims[dst] + axes
    return (t.with_layout(t.layout.with_dims(tuple(dims))),)


def _p2p_checks(ctx: OpContext) -> str:
    axes = mesh_axes_attr(ctx, "axis")
    if len(axes) != 1:
        raise ctx.attr_error(
            "axis", f"point-to-point runs along one mesh axis; got {','.join(axes)}"
        )
    n = ctx.axis_size(axes[0])
    src, dst = int(ctx.attr("src")), int(ctx.attr("dst"))
    for key, c in (("src", src), ("dst", dst)):
        if not 0 <= c < n:
            raise ctx.attr_error(
                key, f"coordinate {c} is out of range 0..{n - 1} of axis {axes[0]!r}"
            )
    if src == dst:
        raise ctx.attr_error("dst", "from and to must be different coordinates")
    if int(ctx.attr("tag")) < 0:
        raise ctx.attr_error("tag", "tag must be >= 0")
    return axes[0]


def _send_ref(op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
    return ()


def _d_send(c: GradContext) -> tuple[Value]:
    """The adjoint of a send is a receive of the cotangent its paired recv sent back."""
    x = c.xs[0].type
    axis = c.attr("axis")
    assert isinstance(axis, tuple) and len(axis) == 1
    got = c.b.emit1(
        "recv",
        [],
        {
            "axis": axis,
            "src": c.attr("dst"),
            "dst": c.attr("src"),
            "tag": c.reverse_tag(int(c.attr("tag"))),  # type: ignore[arg-type]
        },
        [x.with_layout(x.layout.with_partial(Partial(ReduceOp.SUM, axis)))],  # type: ignore[arg-type]
        span=c.span,
        hint="g",
    )
    return (got,)


@register_op(
    "send",
    "$x:operand on $axis:axes from $src:int to $dst:int tag $tag:int",
    grad=_d_send,
    results=0,
    reference=_send_ref,
    kind=OpKind.SEND,
    doc="send blocks to another coordinate of an axis",
)
def _send(ctx: OpContext) -> tuple[TensorType, ...]:
    axis = _p2p_checks(ctx)
    t = ctx.operand_types[0]
    if axis in t.layout.used_axes or t.layout.partial is not None:
        raise ctx.operand_error(
            0,
            f"a sent value must be complete (not pending) and not sharded over {axis!r}; it is {t}",
        )
    return ()


def _recv_ref(op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
    raise NotImplementedError("recv values come from the paired send (the verifier pairs them)")


def _d_recv(c: GradContext) -> tuple[()]:
    """The adjoint of a receive sends the cotangent back to the sender (completed and laid
    out as the received value, as a send needs); the paired send's rule receives it."""
    r = c.ys[0].type
    g = c.b.to_layout(c.g, r.layout.with_partial(None), span=c.span)
    c.b.emit(
        "send",
        [g],
        {
            "axis": c.attr("axis"),
            "src": c.attr("dst"),
            "dst": c.attr("src"),
            "tag": c.reverse_tag(int(c.attr("tag"))),  # type: ignore[arg-type]
        },
        span=c.span,
    )
    return ()


@register_op(
    "recv",
    "on $axis:axes from $src:int to $dst:int tag $tag:int",
    reference=_recv_ref,
    kind=OpKind.RECV,
    doc="receive the blocks of the paired send",
    grad=_d_recv,
)
def _recv(ctx: OpContext) -> tuple[TensorType, ...]:
    axis = _p2p_checks(ctx)
    d = ctx.declared[0]
    if d.layout.partial != Partial(ReduceOp.SUM, (axis,)) or axis in d.layout.sharded_axes:
        raise ctx.result_error(
            0, f"a received value is partial(sum: {axis}) and not sharded over {axis!r}; got {d}"
        )
    return (d,)


@register_op(
    "redistribute",
    "$x:operand",
    reference=_identity,
    kind=OpKind.REDIST,
    doc="the same global value in the result's layout",
    grad=_d_layout,
)
def _redistribute(ctx: OpContext) -> tuple[TensorType, ...]:
    t, d = ctx.operand_types[0], ctx.declared[0]
    if (t.dtype, t.shape) != (d.dtype, d.shape):
        raise ctx.result_error(
            0, f"redistribute keeps dtype and shape: operand is {t}, result is {d}"
        )
    sp, dp = t.layout.partial, d.layout.partial
    if sp is not None and dp is not None and sp.op is not dp.op:
        raise ctx.result_error(0, f"cannot turn {sp} into {dp}")
    if dp is not None and sp is None and dp.op is not ReduceOp.SUM:
        raise ctx.result_error(0, f"a replicated value can only become partial(sum), not {dp}")
    return (d,)


def _call_ref(op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
    raise NotImplementedError("call is evaluated by the interpreter")


@register_op(
    "call",
    "$callee:symbol ( $args:operands )",
    results=-1,
    reference=_call_ref,
    kind=OpKind.CALL,
    doc="call a function of the module",
)
def _call(ctx: OpContext) -> tuple[TensorType, ...]:
    name = str(ctx.attr("callee"))
    f = ctx.module.function(name)
    if f is None:
        raise ctx.attr_error("callee", f"no function @{name} in module {ctx.module.name}")
    if f.entry:
        raise ctx.attr_error("callee", f"@{name} is the entry function and cannot be called")
    if len(f.params) != len(ctx.operand_types):
        raise ctx.error(f"@{name} takes {len(f.params)} argument(s); got {len(ctx.operand_types)}")
    for i, (p, t) in enumerate(zip(f.params, ctx.operand_types, strict=True)):
        if p.type != t:
            raise ctx.operand_error(i, f"argument {i} of @{name} must be {p.type}; got {t}")
    if f.mesh is not None and ctx.mesh is not None and f.mesh != ctx.mesh.name:
        raise ctx.attr_error(
            "callee", f"@{name} runs on mesh @{f.mesh}, the caller on @{ctx.mesh.name}"
        )
    return tuple(r.type for r in f.results)
