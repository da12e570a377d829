"""The executor: one rank walking its :class:`~dtm_mpi.plan.program.ExecPlan`.

Thin by design: the plan says what to do, the kernels compute, and the communication interface
(:class:`~dtm_mpi.comm.interface.Comm`) moves data. Per-op facts (local shapes, offsets, the
per-rank step specs) are computed once per rank and reused by every step of a run. A failure
in an op is re-raised as a :class:`~dtm_mpi.errors.DtmError` whose ``phase`` names the step,
the op and its source line, so the agreed error of a distributed run says where it happened.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from dtm_mpi.comm.interface import Comm, Pending
from dtm_mpi.comm.quantized import QuantizedComm
from dtm_mpi.config import get_config
from dtm_mpi.errors import CommError, DtmError, KernelError, LayoutError
from dtm_mpi.faults import maybe_fail
from dtm_mpi.ir.dtypes import np_dtype, round_bf16
from dtm_mpi.ir.registry import OPS, Trait
from dtm_mpi.ir.types import DType, ReduceOp, TensorType
from dtm_mpi.kernels.backends import parse_backend
from dtm_mpi.kernels.devices import ArrayBackend, open_backend
from dtm_mpi.kernels.dispatch import (
    Kernel,
    KernelContext,
    PreparedKernel,
    backend_kernels,
    prepare_kernel,
)
from dtm_mpi.kernels.exact import Precision, exact_rule, pending_axes
from dtm_mpi.kernels.exact_ranks import exact_across
from dtm_mpi.kernels.fused import Expr
from dtm_mpi.plan.fusion import FusedGroup, FusionNode, fusion_groups
from dtm_mpi.plan.overlap import Bucket
from dtm_mpi.plan.program import ExecPlan, FunctionPlan, OpKind, PlanOp
from dtm_mpi.runtime.chunked import chunkable, chunked_chain, run_chunked
from dtm_mpi.runtime.instructions import (
    BucketStart,
    Instr,
    Resolution,
    Sched,
    buckets_starting,
    fused_frees,
    hold_bucket_operands,
    resolve_pending,
    without_resolved,
)
from dtm_mpi.sharding import collectives
from dtm_mpi.sharding.blocks import Pin, block_owners, local_offsets, local_shape
from dtm_mpi.sharding.redistribute import RedistPlan, plan_redistribute
from dtm_mpi.sharding.retention import keeps_gather_of
from dtm_mpi.sharding.steps import (
    STEP_KINDS,
    AllgatherSpec,
    AllreduceSpec,
    StepKind,
    StepRule,
    StepSpec,
    allreduce_spec,
)

__all__ = ["STEP_RUNNERS", "Executor", "gather_to_root", "run_redistribution"]

OUTPUT_TAG = 32767
"""The point-to-point tag of output gathers (the largest tag every MPI must support; messages
between two ranks with one tag arrive in the order sent)."""


_StepRunner = Callable[
    [np.ndarray, tuple[str, ...], StepSpec, Comm, Callable[..., np.ndarray]], np.ndarray
]


def _step_runner(rule: StepRule) -> _StepRunner:
    """How this rank runs a step of ``rule``'s kind: a collective calls the communicator's
    method the table names; a local kind runs its function of ``sharding.collectives``."""
    if rule.kind.is_collective:
        method, extra = rule.method, rule.args
        if not extra:  # the common case, kept to one lookup and one call

            def collective(
                x: np.ndarray,
                axes: tuple[str, ...],
                spec: StepSpec,
                comm: Comm,
                full: Callable[..., np.ndarray],
            ) -> np.ndarray:
                return getattr(comm, method)(x, axes, spec)  # type: ignore[no-any-return]

            return collective

        def collective_with(
            x: np.ndarray,
            axes: tuple[str, ...],
            spec: StepSpec,
            comm: Comm,
            full: Callable[..., np.ndarray],
        ) -> np.ndarray:
            return getattr(comm, method)(x, axes, spec, *extra)  # type: ignore[no-any-return]

        return collective_with
    local = getattr(collectives, rule.method)

    def alone(
        x: np.ndarray,
        axes: tuple[str, ...],
        spec: StepSpec,
        comm: Comm,
        full: Callable[..., np.ndarray],
    ) -> np.ndarray:
        return local(x, spec, full)  # type: ignore[no-any-return]

    return alone


STEP_RUNNERS: dict[StepKind, _StepRunner] = {k: _step_runner(r) for k, r in STEP_KINDS.items()}
"""Each step kind's runner on one rank, built once from :data:`STEP_KINDS`."""


