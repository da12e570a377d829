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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dtm_mpi.console import say
from dtm_mpi.errors import UsageError, agreed

if TYPE_CHECKING:
    from dtm_mpi.comm.interface import Comm
    from dtm_mpi.io.checkpoint import CheckpointStore, Restored
    from dtm_mpi.ir.nodes import Module, Param
    from dtm_mpi.kernels.devices import ArrayBackend
    from dtm_mpi.plan.program import ExecPlan
    from dtm_mpi.runtime.policies import CheckpointPolicy

__all__ = ["GatheredCheckpoints", "StoreCheckpoints", "check_resumable", "open_store", "restore_globals"]  # fmt: skip


def _targets(plan_or_module: ExecPlan | Module) -> list[tuple[str, Any]]:
    from dtm_mpi.plan.program import ExecPlan

    module = plan_or_module.module if isinstance(plan_or_module, ExecPlan) else plan_or_module
    entry = module.entry
    assert entry is not None
    return [(p.name.lstrip("%"), p.type) for p in entry.params]


def open_store(policy: CheckpointPolicy, comm: Any) -> CheckpointStore:
    """The store of ``policy`` on MPI communicator ``comm`` (collective over it)."""
    from dtm_mpi.config import get_config
    from dtm_mpi.io.checkpoint import CheckpointStore

    return CheckpointStore(policy.store, comm, timeout_s=get_config().timeout_s, keep_last=policy.keep_last, quota_bytes=policy.quota)  # fmt: skip


def check_resumable(got: Restored, module_hash: str, steps: int) -> None:
    """Refuse to resume ``got``: another program's state, or nothing left to run."""
    if got.module_hash != module_hash:
        raise agreed(UsageError(
            f"{got.path} was written by module hash {got.module_hash}; this module's is "
            f"{module_hash}: refusing to resume another program's state"
        ))  # fmt: skip
    if got.step >= steps:
        raise agreed(UsageError(
            f"{got.path} holds the state after step {got.step}; --steps {steps} "
            "leaves nothing to run (raise --steps)"
        ))  # fmt: skip


def _say_resumed(got: Restored) -> None:
    for why in got.skipped:  # newer checkpoints that do not restore and verify
        say(f"resume: skipped {why}")
    say(f"resumed from {got.path} (after step {got.step})")


class StoreCheckpoints:
    """Under MPI: the run's state saved to and resumed from ``policy``'s store, every rank
    writing its blocks (collective methods); ``phase(text)`` names where the rank is."""

    def __init__(self, comm: Any, plan: ExecPlan, policy: CheckpointPolicy, rank: int, backend: ArrayBackend, *, steps: int, fed: Sequence[str], phase: Callable[[str], None]) -> None:  # fmt: skip
        from dtm_mpi.comm import handles
        from dtm_mpi.ir.hashing import module_hash

        self.plan, self.rank, self.backend, self.phase = plan, rank, backend, phase
        phase("checkpoint store")
        self.comm = handles.dup(comm)
        self.store = open_store(policy, self.comm)
        self.background = policy.background
        self.pending: Any = None  # the save writing in the background (SaveHandle)
        self.targets = _targets(plan)
        self.module_hash = module_hash(plan.module)
        self.steps = steps
        self.fed = frozenset(fed)

    def read_init_store(self, params: Sequence[Param]) -> dict[str, np.ndarray]:
        """This rank's blocks of the ``init store`` parameters ``params``, by name, from the
        store's latest checkpoint (written on any mesh)."""
        if not params:
            return {}
        self.phase("init store")
        names = [p.name.lstrip("%") for p in params]
        got = self.store.restore(self.plan.mesh, [(n, t) for n, t in self.targets if n in names])
        if self.rank == 0:
            shown = ", ".join(names) if len(names) <= 4 else f"{len(names)} parameters ({', '.join(names[:3])}, ...)"  # fmt: skip
            say(f"{shown} from {got.path} (after step {got.step})")
        return dict(got.values)

    def resume(self, blocks: list[Any]) -> int:
        """Replace ``blocks`` by the latest checkpoint's state that verifies; returns its
        step."""
        self.phase("resume")
        got = self.store.restore(self.plan.mesh, self.targets, fallback=True)
        if self.rank == 0:
            for why in got.skipped:
                say(f"resume: skipped {why}")
        check_resumable(got, self.module_hash, self.steps)
        blocks[:] = [got.values[name] for name, _ in self.targets]
        if self.rank == 0:
            say(f"resumed from {got.path} (after step {got.step})")
        return got.step

    def save(self, done: int, blocks: list[Any], *, sync: bool = False) -> str:
        """Save the state after step ``done``: in the background with ``--checkpoint-async``
        (unless ``sync``), else now; returns the checkpoint's path."""
        from dtm_mpi.io.ckpt_plan import TensorSpec
        from dtm_mpi.io.store import committed_name

        self.finish_pending()
        self.phase(f"checkpoint {done}")
        items = [
            (TensorSpec(name, t), self.backend.to_host(blocks[i]))
            for i, (name, t) in enumerate(self.targets)
        ]  # device state is copied to the host first (the store writes host memory)
        if self.background and not sync:  # snapshot and hashes now, the writing overlaps
            # The runtime never writes a value in place (a step makes new arrays, and the
            # comm layer reuses a buffer only when nobody else holds it), so the snapshot
            # keeps references; a loader's arrays are the caller's, and copied.
            items = [(spec, np.array(a, copy=True) if spec.name in self.fed else a) for spec, a in items]  # fmt: skip
            self.pending = self.store.save_async(done, self.plan.mesh, items, module_hash=self.module_hash, copy=False)  # fmt: skip
            return str(self.store.path / committed_name(done))
        path = self.store.save(done, self.plan.mesh, items, module_hash=self.module_hash)
        if self.rank == 0:
            say(f"checkpoint {path} (after step {done})")
        return str(path)

    def finish_pending(self) -> None:
        """Wait for the background save (its error raised, agreed), and report it."""
        if self.pending is None:
            return
        handle, self.pending = self.pending, None
        self.phase(f"checkpoint {handle.step}")
        path = handle.wait()
        if self.rank == 0:
            say(f"checkpoint {path} (after step {handle.step}, written in the background)")

    def close(self) -> None:
        from dtm_mpi.comm import handles

        try:
            self.finish_pending()
        finally:
            try:
                self.store.close()
            finally:
                handles.free(self.comm)


