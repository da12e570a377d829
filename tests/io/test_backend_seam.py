"""The storage seam (:mod:`dtm_mpi.io.backend`): the checkpoint protocol (manifest, content
hashes, agreement, commit, retention, restore with verification) runs unchanged over another
shard format. Here a toy backend stores each shard as a ``.npy`` file and the manifest as
plain bytes -- no HDF5 anywhere in the checkpoint -- and a save, a restore, keep-last-K and
the detection of a flipped data byte (naming tensor, shard and file) all work through it.

Single process, the self communicator, a one-rank mesh."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.errors import IntegrityError, ManifestError
from dtm_mpi.io.backend import HDF5, ShardBackend, ShardReader, ShardWriter
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_files import MAIN_FILE, chunk_mismatch
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.manifest import ArtifactRecord, Manifest, ShardRecord
from dtm_mpi.io.store import committed_name, list_checkpoints, remove_path
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.mesh import MeshShape
from tests.io.io_helpers import random_value

MESH = MeshShape((("x", 1),))
TENSORS = [
    ("w", TensorType(DType.F32, (10, 7), Layout.replicated(2))),
    ("b", TensorType(DType.I64, (5,), Layout.replicated(1))),
    ("s", TensorType(DType.F64, (), Layout(()))),
]


def _npy(file: Path, dataset: str) -> Path:
    return file / (dataset.strip("/").replace("/", "__") + ".npy")


class _NpyWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()

    def write_shard(self, dataset: str, extent: tuple[int, ...], dtype: np.dtype[Any], block: np.ndarray | None) -> None:  # fmt: skip
        if block is not None:  # C-contiguous (a scalar may come as one element)
            assert block.size == int(np.prod(extent)) and block.dtype == dtype
            np.save(_npy(self.path, dataset), block.reshape(extent))

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
        path = _npy(self.ckpt / s.file, s.dataset)
        if not path.is_file():
            raise IntegrityError("shard file is missing", tensor=a.name, shard=s.id, file=str(path))  # fmt: skip
        arr = np.load(path)
        if arr.shape != s.extent:
            raise IntegrityError(f"shape {arr.shape} is not {s.extent}", tensor=a.name, shard=s.id, file=str(path))  # fmt: skip
        return arr

    def check(self, a: ArtifactRecord, s: ShardRecord) -> None:
        self._load(a, s)

    def read_rows(self, a: ArtifactRecord, s: ShardRecord, first: int, last: int, out: np.ndarray | None = None, within: tuple[slice, ...] | None = None) -> np.ndarray:  # fmt: skip
        arr = self._load(a, s)
        lo, hi = s.local_chunk_region(first), s.local_chunk_region(last)
        data = arr[(slice(lo[0].start, hi[0].stop), *lo[1:])] if lo else arr
        if out is None:
            return np.array(data)
        target = out[within] if within is not None else out
        target[...] = data
        return target

    def read_chunk(self, a: ArtifactRecord, s: ShardRecord, c: int, out: np.ndarray | None = None, within: tuple[slice, ...] | None = None) -> np.ndarray:  # fmt: skip
        return self.read_rows(a, s, c, c, out, within)

    def read_rows_checked(self, a: ArtifactRecord, s: ShardRecord, first: int, last: int, out: np.ndarray, within: tuple[slice, ...] | None = None) -> list[str | None] | None:  # fmt: skip
        return None  # no one-pass read: the restore reads, then verifies

    def read_verified(self, a: ArtifactRecord, s: ShardRecord, c: int) -> np.ndarray:
        data = self.read_chunk(a, s, c)
        problem = chunk_mismatch(s, c, data)
        if problem is not None:
            raise IntegrityError(problem, tensor=a.name, shard=s.id, file=str(self.ckpt / s.file))
        return data


class NpyBackend:
    """Shards as ``.npy`` files in a directory per data file; the manifest as plain bytes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def open_writer(self, path: Path, comm: Any, attrs: Mapping[str, Any], shared: bool, nshards: int) -> ShardWriter:  # fmt: skip
        assert not shared, "the toy backend writes one file per rank"
        self.calls.append("open_writer")
        return _NpyWriter(path)

    def open_reader(self, ckpt: Path, comm: Any = None) -> ShardReader:
        self.calls.append("open_reader")
        return _NpyReader(ckpt)

    def write_index(self, ckpt: Path, manifest: Manifest, text: bytes) -> None:
        self.calls.append("write_index")
        (ckpt / MAIN_FILE).write_bytes(text)

    def read_index(self, ckpt: Path) -> bytes:
        self.calls.append("read_index")
        try:
            return (ckpt / MAIN_FILE).read_bytes()
        except OSError as exc:
            raise ManifestError(f"{ckpt / MAIN_FILE}: {exc}") from None

    def data_files(self, ckpt: Path) -> list[Path]:
        return sorted(p for p in ckpt.iterdir() if p.name != MAIN_FILE)

    def remove(self, path: Path) -> None:
        remove_path(path)


