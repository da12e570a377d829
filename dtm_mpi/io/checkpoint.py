"""Checkpoints in parallel HDF5: collective save with atomic commit, restore onto any mesh.

**Save** (collective; :meth:`CheckpointStore.save`): the plan is pure (``io.plan``); the quota
is checked before a byte is written; each rank hashes the chunks of the blocks it owns from
memory; all ranks create the file ``ckpt-N.h5.partial-T`` with the MPI-IO driver and write
every tensor as one global dataset with collective transfers (the owner of each block writes
its hyperslab, replicas take part with nothing); the manifest (identical on every rank, built
from the gathered shard hashes) is stored in the file; the file is flushed (``MPI_File_sync``)
and closed; the ranks agree that every one of them got there; rank 0 fsyncs it, reopens it
and validates it (with ``DTM_CKPT_VERIFY=full``, also re-reads and re-hashes every chunk),
renames it to ``ckpt-N.h5``,
fsyncs the directory, points ``latest`` at it and applies keep-last-K retention (never to the
checkpoint just saved), and every rank learns the verdict. A crash at any moment leaves
``latest`` naming a committed, verified checkpoint.

**Async save** (:meth:`CheckpointStore.save_async`): the owned blocks are copied and hashed
(a snapshot: later updates of the caller's arrays do not leak in), then a writer thread does the
rest on a duplicate communicator. :meth:`SaveHandle.wait` joins it; :meth:`SaveHandle.cancel`
(collective) stops it at the next tensor boundary — the writer threads agree on the stop, close
the file, and rank 0 removes the partial file. A later save, a restore, or :meth:`close`
waits for the pending one first.

**Restore** (collective; :meth:`CheckpointStore.restore`): onto any mesh and layout (``io.plan``:
each stored chunk read once by one rank with an independent read, verified in memory, its
pieces sent where they are needed; ``into=`` restores in place), with
an :class:`IntegrityError` naming tensor, shard and file on any mismatch (agreed: every rank
raises it), and ``fallback=True`` to restore the newest checkpoint that verifies instead.
Derived artifacts that fail verification are rebuilt from their parent; ephemeral ones are
never stored; a primary artifact with no healthy copy is an :class:`UnrecoverableError`.

Bounded: every exchange of the store waits at most the timeout, and every HDF5 call runs
under :func:`~dtm_mpi.comm.objects.io_deadline`.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi._version import __version__
from dtm_mpi.comm.abort import abort_job
from dtm_mpi.comm.objects import allgather_obj, alltoallv_bytes, bcast_obj, io_deadline
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
from dtm_mpi.faults import maybe_fail
from dtm_mpi.io.h5 import ALIGN_BYTES, ALIGN_FROM, create_dataset, open_file, read_slab, write_slab
from dtm_mpi.io.hashing import chunk_hash
from dtm_mpi.io.manifest import (
    ArtifactClass,
    ArtifactRecord,
    Manifest,
    RecoveryAction,
    layout_to_json,
    parse_manifest,
    recovery_actions,
    validate_manifest,
)
from dtm_mpi.io.plan import (  # fmt: skip
    CHUNK_BYTES,
    ROUND_BYTES,
    RestorePlan,
    SavePlan,
    TensorSpec,
    plan_manifest,
    plan_restore,
    plan_save,
)
from dtm_mpi.io.store import (
    CKPT_FORMAT,
    FORMAT_VERSION,
    StoreMeta,
    check_file_format,
    committed_name,
    disk_usage,
    fsync_dir,
    list_checkpoints,
    read_latest,
    read_manifest,
    read_meta,
    retired_files,
    verify_checkpoint,
    write_latest,
    write_meta,
)
from dtm_mpi.ir.ops._common import np_dtype
from dtm_mpi.ir.types import TensorType
from dtm_mpi.sharding.blocks import local_shape
from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["CheckpointStore", "Restored", "SaveHandle", "rebuild_value"]


def rebuild_value(a: ArtifactRecord, parent: np.ndarray) -> np.ndarray:
    """Derived artifact ``a`` recomputed from its parent's value by its rebuild instruction:
    ``copy`` or ``cast:<dtype>`` (the artifact's own dtype)."""
    assert a.rebuild is not None
    kind, _, arg = a.rebuild.partition(":")
    if kind == "copy" or (kind == "cast" and arg == a.dtype.value):
        return parent.astype(np_dtype(a.dtype), copy=True)
    raise UnrecoverableError(f"tensor {a.name!r}: unknown rebuild instruction {a.rebuild!r} (known: copy, cast:{a.dtype.value})")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    path: Path
    values: dict[str, np.ndarray]  # this rank's local blocks, by tensor name
    module_hash: str | None = None  # of the program that wrote it


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
        its partial file; returns True if it was cancelled, False if it had already committed
        (then the new checkpoint stands)."""
        self.cancel_requested = True
        try:
            self.wait()
        except CancelledError:
            return True
        return False


class CheckpointStore:
    """Collective: construct on all ranks of ``comm`` (default ``MPI.COMM_WORLD``).

    ``quota_bytes`` and ``keep_last`` are stored in the store's ``store.json`` when given
    (rank 0 creates the store), else read from it."""

    def __init__(
        self, path: str | os.PathLike[str], comm: Any = None, *, quota_bytes: int | None = None,
        keep_last: int | None = None, timeout_s: float | None = None,
        chunk_bytes: int = CHUNK_BYTES, round_bytes: int = ROUND_BYTES,
    ) -> None:  # fmt: skip
        from mpi4py import MPI

        self.path = Path(path)
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())
        self.timeout_s = timeout_s if timeout_s is not None else get_config().timeout_s
        self.chunk_bytes, self.round_bytes = chunk_bytes, round_bytes
        self._io_comm: Any = None
        self._pending: SaveHandle | None = None
        self._reaper: threading.Thread | None = None
        self._poisoned: BaseException | None = None
        outcome: Any = None
        if self.rank == 0:
            try:
                meta = read_meta(self.path) or StoreMeta()
                if quota_bytes is not None or keep_last is not None or not (self.path / "store.json").exists():  # fmt: skip
                    meta = StoreMeta(
                        quota_bytes if quota_bytes is not None else meta.quota_bytes,
                        keep_last if keep_last is not None else meta.keep_last,
                    )
                    write_meta(self.path, meta)
                outcome = meta
            except (OSError, DtmError) as exc:
                outcome = StorageError(f"store {self.path}: {exc}")
        outcome = self._bcast(outcome, "open store")
        if isinstance(outcome, BaseException):
            raise agreed(outcome) if isinstance(outcome, DtmError) else outcome
        self.meta: StoreMeta = outcome

    # -- small collective helpers ----------------------------------------------------------------
    def _bcast(self, obj: Any, what: str, comm: Any = None) -> Any:
        self._check_poisoned()
        try:
            return bcast_obj(comm or self.comm, obj, 0, timeout_s=self.timeout_s, what=what, phase="checkpoint")  # fmt: skip
        except CommTimeoutError as exc:
            self._poisoned = exc
            raise

    def _gather(self, obj: Any, what: str, comm: Any = None) -> list[Any]:
        self._check_poisoned()
        try:
            return allgather_obj(comm or self.comm, obj, timeout_s=self.timeout_s, what=what, phase="checkpoint")  # fmt: skip
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
        errors = self._gather(None if error is None else (type(error).__name__, str(error)), what, comm)  # fmt: skip
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        r, (kind, msg) = failed[0]
        kinds: tuple[type[DtmError], ...] = (ManifestError, QuotaError, CancelledError, UnrecoverableError, UsageError)  # fmt: skip
        cls = {c.__name__: c for c in kinds}.get(kind, StorageError)
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        err = cls(f"{what} failed on rank {r}{others}: {msg}")
        raise agreed(err)

    def _deadline(self, what: str) -> Any:
        return io_deadline(what, "checkpoint", self.rank, self.timeout_s)

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int, mesh: MeshShape, tensors: Sequence[tuple[TensorSpec, np.ndarray | None]], *, module_hash: str | None = None) -> Path:  # fmt: skip
        """Collective: call on all ranks. Save this rank's local blocks ``tensors`` (spec,
        local array; None for ephemeral ones) as checkpoint ``step``; returns its path."""
        self.wait()
        plan, blocks, hashes = self._prepare(step, mesh, tensors, copy=False)
        return self._save(step, plan, blocks, hashes, module_hash, self.comm, None)

    def save_async(self, step: int, mesh: MeshShape, tensors: Sequence[tuple[TensorSpec, np.ndarray | None]], *, module_hash: str | None = None, before_tensor: Callable[[int], None] | None = None) -> SaveHandle:  # fmt: skip
        """Collective: call on all ranks. Snapshot and hash the owned blocks now, write them in
        the background; ``before_tensor(i)`` (tests) runs in the writer before tensor ``i``."""
        from mpi4py import MPI

        self.wait()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise UsageError("async save needs MPI_THREAD_MULTIPLE (mpi4py's default); this MPI was initialised with less")  # fmt: skip
        plan, blocks, hashes = self._prepare(step, mesh, tensors, copy=True)
        if self._io_comm is None:
            self._io_comm = self.comm.Dup()
        handle = SaveHandle(self, step)

        def cancelled() -> bool:
            return handle.cancel_requested

        def body() -> None:
            try:
                handle.result = self._save(step, plan, blocks, hashes, module_hash, self._io_comm, (cancelled, before_tensor))  # fmt: skip
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
            self._reap()
            if self._io_comm is not None:
                self._io_comm.Free()
                self._io_comm = None

    def _prepare(self, step: int, mesh: MeshShape, tensors: Sequence[tuple[TensorSpec, np.ndarray | None]], copy: bool) -> tuple[SavePlan, dict[int, np.ndarray], dict[int, tuple[str, ...]]]:  # fmt: skip
        if mesh.size != self.size:
            raise agreed(UsageError(f"mesh {mesh} has {mesh.size} ranks, the communicator {self.size}"))  # fmt: skip
        if step < 0:
            raise agreed(UsageError(f"step must be >= 0; got {step}"))
        plan = plan_save([t for t, _ in tensors], mesh, self.chunk_bytes)  # pure: same on all
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
                    raise UsageError(f"tensor {spec.name!r}: rank {self.rank} holds {got}, expected its block {dtype}{list(want)}")  # fmt: skip
                arr = np.array(block, order="C", copy=True) if copy else np.ascontiguousarray(block)  # fmt: skip
                rows = shard.chunk_rows
                if arr.ndim == 0:
                    hashes[i] = (chunk_hash(arr),)
                else:
                    hashes[i] = tuple(chunk_hash(arr[c * rows : (c + 1) * rows]) for c in range(shard.nchunks))  # fmt: skip
                blocks[i] = arr
        except DtmError as exc:
            error = exc
        self._agree(error, f"checkpoint {step}: preparing the save")
        return plan, blocks, hashes

    def _check_quota(self, step: int, plan: SavePlan, manifest_bytes: int, comm: Any) -> None:
        error: BaseException | None = None
        if self.rank == 0 and self.meta.quota_bytes is not None:
            try:
                self._reap()  # retired checkpoints still being deleted count until gone
                align = sum(ALIGN_BYTES for per in plan.shards if sum(s.nbytes for s in per) >= ALIGN_FROM)  # fmt: skip
                need = plan.data_bytes + align + manifest_bytes + (256 << 10)
                used = disk_usage(self.path)
                if used + need > self.meta.quota_bytes:
                    error = QuotaError(f"store {self.path}: checkpoint {step} needs about {need} bytes; {used} of the quota's {self.meta.quota_bytes} are in use")  # fmt: skip
            except Exception as exc:  # decided on rank 0 alone: always broadcast
                error = QuotaError(f"store {self.path}: cannot measure its size ({exc})")
        verdict = self._bcast(None if error is None else str(error), f"checkpoint {step}: quota", comm)  # fmt: skip
        if verdict is not None:
            raise agreed(QuotaError(verdict))

    def _save(self, step: int, plan: SavePlan, blocks: dict[int, np.ndarray], hashes: dict[int, tuple[str, ...]], module_hash: str | None, comm: Any, control: tuple[Callable[[], bool], Callable[[int], None] | None] | None) -> Path:  # fmt: skip
        gathered = self._gather(hashes, f"checkpoint {step}: shard hashes", comm)
        all_hashes = {(i, s.index): gathered[s.owner][i] for i, per in enumerate(plan.shards) for s in per}  # fmt: skip
        manifest = plan_manifest(plan, step, all_hashes, module_hash, __version__)
        text = manifest.to_bytes()
        self._check_quota(step, plan, len(text), comm)
        token = self._bcast(secrets.token_hex(4) if self.rank == 0 else None, "checkpoint name", comm)  # fmt: skip
        final = self.path / committed_name(step)
        tmp = self.path / f"{committed_name(step)}.partial-{token}"
        cancelled = False
        with self._deadline(f"checkpoint {step}: creating {tmp.name}"):
            f = open_file(str(tmp), "w", comm)
        with _collective_section(self.rank, f"checkpoint {step} (writing {tmp.name})"):
            with self._deadline(f"checkpoint {step}: file attributes"):
                f.attrs["dtm_format"] = CKPT_FORMAT
                f.attrs["format_version"] = FORMAT_VERSION
                f.attrs["step"] = step
                f.attrs["dtm_version"] = __version__
                f.require_group("tensors")
            for i, spec in enumerate(plan.specs):
                if control is not None:
                    stop_here, before = control
                    if before is not None:
                        before(i)
                    votes = self._gather(stop_here(), f"checkpoint {step}: cancel check", comm)
                    if any(votes):
                        cancelled = True
                        break
                maybe_fail(self.rank, "ckpt_write")
                if spec.cls is ArtifactClass.EPHEMERAL:
                    continue
                t = spec.type
                with self._deadline(f"checkpoint {step}: writing tensor {spec.name!r}"):
                    dset = create_dataset(f, f"tensors/{spec.name}", t.shape, np_dtype(t.dtype))
                    dset.attrs["dtype"] = t.dtype.value
                    dset.attrs["artifact_class"] = spec.cls.value
                    dset.attrs["layout"] = json.dumps(layout_to_json(t.layout))
                    dset.attrs["step"] = step
                    mine = [s for s in plan.shards[i] if s.owner == self.rank]
                    if not plan.shards[i]:
                        pass  # no elements: no storage to write (decided alike on every rank)
                    elif mine:
                        write_slab(dset, mine[0].region, blocks[i])
                    else:
                        write_slab(dset, None, None)
            if not cancelled:
                with self._deadline(f"checkpoint {step}: writing the manifest"):
                    dm = f.create_dataset("manifest", shape=(), dtype=f"S{len(text)}")
                    dm.attrs["content_type"] = "application/json"
                    f.attrs["manifest_hash"] = manifest.to_json()["manifest_hash"]
                    if self.rank == 0:
                        dm[()] = np.bytes_(text)
                    f.flush()
            with self._deadline(f"checkpoint {step}: closing {tmp.name}"):
                f.close()
        if cancelled:
            problem = None
            if self.rank == 0:
                try:
                    tmp.unlink(missing_ok=True)
                    fsync_dir(self.path)
                except OSError as exc:
                    problem = f"checkpoint {step} was cancelled, but removing {tmp.name} failed: {exc}"  # fmt: skip
            problem = self._bcast(problem, "checkpoint cancel", comm)
            if problem is not None:
                raise agreed(StorageError(problem))
            raise agreed(CancelledError(f"checkpoint {step} was cancelled; its partial file was removed and the previous checkpoint stands"))  # fmt: skip
        return self._commit(step, tmp, final, comm)

    def _commit(self, step: int, tmp: Path, final: Path, comm: Any) -> Path:
        """Every rank closed the file: agree on it, then rank 0 fsyncs, verifies, renames
        (the commit), points ``latest`` at it and applies retention; every rank learns how
        it went."""
        self._agree(None, f"checkpoint {step}: writing {tmp.name}", comm)
        verdict: str | None = None
        if self.rank == 0:
            committed = False
            try:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                read_manifest(tmp)
                if get_config().ckpt_verify_full:
                    problems = verify_checkpoint(tmp)
                    if problems:
                        raise problems[0]
                maybe_fail(0, "ckpt_commit")
                os.replace(tmp, final)
                committed = True
                fsync_dir(self.path)
                write_latest(self.path, step)
                self._retain(final)
            except Exception as exc:  # decided on rank 0 alone: always broadcast
                if committed:
                    verdict = f"checkpoint {step} is committed as {final.name}, but updating 'latest' or retention failed: {exc}"  # fmt: skip
                else:
                    verdict = f"checkpoint {step} did not verify ({exc}); it stays as {tmp.name}, the previous checkpoint stands"  # fmt: skip
        verdict = self._bcast(verdict, f"checkpoint {step}: commit", comm)
        if verdict is not None:
            raise agreed(StorageError(verdict))
        return final

    def _retain(self, keep_this: Path) -> None:
        """Keep-last-K: delete the oldest committed checkpoints (by step), never
        ``keep_this`` (the one just committed, which ``latest`` names). The files are first
        renamed out of the checkpoint namespace (instant, and no reader can pick them), then
        unlinked by a background thread: freeing a large file's blocks takes a while, and
        the save need not wait for it (:meth:`close` does)."""
        keep = self.meta.keep_last
        if keep is None:
            return
        others = [e for e in list_checkpoints(self.path) if e.committed and e.path != keep_this]
        doomed = retired_files(self.path)  # left by an earlier crash
        for e in others[: max(0, len(others) - (keep - 1))]:  # DEPRECATED -> DELETED
            gone = e.path.with_name(f".deleting-{e.path.name}")
            os.replace(e.path, gone)
            doomed.append(gone)
        if not doomed:
            return
        fsync_dir(self.path)
        self._reap()

        def unlink_all() -> None:
            for p in doomed:
                p.unlink(missing_ok=True)

        self._reaper = threading.Thread(target=unlink_all, name="dtm-ckpt-retention", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        """Wait for the background deletion of retired checkpoints."""
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None
        fsync_dir(self.path)

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, mesh: MeshShape, targets: Sequence[tuple[str, TensorType]], *, step: int | None = None, fallback: bool = False, into: Mapping[str, np.ndarray] | None = None) -> Restored:  # fmt: skip
        """Collective: call on all ranks. This rank's blocks of ``targets`` (name, type on
        ``mesh``) from checkpoint ``step`` (default: latest); with ``fallback``, the newest
        checkpoint at or before it that restores and verifies.

        ``into`` (name -> array) restores those tensors in place, into the caller's arrays
        (C-contiguous, writeable, exactly this rank's block shape and dtype), as a training
        loop reloading its parameters wants: no new memory. If the restore fails, their
        content is undefined (partly overwritten); the checkpoint itself is untouched."""
        self.wait()
        if mesh.size != self.size:
            raise agreed(UsageError(f"mesh {mesh} has {mesh.size} ranks, the communicator {self.size}"))  # fmt: skip
        self._agree(self._check_into(mesh, targets, into), "restore: checking the 'into' arrays")
        candidates: Any = None
        if self.rank == 0:
            try:
                start = step if step is not None else read_latest(self.path)
                steps = sorted((e.step for e in list_checkpoints(self.path) if e.committed), reverse=True)  # fmt: skip
                if start is None or start not in steps:
                    candidates = f"store {self.path} has no committed checkpoint" + ("" if start is None else f" {start}")  # fmt: skip
                else:
                    candidates = [s for s in steps if s <= start] if fallback else [start]
            except Exception as exc:  # decided on rank 0 alone: always broadcast
                candidates = f"store {self.path}: {exc}"
        candidates = self._bcast(candidates, "restore: choosing the checkpoint")
        if isinstance(candidates, str):
            raise agreed(StorageError(candidates))
        errors = []
        for s in candidates:
            try:
                return self._restore_file(s, mesh, targets, into)
            except (IntegrityError, ManifestError, UnrecoverableError, StorageError) as exc:
                if not fallback or isinstance(exc, UsageError):
                    raise
                errors.append(f"step {s}: {exc}")
        raise agreed(StorageError("no checkpoint restores and verifies: " + "; ".join(errors)))

    def _check_into(self, mesh: MeshShape, targets: Sequence[tuple[str, TensorType]], into: Mapping[str, np.ndarray] | None) -> UsageError | None:  # fmt: skip
        """Why this rank's ``into`` arrays cannot take the restore (a local decision: the
        caller agrees on it), or None."""
        if not into:
            return None
        types = dict(targets)
        for name, arr in into.items():
            if name not in types:
                return UsageError(f"restore: 'into' names {name!r}, which is not a target")
            t = types[name]
            want, dtype = local_shape(t.shape, t.layout, mesh, self.rank), np_dtype(t.dtype)
            if not isinstance(arr, np.ndarray) or tuple(arr.shape) != want or arr.dtype != dtype:
                got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__  # fmt: skip
                return UsageError(f"restore: 'into' array for tensor {name!r} on rank {self.rank} is {got}, expected its block {dtype}{list(want)}")  # fmt: skip
            if not (arr.flags.c_contiguous and arr.flags.writeable):
                return UsageError(f"restore: 'into' array for tensor {name!r} on rank {self.rank} must be C-contiguous and writeable")  # fmt: skip
        return None

    def _restore_file(self, step: int, mesh: MeshShape, targets: Sequence[tuple[str, TensorType]], into: Mapping[str, np.ndarray] | None = None) -> Restored:  # fmt: skip
        path = self.path / committed_name(step)
        with self._deadline(f"restore: opening {path.name}"):
            try:  # every rank opens the same file: it fails alike everywhere
                f = open_file(str(path), "r", self.comm)
            except OSError as exc:
                raise agreed(ManifestError(f"{path}: cannot be opened as HDF5 ({exc})")) from None
        try:
            try:
                check_file_format(f, path)
                text = bytes(f["manifest"][()]) if "manifest" in f else b""
                manifest = parse_manifest(text, str(path)) if text else None
                if manifest is None:
                    raise ManifestError(f"{path}: no manifest: the checkpoint is incomplete")
                validate_manifest(manifest, str(path))
                plan = plan_restore(manifest, targets, mesh, self.round_bytes, str(path))
                _check_datasets(f, path, plan)
            except DtmError as exc:  # decided from the same file on every rank: same error
                raise agreed(exc) from None
            with _collective_section(self.rank, f"restore of {path.name}"):
                values, damaged = self._read(f, path, plan, into or {})
        finally:
            with self._deadline(f"restore: closing {path.name}"):
                f.close()
        bad = self._gather(damaged, f"restore {path.name}: verification")
        failures = [e for per in bad for e in per]
        healthy = {a.name: not any(e[0] == a.name for e in failures) for a in manifest.artifacts}
        actions = recovery_actions(manifest, healthy)
        for name, _ in targets:
            if actions[name] is RecoveryAction.UNRECOVERABLE:
                own = [e for e in failures if e[0] == name]
                tensor, shard, msg = own[0] if own else failures[0] if failures else (name, "*", "no healthy copy and no parent to rebuild it from")  # fmt: skip
                raise agreed(IntegrityError(msg, tensor=tensor, shard=shard, file=str(path)))
        if any(actions[name] is RecoveryAction.REBUILD for name, _ in targets):
            values = self._rebuild(values, manifest, actions, mesh, targets, step)
            for name, arr in (into or {}).items():
                if values[name] is not arr:
                    arr[...] = values[name]
                    values[name] = arr
        return Restored(step, path, values, manifest.module_hash)

    def _rebuild(self, values: dict[str, np.ndarray], manifest: Manifest, actions: dict[str, RecoveryAction], mesh: MeshShape, targets: Sequence[tuple[str, TensorType]], step: int) -> dict[str, np.ndarray]:  # fmt: skip
        """Derived targets that failed verification, recomputed from their parents."""
        for name, t in targets:
            if actions[name] is not RecoveryAction.REBUILD:
                continue
            a = manifest.artifact(name)
            assert a.parent is not None and a.rebuild is not None
            parent = manifest.artifact(a.parent)
            src = self._restore_file(step, mesh, [(a.parent, t.with_dtype(parent.dtype))]).values[
                a.parent
            ]
            try:
                values[name] = rebuild_value(a, src)
            except UnrecoverableError as exc:  # the same instruction on every rank
                raise agreed(exc) from None
        return values

    def _read(self, f: Any, path: Path, plan: RestorePlan, into: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[tuple[str, str, str]]]:  # fmt: skip
        """Read, verify and distribute every round of ``plan`` (collective), into the
        arrays of ``into`` where given (checked by the caller), else new ones."""
        me = self.rank
        outs = {}
        offsets = []
        for ti, (name, t) in enumerate(plan.targets):
            block = plan.block(ti, me)
            outs[name] = into[name] if name in into else np.empty(tuple(s.stop - s.start for s in block), dtype=np_dtype(t.dtype))  # fmt: skip
            offsets.append(block)
        damaged: list[tuple[str, str, str]] = []
        by_item: dict[int, list[int]] = {}
        for k, p in enumerate(plan.pieces):
            by_item.setdefault(p.item, []).append(k)
        rounds: dict[int, list[int]] = {}
        for k, it in enumerate(plan.items):
            rounds.setdefault(it.round, []).append(k)
        for rnd in sorted(rounds):  # the same rounds on every rank: the plan is shared
            round_items = rounds[rnd]
            data: dict[int, np.ndarray] = {}
            for ti, (name, _) in enumerate(plan.targets):
                art = plan.artifacts[ti]
                items = [k for k in round_items if plan.items[k].tensor == ti]
                mine = [k for k in items if plan.items[k].reader == me]
                if not mine:
                    continue
                assert art.dataset is not None
                dset = f[art.dataset]
                # Independent reads: each chunk is whole rows, contiguous in the file, read by
                # exactly one rank (measured 20% faster than collective transfers, whose
                # two-phase buffering only pays for small or interleaved requests).
                for k in mine:
                    with self._deadline(f"restore: reading tensor {name!r}"):
                        item = plan.items[k]
                        direct = self._direct(plan, k, by_item, offsets[ti])
                        if direct is not None:
                            read_slab(dset, item.region, outs[name], within=direct, collective=False)  # fmt: skip
                            buf = outs[name][direct] if direct else outs[name]
                        else:
                            buf = np.empty(item.shape, dtype=outs[name].dtype)
                            read_slab(dset, item.region, buf, collective=False)
                            data[k] = buf
                    shard = art.shards[item.shard]
                    got = chunk_hash(buf)
                    if got != shard.chunks[item.chunk]:
                        damaged.append((name, shard.id, f"chunk {item.chunk} (rows {item.region[0].start if item.region else 0}..) content hash {got} does not match the manifest's {shard.chunks[item.chunk]} (read by rank {me})"))  # fmt: skip
            self._exchange(plan, round_items, by_item, data, outs, offsets)
        return outs, damaged

    def _direct(self, plan: RestorePlan, k: int, by_item: dict[int, list[int]], block: tuple[slice, ...]) -> tuple[slice, ...] | None:  # fmt: skip
        """Where item ``k`` lands in this rank's output when this rank is its only consumer
        (read straight into the output, no copy), else None."""
        pieces = by_item.get(k, [])
        if len(pieces) != 1 or plan.pieces[pieces[0]].dest != self.rank:
            return None
        region = plan.items[k].region
        if plan.pieces[pieces[0]].region != region:
            return None
        return _relative(region, block)

    def _exchange(self, plan: RestorePlan, round_items: list[int], by_item: dict[int, list[int]], data: dict[int, np.ndarray], outs: dict[str, np.ndarray], offsets: list[tuple[slice, ...]]) -> None:  # fmt: skip
        """Send every piece of this round's items to its rank (collective, one Alltoallv)."""
        me, n = self.rank, self.size
        sends: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(n)]  # (view, nbytes)
        recv_plan: list[list[int]] = [[] for _ in range(n)]
        itemsizes = [np_dtype(t.dtype).itemsize for _, t in plan.targets]
        for k in round_items:
            item = plan.items[k]
            name = plan.targets[item.tensor][0]
            for pk in by_item.get(k, []):
                p = plan.pieces[pk]
                if item.reader == me and k in data:
                    local = _relative(p.region, item.region)
                    part = data[k][local]
                    if p.dest == me:
                        out = _relative(p.region, offsets[item.tensor])
                        outs[name][out] = part
                    else:
                        sends[p.dest].append((part, part.size * itemsizes[item.tensor]))
                elif p.dest == me and item.reader != me:
                    recv_plan[item.reader].append(pk)
        if self._nothing_moves(plan, round_items, by_item):
            return
        send_counts = [sum(nb for _, nb in parts) for parts in sends]
        recv_counts = [
            sum(
                math.prod(plan.pieces[pk].shape)
                * itemsizes[plan.items[plan.pieces[pk].item].tensor]
                for pk in pks
            )
            for pks in recv_plan
        ]
        send = np.empty(sum(send_counts), dtype=np.uint8)  # packed in place: no extra copies
        pos = 0
        for parts in sends:
            for part, nb in parts:
                send[pos : pos + nb].view(part.dtype).reshape(part.shape)[...] = part
                pos += nb
        got = alltoallv_bytes(self.comm, send, send_counts, recv_counts, timeout_s=self.timeout_s, what="restore: exchange", phase="checkpoint")  # fmt: skip
        del send
        pos = 0
        for src in range(n):
            for pk in recv_plan[src]:
                p = plan.pieces[pk]
                item = plan.items[p.item]
                name = plan.targets[item.tensor][0]
                nbytes = math.prod(p.shape) * itemsizes[item.tensor]
                out = _relative(p.region, offsets[item.tensor])
                outs[name][out] = got[pos : pos + nbytes].view(outs[name].dtype).reshape(p.shape)
                pos += nbytes

    @staticmethod
    def _nothing_moves(plan: RestorePlan, round_items: list[int], by_item: dict[int, list[int]]) -> bool:  # fmt: skip
        """True when no piece of the round crosses ranks (decided from the plan: the same
        answer on every rank, so all skip the exchange together)."""
        return all(
            plan.pieces[pk].dest == plan.items[k].reader for k in round_items for pk in by_item.get(k, [])
        )  # fmt: skip


