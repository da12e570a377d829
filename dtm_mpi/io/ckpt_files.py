"""The files of one checkpoint directory (io/FORMAT.md §4), serial side.

A checkpoint is a directory::

    ckpt-00000005/checkpoint.h5     the main file: root attributes, /manifest, and one global
                                    *virtual* dataset /tensors/<name> per stored tensor
    ckpt-00000005/data-000000.h5    data files: shard i of tensor t is the contiguous dataset
    ckpt-00000005/data-000001.h5    /shards/<t>/<i> (shape = its extent) of the file the
    ...                             manifest names

The virtual datasets stitch the shards into the global tensors for readers without dtm_mpi
(``h5py.File("ckpt-00000005/checkpoint.h5")["tensors/w"][...]``; source files are found
relative to the main file, so the directory can be moved). dtm_mpi itself reads shards from
their data files, which names a missing file or dataset instead of getting fill values.

Here: writing the main file (rank 0, serial), reading the manifest, opening shard datasets for
reading with checks (:class:`ShardFiles`) and verifying a whole checkpoint. One of the HDF5
backend's modules (with :mod:`dtm_mpi.io.h5`): the rest of dtm_mpi reaches it only through
:class:`~dtm_mpi.io.backend.Hdf5Backend` (tests/io/test_h5py_confined.py).
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from dtm_mpi.errors import IntegrityError, ManifestError
from dtm_mpi.io.hashing import chunk_hasher
from dtm_mpi.io.manifest import (
    ArtifactClass,
    ArtifactRecord,
    Manifest,
    ShardRecord,
    layout_to_json,
    parse_loadable_manifest,
)
from dtm_mpi.io.store import fsync_path
from dtm_mpi.io.verification import (
    ShardVerifier,
    VerifyItem,
    chunk_mismatch,
    digest_mismatch,
    shard_items,
)
from dtm_mpi.ir.dtypes import np_dtype

__all__ = [
    "CKPT_FORMAT",
    "DATA_FORMAT",
    "FORMAT_VERSION",
    "MAIN_FILE",
    "ShardFiles",
    "Verifier",
    "check_file_format",
    "read_manifest",
    "read_manifest_bytes",
    "verify_checkpoint",
    "verify_items",
    "write_main_file",
]

CKPT_FORMAT = "dtm-checkpoint"
DATA_FORMAT = "dtm-checkpoint-data"
FORMAT_VERSION = 2
MAIN_FILE = "checkpoint.h5"

H5_ERRORS: tuple[type[BaseException], ...] = (OSError, KeyError, RuntimeError, ValueError)
"""What h5py raises on a damaged file (fuzzed metadata: tests/io/test_verify_damage.py). Other
exceptions (TypeError, AttributeError, MemoryError, ...) are bugs or resource errors, never
reported as damage: damage can make a restore fall back to an older checkpoint."""


def check_file_format(f: h5py.File, path: Path, kind: str = CKPT_FORMAT) -> None:
    """Raise :class:`ManifestError` unless ``f`` is a dtm file of ``kind`` and a version this
    reads."""
    found = f.attrs.get("dtm_format")
    if not isinstance(found, str) or found != kind:
        raise ManifestError(f"{path}: not a dtm {kind} file (no dtm_format={kind!r} attribute)")
    version = f.attrs.get("format_version")
    if isinstance(version, np.generic):
        version = version.item()
    if not isinstance(version, int | np.integer) or int(version) != FORMAT_VERSION:
        hint = (
            " (version 1 is the earlier single-file layout)"
            if isinstance(version, int | np.integer) and version == 1
            else ""
        )
        raise ManifestError(
            f"{path}: checkpoint format version {version!r} is not supported (this reads version {FORMAT_VERSION}){hint}"
        )


def read_manifest_bytes(ckpt: Path) -> bytes:
    """The stored manifest text of checkpoint directory ``ckpt`` (format checked, not parsed)."""
    path = ckpt / MAIN_FILE
    try:
        with h5py.File(path, "r") as f:
            check_file_format(f, path)
            if "manifest" not in f:
                raise ManifestError(f"{path}: no manifest: the checkpoint is incomplete")
            return bytes(f["manifest"][()])
    except ManifestError:  # a StorageError is an OSError too: not an HDF5 read failure
        raise
    except H5_ERRORS as exc:  # h5py: OSError, and KeyError/RuntimeError/... on damaged metadata
        raise ManifestError(f"{path}: cannot be read as HDF5 ({_h5_reason(exc)})") from None


def read_manifest(ckpt: Path) -> Manifest:
    """The validated manifest of checkpoint directory ``ckpt`` (serial read)."""
    return parse_loadable_manifest(read_manifest_bytes(ckpt), str(ckpt / MAIN_FILE))


def write_main_file(ckpt: Path, manifest: Manifest, text: bytes) -> None:
    """Write, flush and fsync ``ckpt/checkpoint.h5``: root attributes, one virtual dataset
    per stored tensor over its shards' datasets, and the manifest (``text``, its canonical
    bytes) last. Serial (rank 0)."""
    path = ckpt / MAIN_FILE
    with h5py.File(path, "w", libver="earliest") as f:
        f.attrs["dtm_format"] = CKPT_FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["step"] = manifest.step
        f.attrs["dtm_version"] = manifest.dtm_version
        group = f.require_group("tensors")
        for a in manifest.artifacts:
            if a.cls is ArtifactClass.EPHEMERAL:
                continue
            dtype = np_dtype(a.dtype)
            if not a.shards:  # no elements: nothing to map
                dset = group.create_dataset(a.name, shape=a.shape, dtype=dtype)
            else:
                layout = h5py.VirtualLayout(shape=a.shape, dtype=dtype)
                for s in a.shards:
                    layout[s.region] = h5py.VirtualSource(
                        s.file, s.dataset, shape=s.extent, dtype=dtype
                    )
                fill = np.nan if dtype.kind == "f" else 0  # a missing data file reads as NaN
                dset = group.create_virtual_dataset(a.name, layout, fillvalue=fill)
            dset.attrs["dtype"] = a.dtype.value
            dset.attrs["artifact_class"] = a.cls.value
            dset.attrs["layout"] = json.dumps(layout_to_json(a.layout))
            dset.attrs["step"] = manifest.step
        dm = f.create_dataset("manifest", data=np.bytes_(text), dtype=f"S{len(text)}")
        dm.attrs["content_type"] = "application/json"
        f.attrs["manifest_hash"] = manifest.to_json()["manifest_hash"]
        f.flush()
    fsync_path(path)


class ShardFiles:
    """Shard datasets of one checkpoint directory, opened for reading (by this process alone,
    read-only, each data file once). Every lookup checks the file, its format, the dataset, its shape
    and element size, and raises :class:`IntegrityError` naming tensor, shard and file."""

    def __init__(self, ckpt: Path, mpio_comm: Any = None) -> None:
        self.ckpt = ckpt
        self._open: dict[str, h5py.File] = {}
        self._checked: dict[tuple[Any, ...], h5py.Dataset] = {}
        self._fds: dict[str, int] = {}  # plain read-only descriptors for read_rows_checked
        # The MPI-IO driver on the caller's self communicator (in MPI jobs): measured 10-20%
        # faster reads than HDF5's default POSIX driver for these large contiguous requests.
        self._driver: dict[str, Any] = {}
        if mpio_comm is not None:
            self._driver = {"driver": "mpio", "comm": mpio_comm}

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._checked.clear()
        for f in self._open.values():
            with suppress(Exception):  # read-only: nothing to lose; damaged metadata may raise
                f.close()
        self._open.clear()
        for fd in self._fds.values():
            with suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def check(self, a: ArtifactRecord, s: ShardRecord) -> None:
        """Raise :class:`IntegrityError` unless shard ``s`` is stored as the manifest says."""
        self.dataset(a, s)

    def dataset(self, a: ArtifactRecord, s: ShardRecord) -> h5py.Dataset:
        key = (s.file, s.dataset, a.dtype.value, s.extent)
        found = self._checked.get(key)
        if found is None:
            found = self._checked[key] = self._lookup(a, s)
        return found

    def _lookup(self, a: ArtifactRecord, s: ShardRecord) -> h5py.Dataset:
        path = self.ckpt / s.file

        def damaged(message: str) -> IntegrityError:
            return IntegrityError(message, tensor=a.name, shard=s.id, file=str(path))

        f = self._open.get(s.file)
        if f is None:
            if not path.is_file():
                raise damaged("data file is missing")
            try:
                f = h5py.File(path, "r", **self._driver)
            except H5_ERRORS as exc:
                raise damaged(f"data file cannot be read as HDF5 ({_h5_reason(exc)})") from None
            try:
                check_file_format(f, path, DATA_FORMAT)
            except H5_ERRORS as exc:
                f.close()
                raise damaged(str(exc).removeprefix(f"{path}: ")) from None
            self._open[s.file] = f
        try:  # damaged metadata: h5py raises KeyError, RuntimeError, OSError, ValueError, ...
            if s.dataset not in f:
                raise damaged(f"dataset {s.dataset} is missing")
            dset = f[s.dataset]
            bad = (
                not isinstance(dset, h5py.Dataset)
                or tuple(dset.shape) != s.extent
                or dset.dtype.itemsize != np_dtype(a.dtype).itemsize
            )
        except IntegrityError:
            raise
        except H5_ERRORS as exc:
            raise damaged(
                f"dataset {s.dataset} cannot be read as HDF5 ({_h5_reason(exc)})"
            ) from None
        if bad:
            got = f"{dset.dtype}{list(dset.shape)}" if isinstance(dset, h5py.Dataset) else "a group"
            raise damaged(
                f"dataset {s.dataset} is {got}, the manifest says {a.dtype}{list(s.extent)}"
            )
        return dset

    def read_chunk(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        c: int,
        out: np.ndarray | None = None,
        within: tuple[slice, ...] | None = None,
    ) -> np.ndarray:
        """Chunk ``c`` of shard ``s``, unverified, into ``out`` when given (C-contiguous: the
        chunk's shape, or a larger array whose part ``within`` takes it), else a new array;
        returns the chunk's array (a view of ``out`` with ``within``)."""
        return self.read_rows(a, s, c, c, out, within)

    def read_verified(self, a: ArtifactRecord, s: ShardRecord, c: int) -> np.ndarray:
        """Chunk ``c`` of shard ``s``, checked against its content hash (an
        :class:`IntegrityError` naming tensor, shard, chunk and file if it differs)."""
        data = self.read_chunk(a, s, c)
        problem = chunk_mismatch(s, c, data)
        if problem is not None:
            raise IntegrityError(problem, tensor=a.name, shard=s.id, file=str(self.ckpt / s.file))
        return data

    def read_rows(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        first: int,
        last: int,
        out: np.ndarray | None = None,
        within: tuple[slice, ...] | None = None,
    ) -> np.ndarray:
        """Chunks ``first..last`` of shard ``s`` with one read (as :meth:`read_chunk`)."""
        dset = self.dataset(a, s)
        lo, hi = s.local_chunk_region(first), s.local_chunk_region(last)
        region = (slice(lo[0].start, hi[0].stop), *lo[1:]) if lo else ()
        if out is None:
            out = np.empty(tuple(r.stop - r.start for r in region), dtype=dset.dtype)
        target, sel = out, within
        if within is not None and out[within].flags.c_contiguous:
            # whole rows of ``out``: read straight into the view (measured 1.7x faster than
            # HDF5 reading into a hyperslab of the larger buffer)
            target, sel = out[within], None
        try:
            dset.read_direct(target, source_sel=region or None, dest_sel=sel)
        except H5_ERRORS as exc:  # OSError, or what h5py raises on damaged metadata
            what = f"chunk {first}" if first == last else f"chunks {first}..{last}"
            raise IntegrityError(
                f"{what} cannot be read ({_h5_reason(exc)})",
                tensor=a.name,
                shard=s.id,
                file=str(self.ckpt / s.file),
            ) from None
        return out[within] if within is not None else out

    def read_rows_checked(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        first: int,
        last: int,
        out: np.ndarray,
        within: tuple[slice, ...] | None = None,
    ) -> list[str | None] | None:
        """Chunks ``first..last`` of shard ``s`` into ``out`` (as :meth:`read_rows`), each
        checked against its content hash **while it is read**: the dataset's bytes are read
        straight from the file in pieces that fit the CPU cache and each piece is hashed
        before the next is read, so verifying costs a pass over cached memory instead of a
        second pass over main memory. Returns each chunk's mismatch (None where it matches),
        or None where the shard is not stored as plain contiguous bytes of ``out``'s dtype or
        the destination is not contiguous (the caller reads through HDF5 then)."""
        dset = self.dataset(a, s)
        target = out if within is None else out[within]
        if not target.flags.c_contiguous or dset.dtype != target.dtype:
            return None
        try:
            layout = dset.id.get_create_plist().get_layout()
            base = dset.id.get_offset() if layout == h5py.h5d.CONTIGUOUS else None
        except H5_ERRORS:
            return None  # damaged metadata: HDF5's own read reports it
        if base is None:
            return None
        row = (
            int(np.prod(s.extent[1:], dtype=np.int64)) * target.dtype.itemsize
            if s.extent
            else target.dtype.itemsize
        )
        dest = target.reshape(-1).view(np.uint8)
        fd = self._fd(s.file)
        problems: list[str | None] = []
        at = 0
        for c in range(first, last + 1):
            region = s.local_chunk_region(c)
            nbytes = (region[0].stop - region[0].start) * row if region else row
            start = base + (region[0].start * row if region else 0)
            h = chunk_hasher()
            for off in range(0, nbytes, READ_PIECE):
                piece = dest[at + off : at + min(nbytes, off + READ_PIECE)]
                _pread_into(
                    fd,
                    piece,
                    start + off,
                    lambda why, c=c: IntegrityError(
                        f"chunk {c} cannot be read ({why})",
                        tensor=a.name,
                        shard=s.id,
                        file=str(self.ckpt / s.file),
                    ),
                )
                h.update(piece)
            problems.append(digest_mismatch(s, c, h.hexdigest()))
            at += nbytes
        return problems

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(self.ckpt / file, os.O_RDONLY)
        return fd


READ_PIECE = 512 << 10
"""Bytes read and hashed at a time by :meth:`ShardFiles.read_rows_checked`: small enough to
stay in the CPU's cache between the read and the hash (measured here: hashing cached pieces
costs ~13% of the copy, hashing after the whole read ~70%)."""


def _pread_into(fd: int, piece: np.ndarray, offset: int, error: Any) -> None:
    """Fill ``piece`` from ``fd`` at ``offset`` (short reads continued; end of file before it
    is full is ``error(reason)``)."""
    view = memoryview(piece)  # type: ignore[arg-type]
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise error(exc.strerror or str(exc)) from None
        if n == 0:
            raise error(f"the file ends {len(view) - done} bytes early")
        done += n


def _h5_reason(exc: BaseException) -> str:
    """An HDF5 failure as one short text (h5py's KeyError text comes quoted)."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, OSError) else text


def _virtual_problem(dset: Any, a: ArtifactRecord) -> str | None:
    """Why the main file's dataset of ``a`` does not map its shards as the manifest says."""
    if not a.shards:
        return None
    if not dset.is_virtual:
        return "is not a virtual dataset"
    want = sorted((s.file, s.dataset.lstrip("/"), s.offset, s.extent) for s in a.shards)
    got = []
    for m in dset.virtual_sources():
        if a.shape:
            lo, hi = m.vspace.get_select_bounds()
            place = (
                tuple(int(v) for v in lo),
                tuple(int(h) - int(v) + 1 for v, h in zip(lo, hi, strict=True)),
            )
        else:
            place = ((), ())
        got.append((m.file_name, m.dset_name.lstrip("/"), *place))
    if sorted(got) != want:
        return (
            f"maps {sorted(got)}, the manifest's shards (file, dataset, offset, extent) are {want}"
        )
    return None


def verify_items(ckpt: Path, manifest: Manifest) -> list[VerifyItem]:
    """What :func:`verify_checkpoint` checks, in order: the main file's datasets, then every
    shard."""
    main = ckpt / MAIN_FILE
    out = [
        VerifyItem(a.name, "*", main, i, None)
        for i, a in enumerate(manifest.artifacts)
        if a.cls is not ArtifactClass.EPHEMERAL and a.dataset is not None
    ]
    return out + shard_items(ckpt, manifest)


class Verifier:
    """Runs the :class:`~dtm_mpi.io.verification.VerifyItem` s of :func:`verify_items` for one
    checkpoint: shards through :class:`ShardFiles`, the main file's virtual datasets here
    (files opened on first use, read-only; close it, or use it as a context manager)."""

    def __init__(self, ckpt: Path, manifest: Manifest) -> None:
        self.ckpt, self.manifest = ckpt, manifest
        self._main: h5py.File | None = None
        self._shards = ShardVerifier(ShardFiles(ckpt), manifest)

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._shards.close()
        if self._main is not None:
            with suppress(Exception):
                self._main.close()
            self._main = None

    def check(self, item: VerifyItem) -> IntegrityError | None:
        """The damage ``item`` finds, or None."""
        if item.index is not None:
            return self._shards.check(item)
        a = self.manifest.artifacts[item.artifact]
        assert a.dataset is not None
        try:  # damaged metadata: h5py raises KeyError, RuntimeError, OSError, ...
            if self._main is None:
                self._main = h5py.File(item.file, "r")
            f = self._main
            if a.dataset not in f:
                return IntegrityError(
                    "dataset is missing", tensor=a.name, shard="*", file=str(item.file)
                )
            dset = f[a.dataset]
            problem = (
                None
                if tuple(dset.shape) == a.shape
                else f"shape {list(dset.shape)} is not {list(a.shape)}"
            )
            problem = problem or _virtual_problem(dset, a)
        except H5_ERRORS as exc:
            problem = f"cannot be read as HDF5 ({_h5_reason(exc)})"
        if problem is None:
            return None
        return IntegrityError(
            f"dataset {a.dataset} {problem}", tensor=a.name, shard="*", file=str(item.file)
        )


def verify_checkpoint(ckpt: Path) -> list[IntegrityError]:
    """Re-read every stored chunk of checkpoint directory ``ckpt`` and compare it with its
    content hash, and check the main file's virtual datasets; returns one error per damaged
    shard or dataset (naming tensor, shard, chunk and file). Serial, in this process (damaged
    HDF5 metadata can crash or hang the HDF5 library itself: :func:`dtm_mpi.io.tools.verify_isolated`
    runs this in a child process)."""
    manifest = read_manifest(ckpt)
    with Verifier(ckpt, manifest) as v:
        return [
            e for e in (v.check(item) for item in verify_items(ckpt, manifest)) if e is not None
        ]
