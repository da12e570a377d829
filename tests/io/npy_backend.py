"""A toy storage backend for the seam tests (tests/io/test_backend_seam.py): each shard is a
``.npy`` file in a directory per data file, the manifest plain bytes in ``index.bin`` -- no
HDF5 anywhere in the checkpoint, and not even the main file's name shared with HDF5's.

Importing this module registers it as ``npy-toy`` (:data:`NAME`), as a backend's module does:
a store created with ``backend="npy-toy"`` records that name and is opened by it again, by
:class:`~dtm_mpi.io.checkpoint.CheckpointStore` and by the store tools alike (a verification
child spawned in an MPI process imports this module, ``tests.io.npy_backend``, to find it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import IntegrityError, ManifestError
from dtm_mpi.io.backend import CheckpointVerifier, ShardReader, ShardWriter, register_backend
from dtm_mpi.io.manifest import ArtifactRecord, Manifest, ShardRecord
from dtm_mpi.io.store import remove_path
from dtm_mpi.io.verification import ShardVerifier, VerifyItem, chunk_mismatch, shard_items

NAME = "npy-toy"
INDEX = "index.bin"


def npy_path(file: Path, dataset: str) -> Path:
    """Where the toy stores shard dataset ``dataset`` of data file ``file``."""
    return file / (dataset.strip("/").replace("/", "__") + ".npy")


class _NpyWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()

    def write_shard(
        self, dataset: str, extent: tuple[int, ...], dtype: np.dtype[Any], block: np.ndarray | None
    ) -> None:
        if block is not None:  # C-contiguous (a scalar may come as one element)
            assert block.size == int(np.prod(extent)) and block.dtype == dtype
            np.save(npy_path(self.path, dataset), block.reshape(extent))

    def close(self, error: BaseException | None, complete: bool) -> BaseException | None:
        return error


class _NpyReader:
    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt

    def __enter__(self) -> _NpyReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    def _load(self, a: ArtifactRecord, s: ShardRecord) -> np.ndarray:
        path = npy_path(self.ckpt / s.file, s.dataset)
        if not path.is_file():
            raise IntegrityError("shard file is missing", tensor=a.name, shard=s.id, file=str(path))
        arr = np.load(path)
        if arr.shape != s.extent:
            raise IntegrityError(
                f"shape {arr.shape} is not {s.extent}", tensor=a.name, shard=s.id, file=str(path)
            )
        return arr

    def check(self, a: ArtifactRecord, s: ShardRecord) -> None:
        self._load(a, s)

    def read_rows(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        first: int,
        last: int,
        out: np.ndarray | None = None,
        within: tuple[slice, ...] | None = None,
    ) -> np.ndarray:
        arr = self._load(a, s)
        lo, hi = s.local_chunk_region(first), s.local_chunk_region(last)
        data = arr[(slice(lo[0].start, hi[0].stop), *lo[1:])] if lo else arr
        if out is None:
            return np.array(data)
        target = out[within] if within is not None else out
        target[...] = data
        return target

    def read_chunk(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        c: int,
        out: np.ndarray | None = None,
        within: tuple[slice, ...] | None = None,
    ) -> np.ndarray:
        return self.read_rows(a, s, c, c, out, within)

    def read_rows_checked(
        self,
        a: ArtifactRecord,
        s: ShardRecord,
        first: int,
        last: int,
        out: np.ndarray,
        within: tuple[slice, ...] | None = None,
    ) -> list[str | None] | None:
        return None  # no one-pass read: the restore reads, then verifies

    def read_verified(self, a: ArtifactRecord, s: ShardRecord, c: int) -> np.ndarray:
        data = self.read_chunk(a, s, c)
        problem = chunk_mismatch(s, c, data)
        if problem is not None:
            raise IntegrityError(problem, tensor=a.name, shard=s.id, file=str(self.ckpt / s.file))
        return data


class NpyBackend:
    """Shards as ``.npy`` files in a directory per data file; the manifest as plain bytes in
    ``index.bin``. Records the protocol calls it gets in :attr:`calls`."""

    format_name = "npy"
    parallel = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    def describe(self) -> str:
        return f"numpy {np.__version__} .npy files, serial"

    def ready(self) -> None:
        pass  # numpy is loaded

    def index_path(self, ckpt: Path) -> Path:
        return ckpt / INDEX

    def overhead_bytes(self, shard_nbytes: Sequence[int], nfiles: int, manifest_bytes: int) -> int:
        return 128 * len(shard_nbytes) + manifest_bytes  # a .npy header per shard, the index

    def open_writer(
        self, path: Path, comm: Any, attrs: Mapping[str, Any], shared: bool, nshards: int
    ) -> ShardWriter:
        assert not shared, "the toy backend writes one file per rank"
        assert set(attrs) == {"step", "file_index"}, attrs  # the format's own tags are its own
        self.calls.append("open_writer")
        return _NpyWriter(path)

    def open_reader(self, ckpt: Path, comm: Any = None) -> ShardReader:
        self.calls.append("open_reader")
        return _NpyReader(ckpt)

    def write_index(self, ckpt: Path, manifest: Manifest, text: bytes) -> None:
        self.calls.append("write_index")
        (ckpt / INDEX).write_bytes(text)

    def read_index(self, ckpt: Path) -> bytes:
        self.calls.append("read_index")
        try:
            return (ckpt / INDEX).read_bytes()
        except OSError as exc:
            raise ManifestError(f"{ckpt / INDEX}: {exc}") from None

    def data_files(self, ckpt: Path) -> list[Path]:
        return sorted(p for p in ckpt.iterdir() if p.name != INDEX)

    def remove(self, path: Path) -> None:
        self.calls.append("remove")
        remove_path(path)

    def verify_items(self, ckpt: Path, manifest: Manifest) -> list[VerifyItem]:
        return shard_items(ckpt, manifest)  # nothing beside the shards

    def open_verifier(self, ckpt: Path, manifest: Manifest) -> CheckpointVerifier:
        self.calls.append("open_verifier")
        return ShardVerifier(self.open_reader(ckpt), manifest)


NPY = NpyBackend()
register_backend(NAME, NPY)
