"""The commit of a checkpoint and its retention: rank 0's serial file-system steps.

:func:`commit_partial` checks a complete partial checkpoint directory (directory fsynced, main
file and manifest valid, exactly the planned files present) and renames it into place —
atomically exchanging names with a committed checkpoint of the same step where the system can.
:class:`Retention` applies keep-last-K: checkpoints are first renamed out of the checkpoint
namespace (instant, and no reader can pick them), then deleted by a background thread: freeing
a large checkpoint's blocks takes a while, and the save need not wait for it.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

from dtm_mpi.errors import StorageError
from dtm_mpi.faults import maybe_fail
from dtm_mpi.io.backend import HDF5, ShardBackend
from dtm_mpi.io.manifest import parse_loadable_manifest
from dtm_mpi.io.store import fsync_path, list_checkpoints, replace_dir, retired_files

__all__ = ["Retention", "commit_partial"]


def commit_partial(
    store: Path, tmp: Path, final: Path, data_files: list[str], backend: ShardBackend = HDF5
) -> list[Path]:
    """Check the partial checkpoint ``tmp`` (its manifest, read through ``backend``, parses
    and validates; it holds exactly the backend's main file and ``data_files``) and rename it to
    ``final`` (the commit), then fsync ``store``; returns the retired paths of a replaced
    checkpoint of the same step (for :class:`Retention` to delete). Raises before the rename
    if ``tmp`` is incomplete."""
    fsync_path(tmp)
    index = backend.index_path(tmp)
    where = str(index)
    parse_loadable_manifest(backend.read_index(tmp), where)
    want = sorted([index.name, *data_files])
    found = sorted(p.name for p in tmp.iterdir())
    if found != want:
        raise StorageError(f"{tmp} holds {found}, expected {want}")
    maybe_fail(0, "ckpt_commit")
    replaced = []
    if final.exists():  # a checkpoint of the same step is replaced
        old = store / f".deleting-{final.name}-{secrets.token_hex(4)}"
        replaced.append(replace_dir(tmp, final, old))
    else:
        os.replace(tmp, final)
    fsync_path(store)
    return replaced


class Retention:
    """Keep-last-K over one store directory, with deletion in the background."""

    def __init__(self, store: Path, backend: ShardBackend = HDF5) -> None:
        self.store, self.backend = store, backend
        self._reaper: threading.Thread | None = None

    def apply(
        self,
        keep_last: int | None,
        keep_this: Path,
        doomed: list[Path],
        timeout_s: float | None = None,
    ) -> None:
        """Retire the oldest committed checkpoints beyond ``keep_last`` (by step), never
        ``keep_this`` (the one just committed, which ``latest`` names), and delete them, the
        already-retired ``doomed`` and any ``.deleting-*`` entry an earlier crash left
        (after the previous deletion, waited at most ``timeout_s``)."""
        self.wait(timeout_s)
        doomed = [*doomed, *(p for p in retired_files(self.store) if p not in doomed)]
        if keep_last is not None:
            others = [
                e for e in list_checkpoints(self.store) if e.committed and e.path != keep_this
            ]
            for e in others[: max(0, len(others) - (keep_last - 1))]:  # DEPRECATED -> DELETED
                gone = e.path.with_name(f".deleting-{e.path.name}-{secrets.token_hex(4)}")
                os.replace(e.path, gone)
                doomed.append(gone)
        if not doomed:
            return
        fsync_path(self.store)

        def remove_all() -> None:
            for p in doomed:
                self.backend.remove(p)

        self._reaper = threading.Thread(target=remove_all, name="dtm-ckpt-retention", daemon=True)
        self._reaper.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the background deletion (and make it durable); raises
        :class:`StorageError` if it is still running after ``timeout_s`` (None: no bound, for
        ``close``, where no other rank waits on this one)."""
        if self._reaper is not None:
            self._reaper.join(timeout_s)
            if self._reaper.is_alive():
                raise StorageError(
                    f"store {self.store}: deleting retired checkpoints took more than {timeout_s} s; it goes on in the background"
                )
            self._reaper = None
            fsync_path(self.store)
