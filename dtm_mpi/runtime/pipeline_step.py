"""A rank's part of a pipelined training step: the passes of the stages it holds, run per
microbatch in its schedule's order (:mod:`dtm_mpi.plan.schedule`), the boundary values sent
and received along the pipeline axis, the parameter gradients summed over the microbatches,
and the loss published from the last stage to every rank.

The mesh has a pipeline axis (``pp``) besides the model's axes: stage ``s`` runs on the ranks
whose ``pp`` coordinate is ``s % pp``, each holding its blocks in the model's layouts over
the other axes, so a boundary value crosses as the local block of the rank with the same
coordinates on the next (or previous) stage -- no redistribution. Every pass is compiled once
(:func:`~dtm_mpi.plan.program.compile_plan` of :func:`~dtm_mpi.ir.stages.pass_module`) and
run by the one interpreter (:class:`~dtm_mpi.runtime.executor.Executor`); its collectives
run among the ranks of its stage.

Before anything runs, each route's block shape and dtype are checked on both sides against
the plan, and the schedule's sends and receives pair up (:func:`~dtm_mpi.plan.schedule.check_schedule`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from dtm_mpi.comm.interface import Comm
from dtm_mpi.config import get_config
from dtm_mpi.errors import PayloadIntegrityError, PlanError, UsageError
from dtm_mpi.faults import maybe_fail
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.nodes import MeshDecl
from dtm_mpi.ir.stages import CLIP_TOTAL, StagePass, StepStages
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.plan.pipeline import PipelinePlan, boundary_bundles, stage_memory, stage_plans
from dtm_mpi.plan.program import ExecPlan
from dtm_mpi.plan.schedule import Compute, Recv, Schedule, Send, Work
from dtm_mpi.runtime.executor import Executor
from dtm_mpi.runtime.policies import PipelinePolicy
from dtm_mpi.runtime.values import init_block
from dtm_mpi.sharding.blocks import local_block, local_offsets, local_shape
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import allreduce_spec

__all__ = [
    "FIRST_RESERVED_TAG",
    "PipelineExecutor",
    "PipelineRank",
    "StepOutcome",
    "plan_pipelined_run",
    "stage_plans",
]

FIRST_RESERVED_TAG = 32761
"""The runtime's own messages use tags from here up (agreements, outputs, resizes): a
pipeline's boundary messages stay below."""


@dataclass(slots=True)
class StepOutcome:
    """A pipelined step on one rank: the loss (the same bits on every rank) and this rank's
    blocks of the gradients of its stages' parameters, summed over the microbatches (with an
    optimizer, :attr:`PipelineRank.blocks` then holds the updated parameters)."""

    loss: float
    grads: dict[str, np.ndarray] = field(default_factory=dict)
    grad_norm: float | None = None
    """With clipping: the gradients' global 2-norm before it (the square root of the total
    the clip divides by, as the unpipelined step computes it)."""


