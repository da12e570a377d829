"""Checkpoints: save with atomic commit, restore onto any mesh, over the store's shard backend
(:mod:`dtm_mpi.io.backend`, recorded by name in ``store.json``; parallel HDF5, described
here, unless the store records another).

**Save** (collective; :meth:`CheckpointStore.save`): the plan is pure (``io.ckpt_plan``); the quota
is checked before a byte is written; each rank hashes the chunks of the blocks it owns from
memory; rank 0 creates the directory ``ckpt-N.partial-T``; the ranks of each data-file group
(``ranks_per_file``, default 1: one file per writing rank) open ``data-NNNNNN.h5`` with the
MPI-IO driver on their communicator and write one dataset per owned shard; each file is
flushed, closed, fsynced and checked by its group's first rank; rank 0 writes the main file
``checkpoint.h5`` (a virtual dataset per tensor over its shards, and the manifest, identical on
every rank, built from the gathered shard hashes); the ranks agree that every one of them got
there; rank 0 fsyncs the directory, validates the main file and the file list (with
``DTM_CKPT_VERIFY=full`` every data file was also re-read and re-hashed), renames the
directory to ``ckpt-N``, fsyncs the store, points ``latest`` at it and applies keep-last-K
retention (never to the checkpoint just saved), and every rank learns the verdict. A crash at
any moment leaves ``latest`` naming a committed, verified checkpoint.

**Async save** (:meth:`CheckpointStore.save_async`): the owned blocks are copied and hashed
(a snapshot: later updates of the caller's arrays do not leak in), then a writer thread does the
rest on a duplicate communicator. A caller whose arrays are never written in place (the
runtime's values are immutable) passes ``copy=False``: the snapshot is then the hashes and
references to the arrays, and a write of one of them before the save ends would fail the
save's verification (its bytes no longer match the snapshot's hashes), never pass unnoticed. :meth:`SaveHandle.wait` joins it; :meth:`SaveHandle.cancel`
(collective) stops it at the next tensor boundary — the writer threads agree on the stop, close
their files, and rank 0 removes the partial directory. A later save, a restore, or :meth:`close`
waits for the pending one first.

**Restore** (collective; :meth:`CheckpointStore.restore`): onto any mesh and layout (``io.ckpt_plan``:
each stored chunk read once by one rank from its data file, verified in memory, its pieces
sent where they are needed; ``into=`` restores in place), with
an :class:`IntegrityError` naming tensor, shard and file on any mismatch (agreed: every rank
raises it), and ``fallback=True`` to restore the newest checkpoint that verifies instead.
Derived artifacts that fail verification are rebuilt from their parent; ephemeral ones are
never stored; a primary artifact with no healthy copy is an :class:`UnrecoverableError`.

Bounded: every exchange of the store waits at most the timeout, and every HDF5 call on data
files and the main file's write run under :func:`~dtm_mpi.comm.objects.io_deadline` (rank 0's
small serial reads of the main file and the renames of the commit are not: they are local
file-system calls, and the other ranks wait for their verdict with the timeout).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi._version import __version__
from dtm_mpi.comm import handles
from dtm_mpi.comm.objects import allgather_obj, bcast_obj, io_deadline
from dtm_mpi.config import get_config
from dtm_mpi.errors import (
    CancelledError,
    CommTimeoutError,
    DtmError,
    IntegrityError,
    ManifestError,
    PoisonedError,
    QuotaError,
    StorageError,
    UnrecoverableError,
    UsageError,
    agreed,
)
from dtm_mpi.io.backend import ShardBackend, parse_backend_name, parse_optional_backend_name
from dtm_mpi.io.ckpt_plan import (
    CHUNK_BYTES,
    ROUND_BYTES,
    SavePlan,
    TensorSpec,
    plan_manifest,
    plan_restore,
    plan_save,
)
from dtm_mpi.io.commit import Retention, commit_partial
from dtm_mpi.io.data_write import Writer, write_data_file
from dtm_mpi.io.hashing import chunk_hash
from dtm_mpi.io.manifest import (
    ArtifactRecord,
    Manifest,
    RecoveryAction,
    data_file_name,
    parse_loadable_manifest,
    recovery_actions,
)
from dtm_mpi.io.restore_read import Reader, read_plan
from dtm_mpi.io.store import (
    DEFAULT_BACKEND,
    StoreMeta,
    committed_name,
    disk_usage,
    fsync_path,
    legacy_files,
    list_checkpoints,
    meta_outdated,
    partial_name,
    read_latest,
    read_meta,
    write_latest,
    write_meta,
)
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.types import TensorType
from dtm_mpi.sharding.blocks import Pin, local_shape
from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["CheckpointStore", "Restored", "SaveHandle", "rebuild_value"]


def rebuild_value(a: ArtifactRecord, parent: np.ndarray) -> np.ndarray:
    """Derived artifact ``a`` recomputed from its parent's value by its rebuild instruction:
    ``copy`` or ``cast:<dtype>`` (the artifact's own dtype)."""
    assert a.rebuild is not None
    kind, _, arg = a.rebuild.partition(":")
    if kind == "copy" or (kind == "cast" and arg == a.dtype.value):
        return parent.astype(np_dtype(a.dtype), copy=True)
    raise UnrecoverableError(
        f"tensor {a.name!r}: unknown rebuild instruction {a.rebuild!r} (known: copy, cast:{a.dtype.value})"
    )


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    path: Path
    values: dict[str, np.ndarray]  # this rank's local blocks, by tensor name
    module_hash: str | None = None  # of the program that wrote it
    skipped: tuple[str, ...] = ()  # newer checkpoints a fallback restore passed over, and why


class SaveHandle:
    """An async save in progress (see :meth:`CheckpointStore.save_async`)."""

    def __init__(self, store: CheckpointStore, step: int) -> None:
        self.store = store
        self.step = step
        self.cancel_requested = False
        self.result: Path | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> Path:
        """Wait for the save (bounded by the store's timeout per collective step); raises its
        error, e.g. :class:`CancelledError`."""
        if self.thread is not None:
            self.thread.join()
        if self.store._pending is self:
            self.store._pending = None
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def cancel(self) -> bool:
        """Collective: call on all ranks. Stop the save at its next tensor boundary and remove
        its partial checkpoint; returns True if it was cancelled, False if it had already committed
        (then the new checkpoint stands)."""
        self.cancel_requested = True
        try:
            self.wait()
        except CancelledError:
            return True
        return False


class CheckpointStore:
    """Collective: construct on all ranks of ``comm`` (the communicator of the ranks that
    save and restore together, from the caller: see :mod:`dtm_mpi.comm.handles`).

    ``quota_bytes`` and ``keep_last`` are stored in the store's ``store.json`` when given
    (rank 0 creates the store), else read from it. So is the storage ``backend``, by the name it
    is registered under (:func:`~dtm_mpi.io.backend.register_backend`): a new store records the
    one given (default ``hdf5``); an existing one is opened with the one it records (``hdf5``
    when it records none), and naming another is an error."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        comm: Any,
        *,
        quota_bytes: int | None = None,
        keep_last: int | None = None,
        timeout_s: float | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        round_bytes: int = ROUND_BYTES,
        ranks_per_file: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.comm = comm
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())
        self.timeout_s = timeout_s if timeout_s is not None else get_config().timeout_s
        self.chunk_bytes, self.round_bytes = chunk_bytes, round_bytes
        self._io_comm: Any = None
        self._pending: SaveHandle | None = None
        self._poisoned: BaseException | None = None
        outcome: Any = None
        if self.rank == 0:
            try:
                rpf = get_config().ckpt_ranks_per_file if ranks_per_file is None else ranks_per_file
                if rpf < 0:
                    raise UsageError(f"ranks_per_file must be >= 1 (0: all ranks); got {rpf}")
                outcome = (self._settings(quota_bytes, keep_last, backend), rpf)
            except (OSError, DtmError) as exc:
                outcome = StorageError(f"store {self.path}: {exc}")
        outcome = self._bcast(outcome, "open store")
        if isinstance(outcome, BaseException):
            raise agreed(outcome) if isinstance(outcome, DtmError) else outcome
        self.meta: StoreMeta = outcome[0]
        self.ranks_per_file: int = outcome[1]  # rank 0's choice, the same on every rank
        found: ShardBackend | StorageError
        try:  # on every rank: a backend is registered by the process (its imports)
            found = parse_backend_name(self.meta.backend, self.path)
        except StorageError as exc:
            found = exc
        self._agree(found if isinstance(found, StorageError) else None, "opening the store")
        assert not isinstance(found, StorageError)
        self.backend: ShardBackend = found  # the format of the shards; the rest is format-neutral
        self.backend.ready()  # its library loaded now, not in the first save
        self._retention = Retention(self.path, self.backend)
        self._groups: dict[int, Any] = {}
        self._split_groups(self.comm)

    def _settings(
        self, quota_bytes: int | None, keep_last: int | None, backend: str | None
    ) -> StoreMeta:
        """Rank 0: the store's settings, from ``store.json`` and the constructor's arguments,
        written back (creating the store) when they change it or the file is missing or old;
        never for a backend this process has not registered (every rank then reports it)."""
        found = read_meta(self.path)
        recorded = found.backend if found is not None else DEFAULT_BACKEND
        name = backend if backend is not None else recorded
        if found is not None and name != recorded:
            raise UsageError(
                f"{self.path / 'store.json'} records storage backend {recorded!r}; it cannot be opened with backend {name!r}"
            )
        if (
            found is None
            and name != DEFAULT_BACKEND
            and self.path.is_dir()
            and (list_checkpoints(self.path) or legacy_files(self.path))
        ):
            raise UsageError(
                f"it holds checkpoints but no store.json: they are stored with backend {DEFAULT_BACKEND!r}; it cannot be opened with backend {name!r}"
            )
        meta = found or StoreMeta(backend=name)
        if (
            quota_bytes is not None
            or keep_last is not None
            or found is None
            or meta_outdated(self.path)
        ):
            meta = StoreMeta(
                quota_bytes if quota_bytes is not None else meta.quota_bytes,
                keep_last if keep_last is not None else meta.keep_last,
                name,
            )
            if parse_optional_backend_name(name) is not None:
                write_meta(self.path, meta)
        return meta

    # -- small collective helpers ----------------------------------------------------------------
    def _bcast(self, obj: Any, what: str, comm: Any = None) -> Any:
        self._check_poisoned()
        try:
            return bcast_obj(
                comm or self.comm, obj, 0, timeout_s=self.timeout_s, what=what, phase="checkpoint"
            )
        except CommTimeoutError as exc:
            self._poisoned = exc
            raise

    def _gather(self, obj: Any, what: str, comm: Any = None) -> list[Any]:
        self._check_poisoned()
        try:
            return allgather_obj(
                comm or self.comm, obj, timeout_s=self.timeout_s, what=what, phase="checkpoint"
            )
        except CommTimeoutError as exc:
            self._poisoned = exc
            raise

    def _check_poisoned(self) -> None:
        """After a timed-out exchange a request may still be pending on the communicator:
        every later operation of this store fails with the original cause."""
        if self._poisoned is not None:
            raise PoisonedError(self._poisoned)

    def _agree(self, error: BaseException | None, what: str, comm: Any = None) -> None:
        """Every rank raises the first failure (by rank) if any rank failed ``what``."""
        errors = self._gather(
            None if error is None else (type(error).__name__, str(error)), what, comm
        )
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        r, (kind, msg) = failed[0]
        kinds: tuple[type[DtmError], ...] = (
            ManifestError,
            QuotaError,
            CancelledError,
            UnrecoverableError,
            UsageError,
        )
        cls = {c.__name__: c for c in kinds}.get(kind, StorageError)
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        err = cls(f"{what} failed on rank {r}{others}: {msg}")
        raise agreed(err)

    def _deadline(self, what: str) -> Any:
        return io_deadline(what, "checkpoint", self.rank, self.timeout_s)

    # -- save ------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        mesh: MeshShape,
        tensors: Sequence[tuple[TensorSpec, np.ndarray | None]],
        *,
        module_hash: str | None = None,
    ) -> Path:
        """Collective: call on all ranks. Save this rank's local blocks ``tensors`` (spec,
        local array; None for ephemeral ones) as checkpoint ``step``; returns its path."""
        self.wait()
        plan, blocks, hashes = self._prepare(step, mesh, tensors, copy=False)
        return self._save(step, plan, blocks, hashes, module_hash, self.comm, None)

    def save_async(
        self,
        step: int,
        mesh: MeshShape,
        tensors: Sequence[tuple[TensorSpec, np.ndarray | None]],
        *,
        module_hash: str | None = None,
        before_tensor: Callable[[int], None] | None = None,
        copy: bool = True,
    ) -> SaveHandle:
        """Collective: call on all ranks. Snapshot and hash the owned blocks now, write them in
        the background; ``before_tensor(i)`` (tests) runs in the writer before tensor ``i``.
        ``copy=False``: the caller never writes the arrays in place, so the snapshot keeps
        references instead of copies (a write before the save ends fails its verification)."""
        self.wait()
        if not handles.thread_multiple():
            raise agreed(
                UsageError(
                    "async save needs MPI_THREAD_MULTIPLE (mpi4py's default); this MPI was initialised with less"
                )
            )
        plan, blocks, hashes = self._prepare(step, mesh, tensors, copy=copy)
        if self._io_comm is None:
            self._io_comm = handles.dup(self.comm)
            self._split_groups(self._io_comm)
        handle = SaveHandle(self, step)

        def cancelled() -> bool:
            return handle.cancel_requested

        def body() -> None:
            try:
                handle.result = self._save(
                    step,
                    plan,
                    blocks,
                    hashes,
                    module_hash,
                    self._io_comm,
                    (cancelled, before_tensor),
                )
            except BaseException as exc:  # reported by wait()
                handle.error = exc

        handle.thread = threading.Thread(target=body, name=f"dtm-ckpt-save-{step}", daemon=True)
        self._pending = handle
        handle.thread.start()
        return handle

    def wait(self) -> None:
        """Wait for a pending async save (its errors are raised)."""
        if self._pending is not None:
            self._pending.wait()

    def close(self) -> None:
        """Collective: call on all ranks. Wait for a pending save, free the I/O communicator."""
        try:
            self.wait()
        finally:
            self._retention.wait()
            for g in self._groups.values():
                handles.free(g)
            self._groups.clear()
            if self._io_comm is not None:
                handles.free(self._io_comm)
                self._io_comm = None

    def _prepare(
        self,
        step: int,
        mesh: MeshShape,
        tensors: Sequence[tuple[TensorSpec, np.ndarray | None]],
        copy: bool,
    ) -> tuple[SavePlan, dict[int, np.ndarray], dict[int, tuple[str, ...]]]:
        if mesh.size != self.size:
            raise agreed(
                UsageError(f"mesh {mesh} has {mesh.size} ranks, the communicator {self.size}")
            )
        if step < 0:
            raise agreed(UsageError(f"step must be >= 0; got {step}"))
        plan = plan_save(
            [t for t, _ in tensors], mesh, self.chunk_bytes, self.ranks_per_file
        )  # pure: same on all
        blocks: dict[int, np.ndarray] = {}
        hashes: dict[int, tuple[str, ...]] = {}
        error: BaseException | None = None
        try:
            for i, shard in plan.owned(self.rank):
                spec, block = tensors[i]
                want = local_shape(spec.type.shape, spec.type.layout, mesh, self.rank)
                dtype = np_dtype(spec.type.dtype)
                if block is None or tuple(block.shape) != want or block.dtype != dtype:
                    got = "nothing" if block is None else f"{block.dtype}{list(block.shape)}"
                    raise UsageError(
                        f"tensor {spec.name!r}: rank {self.rank} holds {got}, expected its block {dtype}{list(want)}"
                    )
                arr = np.array(block, order="C", copy=True) if copy else np.ascontiguousarray(block)
                rows = shard.chunk_rows
                if arr.ndim == 0:
                    hashes[i] = (chunk_hash(arr),)
                else:
                    hashes[i] = tuple(
                        chunk_hash(arr[c * rows : (c + 1) * rows]) for c in range(shard.nchunks)
                    )
                blocks[i] = arr
        except DtmError as exc:
            error = exc
        self._agree(error, f"checkpoint {step}: preparing the save")
        return plan, blocks, hashes

    def _check_quota(self, step: int, plan: SavePlan, manifest_bytes: int, comm: Any) -> None:
        error: BaseException | None = None
        if self.rank == 0 and self.meta.quota_bytes is not None:
            try:
                # retired checkpoints count until gone (bounded: the others wait for the verdict)
                self._retention.wait(self.timeout_s / 2)
                shards = [s.nbytes for per in plan.shards for s in per]
                need = plan.data_bytes + self.backend.overhead_bytes(
                    shards, len(plan.files), manifest_bytes
                )
                used = disk_usage(self.path)
                if used + need > self.meta.quota_bytes:
                    error = QuotaError(
                        f"store {self.path}: checkpoint {step} needs about {need} bytes; {used} of the quota's {self.meta.quota_bytes} are in use"
                    )
            except Exception as exc:  # decided on rank 0 alone: always broadcast
                error = QuotaError(f"store {self.path}: cannot measure its size ({exc})")
        verdict = self._bcast(
            None if error is None else str(error), f"checkpoint {step}: quota", comm
        )
        if verdict is not None:
            raise agreed(QuotaError(verdict))

    def _group_comm(self, comm: Any, plan: SavePlan) -> Any:
        """The communicator of the ranks sharing this rank's data file (made with ``comm``
        by :meth:`_split_groups`; COMM_SELF for one rank per file)."""
        if plan.ranks_per_file == 1:
            return handles.self_comm()
        return self._groups[id(comm)]

    def _split_groups(self, comm: Any) -> None:
        """Collective on ``comm``: split it into the data-file groups, once, when ``comm`` is
        made (the constructor, the async writer's duplicate), where every rank is together:
        not in the middle of a save, where a rank that timed out would leave the others
        waiting in an unbounded ``MPI_Comm_split``."""
        per_file = self.ranks_per_file or self.size
        if per_file > 1 and id(comm) not in self._groups:
            self._groups[id(comm)] = handles.split(comm, self.rank // per_file, self.rank)

    def _save(
        self,
        step: int,
        plan: SavePlan,
        blocks: dict[int, np.ndarray],
        hashes: dict[int, tuple[str, ...]],
        module_hash: str | None,
        comm: Any,
        control: tuple[Callable[[], bool], Callable[[int], None] | None] | None,
    ) -> Path:
        gathered = self._gather(hashes, f"checkpoint {step}: shard hashes", comm)
        all_hashes = {
            (i, s.index): gathered[s.owner][i] for i, per in enumerate(plan.shards) for s in per
        }
        manifest = plan_manifest(plan, step, all_hashes, module_hash, __version__)
        text = manifest.to_bytes()
        self._check_quota(step, plan, len(text), comm)
        token = self._bcast(
            secrets.token_hex(4) if self.rank == 0 else None, "checkpoint name", comm
        )
        final = self.path / committed_name(step)
        tmp = self.path / partial_name(step, token)
        problem = None
        if self.rank == 0:
            try:
                tmp.mkdir()
            except OSError as exc:
                problem = f"checkpoint {step}: cannot create {tmp}: {exc}"
        problem = self._bcast(problem, f"checkpoint {step}: creating {tmp.name}", comm)
        if problem is not None:
            raise agreed(StorageError(problem))
        writer = Writer(
            self.rank,
            comm,
            self._group_comm(comm, plan),
            self._deadline,
            self._gather,
            self.backend,
        )
        error, cancelled = write_data_file(writer, step, plan, blocks, manifest, tmp, control)
        if cancelled:
            self._gather(None, f"checkpoint {step}: files closed after the cancel", comm)
            problem = None
            if self.rank == 0:
                try:
                    self.backend.remove(tmp)
                    fsync_path(self.path)
                except OSError as exc:
                    problem = (
                        f"checkpoint {step} was cancelled, but removing {tmp.name} failed: {exc}"
                    )
            problem = self._bcast(problem, "checkpoint cancel", comm)
            if problem is not None:
                raise agreed(StorageError(problem))
            raise agreed(
                CancelledError(
                    f"checkpoint {step} was cancelled; its partial checkpoint was removed and the previous checkpoint stands"
                )
            )
        if self.rank == 0 and error is None:
            try:
                with self._deadline(
                    f"checkpoint {step}: writing {self.backend.index_path(tmp).name}"
                ):
                    self.backend.write_index(tmp, manifest, text)
            except Exception as exc:
                error = exc
        self._agree(error, f"checkpoint {step}: writing {tmp.name}", comm)
        return self._commit(step, plan, tmp, final, comm)

    def _commit(self, step: int, plan: SavePlan, tmp: Path, final: Path, comm: Any) -> Path:
        """Every rank wrote, synced and checked its part: rank 0 commits (``io.commit``),
        points ``latest`` at it and applies retention; every rank learns how it went."""
        verdict: str | None = None
        if self.rank == 0:
            committed = False
            try:
                replaced = commit_partial(
                    self.path, tmp, final, [data_file_name(i) for i in plan.files], self.backend
                )
                committed = True
                write_latest(self.path, step)
                self._retention.apply(self.meta.keep_last, final, replaced, self.timeout_s / 2)
            except Exception as exc:  # decided on rank 0 alone: always broadcast
                if committed:
                    verdict = f"checkpoint {step} is committed as {final.name}, but updating 'latest' or retention failed: {exc}"
                else:
                    verdict = f"checkpoint {step} did not verify ({exc}); it stays as {tmp.name}, the previous checkpoint stands"
        verdict = self._bcast(verdict, f"checkpoint {step}: commit", comm)
        if verdict is not None:
            raise agreed(StorageError(verdict))
        return final

    # -- restore ---------------------------------------------------------------------------------
    def restore(
        self,
        mesh: MeshShape,
        targets: Sequence[tuple[str, TensorType]],
        *,
        step: int | None = None,
        fallback: bool = False,
        into: Mapping[str, np.ndarray] | None = None,
        pins: Mapping[str, Pin] | None = None,
        optional: Collection[str] = (),
    ) -> Restored:
        """Collective: call on all ranks. This rank's blocks of ``targets`` (name, type on
        ``mesh``) from checkpoint ``step`` (default: latest); with ``fallback``, the newest
        checkpoint at or before it that restores and verifies. ``pins``: targets held only by
        the ranks at an (axis, coordinate) of ``mesh`` (elsewhere an empty block).
        ``optional``: targets a checkpoint may lack (then absent from the values).

        ``into`` (name -> array) restores those tensors in place, into the caller's arrays
        (C-contiguous, writeable, exactly this rank's block shape and dtype), as a training
        loop reloading its parameters wants: no new memory. If the restore fails, their
        content is undefined (partly overwritten); the checkpoint itself is untouched."""
        self.wait()
        if mesh.size != self.size:
            raise agreed(
                UsageError(f"mesh {mesh} has {mesh.size} ranks, the communicator {self.size}")
            )
        self._agree(self._check_into(mesh, targets, into), "restore: checking the 'into' arrays")
        candidates: Any = None
        if self.rank == 0:
            try:
                start = step if step is not None else read_latest(self.path)
                steps = sorted(
                    (e.step for e in list_checkpoints(self.path) if e.committed), reverse=True
                )
                if start is None or start not in steps:
                    old = legacy_files(self.path)
                    hint = (
                        f" (it holds {len(old)} single-file checkpoint(s) of format version 1, e.g. {old[0].name}, which this dtm_mpi does not read)"
                        if old
                        else ""
                    )
                    candidates = (
                        f"store {self.path} has no committed checkpoint"
                        + ("" if start is None else f" {start}")
                        + hint
                    )
                else:
                    candidates = [s for s in steps if s <= start] if fallback else [start]
            except Exception as exc:  # decided on rank 0 alone: always broadcast
                candidates = f"store {self.path}: {exc}"
        candidates = self._bcast(candidates, "restore: choosing the checkpoint")
        if isinstance(candidates, str):
            raise agreed(StorageError(candidates))
        errors: list[str] = []
        for s in candidates:
            try:
                got = self._restore_file(s, mesh, targets, into, pins, frozenset(optional))
                return replace(got, skipped=tuple(errors)) if errors else got
            except (IntegrityError, ManifestError, UnrecoverableError, StorageError) as exc:
                if not fallback or isinstance(exc, UsageError):
                    raise
                errors.append(f"step {s}: {exc}")
        raise agreed(StorageError("no checkpoint restores and verifies: " + "; ".join(errors)))

    def _check_into(
        self,
        mesh: MeshShape,
        targets: Sequence[tuple[str, TensorType]],
        into: Mapping[str, np.ndarray] | None,
    ) -> UsageError | None:
        """Why this rank's ``into`` arrays cannot take the restore (a local decision: the
        caller agrees on it), or None."""
        if not into:
            return None
        types = dict(targets)
        for name, arr in into.items():
            if name not in types:
                return UsageError(f"restore: 'into' names {name!r}, which is not a target")
            t = types[name]
            try:
                want, dtype = local_shape(t.shape, t.layout, mesh, self.rank), np_dtype(t.dtype)
            except DtmError as exc:  # a layout that does not fit the mesh: agreed by the caller
                return UsageError(f"restore: tensor {name!r}: {exc}")
            if not isinstance(arr, np.ndarray) or tuple(arr.shape) != want or arr.dtype != dtype:
                got = (
                    f"{arr.dtype}{list(arr.shape)}"
                    if isinstance(arr, np.ndarray)
                    else type(arr).__name__
                )
                return UsageError(
                    f"restore: 'into' array for tensor {name!r} on rank {self.rank} is {got}, expected its block {dtype}{list(want)}"
                )
            if not (arr.flags.c_contiguous and arr.flags.writeable):
                return UsageError(
                    f"restore: 'into' array for tensor {name!r} on rank {self.rank} must be C-contiguous and writeable"
                )
        return None

    def _restore_file(
        self,
        step: int,
        mesh: MeshShape,
        targets: Sequence[tuple[str, TensorType]],
        into: Mapping[str, np.ndarray] | None = None,
        pins: Mapping[str, Pin] | None = None,
        optional: frozenset[str] = frozenset(),
    ) -> Restored:
        path = self.path / committed_name(step)
        where = str(self.backend.index_path(path))
        text: Any = None
        if self.rank == 0:  # one reader of the small main file; every rank parses the same bytes
            try:
                text = self.backend.read_index(path)
            except Exception as exc:  # decided on rank 0 alone: always broadcast
                text = str(exc) if isinstance(exc, ManifestError) else f"{where}: {exc}"
        text = self._bcast(text, f"restore: reading the manifest of {path.name}")
        try:
            if isinstance(text, str):
                raise ManifestError(text)
            manifest = parse_loadable_manifest(text, where)
            if optional:
                targets = [t for t in targets if t[0] not in optional or t[0] in manifest.names]
            plan = plan_restore(manifest, targets, mesh, self.round_bytes, where, pins)
        except DtmError as exc:  # decided from the same bytes on every rank: same error
            raise agreed(exc) from None
        with self.backend.open_reader(path, handles.self_comm()) as files:
            reader = Reader(self.comm, self.rank, self.size, self.timeout_s, self._deadline)
            values, damaged = read_plan(reader, files, plan, into or {})
        bad = self._gather(damaged, f"restore {path.name}: verification")
        failures = [e for per in bad for e in per]
        healthy = {a.name: not any(e[0] == a.name for e in failures) for a in manifest.artifacts}
        actions = recovery_actions(manifest, healthy)
        for name, _ in targets:
            if actions[name] is RecoveryAction.UNRECOVERABLE:
                own = [e for e in failures if e[0] == name]
                tensor, shard, msg, file = (
                    own[0]
                    if own
                    else failures[0]
                    if failures
                    else (name, "*", "no healthy copy and no parent to rebuild it from", where)
                )
                raise agreed(IntegrityError(msg, tensor=tensor, shard=shard, file=file))
        if any(actions[name] is RecoveryAction.REBUILD for name, _ in targets):
            values = self._rebuild(values, manifest, actions, mesh, targets, step, pins)
            for name, arr in (into or {}).items():
                if values[name] is not arr:
                    arr[...] = values[name]
                    values[name] = arr
        return Restored(step, path, values, manifest.module_hash)

    def _rebuild(
        self,
        values: dict[str, np.ndarray],
        manifest: Manifest,
        actions: dict[str, RecoveryAction],
        mesh: MeshShape,
        targets: Sequence[tuple[str, TensorType]],
        step: int,
        pins: Mapping[str, Pin] | None = None,
    ) -> dict[str, np.ndarray]:
        """Derived targets that failed verification, recomputed from their parents."""
        for name, t in targets:
            if actions[name] is not RecoveryAction.REBUILD:
                continue
            a = manifest.artifact(name)
            assert a.parent is not None and a.rebuild is not None
            parent = manifest.artifact(a.parent)
            pin = {a.parent: pins[name]} if pins and name in pins else None
            src = self._restore_file(
                step, mesh, [(a.parent, t.with_dtype(parent.dtype))], pins=pin
            ).values[a.parent]
            try:
                values[name] = rebuild_value(a, src)
            except UnrecoverableError as exc:  # the same instruction on every rank
                raise agreed(exc) from None
        return values