def _comm() -> Any:
    from mpi4py import MPI

    return MPI.COMM_SELF


def _values(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {name: random_value(t, rng) for name, t in TENSORS}


def test_the_protocol_runs_over_another_format(tmp_path: Path) -> None:
    backend = NpyBackend()
    typed: ShardBackend = backend  # the protocol, structurally
    store = CheckpointStore(tmp_path / "s", _comm(), timeout_s=30, chunk_bytes=32, keep_last=2, backend=typed)  # fmt: skip
    try:
        for step in (1, 2, 3):
            vals = _values(step)
            store.save(step, MESH, [(TensorSpec(n, t), vals[n]) for n, t in TENSORS])
        got = store.restore(MESH, TENSORS).values
        assert got.keys() == _values(3).keys()
        for name, want in _values(3).items():
            assert got[name].tobytes() == want.tobytes(), name
    finally:
        store.close()
    assert [e.step for e in list_checkpoints(tmp_path / "s")] == [2, 3]  # keep-last-2
    ckpt = tmp_path / "s" / committed_name(3)
    assert not (ckpt / MAIN_FILE).read_bytes().startswith(b"\x89HDF"), "not an HDF5 file"
    assert sorted(p.name for p in (ckpt / "data-000000.h5").iterdir()) == ["shards__b__0.npy", "shards__s__0.npy", "shards__w__0.npy"]  # fmt: skip
    assert {"open_writer", "write_index", "read_index", "open_reader"} <= set(backend.calls)
    assert backend.data_files(ckpt) == [ckpt / "data-000000.h5"]


def test_a_flipped_byte_is_found_through_another_format(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s", _comm(), timeout_s=30, chunk_bytes=32, backend=NpyBackend())  # fmt: skip
    try:
        vals = _values(1)
        path = store.save(1, MESH, [(TensorSpec(n, t), vals[n]) for n, t in TENSORS])
        npy = path / "data-000000.h5" / "shards__w__0.npy"
        data = bytearray(npy.read_bytes())
        data[-5] ^= 0x10  # the last row of w: its last chunk
        npy.write_bytes(bytes(data))
        with pytest.raises(IntegrityError) as info:
            store.restore(MESH, TENSORS)
        e = info.value
        assert (e.tensor, e.shard, e.file) == ("w", "w:shard:0", str(path / "data-000000.h5"))
    finally:
        store.close()


def test_the_default_backend_is_parallel_hdf5(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s", _comm(), timeout_s=30)
    try:
        assert store.backend is HDF5
        vals = _values(1)
        path = store.save(1, MESH, [(TensorSpec(n, t), vals[n]) for n, t in TENSORS])
    finally:
        store.close()
    assert (path / MAIN_FILE).read_bytes().startswith(b"\x89HDF\r\n\x1a\n")
    assert HDF5.data_files(path) == [path / "data-000000.h5"]