def run_redistribution(
    plan: RedistPlan,
    specs: Sequence[StepSpec],
    x: np.ndarray,
    comm: Comm,
    backend: ArrayBackend | None = None,
) -> np.ndarray:
    """Run ``plan`` on this rank's block ``x`` (``specs``: this rank's step specs; ``x`` an
    array of ``backend``, numpy by default). Each step goes through its kind's runner
    (:data:`STEP_RUNNERS`, from the step-kind table :data:`STEP_KINDS`).

    Collective: call on all ranks."""
    full = np.full if backend is None else backend.full
    for step, spec in zip(plan.steps, specs, strict=True):
        x = STEP_RUNNERS[step.kind](x, step.axes, spec, comm, full)
    return x


def gather_to_root(
    t: TensorType, x: np.ndarray | None, comm: Comm, root: int = 0, pin: Pin | None = None
) -> np.ndarray | None:
    """The global value of ``t`` on ``root`` (None elsewhere) from every rank's block ``x``:
    a pending reduction is resolved first (over its axes only), then the owner of each
    distinct block (:func:`~dtm_mpi.sharding.blocks.block_owners`) sends it to ``root``. Each
    element crosses the network once and only ``root`` holds the whole array (gathering to
    every rank would cost ``ranks`` times the memory and ``ranks - 1`` times the traffic).
    With ``pin`` only the ranks at that (axis, coordinate) hold a block (elsewhere ``x`` is
    ignored, and may be None).

    Collective: call on all ranks."""
    mesh, rank = comm.mesh, comm.rank
    if t.layout.partial is not None:
        if pin is not None:
            raise LayoutError(f"a pinned value cannot be pending ({t})")
        plain = t.layout.with_partial(None)
        plan = plan_redistribute(t, plain, mesh)
        assert x is not None
        x = run_redistribution(plan, plan.rank_specs(rank), x, comm)
        t = t.with_layout(plain)
    owners = block_owners(t.shape, t.layout, mesh, pin)
    if rank != root:
        for owner, _ in owners:
            if owner == rank:
                assert x is not None
                comm.send(x, root, OUTPUT_TAG)
        comm.flush()
        return None
    out = np.empty(t.shape, dtype=x.dtype if x is not None else np_dtype(t.dtype))
    for owner, region in owners:
        if owner == rank:
            assert x is not None
            out[region] = x
        else:
            shape = tuple(s.stop - s.start for s in region)
            out[region] = comm.recv(shape, out.dtype, owner, OUTPUT_TAG)
    return out


