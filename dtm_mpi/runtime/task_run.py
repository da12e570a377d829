"""Running a task graph on the ranks of a job (``dtm task run``; io/TASKS.md §6).

Every rank reads the graph and the programs and makes the same plan
(:func:`~dtm_mpi.plan.task_plan.plan_tasks`); then, wave by wave:

1. rank 0 reads the store's latest checkpoint and decides, for each task of the wave, whether
   its result is already there (its content key and record, :mod:`dtm_mpi.io.task_records`)
   or it runs; every rank gets the decisions (phase ``task decide``);
2. the ranks of each running task form its group (a split of the job's communicator) and run
   the task's program there as ``dtm run`` would, its inputs read from the store, its outputs
   staged by the group's first rank; ranks without a task wait;
3. every rank agrees on the wave's outcome (a failure names the task and the rank), then
   rank 0 commits the staged outputs of the wave into one new checkpoint (copy-on-write: the
   older ones stay) and writes each task's record.

A job killed at any point loses at most the wave it was in: tasks committed before are
skipped by the next run, the others run again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtm_mpi.errors import DtmError, TaskGraphError

if TYPE_CHECKING:
    import numpy as np

    from dtm_mpi.io.manifest import Manifest
    from dtm_mpi.io.task_graph import TaskGraph
    from dtm_mpi.io.task_records import TaskRecord
    from dtm_mpi.plan.task_needs import TaskProgram
    from dtm_mpi.plan.task_plan import Placement, TaskPlan

__all__ = ["Decision", "plan_task_graph", "run_task_graph"]


@dataclass(frozen=True, slots=True)
class Decision:
    """Rank 0's decision for one task of a wave, sent to every rank: whether it runs (and
    why), its content key, the checkpoint its inputs are read from and their identities."""

    run: bool
    key: str
    base: int | None
    why: str
    inputs: dict[str, str]  # store tensor -> identity


def plan_task_graph(
    graph: TaskGraph, *, job_ranks: int, capacity: int | None = None, devices: int = 0
) -> tuple[tuple[TaskProgram, ...], TaskPlan]:
    """The programs and the plan of ``graph`` for a job (:func:`~dtm_mpi.plan.task_needs.
    plan_graph` with the IR files loaded as ``dtm run`` loads them)."""
    from dtm_mpi.plan.task_needs import plan_graph
    from dtm_mpi.runtime.request import load_module

    return plan_graph(
        graph,
        lambda path: load_module(path, show=None),
        job_ranks=job_ranks,
        capacity=capacity,
        devices=devices,
    )


def run_task_graph(
    graph: TaskGraph, *, capacity: int | None = None, rerun: bool = False, world: Any = None
) -> int:
    """Run ``graph`` on every rank of ``world`` (default: the job's); returns 0, or raises the
    same error on every rank. ``rerun``: run every task, whatever its record says.
    Collective."""
    from dtm_mpi.comm.agreement import agree_or_raise
    from dtm_mpi.comm.handles import world_comm
    from dtm_mpi.config import get_config

    world = world if world is not None else world_comm()
    rank, size = int(world.Get_rank()), int(world.Get_size())
    timeout = get_config().timeout_s
    if graph.store is None:
        raise TaskGraphError(f'{graph.file}: the graph names no store (store = "DIR")')
    store = graph.store
    progs: tuple[TaskProgram, ...] = ()
    plan = None
    error: BaseException | None = None
    try:
        progs, plan = plan_task_graph(
            graph, job_ranks=size, capacity=capacity, devices=_devices(graph)
        )
    except DtmError as exc:
        error = exc
    agree_or_raise(world, phase="task plan", error=error, timeout_s=timeout)
    assert plan is not None
    by_name = {p.spec.name: p for p in progs}
    if rank == 0:
        _say(
            f"dtm task run: {len(progs)} task(s) in {plan.waves} wave(s) on {size} rank(s); plan {plan.hash[:12]}"
        )
    for wave in range(plan.waves):
        placements = plan.wave(wave)
        decisions = _decisions(world, rank, store, placements, by_name, rerun, timeout)
        running = [p for p in placements if decisions[p.task].run]
        mine = next((p for p in running if rank in p.members), None)
        outcome: BaseException | None = None
        try:
            _run_wave_part(world, rank, store, mine, running, by_name, decisions)
        except DtmError as exc:
            outcome = exc
        agree_or_raise(world, phase=f"task wave {wave}", error=outcome, timeout_s=timeout)
        error = None
        if rank == 0 and running:
            try:
                _commit(store, running, by_name, decisions)
            except DtmError as exc:
                error = exc
        agree_or_raise(world, phase=f"task commit {wave}", error=error, timeout_s=timeout)
    if rank == 0:
        _say("dtm task run: done")
    return 0


def _say(text: str) -> None:
    from dtm_mpi.console import say

    say(text)


def _devices(graph: TaskGraph) -> int:
    """Accelerators per rank, probed only when a task asks for one (the same answer on every
    rank of a uniform job: the plan needs it)."""
    if all(t.backend == "numpy" for t in graph.tasks):
        return 0
    from dtm_mpi.kernels.backends import probe_devices

    return int(probe_devices().devices)


def _latest(store: Path) -> tuple[int | None, Manifest | None]:
    from dtm_mpi.io.store import committed_name, read_latest
    from dtm_mpi.io.tools import read_manifest, store_backend

    if not store.is_dir():
        return None, None
    step = read_latest(store)
    if step is None:
        return None, None
    return step, read_manifest(store / committed_name(step), store_backend(store))


def _decide(
    store: Path, placements: tuple[Placement, ...], by_name: dict[str, TaskProgram], rerun: bool
) -> dict[str, Decision]:
    """Rank 0: for each task of the wave, its key, whether it runs and why (a missing input
    is a located error)."""
    from dtm_mpi.io.task_records import identity, read_record, record_holds, task_key
    from dtm_mpi.ir.hashing import module_hash

    step, latest = _latest(store)
    out: dict[str, Decision] = {}
    for p in placements:
        prog = by_name[p.task]
        spec = prog.spec
        ids: dict[str, str] = {}
        for param, tensor in spec.inputs:
            if latest is None or tensor not in latest.names:
                have = ", ".join(sorted(latest.names)) if latest is not None else "no checkpoint"
                raise TaskGraphError(
                    f"{spec.at('inputs.' + param)}: task {spec.name!r}: input tensor {tensor!r} "
                    f"is not in store {store} (latest: {have}); put it there with `dtm store put`"
                )
            a = latest.artifact(tensor)
            want = prog.input_type(param)
            if a.dtype != want.dtype or a.shape != want.shape:
                raise TaskGraphError(
                    f"{spec.at('inputs.' + param)}: task {spec.name!r}: parameter %{param} is "
                    f"{want.dtype.value}{list(want.shape)}, but the stored tensor {tensor!r} is "
                    f"{a.dtype.value}{list(a.shape)}"
                )
            ids[param] = identity(a)
        key = task_key(
            module_hash(prog.module),
            mesh=prog.mesh.axes,
            steps=spec.steps,
            backend=spec.backend,
            outputs=spec.outputs,
            inputs=ids,
        )
        record = read_record(store, spec.name)
        held = not rerun and record_holds(record, key, latest)
        out[p.task] = Decision(
            not held,
            key,
            step,
            _why(rerun, record, key, ids, spec.inputs),
            {tensor: ids[param] for param, tensor in spec.inputs},
        )
    return out


def _why(
    rerun: bool,
    record: TaskRecord | None,
    key: str,
    ids: dict[str, str],
    inputs: tuple[tuple[str, str], ...],
) -> str:
    """Why a task runs (shown on its line), from its record."""
    if rerun:
        return "--rerun"
    if record is None:
        return "no record of an earlier run"
    if record.key == key:
        return "its outputs are no longer in the store as it wrote them"
    before = dict(record.inputs)
    changed = [t for p, t in inputs if t in before and before[t] != ids[p]]
    if changed:
        return f"input {', '.join(repr(t) for t in changed)} changed"
    return "its program, mesh, steps, backend or inputs changed"


def _decisions(
    world: Any,
    rank: int,
    store: Path,
    placements: tuple[Placement, ...],
    by_name: dict[str, TaskProgram],
    rerun: bool,
    timeout: float,
) -> dict[str, Decision]:
    """Rank 0's decisions for the wave, on every rank (an error of rank 0's, agreed)."""
    from dtm_mpi.comm.agreement import agree_or_raise, exchange_without_session

    text, error = "", None
    if rank == 0:
        try:
            got = _decide(store, placements, by_name, rerun)
            text = json.dumps({t: asdict(d) for t, d in got.items()}, sort_keys=True)
            from dtm_mpi.io.task_records import mark_running

            for task, d in got.items():  # its stored outputs: RECOVERING until the commit
                if d.run:
                    mark_running(store, task, d.key)
            for p in placements:
                d = got[p.task]
                ranks = (
                    f"rank {p.first}"
                    if p.ranks == 1
                    else f"ranks {p.first}-{p.first + p.ranks - 1}"
                )
                _say(
                    f"task {p.task}: running on {ranks} ({d.why})"
                    if d.run
                    else f"task {p.task}: skipped: its program and inputs are unchanged and its "
                    f"outputs are in the store (key {d.key[:12]})"
                )
        except DtmError as exc:
            error = exc
    agree_or_raise(world, phase="task decide", error=error, timeout_s=timeout)
    texts = exchange_without_session(world, text, phase="task decide", timeout_s=timeout)
    return {task: Decision(**d) for task, d in json.loads(texts[0]).items()}


def _run_wave_part(
    world: Any,
    rank: int,
    store: Path,
    mine: Placement | None,
    running: list[Placement],
    by_name: dict[str, TaskProgram],
    decisions: dict[str, Decision],
) -> None:
    """This rank's part of a wave: its task's run in its group, else nothing (the split is
    collective on every rank of the job)."""
    from dtm_mpi.comm.handles import free, split

    color = running.index(mine) if mine is not None else None
    group = split(world, color, rank)
    if mine is None:
        return
    prog = by_name[mine.task]
    try:
        _run_task(group, store, prog, decisions[mine.task].base, mine)
    except DtmError as exc:
        raise TaskGraphError(f"{prog.spec.span}: task {mine.task!r} failed: {exc}") from None
    finally:
        free(group)


def _read_inputs(store: Path, prog: TaskProgram, base: int | None) -> dict[str, np.ndarray]:
    """The task's input values (parameter -> global value) from checkpoint ``base``, read by
    this process alone."""
    from dtm_mpi.ir.types import Layout, TensorType
    from dtm_mpi.runtime.request import read_globals
    from dtm_mpi.sharding.mesh import MeshShape

    if not prog.spec.inputs:
        return {}
    targets = []
    for param, tensor in prog.spec.inputs:
        t = prog.input_type(param)
        targets.append((tensor, TensorType(t.dtype, t.shape, Layout.replicated(len(t.shape)))))
    got = read_globals(store, MeshShape((("x", 1),)), targets, step=base)
    return {param: got[tensor] for param, tensor in prog.spec.inputs}


def _run_task(
    group: Any, store: Path, prog: TaskProgram, base: int | None, where: Placement
) -> None:
    """Run one task on ``group`` (its ranks, numbered from 0 in messages: the label says
    which ranks of the job they are), then stage its outputs from the group's first rank."""
    from dtm_mpi.io.task_records import stage_outputs
    from dtm_mpi.runtime.mpirun import run_under_mpi
    from dtm_mpi.runtime.policies import DevicePolicy
    from dtm_mpi.runtime.request import RunRequest
    from dtm_mpi.runtime.step_loop import RunHooks

    spec = prog.spec
    outputs: dict[str, np.ndarray] = {}
    request = RunRequest(
        str(spec.program),
        binding=spec.binding,
        steps=spec.steps,
        module=prog.module,
        hooks=RunHooks(values=_read_inputs(store, prog, base), on_outputs=outputs.update),
        device=DevicePolicy(spec.backend),
        label=f"dtm task {spec.name} (its rank r is job rank {where.first} + r)"
        if where.first
        else f"dtm task {spec.name}",
    )
    run_under_mpi(request, world=group)
    if int(group.Get_rank()) == 0:
        stage_outputs(store, spec.name, {tensor: outputs[key] for key, tensor in spec.outputs})


