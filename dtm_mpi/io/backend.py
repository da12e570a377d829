"""The storage seam: what the checkpoint protocol needs from the format its shards are
stored in, and that format's first implementation, today's parallel HDF5.

The protocol (:mod:`dtm_mpi.io.checkpoint` with ``plan``, ``manifest``, ``hashing``,
``commit``, ``store``, ``data_write``'s per-tensor loop and ``restore_read``) owns the manifest,
the content hashes, the agreement between ranks, the atomic commit, retention, the quota and
recovery; it knows a checkpoint as a directory holding an index (the main file) and data
files, and talks to the format only through a :class:`ShardBackend`:

* **open a writer** (:meth:`ShardBackend.open_writer`) on a data file, by the ranks that share
  it; **write a shard** (:meth:`ShardWriter.write_shard`: every sharing rank declares it, its
  owner gives the bytes); close it (:meth:`ShardWriter.close`, which reports, never raises);
* **read a chunk** (:meth:`ShardBackend.open_reader`: a :class:`ShardReader` checks a shard
  against its manifest record and reads chunks, or runs of them, into caller buffers);
* the index: :meth:`ShardBackend.write_index` / :meth:`ShardBackend.read_index` (the manifest
  bytes, stored by the format beside whatever lets other readers see whole tensors);
* **list** (:meth:`ShardBackend.data_files`) and **remove** (:meth:`ShardBackend.remove`) the
  files of a checkpoint directory;
* **verify** a checkpoint (:meth:`ShardBackend.verify_items`, :meth:`ShardBackend.open_verifier`:
  every shard, and whatever the format keeps beside them), and estimate what a checkpoint
  takes on disk beyond its data (:meth:`ShardBackend.overhead_bytes`, for the quota).

A backend is selected **by name**: :func:`register_backend` adds one to :data:`BACKENDS` (a
module defining a backend registers it when imported), a store records the name of its
backend in ``store.json`` (``"backend"``; io/FORMAT.md §2.2; a store that records none is
``hdf5``) and every opener of the store (:class:`~dtm_mpi.io.checkpoint.CheckpointStore`, the
tools of :mod:`dtm_mpi.io.tools`) gets it back with :func:`parse_backend_name`.

:data:`HDF5` (``hdf5``) is the implementation of every store so far (io/FORMAT.md, version 2:
nothing on disk depends on this seam existing but that optional field). Its modules,
:mod:`dtm_mpi.io.ckpt_files` and :mod:`dtm_mpi.io.h5`, are the only ones that import h5py,
and :class:`Hdf5Backend` here the only way the rest of dtm_mpi reaches them
(tests/io/test_h5py_confined.py).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dtm_mpi.errors import DtmError, IntegrityError, StorageError, UsageError
from dtm_mpi.io.manifest import ArtifactRecord, Manifest, ShardRecord
from dtm_mpi.io.store import DEFAULT_BACKEND, remove_path
from dtm_mpi.io.verification import VerifyItem

__all__ = [
    "BACKENDS",
    "HDF5",
    "CheckpointVerifier",
    "Hdf5Backend",
    "ShardBackend",
    "ShardReader",
    "ShardWriter",
    "parse_backend_name",
    "parse_optional_backend_name",
    "register_backend",
]

_DATA_FILE = re.compile(r"data-[0-9]{6,}\.h5")


class ShardWriter(Protocol):
    """One data file being written by the ranks that share it."""

    path: Path

    def write_shard(
        self, dataset: str, extent: tuple[int, ...], dtype: np.dtype[Any], block: np.ndarray | None
    ) -> None:
        """Declare shard dataset ``dataset`` (every sharing rank, in the same order) and, on
        the rank that owns it (``block`` given: its C-contiguous bytes), write it whole."""
        ...

    def close(self, error: BaseException | None, complete: bool) -> BaseException | None:
        """Make the file durable when ``complete`` (every shard written, no ``error``) and
        release it; returns the first error (``error`` or its own). It raises only where a
        failure cannot be returned: inside a collective close of a file several ranks share."""
        ...


class ShardReader(Protocol):
    """The data files of one checkpoint directory, opened for reading by this process."""

    ckpt: Path

    def __enter__(self) -> ShardReader: ...

    def __exit__(self, *exc: object) -> None: ...

    def close(self) -> None: ...

    def check(self, a: ArtifactRecord, s: ShardRecord) -> None:
        """Raise :class:`~dtm_mpi.errors.IntegrityError` (tensor, shard, file) unless shard
        ``s`` of ``a`` is stored as the manifest says (present, its extent, its element size)."""
        ...

    def read_chunk(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        c: int,
        out: np.ndarray | None = None,
        within: tuple[slice, ...] | None = None,
    ) -> np.ndarray: ...

    def read_rows(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        first: int,
        last: int,
        out: np.ndarray | None = None,
        within: tuple[slice, ...] | None = None,
    ) -> np.ndarray: ...

    def read_verified(self, a: ArtifactRecord, s: ShardRecord, c: int) -> np.ndarray: ...

    def read_rows_checked(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        first: int,
        last: int,
        out: np.ndarray,
        within: tuple[slice, ...] | None = None,
    ) -> list[str | None] | None:
        """Chunks ``first..last`` into ``out`` (as ``read_rows``), each checked against its
        content hash as it is read: each
        chunk's mismatch (None where it matches), or None where this reader cannot do both in
        one pass (the caller reads, then verifies)."""
        ...


class CheckpointVerifier(Protocol):
    """Checks the :class:`~dtm_mpi.io.verification.VerifyItem` s of one checkpoint (files
    opened on first use, read-only)."""

    def __enter__(self) -> CheckpointVerifier: ...

    def __exit__(self, *exc: object) -> None: ...

    def close(self) -> None: ...

    def check(self, item: VerifyItem) -> IntegrityError | None:
        """The damage ``item`` finds (an :class:`IntegrityError` naming tensor, shard and
        file), or None."""
        ...


class ShardBackend(Protocol):
    """A storage format for the shards of a checkpoint (see the module's docstring)."""

    @property
    def format_name(self) -> str:
        """The format in messages (``HDF5``: "the HDF5 library crashed")."""
        ...

    @property
    def parallel(self) -> bool:
        """Whether this process has the format's parallel I/O (HDF5: an h5py built with MPI,
        whose ``mpio`` driver writes every data file); what the runtime's ``CAP_HDF5_MPI``
        capability reports."""
        ...

    def describe(self) -> str:
        """The library behind the format, its version and whether it is parallel (one line,
        for ``dtm info``)."""
        ...

    def ready(self) -> None:
        """Load what the format needs (its library) now: a store calls it when it opens, so
        that a process's first checkpoint does not pay for it (h5py's import: about 40 ms)."""
        ...

    def index_path(self, ckpt: Path) -> Path:
        """The main file (the index) of checkpoint directory ``ckpt``: what a committed
        checkpoint holds beside its data files, and the file errors about its manifest name."""
        ...

    def overhead_bytes(self, shard_nbytes: Sequence[int], nfiles: int, manifest_bytes: int) -> int:
        """At most how many bytes a checkpoint of shards of ``shard_nbytes`` bytes in
        ``nfiles`` data files, with a manifest of ``manifest_bytes``, takes on disk beyond
        the shards' own bytes (alignment, metadata, the index): the quota's estimate."""
        ...

    def open_writer(
        self, path: Path, comm: Any, attrs: Mapping[str, Any], shared: bool, nshards: int
    ) -> ShardWriter:
        """Collective over ``comm`` (the ranks sharing the file): create data file ``path``
        for ``nshards`` shards (``shared``: several ranks), storing ``attrs`` with it (the
        checkpoint's ``step`` and the file's ``file_index``; the format adds its own
        identification, io/FORMAT.md §4.5 for HDF5)."""
        ...

    def open_reader(self, ckpt: Path, comm: Any = None) -> ShardReader:
        """The data files of checkpoint directory ``ckpt`` for this process (``comm``: the
        self communicator, for an MPI-IO driver; None: serial)."""
        ...

    def write_index(self, ckpt: Path, manifest: Manifest, text: bytes) -> None:
        """Write, make durable, the checkpoint's main file: ``manifest`` (``text``, its
        canonical bytes) and whatever shows readers the whole tensors."""
        ...

    def read_index(self, ckpt: Path) -> bytes:
        """The manifest bytes stored in ``ckpt`` (a :class:`ManifestError` if unreadable)."""
        ...

    def data_files(self, ckpt: Path) -> list[Path]:
        """The data files present in checkpoint directory ``ckpt``."""
        ...

    def remove(self, path: Path) -> None:
        """Remove a checkpoint directory (or one of its files) and everything in it."""
        ...

    def verify_items(self, ckpt: Path, manifest: Manifest) -> list[VerifyItem]:
        """What a verification of checkpoint ``ckpt`` (its validated ``manifest``) checks, in
        order: whatever the format keeps beside the shards (shard ``*``), then every shard
        (:func:`~dtm_mpi.io.verification.shard_items`)."""
        ...

    def open_verifier(self, ckpt: Path, manifest: Manifest) -> CheckpointVerifier:
        """A verifier of the items of :meth:`verify_items` (serial, this process; a backend
        with nothing beside the shards returns a
        :class:`~dtm_mpi.io.verification.ShardVerifier` over its reader)."""
        ...


# --- the backends of this process, by name ---------------------------------------------------

BACKENDS: dict[str, ShardBackend] = {}
"""Every storage backend this process can open a store with, by the name a store records
(read it; add to it with :func:`register_backend`)."""

_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")


def register_backend(name: str, backend: ShardBackend) -> None:
    """Make ``backend`` selectable by ``name`` (lowercase letters, digits, ``-`` and ``_``,
    starting with a letter): what a store created with it records, and what opens it again.
    A :class:`UsageError` when the name is malformed or already names another backend
    (registering the same backend under its name again does nothing)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UsageError(
            f"storage backend name {name!r}: use lowercase letters, digits, '-' and '_', starting with a letter (at most 64)"
        )
    known = BACKENDS.get(name)
    if known is not None and known is not backend:
        raise UsageError(
            f"storage backend name {name!r} is taken (by {type(known).__name__}); register {type(backend).__name__} under another name"
        )
    BACKENDS[name] = backend


def parse_optional_backend_name(name: str) -> ShardBackend | None:
    """The backend registered as ``name``, or None."""
    return BACKENDS.get(name)


def parse_backend_name(name: str, store: str | os.PathLike[str]) -> ShardBackend:
    """The backend registered as ``name`` (what store ``store`` records); a
    :class:`StorageError` naming the store, the name and the registered ones when none is."""
    found = parse_optional_backend_name(name)
    if found is None:
        have = ", ".join(repr(n) for n in sorted(BACKENDS)) or "none"
        raise StorageError(
            f"store {store}: its storage backend {name!r} is not registered in this process (registered: {have}); the module that defines it registers it when imported"
        )
    return found


# --- parallel HDF5 ---------------------------------------------------------------------------


class _Hdf5Writer:
    """A data file open with the MPI-IO driver on the communicator of its ranks."""

    def __init__(
        self, path: Path, comm: Any, attrs: Mapping[str, Any], shared: bool, nshards: int
    ) -> None:
        from dtm_mpi.io.h5 import open_file

        self.path, self.shared, self.nbytes = path, shared, 0
        self.reserve = None if shared else path.parent / f".reserve{path.stem.removeprefix('data')}"
        if self.reserve is not None:
            _reserve(self.reserve, RESERVE_BYTES + RESERVE_PER_SHARD * nshards)
        self.f: Any = None
        try:
            self.f = open_file(str(path), "w", comm)
            for k, v in attrs.items():
                self.f.attrs[k] = v
        except BaseException as exc:
            if self.f is not None and not shared:  # never leave it open (shared: the job ends)
                with suppress(Exception):
                    _close(self.f, path, exc, shared, False, 0, self.reserve)
            self._unreserve()
            raise

    def write_shard(
        self, dataset: str, extent: tuple[int, ...], dtype: np.dtype[Any], block: np.ndarray | None
    ) -> None:
        from dtm_mpi.io.h5 import create_dataset, write_whole

        dset = create_dataset(self.f, dataset, extent, dtype)
        if block is not None:
            self.nbytes += block.nbytes
            write_whole(dset, block)

    def close(self, error: BaseException | None, complete: bool) -> BaseException | None:
        try:
            return _close(
                self.f, self.path, error, self.shared, complete, self.nbytes, self.reserve
            )
        except Exception as exc:
            if self.shared:  # a collective close: the caller's collective section ends the job
                raise
            return error or exc
        finally:
            self._unreserve()

    def _unreserve(self) -> None:
        if self.reserve is not None:
            with suppress(OSError):
                self.reserve.unlink(missing_ok=True)


class Hdf5Backend:
    """Parallel HDF5 (io/FORMAT.md §4): one data file per group of ranks (MPI-IO driver),
    one contiguous dataset ``/shards/<tensor>/<i>`` per shard, and a main file
    ``checkpoint.h5`` with the manifest and a virtual dataset per tensor. The adapter between
    the protocol and the HDF5 modules (:mod:`dtm_mpi.io.ckpt_files`, :mod:`dtm_mpi.io.h5`),
    which it imports on first use: importing this module does not import h5py."""

    format_name = "HDF5"

    @property
    def parallel(self) -> bool:
        from dtm_mpi.io.h5 import mpi_build

        return mpi_build()

    def describe(self) -> str:
        from dtm_mpi.io.h5 import library_text

        return library_text()

    def ready(self) -> None:
        import dtm_mpi.io.ckpt_files  # noqa: F401  (h5py and the HDF5 modules)

    def index_path(self, ckpt: Path) -> Path:
        from dtm_mpi.io.ckpt_files import MAIN_FILE

        return ckpt / MAIN_FILE

    def overhead_bytes(self, shard_nbytes: Sequence[int], nfiles: int, manifest_bytes: int) -> int:
        from dtm_mpi.io.h5 import ALIGN_BYTES, ALIGN_FROM

        align = sum(ALIGN_BYTES for n in shard_nbytes if n >= ALIGN_FROM)  # large shards' padding
        meta = (256 << 10) + (64 << 10) * nfiles + (4 << 10) * len(shard_nbytes)  # HDF5 metadata
        return align + 2 * manifest_bytes + meta  # the manifest counted twice: a margin

    def open_writer(
        self, path: Path, comm: Any, attrs: Mapping[str, Any], shared: bool, nshards: int
    ) -> ShardWriter:
        from dtm_mpi.io.ckpt_files import DATA_FORMAT, FORMAT_VERSION

        tagged = {"dtm_format": DATA_FORMAT, "format_version": FORMAT_VERSION, **attrs}
        return _Hdf5Writer(path, comm, tagged, shared, nshards)

    def open_reader(self, ckpt: Path, comm: Any = None) -> ShardReader:
        from dtm_mpi.io.ckpt_files import ShardFiles

        return ShardFiles(ckpt, mpio_comm=comm)

    def write_index(self, ckpt: Path, manifest: Manifest, text: bytes) -> None:
        from dtm_mpi.io.ckpt_files import write_main_file

        write_main_file(ckpt, manifest, text)

    def read_index(self, ckpt: Path) -> bytes:
        from dtm_mpi.io.ckpt_files import read_manifest_bytes

        return read_manifest_bytes(ckpt)

    def data_files(self, ckpt: Path) -> list[Path]:
        return sorted(p for p in ckpt.iterdir() if _DATA_FILE.fullmatch(p.name))

    def remove(self, path: Path) -> None:
        remove_path(path)

    def verify_items(self, ckpt: Path, manifest: Manifest) -> list[VerifyItem]:
        from dtm_mpi.io.ckpt_files import verify_items

        return verify_items(ckpt, manifest)

    def open_verifier(self, ckpt: Path, manifest: Manifest) -> CheckpointVerifier:
        from dtm_mpi.io.ckpt_files import Verifier

        return Verifier(ckpt, manifest)


HDF5: ShardBackend = Hdf5Backend()
"""The HDF5 backend, registered as ``hdf5``: what a store that records no backend uses."""

register_backend(DEFAULT_BACKEND, HDF5)


RESERVE_BYTES = 64 << 10
RESERVE_PER_SHARD = 8 << 10
"""Space each rank holds on the file system, in ``.reserve-NNNNNN`` beside its data file, from
before it creates the file until it closes it: what HDF5's metadata may need at the close
when the disk has filled meanwhile (see :func:`_close`)."""


def _reserve(path: Path, nbytes: int) -> None:
    """Allocate ``nbytes`` of disk to the new file ``path`` (a full disk fails here, with
    ``ENOSPC``, before HDF5 writes anything). File systems without ``fallocate`` get none."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            fd = -1
            path.unlink(missing_ok=True)
            raise StorageError(
                f"{path}: {exc} (reserving {nbytes} bytes for the metadata of a checkpoint data file)"
            ) from None
    finally:
        if fd >= 0:
            os.close(fd)


def _close(
    f: Any,
    path: Path,
    error: BaseException | None,
    shared: bool,
    complete: bool,
    nbytes: int,
    reserve: Path | None = None,
) -> BaseException | None:
    """Flush and close ``f`` (``complete``: the save wrote all of it); returns the first error.

    HDF5 writes its cached metadata at the close, and a flush or close that fails (a full
    disk) leaves HDF5 1.10's file object half-destroyed: the next close of it, at the latest
    when the interpreter exits, crashes the process. So the space held in ``reserve`` (see
    :data:`RESERVE_BYTES`) is released just before the close, and a file whose save failed
    or stopped (it is never committed) is emptied first when only this rank writes it: the
    close then finds the space its metadata needs even when other ranks filled the disk
    (several ranks writing one file close it collectively: a failure there ends the job)."""
    flush_failed = False
    if error is None and complete:
        try:
            f.flush()
        except Exception as exc:
            error, flush_failed = exc, True
    if error is not None and not isinstance(error, DtmError):
        error = _name_no_space(error, path, nbytes)  # before the truncation frees space
    if (error is not None or not complete) and not shared:
        with suppress(OSError):
            os.truncate(path, 0)  # garbage anyway: free its blocks for the metadata flush
    if reserve is not None:  # the space held for this moment
        with suppress(OSError):
            reserve.unlink()
    if flush_failed and not shared:  # HDF5 1.10 leaves its metadata cache mid-flush after
        with suppress(Exception):  # a failed flush; another attempt (which fails) resets it,
            f.flush()  # and only then can the close succeed (measured)
    f.close()
    return error


def _name_no_space(error: BaseException, path: Path, nbytes: int) -> BaseException:
    """``error`` (an HDF5 failure writing ``path``), naming a full file system as
    ``No space left on device`` when that is the cause: MPI-IO and HDF5 report only "file
    write failed", so the file system's free space decides."""
    text = str(error)
    if "No space left on device" in text:
        return error
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return error
    free = st.f_bavail * st.f_frsize
    if free >= nbytes + (1 << 20):
        return error
    return StorageError(
        f"{path}: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({free} bytes free on its file system; HDF5: {text})"
    )