class Executor:
    """Runs ``plan`` on one rank through ``comm`` with ``backend``'s kernels; in deterministic
    mode (``DTM_DETERMINISTIC``, or ``deterministic=``) the ops that sum floats run their
    exact forms (:mod:`dtm_mpi.kernels.exact`), so results do not depend on the mesh."""

    def __init__(
        self,
        plan: ExecPlan,
        comm: Comm,
        backend: str | ArrayBackend = "numpy",
        deterministic: bool | None = None,
    ) -> None:
        self.plan = plan
        self.deterministic = get_config().deterministic if deterministic is None else deterministic
        self.precision = Precision(get_config().deterministic_matmul)  # its matmul's
        block = get_config().quant_allreduce
        self.quantized = QuantizedComm(comm, block) if block and not self.deterministic else None
        self.comm = self.quantized if self.quantized is not None else comm
        self.mesh = plan.mesh
        self.rank = comm.rank
        if isinstance(backend, str):  # by name: numpy, or a GPU backend opened here (or an error)
            self.backend = open_backend(parse_backend(backend))
        else:
            self.backend = backend
        self.kernels = backend_kernels(self.backend.name)
        self.faults = bool(get_config().faults)  # DTM_FAULT: an instruction before each op
        self._step = 0  # the step being run (read by the ops that depend on it, and calls)
        # per-op facts of this rank, computed once (the plan, and so its ops, outlive them)
        self._kernels: dict[int, tuple[Kernel, KernelContext]] = {}
        self._specs_of: dict[int, tuple[StepSpec, ...]] = {}
        self._allreduce_specs: dict[tuple[tuple[str, ...], ReduceOp, int], AllreduceSpec] = {}
        self._programs: dict[int, list[Instr]] = {}
        self._types: dict[int, dict[str, TensorType]] = {}
        # each program without its shape checks: it replaces the checked one after one run
        self._unchecked: dict[int, list[Instr]] = {}
        # fused elementwise chains on the CPU (DTM_FUSE) in chunks; a GPU backend's generated
        # kernels (the numpy backend's op-by-op run stays the reference without DTM_FUSE)
        self.cpu_fuse = (
            self.backend.name == "numpy" and not self.backend.fuses and get_config().fuse
        )

    # -- per-op facts, computed once per rank -------------------------------------------------
    def local_shape(self, t: TensorType) -> tuple[int, ...]:
        return local_shape(t.shape, t.layout, self.mesh, self.rank)

    def _kernel(self, p: PlanOp, step: int) -> tuple[Kernel, KernelContext]:
        """The op's kernel and context on this rank (computed once; only ``step`` changes)."""
        got = self._kernels.get(id(p))
        if got is None:
            op = p.op
            kernel = self.kernels.get(op.name)
            if kernel is None:
                raise KernelError(f"backend has no kernel for op {op.name!r}")
            ctx = KernelContext(
                op,
                p.operand_types,
                op.result_types,
                tuple(self.local_shape(t) for t in op.result_types),
                tuple(
                    local_offsets(t.shape, t.layout, self.mesh, self.rank) for t in op.result_types
                ),
                step,
                tuple(
                    local_offsets(t.shape, t.layout, self.mesh, self.rank) for t in p.operand_types
                ),
            )
            got = self._kernels[id(p)] = (kernel, ctx)
        if got[1].step != step:
            got = self._kernels[id(p)] = (got[0], replace(got[1], step=step))
        return got

    def _specs(self, p: PlanOp) -> tuple[StepSpec, ...]:
        got = self._specs_of.get(id(p))
        if got is None:
            assert p.redist is not None
            got = self._specs_of[id(p)] = p.redist.rank_specs(self.rank)
        return got

    def _peer(self, axes: tuple[str, ...], coord: int) -> int:
        """The rank equal to this one except at ``coord`` along ``axes`` (one axis)."""
        group = self.mesh.group_of(self.rank, axes)
        return group[coord]

    # -- running ------------------------------------------------------------------------------
    def run(self, args: Sequence[np.ndarray], step: int = 0) -> tuple[np.ndarray, ...]:
        """Run the entry function on this rank's blocks of its arguments.

        Collective: call on all ranks."""
        if self.quantized is not None:
            self.quantized.begin_step()
        results = self.run_function(self.plan.entry_plan, args, step)
        self.comm.flush()
        return results

    def run_function(
        self, fp: FunctionPlan, args: Sequence[np.ndarray], step: int
    ) -> tuple[np.ndarray, ...]:
        """Run ``fp`` on this rank: its instructions (:mod:`dtm_mpi.runtime.instructions`) in
        order, the one loop of every mode (fused chains, exact sums, overlapped allreduces and
        injected faults are instructions and schedules of the program).

        Collective: call on all ranks."""
        self._step = step
        f = fp.function
        env: dict[str, np.ndarray] = {p.name: a for p, a in zip(f.params, args, strict=True)}
        p: PlanOp | None = None
        pending: dict[Bucket, tuple[Pending, list[tuple[int, ...]]]] = {}
        try:
            with np.errstate(all="ignore"):  # IEEE results (inf, nan) are the ops' semantics
                for p, operands, results, frees, call, sched in self._program(fp):  # noqa: B007  (p: for the error)
                    if sched is not None:  # overlapped allreduces (plan.overlap), skipped ops
                        for b in sched.finish:
                            self._finish_bucket(fp, b, pending.pop(b), env)
                        for start in sched.start:
                            pending[start.bucket] = self._start_bucket(fp, start, env)
                        if sched.skip:
                            for name in frees:
                                env.pop(name, None)
                            continue
                    outs = call([env[n] for n in operands])
                    for r, v in zip(results, outs, strict=True):
                        env[r] = v
                    for name in frees:
                        env.pop(name, None)
                    if pending:  # MPI moves a non-blocking collective only while called
                        for handle, _ in pending.values():
                            handle.test()
                p = None
                for b in list(pending):  # needed by the function's results
                    self._finish_bucket(fp, b, pending.pop(b), env)
        except DtmError as err:
            if p is not None and getattr(err, "phase", None) is None:
                err.phase = f"step {step}, {p.op.name} at {p.where}"  # type: ignore[attr-defined]
            raise
        except Exception as exc:  # a kernel's numpy error: name the op and where
            if p is None:
                raise
            raise KernelError(
                f"{p.op.name} at {p.where} failed on rank {self.rank}: {type(exc).__name__}: {exc}"
            ) from exc
        trusted = self._unchecked.pop(id(fp), None)
        if trusted is not None:  # every kernel gave its planned shapes: unchecked from now
            self._programs[id(fp)] = trusted  # on (shapes are static)
        return tuple(env[r] for r in f.returns)

    # -- the program: each op prepared once ------------------------------------------------------
    def _program(self, fp: FunctionPlan) -> list[Instr]:
        """``fp``'s instructions on this rank (computed once): each op with its operand,
        result and freed names and its call -- for a local op that does not read the step,
        its kernel prepared for its context (:func:`~dtm_mpi.kernels.dispatch.prepare_kernel`); a
        fused chain at its root (a GPU backend's generated kernel, or the CPU's chunks), its
        other ops skipped; an exact sum (deterministic mode); where allreduces overlap
        (:func:`~dtm_mpi.plan.overlap.overlap_buckets`) the buckets completed and started
        before each op. The first run checks the shapes of non-elementwise kernels' results;
        later runs use the unchecked calls."""
        got = self._programs.get(id(fp))
        if got is not None:
            return got
        res = resolve_pending(fp, fp.buckets) if self.deterministic else None
        groups = self._groups(fp, res)
        roots = {g.root: g for g in groups}
        skipped = {m for g in groups for m in g.members if m != g.root}
        skipped.update(m for b in fp.buckets for m in b.members)
        for p in fp.ops:  # a gather of a parameter stored sharded (run here or in a bucket)
            if p.kind is OpKind.REDIST and not keeps_gather_of(p.op.operands[0], fp.function):
                for spec in self._specs(p):
                    self.comm.transient(spec)
        frees_of, drops = hold_bucket_operands(
            fp, fused_frees(fp, groups) if groups else [p.frees for p in fp.ops]
        )
        scheds = self._scheds(fp, drops, skipped, res)
        program: list[tuple[Instr, PreparedKernel | None]] = []  # each with its first run's check
        for i, p in enumerate(fp.ops):
            if self.faults:  # DTM_FAULT: the op's fault point first
                program.append(
                    (
                        (p, (), (), (), functools.partial(_fault_at, self.rank, p.op.name), None),
                        None,
                    )
                )
            sched = scheds.get(i)
            if i in skipped:
                assert sched is not None and sched.skip
                program.append(((p, (), (), frees_of[i], _never, sched), None))
                continue
            for name in res.plain_before.get(i, ()) if res is not None else ():
                plain = self._plain(p, name, self._type_of(fp, name), sched)
                if plain is not None:
                    program.append((plain, None))
                    sched = None  # (given to the first instruction of the op)
            operands, call, check = self._prepare(fp, i, p, roots.get(i), res)
            program.append(((p, operands, p.op.results, frees_of[i], call, sched), check))
        for name in res.plain_at_return if res is not None else ():
            plain = self._plain(fp.ops[-1], name, self._type_of(fp, name), None)
            if plain is not None:
                program.append((plain, None))
        self._unchecked[id(fp)] = [ins for ins, _ in program]
        checked = [ins if check is None else (*ins[:4], check, ins[5]) for ins, check in program]
        self._programs[id(fp)] = checked
        return checked

    def _groups(self, fp: FunctionPlan, res: Resolution | None) -> list[FusedGroup]:
        """The fused chains this rank runs at their roots: every group on a GPU backend, the
        chains larger than a core's cache on the CPU (``DTM_FUSE``); in deterministic mode
        none that touches a resolved pending sum (:func:`without_resolved`)."""
        if not (self.backend.fuses or self.cpu_fuse):
            return []
        groups = list(fusion_groups(fp))
        if not self.backend.fuses:
            groups = [
                g
                for g in groups
                if chunkable(fp, g, math.prod(self.local_shape(fp.ops[g.root].op.result_types[0])))
            ]
        return without_resolved(groups, fp, res) if res is not None else list(groups)

    def _scheds(
        self,
        fp: FunctionPlan,
        drops: dict[Bucket, tuple[str, ...]],
        skipped: set[int],
        res: Resolution | None,
    ) -> dict[int, Sched]:
        """Per op: the buckets completed and started before it (``drops``: what each drops
        once packed; where this rank packs ``-0.0``), and whether it is skipped."""
        starts = buckets_starting(fp.buckets)
        finishes: dict[int, list[Bucket]] = {}
        for b in fp.buckets:
            finishes.setdefault(b.finish, []).append(b)
        out: dict[int, Sched] = {}
        for i in sorted(set(starts) | set(finishes) | skipped):
            begun = []
            for b in starts.get(i, ()):
                resolved = res.bucket_resolved.get(b) if res is not None else None
                zeroed = tuple(
                    bool(resolved and resolved[k])
                    and not self._first(self._type_of(fp, fp.ops[m].op.operands[0]))
                    for k, m in enumerate(b.members)
                )
                begun.append(BucketStart(b, drops[b], zeroed))
            out[i] = Sched(tuple(finishes.get(i, ())), tuple(begun), i in skipped)
        return out

    def _prepare(
        self, fp: FunctionPlan, i: int, p: PlanOp, group: FusedGroup | None, res: Resolution | None
    ) -> tuple[tuple[str, ...], PreparedKernel, PreparedKernel | None]:
        """Op ``i``'s operand names, its call, and the call checking its results' shapes on
        the first run (None: the call itself)."""
        if group is not None:
            t = p.op.result_types[0]
            shape = self.local_shape(t)
            if self.backend.fuses:  # a generated kernel
                kernel = functools.partial(
                    self.backend.run_fused,
                    _expr(group.tree),
                    group.lastdim,
                    dtype=np_dtype(t.dtype),
                    shape=shape,
                )
                return group.inputs, _positional(kernel), None
            plan = chunked_chain(fp, group, lambda m: self._prepared_local(fp.ops[m])[0], shape)
            return plan.inputs, functools.partial(run_chunked, plan), None
        if res is not None and i in res.exact:
            _, ctx = self._kernel(p, 0)
            flags = res.operand_resolved[i]
            duplicate = any(
                r and not self._first(t) for r, t in zip(flags, p.operand_types, strict=True)
            )
            return p.op.operands, functools.partial(self._run_exact, ctx, duplicate), None
        if p.kind is OpKind.LOCAL and not OPS[p.op.name].has(Trait.NEEDS_STEP):
            prepared, check = self._prepared_local(p)
            return p.op.operands, prepared, check
        return p.op.operands, functools.partial(self._run_op, p), None

    def _prepared_local(self, p: PlanOp) -> tuple[PreparedKernel, PreparedKernel | None]:
        """A local op's kernel prepared for its context, and (non-elementwise ops: their result
        shapes may differ from the plan's if a kernel is wrong) the same call checked."""
        kernel, ctx = self._kernel(p, 0)
        call: PreparedKernel = prepare_kernel(self.backend.name, kernel, ctx) or functools.partial(
            kernel, ctx
        )
        if OPS[p.op.name].has(Trait.ELEMENTWISE):  # (elementwise: the operands' shapes)
            return call, None
        return call, functools.partial(self._checked, p, call, ctx.local_shapes)

    def _plain(self, p: PlanOp, name: str, t: TensorType, sched: Sched | None) -> Instr | None:
        """The instruction turning resolved pending sum ``name`` back into its plain form on
        this rank (None where this rank is its group's first: it keeps the whole value)."""
        if self._first(t):
            return None
        shape, dtype = self.local_shape(t), np_dtype(t.dtype)
        full = self.backend.full

        def plain(xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
            return (full(shape, -0.0, dtype),)

        return (p, (name,), (name,), (), plain, sched)

    def _first(self, t: TensorType) -> bool:
        """Whether this rank is the first of the group over which ``t`` is a pending sum."""
        axes = pending_axes(t, self.mesh)
        return not axes or self.mesh.index_along(self.rank, axes) == 0

    def _type_of(self, fp: FunctionPlan, name: str) -> TensorType:
        """The type of value ``name`` of ``fp`` (every name, computed once per function)."""
        types = self._types.get(id(fp))
        if types is None:
            types = {v.name: v.type for v in fp.function.params}
            for q in fp.ops:
                types.update(zip(q.op.results, q.op.result_types, strict=True))
            self._types[id(fp)] = types
        return types[name]

    # -- what instructions call ---------------------------------------------------------------
    def _start_bucket(
        self, fp: FunctionPlan, start: BucketStart, env: dict[str, np.ndarray]
    ) -> tuple[Pending, list[tuple[int, ...]]]:
        """Start a bucket's allreduce: its members' operands in one buffer (one alone as it
        is; a resolved pending sum's plain form where this rank packs ``-0.0``); operands
        whose last use was their member op are dropped once packed. A prefetched gather
        starts its one member's allgather."""
        b = start.bucket
        if b.kind is StepKind.ALLGATHER:
            assert not start.drops  # (a parameter: never freed)
            p = fp.ops[b.members[0]]
            (spec,) = self._specs(p)
            assert isinstance(spec, AllgatherSpec)
            return self.comm.start_allgather(env[p.op.operands[0]], b.axes, spec), []
        xs = [env[fp.ops[m].op.operands[0]] for m in b.members]
        if any(start.zeroed):
            xs = [
                self.backend.full(tuple(x.shape), -0.0, x.dtype) if z else x
                for x, z in zip(xs, start.zeroed, strict=True)
            ]
        shapes = [tuple(x.shape) for x in xs]
        buf = xs[0] if len(xs) == 1 else np.concatenate([x.reshape(-1) for x in xs])
        assert b.op is not None
        spec = self._allreduce_spec(b.axes, b.op, int(buf.size))
        handle = self.comm.start_allreduce(buf, b.axes, spec)
        for n in start.drops:
            env.pop(n, None)
        return handle, shapes

    def _finish_bucket(
        self,
        fp: FunctionPlan,
        b: Bucket,
        started: tuple[Pending, list[tuple[int, ...]]],
        env: dict[str, np.ndarray],
    ) -> None:
        """Wait for bucket ``b`` and hand each member its result."""
        handle, shapes = started
        out = handle.wait()
        if len(shapes) <= 1:  # one allreduce, or a prefetched gather
            env[fp.ops[b.members[0]].op.results[0]] = out
            return
        flat, at = out.reshape(-1), 0
        for m, shape in zip(b.members, shapes, strict=True):
            n = math.prod(shape)
            env[fp.ops[m].op.results[0]] = flat[at : at + n].reshape(shape)
            at += n

    def _allreduce_spec(self, axes: tuple[str, ...], op: ReduceOp, count: int) -> AllreduceSpec:
        key = (axes, op, count)
        got = self._allreduce_specs.get(key)
        if got is None:
            got = self._allreduce_specs[key] = allreduce_spec(self.mesh, self.rank, axes, op, count)
        return got

    def _checked(
        self,
        p: PlanOp,
        call: PreparedKernel,
        wants: tuple[tuple[int, ...], ...],
        xs: Sequence[np.ndarray],
    ) -> tuple[np.ndarray, ...]:
        outs = call(xs)
        self._check_shapes(p, outs, wants)
        return outs

    def _check_shapes(
        self, p: PlanOp, outs: Sequence[np.ndarray], wants: Sequence[tuple[int, ...]]
    ) -> None:
        for out, want in zip(outs, wants, strict=True):
            if out.shape != want:
                raise KernelError(
                    f"{p.op.name} at {p.where}: kernel gave local shape {list(out.shape)} on "
                    f"rank {self.rank}; the plan says {list(want)}"
                )

    def _run_exact(
        self, ctx: KernelContext, duplicate: bool, xs: Sequence[np.ndarray]
    ) -> tuple[np.ndarray, ...]:
        """The op's exact form (deterministic mode): computed on the host, across the ranks of
        its pending group (:func:`~dtm_mpi.kernels.exact_ranks.exact_across`); every rank of
        the group ends with the whole result (a resolved pending sum)."""
        host = [self.backend.to_host(x) for x in xs]
        rule = exact_rule(ctx.op)
        assert rule is not None  # (prepared only where it applies)
        out = exact_across(
            rule, ctx, host, self.comm, duplicate=duplicate, precision=self.precision
        )
        return (self.backend.to_device(out),)

    def _run_op(self, p: PlanOp, xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        """An op that is not prepared once: communication, calls, and local ops that read the
        step (``NEEDS_STEP``)."""
        kind = p.kind
        op = p.op
        if kind is OpKind.LOCAL:
            kernel, ctx = self._kernel(p, self._step)
            outs = kernel(ctx, xs)
            self._check_shapes(p, outs, ctx.local_shapes)
            return outs
        if kind is OpKind.REDIST:
            assert p.redist is not None
            out = run_redistribution(p.redist, self._specs(p), xs[0], self.comm, self.backend)
            if op.result_types[0].dtype is DType.BF16 and isinstance(out, np.ndarray):
                out = round_bf16(out)  # a reduction over ranks adds bf16 values in binary32
            return (out,)
        if kind is OpKind.BROADCAST:
            return (self.comm.broadcast(xs[0], p.axes, p.root),)
        if kind is OpKind.SEND:
            if self.mesh.index_along(self.rank, p.axes) == p.root:
                self.comm.send(xs[0], self._peer(p.axes, p.dst), p.tag)
            return ()
        if kind is OpKind.RECV:
            t = op.result_types[0]
            shape = self.local_shape(t)
            dtype = np_dtype(t.dtype)
            if self.mesh.index_along(self.rank, p.axes) == p.dst:
                return (self.comm.recv(shape, dtype, self._peer(p.axes, p.root), p.tag),)
            return (self.backend.zeros(shape, dtype),)
        if kind is OpKind.CALL:
            callee = self.plan.function(str(op.attr("callee")))
            return self.run_function(callee, list(xs), self._step)
        raise CommError(f"unknown plan op kind {kind}")  # pragma: no cover


def _fault_at(rank: int, where: str, xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """An injected fault's instruction (``DTM_FAULT``): fails here if it names this rank and
    op, else does nothing."""
    maybe_fail(rank, where)
    return ()


def _never(xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:  # pragma: no cover
    raise AssertionError("a skipped op's instruction is never called")


def _positional(call: Callable[..., np.ndarray]) -> PreparedKernel:
    """A generated kernel's call as a prepared call (operands in, one result out)."""

    def run(xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        return (call(xs),)

    return run


def _expr(node: FusionNode | int) -> Expr | int:
    """A planned fusion tree as the kernel generator's expression."""
    if isinstance(node, int):
        return node
    return Expr(node.op, tuple(_expr(a) for a in node.args), node.attrs)
