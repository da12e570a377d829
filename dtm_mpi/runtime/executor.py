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
from dataclasses import dataclass, replace

import numpy as np

from dtm_mpi.comm.interface import Comm, Pending
from dtm_mpi.config import get_config
from dtm_mpi.errors import CommError, DtmError, KernelError
from dtm_mpi.faults import maybe_fail
from dtm_mpi.ir.dtypes import np_dtype, round_bf16
from dtm_mpi.ir.registry import OPS, Trait
from dtm_mpi.ir.types import DType, ReduceOp, TensorType
from dtm_mpi.kernels.backends import parse_backend
from dtm_mpi.kernels.devices import ArrayBackend, open_backend
from dtm_mpi.kernels.dispatch import (
    BoundKernel,
    Kernel,
    KernelContext,
    backend_kernels,
    bind_kernel,
)
from dtm_mpi.kernels.exact import (
    EXACT_RULES,
    Levels,
    applies,
    canonical,
    exact_axes,
    pending_axes,
)
from dtm_mpi.kernels.fused import Expr
from dtm_mpi.plan.fusion import FusedGroup, FusionNode, fusion_groups
from dtm_mpi.plan.overlap import Bucket
from dtm_mpi.plan.program import ExecPlan, FunctionPlan, OpKind, PlanOp
from dtm_mpi.sharding import collectives
from dtm_mpi.sharding.blocks import block_owners, local_offsets, local_shape
from dtm_mpi.sharding.redistribute import RedistPlan, plan_redistribute
from dtm_mpi.sharding.steps import STEP_KINDS, AllreduceSpec, StepKind, StepRule, StepSpec

__all__ = ["STEP_RUNNERS", "Executor", "gather_to_root", "run_redistribution"]

OUTPUT_TAG = 32767
"""The point-to-point tag of output gathers (the largest tag every MPI must support; messages
between two ranks with one tag arrive in the order sent)."""


_StepRunner = Callable[[np.ndarray, tuple[str, ...], StepSpec, Comm, Callable[..., np.ndarray]], np.ndarray]  # fmt: skip


def _step_runner(rule: StepRule) -> _StepRunner:
    """How this rank runs a step of ``rule``'s kind: a collective calls the communicator's
    method the table names; a local kind runs its function of ``sharding.collectives``."""
    if rule.kind.is_collective:
        method, extra = rule.method, rule.args
        if not extra:  # the common case, kept to one lookup and one call

            def collective(x: np.ndarray, axes: tuple[str, ...], spec: StepSpec, comm: Comm,
                           full: Callable[..., np.ndarray]) -> np.ndarray:  # fmt: skip
                return getattr(comm, method)(x, axes, spec)  # type: ignore[no-any-return]

            return collective

        def collective_with(x: np.ndarray, axes: tuple[str, ...], spec: StepSpec, comm: Comm,
                            full: Callable[..., np.ndarray]) -> np.ndarray:  # fmt: skip
            return getattr(comm, method)(x, axes, spec, *extra)  # type: ignore[no-any-return]

        return collective_with
    local = getattr(collectives, rule.method)

    def alone(x: np.ndarray, axes: tuple[str, ...], spec: StepSpec, comm: Comm,
              full: Callable[..., np.ndarray]) -> np.ndarray:  # fmt: skip
        return local(x, spec, full)  # type: ignore[no-any-return]

    return alone


STEP_RUNNERS: dict[StepKind, _StepRunner] = {k: _step_runner(r) for k, r in STEP_KINDS.items()}
"""Each step kind's runner on one rank, built once from :data:`STEP_KINDS`."""


def run_redistribution(
    plan: RedistPlan, specs: Sequence[StepSpec], x: np.ndarray, comm: Comm,
    backend: ArrayBackend | None = None,
) -> np.ndarray:  # fmt: skip
    """Run ``plan`` on this rank's block ``x`` (``specs``: this rank's step specs; ``x`` an
    array of ``backend``, numpy by default). Each step goes through its kind's runner
    (:data:`STEP_RUNNERS`, from the step-kind table :data:`STEP_KINDS`).

    Collective: call on all ranks."""
    full = np.full if backend is None else backend.full
    for step, spec in zip(plan.steps, specs, strict=True):
        x = STEP_RUNNERS[step.kind](x, step.axes, spec, comm, full)
    return x


