"""A save's data files: each group of ``ranks_per_file`` ranks writes one, through the
store's backend (:class:`~dtm_mpi.io.backend.ShardBackend`); described here for parallel HDF5.

The ranks of a group open ``data-NNNNNN.h5`` with the MPI-IO driver on their communicator,
create one dataset per shard the file stores (collectively: parallel HDF5's metadata rule) and
each owner writes its shard with an independent transfer; the file is flushed and closed, and
the group's first rank fsyncs it and reopens it to check it. Between tensors an async save's
ranks vote on a cancel (and on failures). With one rank per file nothing here is collective
but those votes, so a failure is simply returned for the caller to agree on; with several, a
failure inside the group's collective HDF5 calls ends the job (:func:`collective_section`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.comm.abort import abort_job
from dtm_mpi.config import get_config
from dtm_mpi.errors import DtmError
from dtm_mpi.faults import maybe_fail
from dtm_mpi.io.backend import HDF5, ShardBackend, ShardWriter
from dtm_mpi.io.ckpt_plan import SavePlan
from dtm_mpi.io.manifest import Manifest, data_file_name, shard_dataset
from dtm_mpi.io.store import fsync_path
from dtm_mpi.ir.dtypes import np_dtype

__all__ = ["Writer", "collective_section", "write_data_file"]


@dataclass(frozen=True, slots=True)
class Writer:
    """Who writes: this rank, the job's communicator (votes), its data-file group's
    communicator, the deadline each HDF5 step runs under, and the bounded allgather."""

    rank: int
    comm: Any
    group_comm: Any
    deadline: Callable[[str], AbstractContextManager[Any]]
    gather: Callable[[Any, str, Any], list[Any]]
    backend: ShardBackend = HDF5


def write_data_file(
    w: Writer,
    step: int,
    plan: SavePlan,
    blocks: dict[int, np.ndarray],
    manifest: Manifest,
    tmp: Path,
    control: tuple[Callable[[], bool], Callable[[int], None] | None] | None,
) -> tuple[BaseException | None, bool]:
    """Write this rank's data file (with the ranks sharing it): one dataset per shard,
    each written by its owner; flush, close, fsync, and check it. Returns this rank's
    error (local: the caller agrees on it) and whether the save was cancelled (agreed).

    With one rank per file (the default) nothing here is collective but the cancel
    votes, so a failure is simply reported. With several, HDF5's metadata calls are
    collective over the file's ranks: a failure inside them ends the job (its peers
    cannot be told; see :func:`_collective_section`)."""
    index = plan.file_index(w.rank)
    shards = plan.file_shards(index)
    path = tmp / data_file_name(index)
    shared = plan.ranks_per_file > 1
    what = f"checkpoint {step} (writing {path.name})"

    def section() -> AbstractContextManager[None]:
        return collective_section(w.rank, what) if shared else nullcontext()

    error: BaseException | None = None
    cancelled = aborted = False
    f: ShardWriter | None = None
    try:
        try:
            with section():
                if shards:
                    with w.deadline(f"checkpoint {step}: creating {path.name}"):
                        attrs = {"step": step, "file_index": index}  # the format adds its own
                        f = w.backend.open_writer(path, w.group_comm, attrs, shared, len(shards))
        except Exception as exc:
            error = exc
        for i, spec in enumerate(plan.specs):
            if control is not None:
                stop_here, before = control
                if before is not None:
                    before(i)
                votes = w.gather(
                    (stop_here(), error is not None), f"checkpoint {step}: cancel check", w.comm
                )
                if any(v[0] for v in votes):
                    cancelled = True
                    break
                if any(v[1] for v in votes):
                    aborted = True  # another rank failed: the agreement reports its error
                    break
            if error is not None:
                continue
            try:
                with section():
                    maybe_fail(w.rank, "ckpt_write")
                    with w.deadline(f"checkpoint {step}: writing tensor {spec.name!r}"):
                        for j, s in shards:
                            if j == i and f is not None:
                                f.write_shard(
                                    shard_dataset(spec.name, s.index),
                                    s.extent,
                                    np_dtype(spec.type.dtype),
                                    blocks[i] if s.owner == w.rank else None,
                                )
            except Exception as exc:
                error = exc
    finally:  # also when a vote timed out: never leave the file open
        complete = not (cancelled or aborted) and error is None
        if f is not None:
            try:
                with section(), w.deadline(f"checkpoint {step}: closing {path.name}"):
                    error = f.close(error, complete)
            except Exception as exc:
                error = error or exc
            complete = complete and error is None
    if f is not None and complete and w.rank == plan.group(w.rank).start:
        try:
            with w.deadline(f"checkpoint {step}: syncing and checking {path.name}"):
                fsync_path(path)
                _check_data_file(w.backend, tmp, manifest, shards)
        except Exception as exc:
            error = exc
    return error, cancelled


def _check_data_file(
    backend: ShardBackend, tmp: Path, manifest: Manifest, shards: list[tuple[int, Any]]
) -> None:
    """Reopen the data file just written (serially) and check every shard dataset; with
    ``DTM_CKPT_VERIFY=full`` also re-read and re-hash every chunk."""
    full = get_config().ckpt_verify_full
    with backend.open_reader(tmp) as files:
        for i, s in shards:
            a = manifest.artifacts[i]
            record = a.shards[s.index]
            files.check(a, record)
            for c in range(len(record.chunks) if full else 0):
                files.read_verified(a, record, c)  # reads back what was written, or raises


@contextmanager
def collective_section(rank: int, what: str) -> Iterator[None]:
    """A run of collective HDF5 calls. A failure inside it is local to this rank while its
    peers wait inside HDF5 (holding the interpreter lock, so nothing can tell them): the
    only way not to leave them hanging is to end the job now, with this rank's error."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, DtmError) and exc.agreed:
            raise
        abort_job(
            1,
            f"dtm: error: rank {rank} failed during {what}: {type(exc).__name__}: {exc}\ndtm: aborting the job (its peers are inside collective HDF5 calls)",
        )
        raise