class _Pass:
    """One pass compiled for this rank."""

    def __init__(
        self, sp: StagePass, plan: ExecPlan, comm: Comm, deterministic: bool = False
    ) -> None:
        self.carries = sp.carries
        self.params = tuple(p.name for p in sp.function.params)
        self.types = tuple(p.type for p in sp.function.params)
        self.executor = Executor(plan, comm, deterministic=deterministic)

    def run(self, values: Mapping[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        # (not Executor.run: its flush would wait for this rank's boundary sends to be taken,
        # tying every pass to the peer's schedule; the step flushes once, at its end)
        exe = self.executor
        out = exe.run_function(exe.plan.entry_plan, [values[n] for n in self.params], step)
        return dict(zip(self.carries, out, strict=True))


class PipelineRank:
    """This rank's stages of ``stages`` (``axis``: the pipeline axis of ``shape``), run as
    ``schedule`` says. ``values``: global initial values of parameters by name (default:
    each parameter's init; none with ``initial=False``: the caller sets :attr:`blocks`);
    ``plans``: the passes already compiled (:func:`stage_plans`; default: this rank's
    compiled here).

    In deterministic mode (``DTM_DETERMINISTIC``) the passes run exact sums, and so that the
    step has the unpipelined step's bits, the sums over the batch run over the whole batch
    once per step: each stage's weight-gradient pass of ``whole`` (the stages traced on the
    whole batch; ``whole_plans`` compiled) on every microbatch's values joined, after the
    schedule's forward and input-gradient passes, and the loss by the last stage's
    whole-batch forward. Every microbatch's values are then held to the step's end."""

    def __init__(
        self,
        stages: StepStages,
        schedule: Schedule,
        mesh: MeshDecl,
        shape: MeshShape,
        comm: Comm,
        *,
        axis: str = "pp",
        values: Mapping[str, np.ndarray] | None = None,
        plans: Mapping[str, ExecPlan] | None = None,
        initial: bool = True,
        whole: StepStages | None = None,
        whole_plans: Mapping[str, ExecPlan] | None = None,
        microbatch_sums: bool = False,
    ) -> None:
        self.deterministic = get_config().deterministic
        if (whole is None) != (whole_plans is None):
            raise UsageError("give the whole-batch stages and their plans together")
        if self.deterministic and whole is None and not microbatch_sums:
            raise UsageError(
                "deterministic mode runs a pipeline's weight passes on the whole batch: give the whole-batch stages (plan_pipelined_run plans them), or microbatch_sums=True for a step written per microbatch"
            )
        # deterministic mode with the whole batch's stages: the weight passes run once per step
        # on every microbatch's values joined (the unpipelined step's bits); without them (an
        # IR forward written per microbatch) each microbatch's passes run exact sums, added in
        # microbatch order (the same bits on every mesh)
        self.whole_batch = self.deterministic and whole is not None
        if axis not in shape.axis_names:
            raise UsageError(f"the mesh {shape} has no pipeline axis {axis!r}")
        if shape.axis_size(axis) != schedule.shape.ranks:
            raise UsageError(
                f"the schedule is for {schedule.shape.ranks} pipeline ranks; the mesh has {axis}={shape.axis_size(axis)}"
            )
        if schedule.shape.stages != len(stages.passes):
            raise UsageError(
                f"the schedule runs {schedule.shape.stages} stages; the model is cut into {len(stages.passes)}"
            )
        self.stages, self.schedule, self.shape, self.comm = stages, schedule, shape, comm
        self.rank = comm.rank
        self.pp = shape.index_along(self.rank, (axis,))
        self.pp_group = shape.group_of(self.rank, (axis,))  # ranks along pp, in pp order
        self.axis = axis
        self.mine = [s for s in stages.passes if schedule.shape.rank_of(s.index) == self.pp]
        if plans is None:
            plans = stage_plans(replace(stages, passes=tuple(self.mine)), mesh, shape)
        det = self.deterministic
        compiled = {
            sp.function.name: _Pass(sp, plans[sp.function.name], comm, det)
            for s in self.mine
            for sp in s.all()
        }
        self.passes = {
            (s.index, work): compiled[sp.function.name]
            for s in self.mine
            for work, sp in ((Work.F, s.forward), (Work.I, s.input_grad), (Work.W, s.weight_grad))
        }
        self.updates = {s.index: compiled[s.update.function.name] for s in self.mine if s.update}
        self.reduces = {  # the gradients' deferred data-parallel sums, once per step
            s.index: compiled[s.reduce_grads.function.name] for s in self.mine if s.reduce_grads
        }
        self.square_sums = [compiled[s.square_sum.function.name] for s in self.mine if s.square_sum]
        # the parameters of this rank's stages, and their optimizer state
        self.owned = [n for s in self.mine for n in (s.update.carries if s.update else s.params)]
        given = values or {}
        by_name = {p.name: p for p in stages.params}
        self.blocks: dict[str, np.ndarray] = {}
        for name in self.owned if initial else ():  # this rank's blocks only: no global array
            p = by_name[name]
            t = p.type
            value = given.get(name.lstrip("%"))
            if value is None:
                block = init_block(
                    p,
                    local_offsets(t.shape, t.layout, shape, self.rank),
                    local_shape(t.shape, t.layout, shape, self.rank),
                )
            else:
                block = np.asarray(value)[local_block(t.shape, t.layout, shape, self.rank)]
            self.blocks[name] = np.ascontiguousarray(block)
        self._routes = {r.value: r for r in (*stages.partition.routes, *stages.grad_routes)}
        self._received = {  # a routed value's block on this rank: shape, dtype
            v: (local_shape(r.type.shape, r.type.layout, shape, self.rank), np_dtype(r.type.dtype))
            for v, r in self._routes.items()
        }
        self._fed = {  # a fed input's type in a microbatch
            p.name: p.type
            for s in stages.passes
            for p in s.forward.function.params
            if p.name in {n for st in stages.partition.stages for n in st.inputs}
        }
        self._bundles = boundary_bundles(stages)
        widest = max((len(b) for b in self._bundles.values()), default=1)
        if widest * (schedule.shape.max_tag + 1) > FIRST_RESERVED_TAG:
            raise UsageError(
                f"{schedule.shape.microbatches} microbatches over {schedule.shape.stages} stages with up to {widest} values per boundary need more than {FIRST_RESERVED_TAG} message tags (fewer microbatches or stages)"
            )
        self._tag_stride = schedule.shape.max_tag + 1
        self._drops = self._last_uses()
        # deterministic mode: the whole-batch passes, and where each joins its microbatches
        self.whole_w: dict[int, _Pass] = {}
        self.whole_f: dict[int, _Pass] = {}
        self._joins: dict[tuple[int, str], int | None] = {}
        self._loss_at = 0  # the loss among the last stage's forward results
        if self.whole_batch:
            assert whole is not None and whole_plans is not None
            m = schedule.shape.microbatches
            for s in self.mine:
                w = whole.passes[s.index]
                big_w = _Pass(w.weight_grad, whole_plans[w.weight_grad.function.name], comm, True)
                big_f = _Pass(w.forward, whole_plans[w.forward.function.name], comm, True)
                self.whole_w[s.index], self.whole_f[s.index] = big_w, big_f
                made = set(big_f.carries)
                # the forward's inputs, and the weight pass's that the whole-batch forward does
                # not make (the input-gradient passes' cotangents), join their microbatches'
                # values (the two traces' passes match by position)
                for micro, big in (
                    (self.passes[(s.index, Work.F)], big_f),
                    (self.passes[(s.index, Work.W)], big_w),
                ):
                    for name, theirs, a, b in zip(
                        micro.params, big.params, micro.types, big.types, strict=True
                    ):
                        if big is big_w and theirs in made:
                            continue
                        self._joins[(s.index, name)] = _join_dim(name, a.shape, b.shape, m)
            last = len(stages.passes) - 1
            if any(s.index == last for s in self.mine):
                self._loss_at = stages.passes[last].forward.carries.index(stages.loss)
            self._drops = [() for _ in self._drops]  # the whole-batch passes read them last
        # the step's parameters in the order the unpipelined step adds their square sums
        owners = {n for s in stages.passes for n in s.params}
        self._sq_order = [p.name for p in stages.params if p.name in owners]
        self.seconds: dict[tuple[int, Work], list[float]] = {}
        """Each pass's run times, by (stage, F/I/W), over every step so far (benchmarks)."""
        self.schedule_seconds = 0.0
        """The last step's schedule on this rank: its passes and messages, from the first
        action to the last send taken (the optimizer and the loss's publication after)."""
        self.waited_seconds = 0.0
        """Of that, the time spent in receives and in the last wait for its sends to be
        taken: the rank's idle share of the schedule (the bubble), transfers included."""
        self._check_routes()

    def _last_uses(self) -> list[tuple[str, ...]]:
        """Per action of this rank's schedule, the values of its microbatch that no later
        action reads: what it read for the last time, and what it made that nothing reads
        (dropped then: a microbatch's activations live only as long as the schedule needs
        them, as its memory model counts)."""
        actions = self.schedule.actions[self.pp]
        later: set[tuple[int, str]] = set()  # (microbatch, value) read after the action
        drops: list[tuple[str, ...]] = []
        for action in reversed(actions):
            reads: tuple[str, ...] = ()
            made: tuple[str, ...] = ()
            if isinstance(action, Send):
                reads = self._bundles[(action.what, action.stage)]
            elif isinstance(action, Compute):
                works = (Work.I, Work.W) if action.work is Work.B else (action.work,)
                passes = [self.passes[(action.stage, w)] for w in works]
                reads = tuple(n for p in passes for n in p.params)
                made = tuple(n for p in passes for n in p.carries)
            mb = action.microbatch
            drops.append(tuple(n for n in dict.fromkeys((*reads, *made)) if (mb, n) not in later))
            later.update((mb, n) for n in reads)
        return drops[::-1]

    def _check_routes(self) -> None:
        """Every value this rank receives is declared, in the plan, with the block its sender
        computes: the same shape and dtype on both sides (a mismatch is a located error
        before any data moves, the same on every rank)."""
        for action in self.schedule.actions[self.pp]:
            if not isinstance(action, Send | Recv):
                continue
            peer = self.pp_group[action.peer]
            for value in self._bundles[(action.what, action.stage)]:
                route = self._routes[value]
                mine = self._received[value][0]
                theirs = local_shape(route.type.shape, route.type.layout, self.shape, peer)
                if mine != theirs:
                    raise PlanError(
                        f"route {route} (made at {route.span}): rank {self.rank} holds a block of {list(mine)} but rank {peer} one of {list(theirs)}"
                    )

    def step(self, batch: Mapping[str, np.ndarray], step: int = 0) -> StepOutcome:
        """Run one step on this rank's blocks of the step's fed inputs (``batch``, by name,
        in the unpipelined step's layouts: :meth:`batch_blocks` cuts them from global
        arrays), each split into the schedule's microbatches along its first dimension.

        Collective: call on all ranks."""
        m = self.schedule.shape.microbatches
        envs: list[dict[str, np.ndarray]] = [dict(self.blocks) for _ in range(m)]
        for name, block in batch.items():
            rows = self._micro_rows(name, block, m)
            for k, env in enumerate(envs):
                env["%" + name] = block[k * rows : (k + 1) * rows]
        if self.stages.microbatch is not None:  # microbatch_index: counted over the run
            for k, env in enumerate(envs):
                env[self.stages.microbatch] = np.array(step * m + k, dtype=np.int64)
        grads: dict[str, np.ndarray] = {}
        loss = np.zeros((), np.float64)
        faults = bool(get_config().faults)  # DTM_FAULT=RANK:send|recv:KIND, mid-schedule
        waited = 0.0  # in receives and the last flush: waiting for the pipeline (and copying)
        started = time.perf_counter()
        for i, action in enumerate(self.schedule.actions[self.pp]):
            env = envs[action.microbatch]
            if faults and isinstance(action, Send | Recv):
                maybe_fail(self.rank, "send" if isinstance(action, Send) else "recv")
            if isinstance(action, Send):
                for k, value in enumerate(self._bundles[(action.what, action.stage)]):
                    tag = action.tag + k * self._tag_stride
                    self.comm.send(env[value], self.pp_group[action.peer], tag)
            elif isinstance(action, Recv):
                t0 = time.perf_counter()
                for k, value in enumerate(self._bundles[(action.what, action.stage)]):
                    shape, dtype = self._received[value]
                    tag = action.tag + k * self._tag_stride
                    try:
                        env[value] = self.comm.recv(shape, dtype, self.pp_group[action.peer], tag)
                    except PayloadIntegrityError as err:  # name the pipeline's route too
                        raise PayloadIntegrityError(
                            f"{err} ({value}, {action.what.value} of microbatch "
                            f"{action.microbatch} from stage {action.stage} over {self.axis})",
                            rank=err.rank,
                        ) from None
                waited += time.perf_counter() - t0
            else:
                loss = self._compute(action, env, grads, loss, step)
            for name in self._drops[i]:
                env.pop(name, None)
        if self.whole_batch:
            loss = self._whole_batch(envs, batch, grads, loss, step)
        else:
            for reduce in self.reduces.values():  # the microbatches' local sums, reduced once
                pairs = zip(reduce.params, reduce.carries, strict=True)
                pending = {p: grads[name] for p, name in pairs}
                grads.update(reduce.run(pending, step))
        t0 = time.perf_counter()
        self.comm.flush()
        done = time.perf_counter()
        self.waited_seconds = waited + (done - t0)
        self.schedule_seconds = done - started
        named = {f"{n}.grad": g for n, g in grads.items()}
        norm = None
        if self.square_sums:  # clipping by the global norm: every stage's square sum, added
            named[CLIP_TOTAL] = self._clip_total(named, step)
            norm = float(np.sqrt(named[CLIP_TOTAL]))
        for s in self.mine:  # the optimizer, once per step, on the summed gradients
            update = self.updates.get(s.index)
            if update is not None:
                self.blocks.update(update.run({**self.blocks, **named}, step))
        last = self.schedule.shape.rank_of(len(self.stages.passes) - 1)
        published = self.comm.broadcast(np.reshape(loss, (1,)), (self.axis,), last)
        return StepOutcome(float(published[0]), grads, norm)

    def _compute(
        self,
        c: Compute,
        env: dict[str, np.ndarray],
        grads: dict[str, np.ndarray],
        loss: np.ndarray,
        step: int,
    ) -> np.ndarray:
        works: tuple[Work, ...] = (Work.I, Work.W) if c.work is Work.B else (c.work,)
        if self.whole_batch:  # the weight passes run once, on the whole batch, at the end
            works = tuple(w for w in works if w is not Work.W)
        for work in works:
            start = time.perf_counter()
            out = self.passes[(c.stage, work)].run(env, step)
            if work is Work.W:  # the gradients summed over the microbatches, in place
                for name, g in zip(self.stages.passes[c.stage].params, out.values(), strict=True):
                    if name in grads:
                        np.add(grads[name], g, out=grads[name])
                    else:
                        grads[name] = np.array(g, copy=True)
            spent = self.seconds.setdefault((c.stage, work), [])
            spent.append(time.perf_counter() - start)
            env.update(out)
            if work is Work.F and self.stages.loss in out:
                loss = loss + out[self.stages.loss]
        return loss

    def _whole_batch(
        self,
        envs: list[dict[str, np.ndarray]],
        batch: Mapping[str, np.ndarray],
        grads: dict[str, np.ndarray],
        loss: np.ndarray,
        step: int,
    ) -> np.ndarray:
        """Deterministic mode, after the schedule: each of this rank's stages' forward again
        on the whole batch (its inputs every microbatch's joined), then its weight pass on
        the whole batch (the forward's values, and the input-gradient passes' cotangents
        joined): every sum over the batch exact over the whole batch, as unpipelined; the
        last stage's forward gives the loss. Returns the loss (this rank's: the last
        stage's, else the one given)."""
        m = self.schedule.shape.microbatches
        last = len(self.stages.passes) - 1

        def join(stage: int, mine: str) -> np.ndarray:
            if mine.lstrip("%") in batch:  # a fed input: this rank's block of the batch
                return batch[mine.lstrip("%")]
            dim = self._joins[(stage, mine)]
            values = [envs[k][mine] for k in range(m)]
            return values[0] if dim is None else np.concatenate(values, axis=dim)

        for s in self.mine:
            start = time.perf_counter()
            big_f, big_w = self.whole_f[s.index], self.whole_w[s.index]
            micro_f, micro_w = self.passes[(s.index, Work.F)], self.passes[(s.index, Work.W)]
            env = {**self.blocks}
            for theirs, mine in zip(big_f.params, micro_f.params, strict=True):
                env[theirs] = env[mine] if mine in self.blocks else join(s.index, mine)
            made = big_f.run(env, step)
            if s.index == last:
                loss = np.asarray(list(made.values())[self._loss_at], dtype=np.float64)
            inputs = {}
            for theirs, mine in zip(big_w.params, micro_w.params, strict=True):
                if theirs in made:
                    inputs[theirs] = made[theirs]
                elif mine in self.blocks:
                    inputs[theirs] = self.blocks[mine]
                else:
                    inputs[theirs] = join(s.index, mine)
            out = big_w.run(inputs, step)
            for name, g in zip(self.stages.passes[s.index].params, out.values(), strict=True):
                grads[name] = g
            self.seconds.setdefault((s.index, Work.W), []).append(time.perf_counter() - start)
        return loss

    def _clip_total(self, named: Mapping[str, np.ndarray], step: int) -> np.ndarray:
        """The square sum of every gradient of the step, as the unpipelined step adds it: each
        parameter's square sum (from its stage's pass), gathered over the pipeline axis, added
        one by one in the step's parameter order in their dtype."""
        mine: dict[str, np.ndarray] = {}
        for p in self.square_sums:
            mine.update(p.run(named, step))
        slots = np.zeros(len(self._sq_order), np.float64)  # others' slots 0: the sum is exact
        dtype = next(iter(mine.values())).dtype
        for i, name in enumerate(self._sq_order):
            if f"{name}.sqsum" in mine:
                slots[i] = float(mine[f"{name}.sqsum"])
        spec = allreduce_spec(self.shape, self.rank, (self.axis,), ReduceOp.SUM, len(slots))
        every = self.comm.allreduce(slots, (self.axis,), spec)
        total = dtype.type(every[0])
        for x in every[1:]:
            total = total + dtype.type(x)
        return np.asarray(total, dtype=dtype).reshape(())

    def held_bytes(self) -> int:
        """The bytes of one microbatch's held activations (what its forward pass returns for
        its backward passes) on this rank's largest stage: what the plan's peak count of held
        microbatches multiplies."""
        return max(
            (stage_memory(self.stages, s.index, self.shape, self.rank).held for s in self.mine),
            default=0,
        )

    def batch_blocks(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's blocks of the global fed inputs ``batch`` (what a loader gives it)."""
        out = {}
        m = self.schedule.shape.microbatches
        for name, whole in batch.items():
            t = self._fed.get("%" + name)
            if t is None:
                raise UsageError(f"fed input {name!r} is not an input of any stage")
            shape = (t.shape[0] * m, *t.shape[1:])
            out[name] = np.ascontiguousarray(
                whole[local_block(shape, t.layout, self.shape, self.rank)]
            )
        return out

    def _micro_rows(self, name: str, block: np.ndarray, m: int) -> int:
        """The rows of each of the ``m`` microbatches of this rank's block of ``name``."""
        t = self._fed.get("%" + name)
        if t is None:
            raise UsageError(f"fed input {name!r} is not an input of any stage")
        want = local_shape(t.shape, t.layout, self.shape, self.rank)
        if block.shape != (want[0] * m, *want[1:]):
            raise UsageError(
                f"fed input {name!r}: rank {self.rank}'s block is {list(block.shape)}; {m} microbatches of {list(want)} expected"
            )
        return want[0]


def _join_dim(name: str, micro: tuple[int, ...], whole: tuple[int, ...], m: int) -> int | None:
    """The dimension along which ``m`` microbatch values of shape ``micro`` join into the
    whole batch's ``whole`` (None: the same value in every microbatch)."""
    if micro == whole:
        return None
    dims = []
    if len(micro) == len(whole):
        differ = [d for d, (a, b) in enumerate(zip(micro, whole, strict=True)) if a != b]
        dims = [d for d in differ if whole[d] == micro[d] * m]
        dims = dims if len(differ) == 1 else []
    if len(dims) != 1:
        raise UsageError(
            f"{name}: a microbatch's {list(micro)} does not join into the whole batch's {list(whole)} along one dimension; deterministic mode cannot run this pipeline"
        )
    return dims[0]


class PipelineExecutor:
    """The step runner of a pipelined run (what :class:`~dtm_mpi.runtime.step_loop.StepLoop`
    runs each step, in place of the :class:`~dtm_mpi.runtime.executor.Executor` of the
    unpipelined step ``plan``): this rank's blocks of the step's state and fed inputs in
    (None for state another ``pp`` coordinate holds), its stages run as ``pipeline`` plans
    them (:class:`PipelineRank`), and the results out in the order of the unpipelined step's:
    the loss (the same bits on every rank), then each state parameter's new value (None on
    the ranks that do not hold it).

    Collective per step: call on all ranks."""

    def __init__(self, plan: ExecPlan, pipeline: PipelinePlan, comm: Comm) -> None:
        from dtm_mpi.ir.verify import function_mesh

        entry = plan.entry_plan.function
        mesh = function_mesh(plan.module, entry)
        assert mesh is not None
        self.plan, self.pipeline, self.rank = plan, pipeline, comm.rank
        self.runner = PipelineRank(
            pipeline.stages,
            pipeline.schedule,
            mesh,
            plan.mesh,
            comm,
            axis=pipeline.axis,
            plans=pipeline.passes,
            initial=False,
            whole=pipeline.whole,
            whole_plans=pipeline.whole_passes,
            microbatch_sums=pipeline.whole is None,  # (planned: a traced step has them)
        )
        index = {p.name: i for i, p in enumerate(entry.params)}
        self.state = [(name, index[name]) for name in self.runner.owned]
        fed_names = {n for st in pipeline.stages.partition.stages for n in st.inputs}
        self.fed = [
            (p.name.lstrip("%"), i) for i, p in enumerate(entry.params) if p.name in fed_names
        ]
        self.results: list[tuple[str | None, np.dtype[np.generic]]] = []
        for spec in entry.results:
            if spec.updates is None and spec.type.shape != ():
                raise UsageError(
                    f"@{entry.name} returns {spec.type}: a pipelined step returns its loss and state updates only"
                )
            self.results.append((spec.updates, np_dtype(spec.type.dtype)))
        scalars = sum(1 for u, _ in self.results if u is None)
        clipped = bool(self.runner.square_sums)
        if scalars != 1 and not (scalars == 2 and clipped):
            raise UsageError(
                f"@{entry.name} returns {scalars} scalars: a pipelined step reports its loss "
                "(and, clipped, the gradient norm) only"
            )

    @property
    def seconds(self) -> dict[tuple[int, Work], list[float]]:
        return self.runner.seconds

    def run(self, blocks: list[np.ndarray | None], step: int) -> tuple[np.ndarray | None, ...]:
        runner = self.runner
        for name, i in self.state:
            block = blocks[i]
            assert block is not None, f"rank {self.rank} holds no block of {name}"
            runner.blocks[name] = block
        batch = {}
        for name, i in self.fed:
            block = blocks[i]
            assert block is not None
            batch[name] = block
        got = runner.step(batch, step)
        scalars = iter((got.loss, got.grad_norm))  # the loss, then the gradient norm
        return tuple(
            np.asarray(next(scalars), dtype=dtype)
            if updates is None
            else runner.blocks.get(updates)
            for updates, dtype in self.results
        )


def plan_pipelined_run(
    policy: PipelinePolicy, plan: ExecPlan, *, fed: tuple[str, ...] = (), backend: str = "numpy"
) -> PipelinePlan:
    """The pipeline plan of a run of ``plan`` (the unpipelined training step on the run's
    mesh) with ``policy`` (pure: every rank computes the same). Refused, naming why:
    deterministic mode, another backend than numpy, a mesh without the pipeline axis, and
    the refusals of :func:`~dtm_mpi.plan.pipeline.plan_pipeline`."""
    from dtm_mpi.ir.verify import function_mesh
    from dtm_mpi.plan.pipeline import plan_pipeline
    from dtm_mpi.plan.schedule import PipelineShape

    deterministic = get_config().deterministic and policy.whole_batch
    m = policy.microbatches
    if deterministic and m & (m - 1):
        raise UsageError(
            f"deterministic mode pipelines take a power of two of microbatches (so that their scaled losses have the unpipelined gradients' bits); got --microbatches {m}"
        )
    if backend != "numpy":
        raise UsageError(f"pipeline stages run on the numpy backend only; got --backend {backend}")
    if policy.axis not in plan.mesh.axis_names:
        raise UsageError(
            f"a pipelined step needs a {policy.axis!r} axis in its mesh; the run's is {plan.mesh}"
        )
    shape = PipelineShape(plan.mesh.axis_size(policy.axis), policy.microbatches, policy.chunks)
    entry = plan.entry_plan.function
    mesh = function_mesh(plan.module, entry)
    assert mesh is not None
    return plan_pipeline(
        entry,
        policy.stages(shape.stages, False),
        policy.schedule,
        shape,
        mesh,
        plan.mesh,
        axis=policy.axis,
        fed=fed,
        whole=policy.stages(shape.stages, True) if deterministic else None,
    )