def gather_to_root(t: TensorType, x: np.ndarray, comm: Comm, root: int = 0) -> np.ndarray | None:
    """The global value of ``t`` on ``root`` (None elsewhere) from every rank's block ``x``:
    a pending reduction is resolved first (over its axes only), then the owner of each
    distinct block (:func:`~dtm_mpi.sharding.blocks.block_owners`) sends it to ``root``. Each
    element crosses the network once and only ``root`` holds the whole array (gathering to
    every rank would cost ``ranks`` times the memory and ``ranks - 1`` times the traffic).

    Collective: call on all ranks."""
    mesh, rank = comm.mesh, comm.rank
    if t.layout.partial is not None:
        plain = t.layout.with_partial(None)
        plan = plan_redistribute(t, plain, mesh)
        x = run_redistribution(plan, plan.rank_specs(rank), x, comm)
        t = t.with_layout(plain)
    owners = block_owners(t.shape, t.layout, mesh)
    if rank != root:
        for owner, _ in owners:
            if owner == rank:
                comm.send(x, root, OUTPUT_TAG)
        comm.flush()
        return None
    out = np.empty(t.shape, dtype=x.dtype)
    for owner, region in owners:
        if owner == rank:
            out[region] = x
        else:
            shape = tuple(s.stop - s.start for s in region)
            out[region] = comm.recv(shape, x.dtype, owner, OUTPUT_TAG)
    return out


CHUNK_ELEMS = 16384
"""Elements per chunk of a fused chain on the CPU (64 KiB of float32 per array: the
chain's inputs and intermediates stay in a core's L2 cache)."""
MIN_CHUNKED_ELEMS = 8 * CHUNK_ELEMS
"""The smallest chain run in chunks: below it the arrays fit in a core's cache anyway, and
op by op is as fast (measured: a 9-op chain over 512x4096 float32 1.5x faster in chunks,
over 256x1024 1.4x, a 1-d chain of 65,536 elements 1.7x slower)."""


@dataclass(frozen=True, slots=True)
class _Chunked:
    """A fused elementwise chain as the CPU runs it: its inputs, its ops in order (a bound
    call with operand names, result and the intermediates it reads last; ``None``: a bias
    broadcast, its vector aliased), the result name, local shape and dtype."""

    inputs: tuple[str, ...]
    steps: tuple[tuple[BoundKernel | None, tuple[str, ...], str, tuple[str, ...]], ...]
    result: str
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]


@dataclass(frozen=True, slots=True)
class _Sched:
    """Overlapped allreduces at one op: buckets to complete and to start before it, and
    whether the op is a bucket's member (not run: its result comes with the bucket)."""

    finish: tuple[Bucket, ...]
    start: tuple[tuple[Bucket, tuple[str, ...]], ...]  # with the operands to drop once packed
    skip: bool


_Instr = tuple[PlanOp, tuple[str, ...], tuple[str, ...], tuple[str, ...], "BoundKernel | None", _Sched | None]  # fmt: skip
"""One op as the executor's fast loop runs it: (op, operands, results, frees, bound call,
overlap schedule)."""


@dataclass(frozen=True, slots=True)
class _Fusion:
    roots: dict[int, FusedGroup]
    frees: dict[int, tuple[str, ...]]  # at a root: every member's frees
    skip: frozenset[int]


def _fused_frees(fp: FunctionPlan, groups: Sequence[FusedGroup]) -> dict[int, tuple[str, ...]]:
    """What each op frees when groups run at their roots: a root frees what its members
    freed, and an input of a group is never freed before the group's root reads it (an op
    between a member and the root that was its last other user no longer frees it; the
    root does)."""
    frees = {i: list(p.frees) for i, p in enumerate(fp.ops)}
    for g in sorted(groups, key=lambda g: g.root):
        members = set(g.members)
        frees[g.root] = [n for m in g.members for n in fp.ops[m].frees]
        for m in g.members:
            if m != g.root:
                frees[m] = []
        inputs = set(g.inputs)
        for j in range(min(members), g.root):
            if j in members:
                continue
            moved = [n for n in frees[j] if n in inputs]
            if moved:
                frees[j] = [n for n in frees[j] if n not in inputs]
                frees[g.root] += moved
    return {i: tuple(dict.fromkeys(v)) for i, v in frees.items()}


