"""The execution plan: what every rank does, compiled once from a verified module and a mesh.

:func:`compile_plan` is pure: every rank computes the identical :class:`ExecPlan` from
(module, bound mesh), so every decidable error (a coordinate beyond the bound mesh, a layout
the mesh cannot hold, an impossible redistribution, an op rule the bound sizes decide: the
op's registry ``plan_check``, e.g. ``dequantize`` blocks that straddle shards) is raised on
every rank before the first message. Each op of each function becomes a :class:`PlanOp` of
the kind its registry entry declares (``dtm_mpi.ir.registry.OpKind``):

* ``LOCAL`` — computed locally by the backend's kernel on local blocks;
* ``REDIST`` — ``allreduce``, ``allgather``, ``reduce_scatter``, ``all_to_all`` and
  ``redistribute`` all run the redistribution plan from the operand's type to the result's
  layout (``dtm_mpi.sharding``): exact under the uneven-split rule, so an IR collective
  whose blocks do not nest runs whatever steps that needs, visibly (``dtm explain``);
* ``BROADCAST`` — every rank takes the block of the root along the axes;
* ``SEND`` / ``RECV`` — point-to-point along one axis (receivers hold the block, every
  other rank zeros: the value is ``partial(sum)`` over the axis);
* ``CALL`` — the callee's plan.

A ``broadcast_to`` whose uses only cut the dims it made is planned in their layout
(:mod:`dtm_mpi.plan.local_broadcast`): each rank makes its block of the repeat; a
broadcast nothing uses is not planned.

``frees`` lists the values whose last use is the op (buffer lifetimes). Per-rank figures
(local shapes, bytes, memory) are pure functions of (plan, rank): :mod:`dtm_mpi.plan.cost`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dtm_mpi.errors import PlanError, UsageError
from dtm_mpi.ir import registry
from dtm_mpi.ir.nodes import Function, Module, Op
from dtm_mpi.ir.types import TensorType
from dtm_mpi.ir.verify import function_mesh
from dtm_mpi.plan.local_broadcast import local_broadcasts
from dtm_mpi.sharding.blocks import shard_bounds
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import RedistPlan, plan_redistribute

__all__ = ["ExecPlan", "FunctionPlan", "OpKind", "PlanOp", "compile_plan", "mesh_for"]

NO_MESH_AXIS = "_ranks"
"""The one axis of the mesh a module without meshes runs on: every value is replicated."""


OpKind = registry.OpKind
"""A plan op's kind is its registry entry's kind (re-exported: the plan's users import it here)."""


@dataclass(frozen=True, slots=True)
class PlanOp:
    op: Op
    kind: OpKind
    redist: RedistPlan | None = None
    frees: tuple[str, ...] = ()
    axes: tuple[str, ...] = ()  # BROADCAST / SEND / RECV: the mesh axes
    root: int = 0  # BROADCAST: index along axes; SEND/RECV: the source coordinate
    dst: int = 0  # SEND / RECV: the destination coordinate
    tag: int = 0
    operand_types: tuple[TensorType, ...] = ()  # known when planning: the verifier checked them

    @property
    def where(self) -> str:
        s = self.op.span
        return f"{s.file}:{s.line}:{s.col}"


@dataclass(frozen=True, slots=True)
class FunctionPlan:
    function: Function
    ops: tuple[PlanOp, ...]
    buckets: tuple[Any, ...] = ()
    """The collectives that overlap computation (:class:`~dtm_mpi.plan.overlap.Bucket` s, in
    start order: allreduces in buckets, prefetched gathers of parameters stored sharded): the
    executor starts each bucket when its values are ready and completes it before its results
    are needed, in every mode."""


@dataclass(frozen=True, slots=True)
class ExecPlan:
    module: Module
    mesh: MeshShape
    functions: tuple[tuple[str, FunctionPlan], ...]
    entry: str

    def function(self, name: str) -> FunctionPlan:
        for n, fp in self.functions:
            if n == name:
                return fp
        raise PlanError(f"no plan for function @{name}")

    @property
    def entry_plan(self) -> FunctionPlan:
        return self.function(self.entry)


def mesh_for(module: Module, nranks: int, binding: dict[str, int] | None) -> MeshShape:
    """The bound mesh of the entry function for ``nranks`` ranks (spec §6): ``--mesh``
    sizes override the declared ones; without them every rank goes on the first axis."""
    from dtm_mpi.sharding.mesh import bind_mesh

    entry = module.entry
    if entry is None:
        raise UsageError(f"module {module.name} has no entry function")
    mesh = function_mesh(module, entry)
    if mesh is None:
        if binding:
            raise UsageError(
                f"--mesh {','.join(binding)}: module {module.name} declares no mesh for "
                f"@{entry.name}"
            )
        return MeshShape(((NO_MESH_AXIS, nranks),))
    return bind_mesh(mesh, nranks, binding)


def _check_coord(op: Op, key: str, value: int, size: int, axes: tuple[str, ...]) -> None:
    if not 0 <= value < size:
        s = op.attr_span(key)
        raise PlanError(
            f"{s.file}:{s.line}:{s.col}: {op.name} {key} {value} is out of range 0..{size - 1} "
            f"for axes {','.join(axes)} of the bound mesh"
        )


def _axes(op: Op, key: str) -> tuple[str, ...]:
    value = op.attr(key)
    assert isinstance(value, tuple)
    return tuple(str(a) for a in value)


def _extents(mesh: MeshShape) -> registry.ShardExtents:
    def extents(n: int, axes: tuple[str, ...]) -> list[tuple[int, int]]:
        k = mesh.group_size(axes)
        return [shard_bounds(n, k, i) for i in range(k)]

    return extents


def _plan_op(
    op: Op, mesh: MeshShape, operand_types: tuple[TensorType, ...], frees: tuple[str, ...]
) -> PlanOp:
    name = op.name
    opdef = registry.lookup_op(name)
    assert opdef is not None, name
    kind = opdef.kind
    src = operand_types[0] if operand_types else None  # where a redistribution starts
    if opdef.plan_check is not None:  # a rule the bound mesh's sizes decide
        broken = opdef.plan_check(op, operand_types, _extents(mesh))
        if broken is not None:
            s = op.span
            raise PlanError(f"{s.file}:{s.line}:{s.col}: {name}: {broken}")
    if kind is OpKind.REDIST:
        assert src is not None
        dst = op.result_types[0]
        try:
            plan = plan_redistribute(src, dst.layout, mesh)
        except PlanError as err:
            s = op.span
            raise PlanError(f"{s.file}:{s.line}:{s.col}: {name}: {err}") from None
        return PlanOp(op, OpKind.REDIST, plan, frees, operand_types=operand_types)
    if kind is OpKind.BROADCAST:
        axes = _axes(op, "axes")
        root = int(op.attr("root"))  # type: ignore[arg-type]
        _check_coord(op, "root", root, mesh.group_size(axes), axes)
        return PlanOp(op, OpKind.BROADCAST, None, frees, axes, root, operand_types=operand_types)
    if kind in (OpKind.SEND, OpKind.RECV):
        axes = _axes(op, "axis")
        src_c, dst_c = int(op.attr("src")), int(op.attr("dst"))  # type: ignore[arg-type]
        for key, c in (("src", src_c), ("dst", dst_c)):
            _check_coord(op, key, c, mesh.group_size(axes), axes)
        tag = int(op.attr("tag"))  # type: ignore[arg-type]
        return PlanOp(op, kind, None, frees, axes, src_c, dst_c, tag, operand_types)
    return PlanOp(op, kind, None, frees, operand_types=operand_types)


def _plan_function(f: Function, mesh: MeshShape) -> FunctionPlan:
    types: dict[str, TensorType] = {p.name: p.type for p in f.params}
    body = local_broadcasts(f)
    last_use: dict[str, int] = {}
    for i, op in enumerate(body):
        for name in op.operands:
            last_use[name] = i
    keep = set(f.returns)
    frees_at: dict[int, list[str]] = {}
    for name, i in last_use.items():
        if name not in keep:
            frees_at.setdefault(i, []).append(name)
    ops: list[PlanOp] = []
    for i, op in enumerate(body):
        operand_types = tuple(types[n] for n in op.operands)
        unused = [r for r in op.results if r not in last_use and r not in keep]
        frees = tuple(sorted(frees_at.get(i, ()))) + tuple(unused)
        ops.append(_plan_op(op, mesh, operand_types, frees))
        for r, t in zip(op.results, op.result_types, strict=True):
            types[r] = t
    return FunctionPlan(f, tuple(ops))


def compile_plan(module: Module, mesh: MeshShape, *, bucket_bytes: int | None = None) -> ExecPlan:
    """The plan of a *verified* module on the bound ``mesh`` (pure; identical on every rank).
    ``bucket_bytes``: the largest bucket of overlapped allreduces (0: none; None:
    ``DTM_BUCKET_BYTES`` with ``DTM_OVERLAP=1``, else none)."""
    from dtm_mpi.plan.overlap import overlap_buckets, prefetch_gathers

    if bucket_bytes is None:
        from dtm_mpi.config import get_config

        config = get_config()
        bucket_bytes = config.bucket_bytes if config.overlap else 0
    entry = module.entry
    if entry is None:
        raise UsageError(f"module {module.name} has no entry function")
    plans: list[tuple[str, FunctionPlan]] = []
    todo, seen = [entry], {entry.name}
    while todo:  # the entry and every function it reaches (others may use other meshes)
        f = todo.pop()
        fp = _plan_function(f, mesh)
        if bucket_bytes:
            buckets = overlap_buckets(fp, bucket_bytes) + prefetch_gathers(fp)
            fp = replace(fp, buckets=tuple(sorted(buckets, key=lambda b: (b.start, b.members))))
        plans.append((f.name, fp))
        for op in f.body:
            is_call = registry.OPS[op.name].kind is OpKind.CALL
            callee = module.function(str(op.attr("callee"))) if is_call else None
            if callee is not None and callee.name not in seen:
                seen.add(callee.name)
                todo.append(callee)
    return ExecPlan(module, mesh, tuple(plans), entry.name)