@contextmanager
def _collective_section(rank: int, what: str) -> Iterator[None]:
    """A run of collective HDF5 calls. A failure inside it is local to this rank while its
    peers wait inside HDF5 (holding the interpreter lock, so nothing can tell them): the
    only way not to leave them hanging is to end the job now, with this rank's error."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, DtmError) and exc.agreed:
            raise
        abort_job(1, f"dtm: error: rank {rank} failed during {what}: {type(exc).__name__}: {exc}\ndtm: aborting the job (its peers are inside collective HDF5 calls)")  # fmt: skip
        raise


def _check_datasets(f: Any, path: Path, plan: RestorePlan) -> None:
    """Every dataset the restore reads exists with the manifest's shape and element size
    (checked from the same file on every rank before any collective read)."""
    for a in plan.artifacts:
        assert a.dataset is not None
        if a.dataset not in f:
            raise IntegrityError("dataset is missing", tensor=a.name, shard="*", file=str(path))
        dset = f[a.dataset]
        if tuple(dset.shape) != a.shape or dset.dtype.itemsize != np_dtype(a.dtype).itemsize:
            raise IntegrityError(
                f"dataset is {dset.dtype}{list(dset.shape)}, the manifest says {a.dtype}{list(a.shape)}",
                tensor=a.name, shard="*", file=str(path),
            )  # fmt: skip


def _relative(region: tuple[slice, ...], origin: tuple[slice, ...]) -> tuple[slice, ...]:
    """``region`` (global) relative to the block that starts at ``origin``."""
    return tuple(slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin, strict=True))  # fmt: skip