def _expr(node: FusionNode | int) -> Expr | int:
    """A planned fusion tree as the kernel generator's expression."""
    if isinstance(node, int):
        return node
    return Expr(node.op, tuple(_expr(a) for a in node.args))


class Executor:
    """Runs ``plan`` on one rank through ``comm`` with ``backend``'s kernels; in deterministic
    mode (``DTM_DETERMINISTIC``, or ``deterministic=``) the ops that sum floats run their
    exact forms (:mod:`dtm_mpi.kernels.exact`), so results do not depend on the mesh."""

    def __init__(
        self, plan: ExecPlan, comm: Comm, backend: str | ArrayBackend = "numpy",
        deterministic: bool | None = None,
    ) -> None:  # fmt: skip
        self.plan = plan
        self.deterministic = get_config().deterministic if deterministic is None else deterministic
        self.comm = comm
        self.mesh = plan.mesh
        self.rank = comm.rank
        if isinstance(backend, str):  # by name: numpy, or a GPU backend opened here (or an error)
            self.backend = open_backend(parse_backend(backend))
        else:
            self.backend = backend
        self.kernels = backend_kernels(self.backend.name)
        self._fusion: dict[int, _Fusion] = {}
        # per-op facts of this rank, computed once (the plan, and so its ops, outlive them)
        self._kernels: dict[int, tuple[Kernel, KernelContext]] = {}
        self._specs_of: dict[int, tuple[StepSpec, ...]] = {}
        self._allreduce_specs: dict[tuple[tuple[str, ...], ReduceOp, int], AllreduceSpec] = {}
        self._programs: dict[int, list[_Instr]] = {}
        # each program without its shape checks: it replaces the checked one after one run
        self._unchecked: dict[int, list[_Instr]] = {}
        # fused elementwise chains on the CPU (DTM_FUSE): the numpy backend's fast loop
        self.cpu_fuse = self.backend.name == "numpy" and not self.backend.fuses and get_config().fuse  # fmt: skip

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
        results = self.run_function(self.plan.entry_plan, args, step)
        self.comm.flush()
        return results

    def run_function(
        self, fp: FunctionPlan, args: Sequence[np.ndarray], step: int
    ) -> tuple[np.ndarray, ...]:
        """Collective: call on all ranks."""
        if self.deterministic or self.backend.fuses or get_config().faults:
            return self._run_general(fp, args, step)
        f = fp.function
        env: dict[str, np.ndarray] = {p.name: a for p, a in zip(f.params, args, strict=True)}
        p: PlanOp | None = None
        pending: dict[Bucket, tuple[Pending, list[tuple[int, ...]]]] = {}
        try:
            with np.errstate(all="ignore"):  # IEEE results (inf, nan) are the ops' semantics
                for p, operands, results, frees, call, sched in self._program(fp):
                    if sched is not None:  # overlapped allreduces (plan.overlap)
                        for b in sched.finish:
                            self._finish_bucket(fp, b, pending.pop(b), env)
                        for b, drops in sched.start:
                            pending[b] = self._start_bucket(fp, b, env, drops)
                        if sched.skip:  # a bucket member: its result comes with the bucket
                            for name in frees:
                                env.pop(name, None)
                            continue
                    if call is not None:  # a local op, bound once
                        outs = call([env[n] for n in operands])
                    else:
                        outs = self._run_op(p, [env[n] for n in operands], step)
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

    def _program(self, fp: FunctionPlan) -> list[_Instr]:
        """``fp``'s ops as this rank runs them (computed once): each op with its operand,
        result and freed names, for a local op that does not read the step its kernel bound
        to its context (:func:`~dtm_mpi.kernels.dispatch.bind_kernel`); on the CPU each fused
        elementwise chain (:func:`~dtm_mpi.plan.fusion.fusion_groups`, ``DTM_FUSE``) run at
        its root in chunks, its other ops skipped; where allreduces overlap
        (:func:`~dtm_mpi.plan.overlap.overlap_buckets`) the buckets completed and started
        before each op, and whether it is a bucket's member (run with its bucket)."""
        got = self._programs.get(id(fp))
        if got is not None:
            return got
        buckets: tuple[Bucket, ...] = fp.buckets
        starts: dict[int, list[Bucket]] = {}
        finishes: dict[int, list[Bucket]] = {}
        members: dict[int, Bucket] = {}
        for b in buckets:
            starts.setdefault(b.start, []).append(b)
            finishes.setdefault(b.finish, []).append(b)
            for m in b.members:
                members[m] = b
        bound: list[BoundKernel | None] = []
        checked: dict[int, BoundKernel] = {}  # the first run's calls that check shapes
        for i, p in enumerate(fp.ops):
            call = None
            if p.kind is OpKind.LOCAL and not OPS[p.op.name].has(Trait.NEEDS_STEP):
                kernel, ctx = self._kernel(p, 0)
                call = bind_kernel(self.backend.name, kernel, ctx) or functools.partial(kernel, ctx)  # fmt: skip
                if not OPS[p.op.name].has(Trait.ELEMENTWISE):  # (elementwise: the same shapes)
                    checked[i] = functools.partial(self._checked, p, call, ctx.local_shapes)
            bound.append(call)
        frees_of = [p.frees for p in fp.ops]
        chunked: dict[int, _Chunked] = {}
        skipped: set[int] = set()
        if self.cpu_fuse:  # chains larger than a core's cache (smaller: op by op)
            groups = [g for g in fusion_groups(fp) if self._chunkable(fp, g)]
            fused_frees = _fused_frees(fp, groups)
            frees_of = [fused_frees[i] for i in range(len(fp.ops))]
            for g in groups:
                chunked[g.root] = self._chunk_plan(fp, g, bound)
                skipped.update(m for m in g.members if m != g.root)
        # a member's operand stays until its bucket starts (it may be freed before: by its
        # member op, or by another op reading it last): dropped when the bucket has packed it
        held: dict[int, set[str]] = {}
        drops: dict[Bucket, tuple[str, ...]] = {}
        for b in buckets:
            names = {fp.ops[m].op.operands[0] for m in b.members}
            freed = {n for j in range(b.start) for n in frees_of[j] if n in names}
            drops[b] = tuple(sorted(freed))
            for j in range(b.start):
                held.setdefault(j, set()).update(names)
        got = []
        for i, p in enumerate(fp.ops):
            op = p.op
            call = bound[i]
            operands, results = op.operands, op.results
            frees = frees_of[i]
            if i in chunked:  # the root of a fused chain: the chain, evaluated in chunks
                plan = chunked[i]
                call, operands = functools.partial(self._run_chunked, plan), plan.inputs
            bucket = members.get(i)
            if i in held:
                frees = tuple(n for n in frees if n not in held[i])
            sched = None
            if i in starts or i in finishes or bucket is not None or i in skipped:
                sched = _Sched(tuple(finishes.get(i, ())), tuple((b, drops[b]) for b in starts.get(i, ())), bucket is not None or i in skipped)  # fmt: skip
            got.append((p, operands, results, frees, call, sched))
        self._unchecked[id(fp)] = got
        self._programs[id(fp)] = [(*ins[:4], checked.get(i, ins[4]), ins[5]) for i, ins in enumerate(got)]  # fmt: skip
        return self._programs[id(fp)]

    def _chunkable(self, fp: FunctionPlan, g: FusedGroup) -> bool:
        """Whether the CPU runs group ``g`` in chunks: every member an elementwise op with
        an array function (the numpy backend's bound call) or an absorbed bias broadcast."""
        if math.prod(self.local_shape(fp.ops[g.root].op.result_types[0])) < MIN_CHUNKED_ELEMS:
            return False
        for m in g.members:
            name = fp.ops[m].op.name
            if not (OPS[name].has(Trait.ELEMENTWISE) and OPS[name].array_fn is not None) and not OPS[name].has(Trait.BROADCASTS):  # fmt: skip
                return False
        return True

    def _chunk_plan(self, fp: FunctionPlan, g: FusedGroup, bound: Sequence[BoundKernel | None]) -> _Chunked:  # fmt: skip
        steps: list[tuple[BoundKernel | None, tuple[str, ...], str, tuple[str, ...]]] = []
        made: set[str] = set()  # the chain's intermediates: each read once, then dropped
        for m in g.members:
            op = fp.ops[m].op
            names = (op.operands[0],) if OPS[op.name].has(Trait.BROADCASTS) else op.operands
            call = None if OPS[op.name].has(Trait.BROADCASTS) else bound[m]  # a bias: aliased
            steps.append((call, names, op.results[0], tuple(n for n in dict.fromkeys(names) if n in made)))  # fmt: skip
            made.add(op.results[0])
        t = fp.ops[g.root].op.result_types[0]
        shape = self.local_shape(t)
        return _Chunked(tuple(dict.fromkeys(g.inputs)), tuple(steps), g.result, shape, np_dtype(t.dtype))  # fmt: skip

    def _run_chunked(self, plan: _Chunked, xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        """A fused elementwise chain on the CPU: its ops in order (each the op's own bound
        call: the op-by-op results bit for bit) over blocks of ``CHUNK_ELEMS`` elements of
        rows, so the intermediates stay in cache instead of one full array per op."""
        shape = plan.shape
        if len(shape) == 1:  # a vector: rows of one (a bias vector is the whole vector too)
            shape2 = (shape[0], 1)
            flat = [x.reshape(shape2) for x in xs]
        else:
            shape2 = (math.prod(shape[:-1]), shape[-1])
            flat = [x if x.ndim == 1 else x.reshape(shape2) for x in xs]  # (1-d: a bias vector)
        rows, cols = shape2
        step = max(1, CHUNK_ELEMS // max(cols, 1))
        out = np.empty(shape2, dtype=plan.dtype)
        for r0 in range(0, rows, step):
            env = {n: (x if x.ndim == 1 else x[r0 : r0 + step]) for n, x in zip(plan.inputs, flat, strict=True)}  # fmt: skip
            for call, names, result, drops in plan.steps:
                env[result] = env[names[0]] if call is None else call([env[n] for n in names])[0]  # fmt: skip
                for n in drops:
                    del env[n]
            out[r0 : r0 + step] = env[plan.result]
        return (out.reshape(shape),)

    def _start_bucket(self, fp: FunctionPlan, b: Bucket, env: dict[str, np.ndarray], drops: tuple[str, ...]) -> tuple[Pending, list[tuple[int, ...]]]:  # fmt: skip
        """Start bucket ``b``'s allreduce: its members' operands in one buffer (one alone as
        it is); operands whose last use was their member op are dropped once packed."""
        names = [fp.ops[m].op.operands[0] for m in b.members]
        xs = [env[n] for n in names]
        shapes = [tuple(x.shape) for x in xs]
        buf = xs[0] if len(xs) == 1 else np.concatenate([x.reshape(-1) for x in xs])
        spec = self._allreduce_spec(b.axes, b.op, int(buf.size))
        handle = self.comm.start_allreduce(buf, b.axes, spec)
        for n in drops:
            env.pop(n, None)
        return handle, shapes

    def _finish_bucket(self, fp: FunctionPlan, b: Bucket, started: tuple[Pending, list[tuple[int, ...]]], env: dict[str, np.ndarray]) -> None:  # fmt: skip
        """Wait for bucket ``b`` and hand each member its result."""
        handle, shapes = started
        out = handle.wait()
        if len(shapes) == 1:
            env[fp.ops[b.members[0]].op.results[0]] = out
            return
        flat, at = out.reshape(-1), 0
        for m, shape in zip(b.members, shapes, strict=True):
            n = math.prod(shape)
            env[fp.ops[m].op.results[0]] = flat[at : at + n].reshape(shape)
            at += n

    def _checked(self, p: PlanOp, call: BoundKernel, wants: tuple[tuple[int, ...], ...], xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:  # fmt: skip
        outs = call(xs)
        self._check_shapes(p, outs, wants)
        return outs

    def _check_shapes(self, p: PlanOp, outs: Sequence[np.ndarray], wants: Sequence[tuple[int, ...]]) -> None:  # fmt: skip
        for out, want in zip(outs, wants, strict=True):
            if out.shape != want:
                raise KernelError(
                    f"{p.op.name} at {p.where}: kernel gave local shape {list(out.shape)} on "
                    f"rank {self.rank}; the plan says {list(want)}"
                )

    def _run_general(
        self, fp: FunctionPlan, args: Sequence[np.ndarray], step: int
    ) -> tuple[np.ndarray, ...]:
        """``run_function`` op by op with every feature: fused groups (GPU backends), exact
        sums (deterministic mode) and injected faults."""
        f = fp.function
        faults = bool(get_config().faults)
        env: dict[str, np.ndarray] = {p.name: a for p, a in zip(f.params, args, strict=True)}
        fused = self._fused(fp)
        # deterministic mode: the pending sums every rank of their group holds whole (the
        # results of exact ops, and local ops of them); turned back into the plain form of a
        # pending sum (first rank whole, others -0.0) before anything else reads them
        resolved: set[str] = set()
        types = {v.name: v.type for v in f.params}
        for index, p in enumerate(fp.ops):
            op = p.op
            group = None
            if fused is not None:
                if index in fused.skip:  # computed by its group's root
                    continue
                group = fused.roots.get(index)
            try:
                if faults:
                    maybe_fail(self.rank, op.name)
                keeps = False
                if resolved:
                    keeps = group is None and self._keeps_resolved(p, resolved)
                    if not keeps:
                        for n in op.operands:
                            if n in resolved:
                                self._materialize(n, types[n], env)
                                resolved.discard(n)
                if group is not None:
                    outs = self._run_group(p, group, env)
                elif self.deterministic and p.kind is OpKind.LOCAL and applies(op):
                    _, ctx = self._kernel(p, step)
                    outs = (self._run_exact(ctx, [env[n] for n in op.operands], [n in resolved for n in op.operands]),)  # fmt: skip
                    if op.result_types[0].layout.partial is not None:
                        keeps = True
                else:
                    outs = self._run_op(p, [env[n] for n in op.operands], step)
            except DtmError as err:
                if getattr(err, "phase", None) is None:
                    err.phase = f"step {step}, {op.name} at {p.where}"  # type: ignore[attr-defined]
                raise
            except Exception as exc:  # a kernel's numpy error: name the op and where
                raise KernelError(
                    f"{op.name} at {p.where} failed on rank {self.rank}: {type(exc).__name__}: {exc}"
                ) from exc
            for r, v, t in zip(op.results, outs, op.result_types, strict=True):
                env[r] = v
                if self.deterministic:
                    types[r] = t
                    if keeps and t.layout.partial is not None:
                        resolved.add(r)
            for name in p.frees if fused is None else fused.frees[index]:
                env.pop(name, None)
                resolved.discard(name)
        for r in f.returns:  # what leaves the function is in the plain form
            if r in resolved:
                self._materialize(r, types[r], env)
        return tuple(env[r] for r in f.returns)

    def _fused(self, fp: FunctionPlan) -> _Fusion | None:
        """The fused elementwise groups of ``fp`` where the backend runs them (GPU backends;
        the numpy backend is the op-by-op reference), computed once per function."""
        if not self.backend.fuses:
            return None
        got = self._fusion.get(id(fp))
        if got is None:
            groups = fusion_groups(fp)
            roots = {g.root: g for g in groups}
            skip = {m for g in groups for m in g.members if m != g.root}
            got = self._fusion[id(fp)] = _Fusion(roots, _fused_frees(fp, groups), frozenset(skip))  # fmt: skip
        return got

    def _run_group(self, p: PlanOp, group: FusedGroup, env: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:  # fmt: skip
        t = p.op.result_types[0]
        shape = self.local_shape(t)
        xs = [env[n] for n in group.inputs]
        return (self.backend.run_fused(_expr(group.tree), group.lastdim, xs, np_dtype(t.dtype), shape),)  # fmt: skip

    def _allreduce_spec(self, axes: tuple[str, ...], op: ReduceOp, count: int) -> AllreduceSpec:
        key = (axes, op, count)
        got = self._allreduce_specs.get(key)
        if got is None:
            group = self.mesh.group_of(self.rank, axes)
            got = self._allreduce_specs[key] = AllreduceSpec(
                group, group.index(self.rank), op, count
            )
        return got

    def _exact_allreduce(self, x: np.ndarray, axes: tuple[str, ...], op: ReduceOp) -> np.ndarray:
        return self.comm.allreduce(x, axes, self._allreduce_spec(axes, op, x.size))

    def _run_exact(self, ctx: KernelContext, xs: list[np.ndarray], resolved: Sequence[bool]) -> np.ndarray:  # fmt: skip
        """The op's exact form (deterministic mode). Where its result is a pending sum, the
        group's exponents are max-allreduced and its integer levels sum-allreduced (exact in
        any order), so every rank of the group ends with the whole result: a *resolved*
        pending sum (see :meth:`run_function`). An operand that is itself resolved is whole on
        every rank of its group: only the group's first rank contributes its levels."""
        rule = EXACT_RULES[ctx.op.name]
        axes = exact_axes(ctx.op, self.mesh)
        host = [self.backend.to_host(x) for x in xs]
        with np.errstate(all="ignore"):  # IEEE results (inf, nan) are the op's semantics
            exps = rule.exponents(ctx, host)
            if axes:
                exps = self._exact_allreduce(exps, axes, ReduceOp.MAX)
            got = rule.levels(ctx, host, exps)
            if axes:
                duplicate = any(
                    r and self.mesh.index_along(self.rank, a) != 0
                    for r, a in zip(resolved, self._operand_axes(ctx), strict=True)
                )
                levels, specials = got.levels, got.specials
                if duplicate:  # this rank's operand repeats the first rank's: no contribution
                    levels = np.zeros_like(levels)
                    specials = None if specials is None else np.zeros_like(specials)
                if specials is not None:  # where an infinity or NaN is: counted, order-free
                    specials = self._exact_allreduce(specials, axes, ReduceOp.SUM)
                got = Levels(self._exact_allreduce(levels, axes, ReduceOp.SUM), specials)
            out = np.asarray(canonical(rule.finish(ctx, got, exps)), order="C")  # (0-d stays 0-d)
        return self.backend.to_device(out)  # type: ignore[no-any-return]

    def _operand_axes(self, ctx: KernelContext) -> tuple[tuple[str, ...], ...]:
        return tuple(pending_axes(t, self.mesh) for t in ctx.operand_types)

    def _keeps_resolved(self, p: PlanOp, resolved: set[str]) -> bool:
        """Whether ``p`` can run on whole (resolved) pending sums and give one: an op with an
        exact form, or a local op whose pending operands are all resolved and whose result is
        pending over the same axes (it then computes the whole value on every rank)."""
        if p.kind is not OpKind.LOCAL:
            return False
        if applies(p.op):
            return True
        pending = [(n, t) for n, t in zip(p.op.operands, p.operand_types, strict=True) if t.layout.partial is not None]  # fmt: skip
        result = p.op.result_types[0].layout.partial if len(p.op.result_types) == 1 else None
        return bool(pending) and all(n in resolved and t.layout.partial == result for n, t in pending)  # fmt: skip

    def _materialize(self, name: str, t: TensorType, env: dict[str, np.ndarray]) -> None:
        """A resolved pending sum ``name`` back to the plain form of a pending sum: the
        group's first rank keeps the whole value, the others hold -0.0 (the additive identity
        of IEEE: any value plus -0.0 is that value, -0.0 included)."""
        axes = pending_axes(t, self.mesh)
        if axes and self.mesh.index_along(self.rank, axes) != 0:
            x = env[name]
            env[name] = self.backend.full(tuple(x.shape), -0.0, x.dtype)

    def _run_op(self, p: PlanOp, xs: list[np.ndarray], step: int) -> tuple[np.ndarray, ...]:
        kind = p.kind
        op = p.op
        if kind is OpKind.LOCAL:
            kernel, ctx = self._kernel(p, step)
            with np.errstate(all="ignore"):  # IEEE results (inf, nan) are the op's semantics
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
            return self.run_function(callee, xs, step)
        raise CommError(f"unknown plan op kind {kind}")  # pragma: no cover
