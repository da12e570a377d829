"""A run's checkpoints: its state (every entry parameter, as PRIMARY artifacts named like the
parameters) saved to and resumed from a checkpoint store (:mod:`dtm_mpi.io.checkpoint`), the
checkpoint policy of the step loop (:mod:`dtm_mpi.runtime.step_loop`) in both run modes:

* :class:`StoreCheckpoints` -- under MPI: every rank writes its own blocks into the store
  (parallel HDF5, collective), in the background with ``--checkpoint-async``;
* :class:`GatheredCheckpoints` -- on simulated ranks (threads of one process): each save
  gathers every block to rank 0 through the communication interface, and rank 0 writes the
  global values as this one process (a checkpoint of a one-rank mesh: it resumes onto any
  mesh, as every checkpoint does); :func:`restore_globals` reads one back before the ranks
  start.

Both refuse to resume another module's state (its hash differs) or a checkpoint at or past
the last step, with the same agreed errors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dtm_mpi.console import say
from dtm_mpi.errors import UsageError, agreed
from dtm_mpi.runtime.data_position import (
    PREFIX,
    check_position,
    position_items,
    position_targets,
)
from dtm_mpi.sharding.blocks import Pin, holds

if TYPE_CHECKING:
    from dtm_mpi.comm.interface import Comm
    from dtm_mpi.io.checkpoint import CheckpointStore, Restored
    from dtm_mpi.ir.nodes import Module, Param
    from dtm_mpi.kernels.devices import ArrayBackend
    from dtm_mpi.plan.program import ExecPlan
    from dtm_mpi.runtime.data_position import DataPosition
    from dtm_mpi.runtime.policies import CheckpointPolicy

__all__ = [
    "GatheredCheckpoints",
    "StoreCheckpoints",
    "check_resumable",
    "state_hashes",
    "open_store",
    "restore_globals",
]


def _targets(module: Module) -> list[tuple[str, Any]]:
    """The saved state: every entry parameter, by name without ``%``."""
    entry = module.entry
    assert entry is not None
    return [(p.name.lstrip("%"), p.type) for p in entry.params]


def open_store(policy: CheckpointPolicy, comm: Any) -> CheckpointStore:
    """The store of ``policy`` on MPI communicator ``comm`` (collective over it)."""
    from dtm_mpi.config import get_config
    from dtm_mpi.io.checkpoint import CheckpointStore

    return CheckpointStore(
        policy.store,
        comm,
        timeout_s=get_config().timeout_s,
        keep_last=policy.keep_last,
        quota_bytes=policy.quota,
    )


def state_hashes(module: Module) -> tuple[str, ...]:
    """What identifies the program a checkpoint's state belongs to: the program hash of
    ``module`` (its layouts erased: docs/spec/ir.md §11.3), which every save records, so a run
    resumes on any mesh and under any sharding choice, then its module hash, which the saves
    of earlier versions recorded (still resumed), then the program hash of the same module
    with or without the axis a gradient-accumulating step adds to its mesh
    (:data:`~dtm_mpi.runtime.policies.ACCUMULATE_AXIS`: accumulation changes no state)."""
    from dataclasses import replace

    from dtm_mpi.ir.hashing import module_hash, program_hash
    from dtm_mpi.runtime.policies import ACCUMULATE_AXIS

    def other(m: Any) -> Any:
        axes = tuple(m.axes)
        if any(a == ACCUMULATE_AXIS for a, _ in axes):
            return replace(m, axes=tuple((a, s) for a, s in axes if a != ACCUMULATE_AXIS))
        return replace(m, axes=((ACCUMULATE_AXIS, 1), *axes))

    accumulation = replace(module, meshes=tuple(other(m) for m in module.meshes))
    return program_hash(module), module_hash(module), program_hash(accumulation)


def check_resumable(got: Restored, hashes: tuple[str, ...], steps: int) -> None:
    """Refuse to resume ``got``: another program's state (its recorded hash is none of
    ``hashes``: :func:`state_hashes`), or nothing left to run."""
    if got.module_hash not in hashes:
        raise agreed(
            UsageError(
                f"{got.path} was written by program {got.module_hash}; this one is "
                f"{hashes[0]}: refusing to resume another program's state (the model, the "
                "loss, the optimizer and its learning-rate schedule are all part of the "
                "program; the mesh, sharding, pipeline, accumulation, precision and "
                "recomputation are not)"
            )
        )
    if got.step >= steps:
        raise agreed(
            UsageError(
                f"{got.path} holds the state after step {got.step}; --steps {steps} "
                "leaves nothing to run (raise --steps)"
            )
        )


def _resumed(
    got: Restored,
    hashes: tuple[str, ...],
    steps: int,
    *,
    speak: bool,
    data: DataPosition | None = None,
) -> None:
    """Say which newer checkpoints a resume skipped (``speak``: this rank reports), refuse
    ``got`` if it cannot be resumed (:func:`check_resumable`; ``data``: the loader refuses
    the position it recorded), else say where the run resumes."""
    if speak:
        for why in got.skipped:  # newer checkpoints that do not restore and verify
            say(f"resume: skipped {why}")
    check_resumable(got, hashes, steps)
    if data is not None:
        check_position(data, got.values, got.step, str(got.path))
    if speak:
        say(f"resumed from {got.path} (after step {got.step})")


class _Saves:
    """Saving the state into ``store`` (every save gives it the module hash), now or with the
    policy's ``background`` in a background thread, its completion reported when the next save
    starts or the run ends; ``speak``: this rank says what was saved, ``phase(text)``: where
    it is."""

    def __init__(
        self,
        policy: CheckpointPolicy,
        store: CheckpointStore | None,
        hashes: tuple[str, ...],
        *,
        speak: bool,
        phase: Callable[[str], None],
    ) -> None:
        self.policy, self.store, self.hashes = policy, store, hashes
        self.speak, self.phase = speak, phase
        self.pending: Any = None  # the save writing in the background (SaveHandle)

    def _write(
        self, done: int, mesh: Any, items: list[tuple[Any, np.ndarray | None]], sync: bool
    ) -> str:
        """Write ``items`` as the checkpoint after step ``done`` (after :meth:`finish_pending`);
        returns its path."""
        from dtm_mpi.io.store import committed_name

        assert self.store is not None
        if self.policy.background and not sync:  # snapshot and hashes now, the writing overlaps
            self.pending = self.store.save_async(
                done, mesh, items, module_hash=self.hashes[0], copy=False
            )
            return str(self.store.path / committed_name(done))
        path = self.store.save(done, mesh, items, module_hash=self.hashes[0])
        if self.speak:
            say(f"checkpoint {path} (after step {done})")
        return str(path)

    def finish_pending(self) -> None:
        """Wait for the background save (its error raised, agreed), and report it."""
        if self.pending is None:
            return
        handle, self.pending = self.pending, None
        self.phase(f"checkpoint {handle.step}")
        path = handle.wait()
        if self.speak:
            say(f"checkpoint {path} (after step {handle.step}, written in the background)")


def _nowhere(text: str) -> None:
    """A phase nobody reads (the simulator's ranks name none)."""


class StoreCheckpoints(_Saves):
    """Under MPI: the run's state saved to and resumed from ``policy``'s store, every rank
    writing its blocks (collective methods); ``phase(text)`` names where the rank is."""

    def __init__(
        self,
        comm: Any,
        plan: ExecPlan,
        policy: CheckpointPolicy,
        rank: int,
        backend: ArrayBackend,
        *,
        steps: int,
        fed: Sequence[str],
        phase: Callable[[str], None],
        pins: Mapping[str, Pin] | None = None,
        data: DataPosition | None = None,
        identity: Module | None = None,
        fresh: Sequence[str] = (),
    ) -> None:
        from dtm_mpi.comm import handles

        phase("checkpoint store")
        self.comm = handles.dup(comm)
        super().__init__(
            policy,
            open_store(policy, self.comm),
            state_hashes(identity or plan.module),
            speak=rank == 0,
            phase=phase,
        )
        self.plan, self.rank, self.backend = plan, rank, backend
        self.targets = _targets(plan.module)
        self.steps = steps
        self.fed = frozenset(fed)
        self.pins = dict(pins or {})
        """A pipelined run's state: each value held by the ranks of one ``pp`` coordinate."""
        self.data = data
        self.fresh = tuple(fresh)

    def _held(self, values: Mapping[str, np.ndarray]) -> list[np.ndarray | None]:
        """The restored blocks in target order, None where this rank holds none (pinned);
        a fresh state the checkpoint lacks starts from its init."""
        from dtm_mpi.runtime.values import init_block
        from dtm_mpi.sharding.blocks import local_offsets, local_shape

        mesh = self.plan.mesh
        params = self.plan.entry_plan.function.params
        out: list[np.ndarray | None] = []
        for (name, t), p in zip(self.targets, params, strict=True):
            if not holds(mesh, self.rank, self.pins.get(name)):
                out.append(None)
            elif name in values:
                out.append(values[name])
            else:  # (restore refused any other missing tensor)
                offsets = local_offsets(t.shape, t.layout, mesh, self.rank)
                out.append(init_block(p, offsets, local_shape(t.shape, t.layout, mesh, self.rank)))
        return out

    def read_init_store(self, params: Sequence[Param]) -> dict[str, np.ndarray]:
        """This rank's blocks of the ``init store`` parameters ``params``, by name, from the
        store's latest checkpoint (written on any mesh)."""
        if not params:
            return {}
        self.phase("init store")
        names = [p.name.lstrip("%") for p in params]
        assert self.store is not None
        got = self.store.restore(
            self.plan.mesh, [(n, t) for n, t in self.targets if n in names], pins=self.pins
        )
        if self.speak:
            shown = (
                ", ".join(names)
                if len(names) <= 4
                else f"{len(names)} parameters ({', '.join(names[:3])}, ...)"
            )
            say(f"{shown} from {got.path} (after step {got.step})")
        return dict(got.values)

    def resume(self, blocks: list[Any]) -> int:
        """Replace ``blocks`` by the latest checkpoint's state that verifies; returns its
        step."""
        self.phase("resume")
        assert self.store is not None
        extra = position_targets(self.data) if self.data is not None else []
        got = self.store.restore(
            self.plan.mesh,
            [*self.targets, *extra],
            fallback=True,
            pins=self.pins,
            optional=[*(n for n, _ in extra), *self.fresh],
        )
        _resumed(got, self.hashes, self.steps, speak=self.speak, data=self.data)
        blocks[:] = self._held(got.values)
        return got.step

    def save(self, done: int, blocks: list[Any], *, sync: bool = False) -> str:
        """Save the state after step ``done``: in the background with ``--checkpoint-async``
        (unless ``sync``), else now; returns the checkpoint's path."""
        from dtm_mpi.io.ckpt_plan import TensorSpec

        self.finish_pending()
        self.phase(f"checkpoint {done}")
        items: list[tuple[Any, np.ndarray | None]] = [
            (
                TensorSpec(name, t, pin=self.pins.get(name)),
                None if blocks[i] is None else self.backend.to_host(blocks[i]),
            )
            for i, (name, t) in enumerate(self.targets)
        ]  # device state is copied to the host first (the store writes host memory)
        if self.policy.background and not sync:
            # The runtime never writes a value in place (a step makes new arrays, and the
            # comm layer reuses a buffer only when nobody else holds it), so the snapshot
            # keeps references; a loader's arrays are the caller's, and copied.
            items = [
                (spec, np.array(a, copy=True) if spec.name in self.fed and a is not None else a)
                for spec, a in items
            ]
        if self.data is not None:  # where the loader stands: replicated, every rank its copy
            items += position_items(self.data, done)
        return self._write(done, self.plan.mesh, items, sync)

    def close(self) -> None:
        from dtm_mpi.comm import handles

        try:
            self.finish_pending()
        finally:
            try:
                assert self.store is not None
                self.store.close()
            finally:
                handles.free(self.comm)


def _one_rank_mesh(module: Module) -> Any:
    from dtm_mpi.plan.program import mesh_for

    return mesh_for(module, 1, None)


def restore_globals(
    policy: CheckpointPolicy,
    module: Module,
    steps: int,
    data: DataPosition | None = None,
    identity: Module | None = None,
    fresh: Sequence[str] = (),
) -> tuple[dict[str, np.ndarray], int]:
    """A simulated run's resume, before its ranks start: the global value of every entry
    parameter from the newest checkpoint of ``policy``'s store that restores and verifies
    (written on any mesh), and its step (``data``: the loader checks the position the
    checkpoint recorded; ``identity``: the module identifying the state, where not
    ``module``; ``fresh``: state that takes its init where the checkpoint lacks it)."""
    from dtm_mpi.comm.handles import self_comm

    store = open_store(policy, self_comm())
    extra = position_targets(data) if data is not None else []
    try:
        got = store.restore(
            _one_rank_mesh(module),
            [*_targets(module), *extra],
            fallback=True,
            optional=[*(n for n, _ in extra), *fresh],
        )
    finally:
        store.close()
    _resumed(got, state_hashes(identity or module), steps, speak=True, data=data)
    values = {k: v for k, v in got.values.items() if not k.startswith(PREFIX)}
    return values, got.step


class GatheredCheckpoints(_Saves):
    """On simulated ranks: each save gathers every rank's blocks to rank 0 through ``comm``
    (the communication interface), and rank 0 writes the global values into ``store`` (this
    process's, opened on ``MPI_COMM_SELF``; None on the other ranks) as a one-rank
    checkpoint, when and how ``policy`` says."""

    def __init__(
        self,
        comm: Comm,
        plan: ExecPlan,
        policy: CheckpointPolicy,
        store: CheckpointStore | None,
        backend: ArrayBackend,
        pins: Mapping[str, Pin] | None = None,
        data: DataPosition | None = None,
        identity: Module | None = None,
    ) -> None:
        super().__init__(
            policy,
            store,
            state_hashes(identity or plan.module),
            speak=store is not None,
            phase=_nowhere,
        )
        self.comm, self.backend = comm, backend
        self.targets = _targets(plan.module)
        self.mesh = _one_rank_mesh(plan.module)
        self.pins = dict(pins or {})
        self.data = data

    def save(self, done: int, blocks: list[Any], *, sync: bool = False) -> str:
        """Save the state after step ``done`` (collective over the simulated ranks); returns
        the checkpoint's path (rank 0; the others its name)."""
        from dtm_mpi.io.ckpt_plan import TensorSpec
        from dtm_mpi.io.store import committed_name
        from dtm_mpi.runtime.executor import gather_to_root

        values = [
            gather_to_root(
                t, None if b is None else self.backend.to_host(b), self.comm, pin=self.pins.get(n)
            )
            for (n, t), b in zip(self.targets, blocks, strict=True)
        ]
        if self.store is None:  # not rank 0: rank 0 writes (its failure stops every rank)
            return committed_name(done)
        self.finish_pending()
        items: list[tuple[Any, np.ndarray | None]] = [
            (TensorSpec(n, t), v) for (n, t), v in zip(self.targets, values, strict=True)
        ]
        if self.data is not None:
            items += position_items(self.data, done)
        return self._write(done, self.mesh, items, sync)  # (gathered arrays are new: no copy)
