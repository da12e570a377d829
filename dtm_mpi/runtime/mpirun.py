"""``dtm run`` under ``mpirun``/``srun``: every rank runs its plan over MPI.

Phases, each ended by a bounded agreement (so a rank-local failure — an unreadable file, a bad
input — becomes the same error on every rank, naming the ranks that failed and why):

``load`` (read and verify the module) -> ``handshake`` (module hash, mesh, versions,
capabilities, backend; before any data moves) -> ``plan`` -> ``inputs`` -> ``step N`` (state
updates commit only when every rank finished the step) -> ``output`` (the owner of each distinct
block sends it to rank 0, which alone assembles the results and writes the file).

A failure inside a step (a kernel error, an injected fault) is announced to every peer at once
(:meth:`MpiSession.fail`), so peers blocked in a collective stop with the same error instead of
waiting out ``DTM_TIMEOUT``; a peer that hangs or dies is detected by the bounded waits. In
both cases communication requests may still be pending, so the job ends with
:meth:`MpiSession.end_job` (every rank prints one error, then the job is aborted: no process
survives).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dtm_mpi._version import __version__
from dtm_mpi.console import say, write_line
from dtm_mpi.errors import (
    EXIT_REQUEUE,
    DtmError,
    HandshakeError,
    LauncherTerminatedError,
    RemoteFailureError,
    RunStopped,
    UsageError,
    agreed,
)
from dtm_mpi.runtime.audit import replica_audit
from dtm_mpi.runtime.request import (
    RunRequest,
    capabilities,
    deliver_outputs,
    given_inputs,
    load_run,
    plan_pipeline_run,
    plan_run,
    store_params,
)
from dtm_mpi.runtime.step_loop import StepLoop

if TYPE_CHECKING:
    from dtm_mpi.comm.gpu_aware import GpuAwareness
    from dtm_mpi.comm.interface import Comm
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.comm.presence import Presence
    from dtm_mpi.comm.world import Communicator
    from dtm_mpi.ir.nodes import Module
    from dtm_mpi.ir.types import TensorType
    from dtm_mpi.kernels.devices import ArrayBackend, DeviceArray
    from dtm_mpi.plan.pipeline import PipelinePlan
    from dtm_mpi.plan.program import ExecPlan
    from dtm_mpi.runtime.checkpoints import StoreCheckpoints
    from dtm_mpi.runtime.step_loop import Progress
    from dtm_mpi.sharding.blocks import Pin
    from dtm_mpi.sharding.remesh import RemeshPlan

__all__ = [
    "MpiRunArgs",
    "open_backend_everywhere",
    "pipeline_groups",
    "plan_groups",
    "run_loop",
    "run_under_mpi",
]


#: What ``dtm run`` under MPI is given: the one run request of the launcher.
MpiRunArgs = RunRequest


def run_under_mpi(
    args: RunRequest | Callable[[], RunRequest], world: Communicator | None = None
) -> int:
    """Run ``args`` (checked, :class:`~dtm_mpi.runtime.request.RunRequest`) on every rank of
    ``world`` (default ``MPI.COMM_WORLD``; a task of a task graph gets its group's); returns
    0 or ends the job. Reached through
    :func:`~dtm_mpi.runtime.runner.run_request`. Given a function making the request from the
    command line instead, every rank first decides whether its arguments are valid and all
    agree (phase ``arguments``) before any may exit; a rank that dies meanwhile is named.

    Collective: call on all ranks."""
    from dtm_mpi.comm.presence import Presence
    from dtm_mpi.comm.world import finalize_world, world_comm
    from dtm_mpi.errors import CommTimeoutError

    world = world if world is not None else world_comm()
    rank, size = int(world.Get_rank()), int(world.Get_size())
    presence = Presence(world, "dtm run")  # from here on, a rank that dies is named
    try:
        if not isinstance(args, RunRequest):
            presence.phase = "arguments"
            args = _agreed_request(args)
        presence.label = args.label
        code = _load_and_run(args, world, rank, size, presence)
    except CommTimeoutError as exc:  # a phase before the session: some rank(s) did not arrive
        presence.end_job(
            1, f"{presence.label}: {exc}"
        )  # every arrived rank prints it, then the abort
        raise
    finally:
        presence.stop()
    if code == EXIT_REQUEUE:  # stopped together after saving: end MPI so the code is seen
        finalize_world()
    return code


def _agreed_request(make: Callable[[], RunRequest]) -> RunRequest:
    """The request ``make`` builds from the command line, once every rank built its own (a
    rank's error raised, else the agreed failure of the others)."""
    from dtm_mpi.comm.world import world_comm
    from dtm_mpi.faults import maybe_fail
    from dtm_mpi.runtime.request import agree_arguments

    request = None
    error: DtmError | None = None
    try:
        maybe_fail(int(world_comm().Get_rank()), "arguments")
        request = make()
    except DtmError as exc:  # from the command line alone: the same on every rank
        error = exc
    agree_arguments(error)
    if error is not None:
        raise error
    assert request is not None
    return request


def _load_and_run(
    args: RunRequest, world: Communicator, rank: int, size: int, presence: Presence
) -> int:
    from dtm_mpi.comm.agreement import agree_or_raise
    from dtm_mpi.config import get_config

    config = get_config()
    # load: every rank reads and verifies; local failures agreed on the world communicator
    presence.phase = "load"
    module = None
    error: BaseException | None = None
    try:
        from dtm_mpi.faults import maybe_fail

        maybe_fail(rank, "load")
        module = load_run(args, show=None)  # paths, module, capabilities, output keys
    except (DtmError, OSError) as exc:
        error = exc
    agree_or_raise(world, phase="load", error=error, timeout_s=config.timeout_s)
    assert module is not None
    presence.phase = "backend"
    backend = open_backend_everywhere(args.backend, world)
    presence.phase = "plan"
    return _run_session(module, args, world, rank, size, backend)


def open_backend_everywhere(name: str, world: Communicator) -> ArrayBackend:
    """Phase ``backend``: every rank opens backend ``name`` on its GPU (node-local rank); a
    rank that cannot (no CuPy, runtime or device) ends every rank with the same error naming
    it. Returns this rank's :class:`~dtm_mpi.kernels.devices.ArrayBackend`.

    Collective: call on all ranks."""
    from dtm_mpi.comm.agreement import agree_or_raise
    from dtm_mpi.comm.world import node_local_rank
    from dtm_mpi.config import get_config
    from dtm_mpi.faults import maybe_fail
    from dtm_mpi.kernels.backends import parse_backend
    from dtm_mpi.kernels.devices import open_backend

    kind = parse_backend(name)
    timeout_s = get_config().timeout_s
    # every rank, whatever its backend, takes part (a rank alone on a GPU backend is then
    # refused by the agreement below, naming its reason, instead of waiting for the others)
    # (the node's ranks: the GPU a rank binds, or its share of the CPUs for the BLAS)
    local_rank, local_size = node_local_rank(world, phase="backend", timeout_s=timeout_s)
    backend: ArrayBackend | None = None
    error: BaseException | None = None
    try:
        maybe_fail(int(world.Get_rank()), "backend")
        backend = open_backend(kind, local_rank, local_size)
    except DtmError as exc:
        error = exc
    agree_or_raise(world, phase="backend", error=error, timeout_s=timeout_s)
    assert backend is not None  # (else every rank raised)
    return backend


@dataclass
class _Live:
    """The run's session, communicators, plan and checkpoints on its current mesh: replaced
    together at a live resize."""

    session: MpiSession
    plan: ExecPlan
    rank: int
    comm: Comm | None = None
    """The session's communication interface (set by the handshake)."""
    dcomm: Comm | None = None
    """The same for the executor (device buffers on a GPU backend)."""
    ckpt: StoreCheckpoints | None = None
    """The run's checkpoints (None without ``--store``)."""
    local_aware: GpuAwareness | None = None
    worlds: list[Communicator] = field(default_factory=list)
    """The communicators resizes made (kept to the end)."""
    pool: Communicator | None = None
    """Every launched process's duplicate of the world, for resizes (None without them)."""
    members: list[int] | None = None
    """The session's ranks as pool ranks (None once spawned ones join)."""
    parked: list[int] = field(default_factory=list)
    """The pool ranks that left, waiting to be called."""
    left: list[tuple[Communicator, list[int]]] = field(default_factory=list)
    """Rank 0: the ranks that left at a shrink after ranks were spawned, by the communicator
    they wait on until the run ends (they cannot be called back: not all are in the pool)."""
    waits_on: Communicator | None = None
    """A rank that so left: the communicator it waits on for the end."""
    active: bool = True
    """False once this rank left the run, and between two sessions of a resize."""
    pipeline: PipelinePlan | None = None
    """A pipelined run's stages on the mesh (None for other runs)."""

    @property
    def endpoint(self) -> Comm:
        """The current session's communication interface (host buffers)."""
        assert self.comm is not None
        return self.comm

    @property
    def device_endpoint(self) -> Comm:
        """The current session's communication interface for the executor."""
        assert self.dcomm is not None
        return self.dcomm


def _ranks(binding: dict[str, int] | None) -> int:
    return math.prod(binding.values()) if binding else 1


def _param_types(plan: ExecPlan) -> list[TensorType]:
    return [p.type for p in plan.entry_plan.function.params]


def _planned(
    module: Module, args: MpiRunArgs, binding: dict[str, int]
) -> tuple[ExecPlan, PipelinePlan | None]:
    """The plan of the run on the mesh ``binding`` binds, and its pipeline's (if pipelined)."""
    request = replace(args, binding=binding)
    plan = plan_run(module, request, _ranks(binding))
    return plan, plan_pipeline_run(request, plan)


def _remesh(
    old: ExecPlan,
    old_pipeline: PipelinePlan | None,
    new: ExecPlan,
    new_pipeline: PipelinePlan | None,
) -> RemeshPlan:
    """Moving the run's state from ``old``'s mesh to ``new``'s, each piece of a pipelined
    run's state from and to the ranks of its stage."""
    from dtm_mpi.sharding.remesh import plan_remesh

    def pins(plan: ExecPlan, pipeline: PipelinePlan | None) -> list[Pin | None]:
        if pipeline is None:
            return []
        return [pipeline.pin_of(p.name) for p in plan.entry_plan.function.params]

    return plan_remesh(
        _param_types(old),
        old.mesh,
        _param_types(new),
        new.mesh,
        pins(old, old_pipeline),
        pins(new, new_pipeline),
    )


def _run_session(
    module: object,
    args: MpiRunArgs,
    world: Communicator,
    rank: int,
    size: int,
    backend: ArrayBackend,
) -> int:
    from dtm_mpi.comm.agreement import agree_or_raise
    from dtm_mpi.config import get_config
    from dtm_mpi.faults import maybe_fail
    from dtm_mpi.ir.nodes import Module

    assert isinstance(module, Module)
    config = get_config()
    from dtm_mpi.comm.resize import join_parents

    joining = join_parents(rank, config.timeout_s)
    if joining is not None:  # spawned by a live resize: join the running ranks
        return _join_session(module, args, backend, *joining)
    plan = pipeline = None
    error: BaseException | None = None
    try:  # pure, but a rank given another module (or another --mesh) may fail alone
        maybe_fail(rank, "plan")
        plan = plan_run(module, args, size)
        pipeline = plan_pipeline_run(args, plan)
        for step, binding in (
            args.resize.at if args.resize is not None else ()
        ):  # every mesh the run will have, checked now
            try:
                _planned(module, args, binding)
            except DtmError as exc:
                raise agreed(UsageError(f"--resize-at {step}: {exc}")) from None
    except DtmError as exc:
        error = exc
    agree_or_raise(world, phase="plan", error=error, timeout_s=config.timeout_s)
    assert plan is not None
    pool = None
    if args.resize is not None:  # ranks that leave wait here to be called back
        from dtm_mpi.comm.resize import pool_comm

        pool = pool_comm(world, rank, config.timeout_s)
    session = _new_session(plan, world)
    session.label = args.label
    live = _Live(
        session,
        plan,
        rank,
        pool=pool,
        members=list(range(size)) if pool is not None else None,
        pipeline=pipeline,
    )

    def body() -> int:
        live.session.phase = "handshake"
        maybe_fail(rank, "handshake")
        live.local_aware = _detect_gpu_aware(args, backend)
        _join(live, module, args, backend)
        return _run_steps(live, module, args, backend)

    return _guarded(live, body, from_python=args.module is not None)


def _new_session(plan: ExecPlan, world: Communicator | None) -> MpiSession:
    """A session on ``world`` (``MPI.COMM_WORLD`` when None) for ``plan``'s mesh. Collective."""
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.config import get_config

    session = MpiSession(plan.mesh, timeout_s=get_config().timeout_s, world=world, join=False)
    session.on_launcher_terminate()
    return session


def _join(live: _Live, module: Module, args: MpiRunArgs, backend: ArrayBackend) -> None:
    """The handshake (module hash, mesh, versions, capabilities, backend; joining ranks
    included), the plan's group communicators, and the communication interface. Collective."""
    from dtm_mpi.comm.handshake import PROTOCOL_VERSION, Hello, handshake, use_agreed_gemm
    from dtm_mpi.comm.mpi_comm import MpiComm
    from dtm_mpi.config import get_config
    from dtm_mpi.ir.hashing import module_hash
    from dtm_mpi.kernels.gemm import active_choice
    from dtm_mpi.plan.pipeline import pipeline_signature

    config = get_config()
    session, plan = live.session, live.plan
    hello = Hello(
        PROTOCOL_VERSION,
        __version__,
        module_hash(module),
        str(plan.mesh),
        capabilities(args.backend),
        args.backend,
        config.deterministic,
        gpu_aware="" if live.local_aware is None else str(live.local_aware),
        steps=args.steps,
        buckets=config.bucket_bytes if config.overlap else 0,
        pipeline=pipeline_signature(live.pipeline) if live.pipeline is not None else (),
        integrity=config.integrity,
        audit_every=config.audit_every,
        quant_allreduce=0 if config.deterministic else config.quant_allreduce,
        deterministic_matmul=config.deterministic_matmul if config.deterministic else "",
        gemm=active_choice(config.gemm, own=True).text() if args.backend == "numpy" else "",
    )
    hellos = handshake(session, hello)  # the module's requirements were checked in phase load
    use_agreed_gemm([h.gemm for h in hellos], session.rank)
    groups = plan_groups(plan, config.deterministic)
    if live.pipeline is not None:  # every stage's passes, and the pipeline axis
        passes = {**live.pipeline.passes, **(live.pipeline.whole_passes or {})}
        more = pipeline_groups(passes, live.pipeline.axis, config.deterministic)
        groups += [g for g in more if g not in groups]
    session.join_mesh(groups)
    live.comm = comm = MpiComm(
        session, deterministic=config.deterministic, max_msg_elems=config.max_msg_elems
    )
    live.dcomm = _device_comm(session, comm, args, backend, live.local_aware)


def _guarded(live: _Live, body: Callable[[], int], *, from_python: bool = False) -> int:
    """Run ``body``; every failure ends every rank of the current session with one error: an
    agreed one (raised alike on every rank) is a line on every rank and exit code 1 for the
    command line, and raised to the caller of a run started from Python (``from_python``:
    :func:`~dtm_mpi.frontend.fit.fit`); any other ends the job."""
    try:
        code = body()
    except LauncherTerminatedError as exc:  # a peer died: mpirun is killing the job
        if not live.active:
            raise
        live.session.report_terminated(exc)
        raise
    except BaseException as exc:  # every failure ends every rank with one error
        if not live.active:  # between two sessions of a resize: nothing to agree on
            raise
        session = live.session
        if _raised_everywhere(exc) and session.poisoned is None:
            # raised alike on every rank at the same point, nothing pending: a clean exit
            _release_parked(live)
            session.close()
            if from_python:
                raise
            write_line(f"[rank {live.rank}] dtm run: {exc}")
            return 1
        session.end_with(session.fail(exc))
        raise
    if live.active:
        live.session.close()
    return code


def _join_session(
    module: Module,
    args: MpiRunArgs,
    backend: ArrayBackend,
    world: Communicator,
    joins: tuple[int, dict[str, int], dict[str, int]],
) -> int:
    """A rank spawned by a live resize, merged with the running ranks in ``world``: ``joins``
    after which step, from which mesh to which; take part in the new session's handshake,
    receive this rank's part of the state in memory, and run the remaining steps."""
    from dtm_mpi.runtime.remesh import move_blocks

    step, before, binding = joins
    plan, pipeline = _planned(module, args, binding)
    old, old_pipeline = _planned(module, args, before)
    rank = int(world.Get_rank())
    live = _Live(_new_session(plan, world), plan, rank, worlds=[world], pipeline=pipeline)

    def body() -> int:
        live.session.phase = f"resize after step {step}"
        live.local_aware = _detect_gpu_aware(args, backend)
        _join(live, module, args, backend)
        moved = move_blocks(
            _remesh(old, old_pipeline, plan, pipeline),
            rank,
            None,
            live.endpoint,
        )
        assert moved is not None
        return _run_steps(live, module, args, backend, joined=(step, moved))

    return _guarded(live, body, from_python=args.module is not None)


def _raised_everywhere(exc: BaseException) -> bool:
    """Whether ``exc`` is raised alike on every rank at the same point (an agreed failure)."""
    return isinstance(exc, HandshakeError | RemoteFailureError) or (
        isinstance(exc, DtmError) and exc.agreed
    )


def plan_groups(plan: object, deterministic: bool) -> list[tuple[str, ...]]:
    """Every group of axes the run communicates over (the plan, the exact sums of
    deterministic mode, then the reductions pending on outputs, and the whole mesh for the
    replica audit when ``DTM_AUDIT_EVERY`` asks for one), in a fixed order: groups are
    created once, collectively, before any data moves."""
    from dtm_mpi.config import get_config
    from dtm_mpi.kernels.exact import applies, exact_axes
    from dtm_mpi.plan.program import ExecPlan, OpKind
    from dtm_mpi.sharding.redistribute import plan_redistribute

    assert isinstance(plan, ExecPlan)
    seen: list[tuple[str, ...]] = []

    def add(axes_list: list[tuple[str, ...]]) -> None:
        for axes in axes_list:
            if axes not in seen:
                seen.append(axes)

    for _, fp in plan.functions:
        for p in fp.ops:
            if p.kind is OpKind.REDIST and p.redist is not None:
                add([s.axes for s in p.redist.steps if s.kind.is_collective])
            elif p.kind is OpKind.BROADCAST:
                add([p.axes])
            elif p.kind is OpKind.LOCAL and deterministic and applies(p.op):
                add([axes for axes in [exact_axes(p.op, plan.mesh)] if axes])
    entry = plan.entry_plan.function
    for t in [r.type for r in entry.results] + [p.type for p in entry.params]:
        if t.layout.partial is not None:  # gather_to_root reduces first
            reduce = plan_redistribute(t, t.layout.with_partial(None), plan.mesh)
            add([s.axes for s in reduce.steps if s.kind.is_collective])
    if get_config().audit_every:
        add([plan.mesh.axis_names])
    return seen


def pipeline_groups(
    plans: Mapping[str, ExecPlan], axis: str = "pp", deterministic: bool = False
) -> list[tuple[str, ...]]:
    """Every group of axes a pipelined step communicates over: those of every stage's passes
    (:func:`~dtm_mpi.plan.pipeline.stage_plans`), then the pipeline axis (the loss's
    broadcast, the clipping sum); under MPI they are created once, collectively, before any
    data moves."""
    seen: list[tuple[str, ...]] = []
    for plan in plans.values():
        seen += [g for g in plan_groups(plan, deterministic) if g not in seen]
    return [*seen, *([(axis,)] if (axis,) not in seen else [])]


def _detect_gpu_aware(args: MpiRunArgs, backend: ArrayBackend) -> GpuAwareness | None:
    """This rank's answer to "does MPI take device buffers?" (GPU backends only; no
    collective): the setting, then the MPI vendor's query, then a probe."""
    if backend is None or backend.ops is None:
        return None
    from dtm_mpi.comm.gpu_aware import detect_gpu_aware

    return detect_gpu_aware(args.device.gpu_aware, backend.name, device=backend.device)


def _device_comm(
    session: MpiSession,
    comm: MpiComm,
    args: MpiRunArgs,
    backend: ArrayBackend,
    local: GpuAwareness | None,
) -> Comm:
    """The communication endpoint the executor uses: ``comm`` itself on the numpy backend;
    on a GPU backend, ``comm`` wrapped so that device buffers are synchronised and go to MPI
    directly (GPU-aware MPI, agreed by every rank) or through pinned host buffers.

    Collective: call on all ranks."""
    if backend is None or backend.ops is None:
        return comm
    from dtm_mpi.comm.device import DeviceComm
    from dtm_mpi.comm.gpu_aware import agree_gpu_aware

    session.phase = "gpu-aware mpi"
    assert local is not None  # (detected on every rank of a GPU backend)
    aware = agree_gpu_aware(session, local)
    rank = session.rank
    if rank == 0:
        say(f"backend {backend.description}; GPU-aware MPI: {aware.describe()}")
    return DeviceComm(
        comm,
        backend.ops,
        aware,
        require_gpu_aware=args.device.require_gpu_aware,
        log=(lambda line: say(f"dtm: {line}")) if rank == 0 else (lambda line: None),
    )


def _run_steps(
    live: _Live,
    module: Module,
    args: MpiRunArgs,
    backend: ArrayBackend,
    joined: tuple[int, list[np.ndarray | None]] | None = None,
) -> int:
    from dtm_mpi.faults import maybe_fail
    from dtm_mpi.plan.outputs import output_values
    from dtm_mpi.runtime.executor import gather_to_root
    from dtm_mpi.runtime.simulate import output_pins

    session, rank = live.session, live.rank
    error: BaseException | None = None
    blocks: list[np.ndarray] = []
    given: dict[str, np.ndarray] = {}
    if joined is None:
        session.phase = "inputs"
        try:
            maybe_fail(rank, "inputs")
            if not args.resume:  # a resumed run takes every parameter from the checkpoint
                given = given_inputs(args, live.plan.module)
        except LauncherTerminatedError:
            raise
        except DtmError as exc:
            error = exc
        session.agree("inputs", error)
    live.ckpt = _checkpoints(live, args, backend)
    try:
        results = _steps_with(live, module, args, backend, blocks, given, joined)
    except RunStopped as stop:  # every rank stopped after the same step, the state saved
        if live.ckpt is not None:
            live.ckpt.close()
        if rank == 0:
            write_line(f"dtm run: {stop}")
        _release_parked(live)
        return int(stop.code)  # type: ignore[arg-type]
    except BaseException as exc:
        if (
            live.ckpt is not None
            and live.active
            and _raised_everywhere(exc)
            and live.session.poisoned is None
        ):
            with suppress(DtmError):  # every rank is here: close the store (collective)
                live.ckpt.close()
        raise
    if results is None:  # this rank left the run at a live resize
        return _parked(live, module, args, backend)
    if live.ckpt is not None:
        live.ckpt.close()

    session, plan = live.session, live.plan
    session.phase = "output"
    maybe_fail(rank, "output")
    outputs: dict[str, np.ndarray] = {}
    entry = plan.entry_plan.function
    pins = output_pins(entry, live.pipeline.pins) if live.pipeline is not None else {}
    for name, t, block in output_values(entry, results, blocks):
        host = None if block is None else backend.to_host(block)
        value = gather_to_root(t, host, live.endpoint, pin=pins.get(name))
        if value is not None:
            outputs[name] = value
    error = None
    if rank == 0:
        try:
            deliver_outputs(args, outputs)
        except (DtmError, OSError) as exc:
            error = exc
    session.agree("output", error)
    _release_parked(live)
    return 0


def _steps_with(
    live: _Live,
    module: Module,
    args: MpiRunArgs,
    backend: ArrayBackend,
    blocks: list[DeviceArray],
    given: dict[str, np.ndarray],
    joined: tuple[int, list[np.ndarray | None]] | None = None,
) -> tuple[DeviceArray, ...] | None:
    """The initial state (inputs, ``init store``, the resumed checkpoint, or a joining rank's
    moved blocks), then the step loop (:mod:`dtm_mpi.runtime.step_loop`) on each mesh of the
    run, resizing live where a loop ends for it; the last step's results (None on a rank that
    left at a resize)."""
    from dtm_mpi.comm.presence import current as current_presence
    from dtm_mpi.runtime.simulate import held_blocks
    from dtm_mpi.runtime.step_loop import Progress

    rank = live.rank
    if joined is not None:
        first = joined[0]
        blocks[:] = joined[1]
    else:
        ckpt = live.ckpt
        if not args.resume:  # 'init store' parameters no input supplies: from the store
            local = (
                ckpt.read_init_store(store_params(live.plan.module, given))
                if ckpt is not None
                else {}
            )
            pins = live.pipeline.pins if live.pipeline is not None else None
            blocks[:] = held_blocks(live.plan, rank, given, local, fed=args.fed, pins=pins)
        first = ckpt.resume(blocks) if ckpt is not None and args.resume else 0
    # the state lives on the backend (a pipelined run's: only its stages')
    blocks[:] = [None if b is None else backend.to_device(b) for b in blocks]
    presence = current_presence()
    progress = Progress(args.progress, args.steps) if rank == 0 and args.progress else None
    if presence is not None:
        presence.stoppable = True  # a signal now asks for a stop at the next step boundary
    try:
        while True:
            end = _step_loop(live, args, backend, presence, progress).run(blocks, first)
            if end.done == args.steps:
                return end.results
            binding = end.resize
            if end.resize_requested:
                binding = _requested_mesh(live, module, args, end.done)
            if binding is None:  # not a mesh this run can take: said, and the run goes on
                first = end.done
                continue
            moved = _resize(live, module, args, backend, end.done, binding, blocks)
            if moved is None:
                return None
            blocks[:] = moved
            first = end.done
    finally:
        if presence is not None:
            presence.stoppable = False


class _SessionPolicies:
    """The step loop's MPI policies on the run's current session: the phase, the commit
    agreement (the flags every rank raised), the stop on a signal (the launcher's presence)
    and the resize request (rank 0 alone sees the file: one answer, agreed)."""

    def __init__(self, live: _Live, presence: Presence | None, resize_file: str | None) -> None:
        self.live, self.presence, self.resize_file = live, presence, resize_file

    def phase(self, text: str) -> None:
        _set_phase(self.live, text)

    def agree(self, step: int, flags: int) -> int:
        return int(self.live.session.agree(f"step {step}", None, flag=flags))

    def asked(self) -> int | None:
        return None if self.presence is None else self.presence.stop_signal

    def resize_requested(self) -> bool:
        return self.resize_file is not None and os.path.exists(self.resize_file)


def _step_loop(
    live: _Live,
    args: MpiRunArgs,
    backend: ArrayBackend,
    presence: Presence | None,
    progress: Progress | None,
) -> StepLoop:
    """The step loop of ``args`` on the current session, with its MPI policies."""
    from dtm_mpi.runtime.executor import Executor
    from dtm_mpi.runtime.pipeline_step import PipelineExecutor
    from dtm_mpi.runtime.step_loop import Feed, StepRunner

    file = args.resize.file if args.resize is not None and live.rank == 0 else None
    policies = _SessionPolicies(live, presence, file)
    runner: StepRunner = (
        Executor(live.plan, live.device_endpoint, backend)
        if live.pipeline is None
        else PipelineExecutor(live.plan, live.pipeline, live.endpoint)
    )
    return StepLoop(
        runner,
        args.steps,
        feed=Feed(live.plan, live.rank, args.hooks, backend.to_device, backend.to_host)
        if args.hooks is not None
        else None,
        commit=policies,
        checkpoints=live.ckpt,
        stop=policies if presence is not None else None,
        resize_at=args.resize.at if args.resize is not None else (),
        resize_requested=policies.resize_requested if file is not None else None,
        progress=progress,
        phase=policies.phase,
        audit=replica_audit(
            live.endpoint,
            live.plan.entry_plan.function,
            live.pipeline.pins if live.pipeline is not None else None,
            backend.to_host,
        ),
    )


def _checkpoints(live: _Live, args: MpiRunArgs, backend: ArrayBackend) -> StoreCheckpoints | None:
    """The run's checkpoints on the current session (None without ``--store``)."""
    if args.checkpoint is None:
        return None
    from dtm_mpi.runtime.checkpoints import StoreCheckpoints

    phase = functools.partial(_set_phase, live)
    return StoreCheckpoints(
        live.session.comm,
        live.plan,
        args.checkpoint,
        live.rank,
        backend,
        steps=args.steps,
        fed=args.fed,
        phase=phase,
        pins=live.pipeline.pins if live.pipeline is not None else None,
        data=args.hooks.data if args.hooks is not None else None,
        identity=args.hooks.identity if args.hooks is not None else None,
        fresh=args.hooks.fresh if args.hooks is not None else (),
    )


def _set_phase(live: _Live, text: str) -> None:
    """Where this rank is, on the run's current session (for the agreed error of a failure)."""
    live.session.phase = text


def _resize(
    live: _Live,
    module: Module,
    args: MpiRunArgs,
    backend: ArrayBackend,
    step: int,
    binding: dict[str, int],
    blocks: list[DeviceArray],
) -> list[DeviceArray] | None:
    """The live resize after ``step``: the pending checkpoint finished and the store closed;
    to fewer ranks, the state moved in memory to the first ones, the others leaving (None
    returned: a launched process is then parked, :func:`_parked`); to more, parked ranks called
    back and, beyond them, new ranks spawned and merged, then the state moved. A new session
    for the new mesh (its handshake includes the joining ranks), the plan, the store.
    Collective over the old and new ranks."""

    from dtm_mpi.comm.resize import call_parked, spawn_and_merge, split_first, split_pool
    from dtm_mpi.config import get_config
    from dtm_mpi.runtime.remesh import move_blocks

    session, rank = live.session, live.rank
    phase = f"resize after step {step}"
    session.phase = phase
    timeout = get_config().timeout_s
    if binding == _binding_of(live.plan):  # already on that mesh (e.g. a run resumed there)
        return blocks
    if live.ckpt is not None:
        live.ckpt.close()  # the pending save finished, on the old ranks
        live.ckpt = None
    old_binding = _binding_of(live.plan)
    plan, pipeline = _planned(module, args, binding)
    move = _remesh(live.plan, live.pipeline, plan, pipeline)
    host = [None if b is None else backend.to_host(b) for b in blocks]
    n_old, n_new = int(session.size), plan.mesh.size
    joins = (step, old_binding, binding)
    argv = ["-m", "mpi4py", *(args.resize.relaunch or ())] if args.resize is not None else []
    moved = None
    if n_new <= n_old:  # on the old ranks, before they split
        moved = move_blocks(move, rank, host, live.endpoint)
    if live.members is not None:  # every rank is a launched process: split the pool
        members, parked = list(live.members), list(live.parked)
        if n_new <= n_old:
            new_members, parked = members[:n_new], sorted(parked + members[n_new:])
        else:
            back = parked[: n_new - n_old]
            new_members, parked = members + back, parked[len(back) :]
        extra = n_new - len(new_members)  # beyond the parked ranks: spawned
        _can_spawn(args, extra)
        call = _Call(step, old_binding, binding, new_members, parked, extra, argv)
        if rank == 0:  # every parked rank takes part in the split (those called back join)
            call_parked(live.pool, live.parked, call, timeout, phase)
        me = members[rank]
        world = split_pool(
            live.pool, new_members.index(me) if me in new_members else None, rank, timeout, phase
        )
        live.parked = parked
        live.members = new_members if extra == 0 else None
        if world is not None and extra > 0:
            world = spawn_and_merge(world, extra, argv, joins, rank, timeout, phase)
    elif n_new <= n_old:  # ranks were spawned: the last ones leave, and wait for the end
        world = split_first(session.comm, n_new, rank, timeout, phase)
        if rank == 0:
            live.left.append((live.worlds[-1], list(range(n_new, n_old))))
        elif world is None:
            live.waits_on = live.worlds[-1]
    else:
        _can_spawn(args, n_new - n_old)
        world = spawn_and_merge(session.comm, n_new - n_old, argv, joins, rank, timeout, phase)
    live.active = False
    session.close()
    if world is None:  # this rank leaves
        return None
    live.worlds.append(world)
    live.session, live.plan, live.active = _new_session(plan, world), plan, True
    live.pipeline = pipeline
    live.session.phase = phase
    _join(live, module, args, backend)
    if moved is None:  # grown: the joining ranks take part in the move
        moved = move_blocks(move, rank, host, live.endpoint)
    assert moved is not None
    if rank == 0:
        say(f"resized after step {step}: {n_old} -> {n_new} rank(s), mesh {plan.mesh}")
    live.ckpt = _checkpoints(live, args, backend)
    return [None if b is None else backend.to_device(b) for b in moved]


def _can_spawn(args: MpiRunArgs, count: int) -> None:
    """Refuse (alike on every rank) a grow that must spawn ranks of a program that cannot be
    started again (a ``fit()`` not run from a script file)."""
    if count > 0 and (args.resize is None or args.resize.relaunch is None):
        raise agreed(
            UsageError(
                f"growing past the ranks the job was launched with spawns {count} more running this program again; it was not started from a script file (run it as 'python -m mpi4py SCRIPT.py')"
            )
        )


@dataclass(frozen=True, slots=True)
class _Call:
    """Rank 0's call to the parked ranks at a resize: the split of the pool they take part in
    (``members``: the new session's pool ranks in order; ``extra`` ranks then spawned)."""

    step: int
    old: dict[str, int]
    new: dict[str, int]
    members: list[int]
    parked: list[int]
    extra: int
    argv: list[str]


def _parked(live: _Live, module: Module, args: MpiRunArgs, backend: ArrayBackend) -> int:
    """A rank that left at a shrink: a launched process waits, idle, for rank 0's calls: each
    resize's split of the pool (called back when it is one of the new members: it then joins
    the new session, receives its part of the state and runs the remaining steps), or the end
    of the run (exit 0). A rank that left after ranks were spawned waits for the end only."""
    from dtm_mpi.comm.presence import current as current_presence
    from dtm_mpi.comm.resize import spawn_and_merge, split_pool, wait_for_call
    from dtm_mpi.config import get_config
    from dtm_mpi.runtime.remesh import move_blocks

    presence = current_presence()
    if presence is not None:
        presence.stoppable = True  # a scheduler's SIGTERM is the running ranks' stop, not an end
    if live.waits_on is not None:  # it left after ranks were spawned: wait for the end
        wait_for_call(live.waits_on)
        return 0
    if live.pool is None:
        return 0
    me, timeout = int(live.pool.Get_rank()), get_config().timeout_s
    while True:
        call = wait_for_call(live.pool)
        if call is None:  # the run is over
            return 0
        assert isinstance(call, _Call)
        phase = f"resize after step {call.step}"
        key = call.members.index(me) if me in call.members else None
        world = split_pool(live.pool, key, me, timeout, phase)
        if world is None:
            continue
        assert key is not None
        if call.extra > 0:
            world = spawn_and_merge(
                world, call.extra, call.argv, (call.step, call.old, call.new), key, timeout, phase
            )
        plan, pipeline = _planned(module, args, call.new)
        old, old_pipeline = _planned(module, args, call.old)
        live.worlds.append(world)
        live.session, live.plan, live.rank = _new_session(plan, world), plan, key
        live.pipeline = pipeline
        live.active = True
        live.members = call.members if call.extra == 0 else None
        live.parked = call.parked
        live.session.phase = phase
        _join(live, module, args, backend)
        moved = move_blocks(_remesh(old, old_pipeline, plan, pipeline), key, None, live.endpoint)
        assert moved is not None
        return _run_steps(live, module, args, backend, joined=(call.step, moved))


def _release_parked(live: _Live) -> None:
    """Rank 0 at the end of the run: the ranks that left may end (they exit 0) -- together
    with the run's, so that no process of the job leaves while its peers still use it."""
    if live.rank != 0:
        return
    from dtm_mpi.comm.resize import call_parked
    from dtm_mpi.config import get_config

    if live.pool is not None and live.parked:
        call_parked(live.pool, live.parked, None, get_config().timeout_s, "end")
        live.parked = []
    for world, ranks in live.left:
        call_parked(world, ranks, None, get_config().timeout_s, "end")
    live.left = []


def _binding_of(plan: ExecPlan) -> dict[str, int]:
    return {name: size for name, size in plan.mesh.axes}


def _requested_mesh(
    live: _Live, module: Module, args: MpiRunArgs, step: int
) -> dict[str, int] | None:
    """The mesh of a resize request (``--resize-file``): rank 0 reads and removes the file and
    sends its text to every rank; every rank checks it alike (a mesh binding of the same axes
    whose plan fits) and, if it does not, rank 0 says why and the run goes on unchanged."""
    from dtm_mpi.comm.objects import bcast_obj
    from dtm_mpi.config import get_config
    from dtm_mpi.sharding.mesh import parse_mesh_binding

    assert args.resize is not None and args.resize.file is not None
    file = args.resize.file
    phase = f"resize request after step {step}"
    live.session.phase = phase
    text = ""
    if live.rank == 0:
        try:
            text = Path(file).read_text(encoding="utf-8").strip()
            Path(file).unlink()
        except OSError as exc:
            text = f"\0{exc}"
    text = bcast_obj(
        live.session.comm,
        text,
        0,
        timeout_s=get_config().timeout_s,
        what="the resize request",
        phase=phase,
    )
    why = text[1:] if text.startswith("\0") else ""
    binding = None
    if not why:
        try:
            binding = parse_mesh_binding(text)
            if set(binding) != set(_binding_of(live.plan)):
                raise UsageError(
                    f"it binds {', '.join(sorted(binding))}; the run's mesh has {', '.join(sorted(_binding_of(live.plan)))}"
                )
            _planned(module, args, binding)
        except DtmError as exc:
            why, binding = str(exc), None
    if binding is None and live.rank == 0:
        say(f"resize request {file} after step {step} ignored: {why}")
    return binding


def run_loop(
    session: MpiSession,
    comm: Comm,
    plan: ExecPlan,
    request: MpiRunArgs,
    rank: int,
    backend: ArrayBackend,
) -> tuple[list[DeviceArray], float]:
    """The training loop of a run on a joined session: the initial state, the steps with their
    commit agreements, the checkpoints; without the agreement on inputs and without outputs
    (what ``dtm bench ckpt-async`` times). Returns this rank's final state blocks and the
    seconds from the first step to the last step's end (the pending checkpoint is finished
    after that, not counted: in a long run it overlaps the steps that follow).

    Collective: call on all ranks."""
    live = _Live(session, plan, rank, comm=comm, dcomm=comm)
    live.ckpt = _checkpoints(live, request, backend)
    blocks: list[DeviceArray] = []
    try:
        start = time.perf_counter()
        _steps_with(live, plan.module, request, backend, blocks, {})
        seconds = time.perf_counter() - start
    finally:
        if live.ckpt is not None:
            live.ckpt.close()
    return blocks, seconds