def _commit(
    store: Path,
    running: list[Placement],
    by_name: dict[str, TaskProgram],
    decisions: dict[str, Decision],
) -> None:
    """Rank 0: the wave's staged outputs into one new checkpoint, then each task's record."""
    from dtm_mpi.comm.handles import self_comm
    from dtm_mpi.io.task_records import (
        TaskRecord,
        clear_running,
        identity,
        read_staged,
        remove_staged,
        write_record,
    )

    values: dict[str, np.ndarray] = {}
    for p in running:
        values.update(read_staged(store, p.task))
    from dtm_mpi.io.tools import put_tensors, read_manifest, store_backend

    put = put_tensors(store, self_comm(), values, where={t: f"task output {t!r}" for t in values})
    latest = read_manifest(put.path, store_backend(store))
    for p in running:
        spec = by_name[p.task].spec
        outs = tuple(sorted((t, identity(latest.artifact(t))) for _, t in spec.outputs))
        d = decisions[p.task]
        write_record(
            store, TaskRecord(p.task, d.key, put.step, outs, tuple(sorted(d.inputs.items())))
        )
        remove_staged(store, p.task)
        clear_running(store, p.task)
        _say(
            f"task {p.task}: wrote {', '.join(t for _, t in spec.outputs)} (checkpoint {put.step})"
        )