def _one_rank_mesh(module: Module) -> Any:
    from dtm_mpi.plan.program import mesh_for

    return mesh_for(module, 1, None)


def restore_globals(policy: CheckpointPolicy, module: Module, steps: int) -> tuple[dict[str, np.ndarray], int]:  # fmt: skip
    """A simulated run's resume, before its ranks start: the global value of every entry
    parameter from the newest checkpoint of ``policy``'s store that restores and verifies
    (written on any mesh), and its step."""
    from dtm_mpi.comm.handles import self_comm
    from dtm_mpi.ir.hashing import module_hash

    store = open_store(policy, self_comm())
    try:
        got = store.restore(_one_rank_mesh(module), _targets(module), fallback=True)
    finally:
        store.close()
    check_resumable(got, module_hash(module), steps)
    _say_resumed(got)
    return dict(got.values), got.step


class GatheredCheckpoints:
    """On simulated ranks: each save gathers every rank's blocks to rank 0 through ``comm``
    (the communication interface), and rank 0 writes the global values into ``store`` (this
    process's, opened on ``MPI_COMM_SELF``; None on the other ranks) as a one-rank
    checkpoint -- synchronously, or in the background with ``background``."""

    def __init__(self, comm: Comm, plan: ExecPlan, store: CheckpointStore | None, backend: ArrayBackend, *, background: bool = False, fed: Sequence[str] = ()) -> None:  # fmt: skip
        from dtm_mpi.ir.hashing import module_hash

        self.comm, self.plan, self.store, self.backend = comm, plan, store, backend
        self.background = background
        self.targets = _targets(plan)
        self.mesh = _one_rank_mesh(plan.module)
        self.module_hash = module_hash(plan.module)
        self.fed = frozenset(fed)
        self.pending: Any = None  # rank 0: the save writing in the background (SaveHandle)

    def save(self, done: int, blocks: list[Any], *, sync: bool = False) -> str:
        """Save the state after step ``done`` (collective over the simulated ranks); returns
        the checkpoint's path (on every rank)."""
        from dtm_mpi.io.ckpt_plan import TensorSpec
        from dtm_mpi.io.store import committed_name
        from dtm_mpi.runtime.executor import gather_to_root

        values = [gather_to_root(t, self.backend.to_host(b), self.comm) for (_, t), b in zip(self.targets, blocks, strict=True)]  # fmt: skip
        self.comm.flush()
        name = committed_name(done)
        if self.store is None:  # not rank 0: rank 0 writes (its failure stops every rank)
            return name
        items = [(TensorSpec(n, t), v) for (n, t), v in zip(self.targets, values, strict=True)]
        self.finish_pending()
        if self.background and not sync:  # (the gathered values are new arrays: no copy)
            self.pending = self.store.save_async(done, self.mesh, items, module_hash=self.module_hash, copy=False)  # fmt: skip
            return str(self.store.path / name)
        path = self.store.save(done, self.mesh, items, module_hash=self.module_hash)
        say(f"checkpoint {path} (after step {done})")
        return str(path)

    def finish_pending(self) -> None:
        """Rank 0: wait for the background save (its error raised), and report it."""
        if self.pending is None:
            return
        handle, self.pending = self.pending, None
        path = handle.wait()
        say(f"checkpoint {path} (after step {handle.step}, written in the background)")
