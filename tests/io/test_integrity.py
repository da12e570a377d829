"""Done-when of the tensor store (issue #6): flipping any single byte of tensor data in a
checkpoint is detected on restore and by ``dtm ckpt verify``, naming the tensor, the shard and
the data file; a flipped byte of the manifest makes it unloadable.

Single process: the checkpoint is saved with :class:`CheckpointStore` on ``MPI.COMM_SELF`` (a
1-rank mesh: one shard per tensor, ``<tensor>:shard:0``, every shard the dataset
``/shards/<tensor>/0`` of the checkpoint directory's one data file ``data-000000.h5``) with
64-byte chunks, so every shard has several chunks and a flip must be found in the right one.
Byte positions are drawn with a seeded generator over every data byte of every shard dataset
(``get_offset``/``get_storage_size`` in the data file).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.cli import run
from dtm_mpi.errors import IntegrityError, ManifestError
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_files import MAIN_FILE, read_manifest, verify_checkpoint
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.manifest import ArtifactClass
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.mesh import MeshShape
from tests.io.io_helpers import random_value

MESH = MeshShape((("x", 1),))
STEP = 4
CHUNK = 64
TENSORS = [
    ("w", TensorType(DType.F32, (10, 7), Layout((("x",), ())))),
    ("v", TensorType(DType.F64, (5,), Layout.replicated(1))),
    ("m", TensorType(DType.F16, (3, 1, 4), Layout(((), (), ("x",))))),
    ("step_count", TensorType(DType.I64, (), Layout(()))),
    ("mask", TensorType(DType.BOOL, (6, 2), Layout.replicated(2))),
    ("big", TensorType(DType.F32, (37, 5), Layout((("x",), ())))),
    ("b16", TensorType(DType.BF16, (20, 2), Layout.replicated(2))),
]
FLIPS = 60


def comm() -> Any:
    from mpi4py import MPI

    return MPI.COMM_SELF


def global_value(name: str, t: TensorType, rng: np.random.Generator) -> np.ndarray:
    return random_value(t, rng)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """One good checkpoint directory (with an ephemeral artifact beside the stored ones)."""
    store = tmp_path_factory.mktemp("good")
    rng = np.random.default_rng(20240611)
    values = {name: global_value(name, t, rng) for name, t in TENSORS}
    items: list[tuple[TensorSpec, np.ndarray | None]] = [
        (TensorSpec(n, t), values[n]) for n, t in TENSORS
    ]
    eph = TensorType(DType.F32, (3,), Layout.replicated(1))
    items.append((TensorSpec("scratch", eph, ArtifactClass.EPHEMERAL), None))
    cs = CheckpointStore(store, comm(), chunk_bytes=CHUNK)
    path = cs.save(STEP, MESH, items)
    cs.close()
    return path, values


DATA = "data-000000.h5"  # one rank: one data file


def data_extents(path: Path) -> list[tuple[str, int, int]]:
    """(tensor, offset in the data file, bytes) of every shard dataset of checkpoint
    directory ``path``."""
    import h5py

    out = []
    with h5py.File(path / DATA, "r") as f:
        for name, _ in TENSORS:
            d = f[f"/shards/{name}/0"]
            out.append((name, int(d.id.get_offset()), int(d.id.get_storage_size())))
    return out


def flip_at(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ mask]))


def fresh_store(good_path: Path, where: Path) -> Path:
    """A store at ``where`` holding a copy of checkpoint directory ``good_path``; returns the
    copy's path."""
    where.mkdir()
    shutil.copytree(good_path, where / good_path.name)
    return where / good_path.name


def restore_all(store: Path) -> dict[str, np.ndarray]:
    cs = CheckpointStore(store, comm(), timeout_s=60)
    try:
        return cs.restore(MESH, TENSORS, step=STEP).values
    finally:
        cs.close()


def test_the_good_file_verifies_and_restores(
    good: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, values = good
    assert path.is_dir() and sorted(p.name for p in path.iterdir()) == [MAIN_FILE, DATA]
    assert verify_checkpoint(path) == []
    m = read_manifest(path)
    for name, _ in TENSORS:  # the flips below land in shards of several chunks
        (shard,) = m.artifact(name).shards
        assert shard.id == f"{name}:shard:0"
        assert (shard.file, shard.dataset) == (DATA, f"/shards/{name}/0")
        assert len(shard.chunks) >= (2 if name in ("w", "big", "b16") else 1)
    store = fresh_store(path, tmp_path / "s")
    got = restore_all(store.parent)
    for name, want in values.items():
        assert got[name].dtype == want.dtype and got[name].tobytes() == want.tobytes(), name
    assert run(["ckpt", "verify", str(store.parent)]) == 0
    assert capsys.readouterr().out.startswith(f"ok {store}: 7 tensors, ")
    # every data byte of the file is covered by one dataset of the extents drawn from
    extents = data_extents(path)
    assert sum(n for _, _, n in extents) >= m.data_bytes


@pytest.mark.parametrize("mode", ["one-pass", "inline-hash", "hash-thread"])
def test_every_flipped_data_byte_is_found(
    good: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """Without a spare core, restore hashes each piece as it reads it (one pass); with that
    path off, each run is read, then hashed inline; with a spare core, hashed on a second
    thread while the next run is read."""
    import dtm_mpi.io.restore_read as restore_read

    hash_thread = mode == "hash-thread"
    monkeypatch.setattr(restore_read, "hash_thread_wanted", lambda: hash_thread)
    pipelined, one_pass = [], []
    real, real_read = restore_read._read_runs, restore_read._read_run

    def spy(*args: Any, threaded: bool) -> Any:
        pipelined.append(threaded)
        return real(*args, threaded=threaded)

    def read(*args: Any, checked: bool) -> Any:
        if not checked:
            return real_read(*args, checked=False)
        got = real_read(*args, checked=True) if mode == "one-pass" else None
        one_pass.append(got is not None)
        return got

    monkeypatch.setattr(restore_read, "_read_runs", spy)
    monkeypatch.setattr(restore_read, "_read_run", read)
    path, _ = good
    extents = data_extents(path)
    total = sum(n for _, _, n in extents)
    rng = np.random.default_rng(6)
    # the first and last byte of every tensor, the rest drawn over all data bytes
    ends, start = [], 0
    for _, _, nbytes in extents:
        ends += [start, start + nbytes - 1]
        start += nbytes
    rest = np.setdiff1d(np.arange(total), ends)
    positions = np.concatenate([ends, rng.choice(rest, size=FLIPS - len(ends), replace=False)])
    masks = rng.integers(1, 256, size=FLIPS)
    hit: set[str] = set()
    for k, (pos, mask) in enumerate(zip(positions.tolist(), masks.tolist(), strict=True)):
        start = 0
        for name, offset, nbytes in extents:
            if pos < start + nbytes:
                tensor, at = name, offset + (pos - start)
                break
            start += nbytes
        hit.add(tensor)
        shard = f"{tensor}:shard:0"
        bad = fresh_store(path, tmp_path / f"s{k}")
        data = bad / DATA
        flip_at(data, at, mask)
        where = f"flip {k}: byte {pos - start} of {tensor!r} (offset {at} of {DATA}) ^ {mask:#04x}"

        problems = verify_checkpoint(bad)
        assert len(problems) == 1, (where, [str(p) for p in problems])
        p = problems[0]
        assert (p.tensor, p.shard, p.file) == (tensor, shard, str(data)), (where, str(p))

        with pytest.raises(IntegrityError) as info:
            restore_all(bad.parent)
        e = info.value
        assert (e.tensor, e.shard, e.file) == (tensor, shard, str(data)), (where, str(e))
        assert f"tensor {tensor!r} shard {shard!r}" in str(e) and str(data) in str(e)

        if k % 10 == 0:
            assert run(["ckpt", "verify", str(bad.parent)]) == 1, where
            out = capsys.readouterr().out
            assert f"DAMAGED {data}: tensor {tensor!r} shard {shard!r}: chunk " in out, (where, out)
        shutil.rmtree(bad.parent)
    assert hit == {name for name, _ in TENSORS}
    assert pipelined and any(pipelined) == hash_thread
    if mode == "hash-thread":  # with a spare core whole runs are read, hashed on the worker
        assert not one_pass
    else:
        assert one_pass and all(one_pass) == (mode == "one-pass")


def test_a_flipped_manifest_byte_makes_it_unloadable(
    good: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import h5py

    path, _ = good
    with h5py.File(path / MAIN_FILE, "r") as f:
        d = f["/manifest"]
        offset, nbytes = int(d.id.get_offset()), int(d.id.get_storage_size())
    rng = np.random.default_rng(7)
    positions = rng.choice(nbytes, size=20, replace=False)
    masks = rng.integers(1, 256, size=20)
    for k, (pos, mask) in enumerate(zip(positions.tolist(), masks.tolist(), strict=True)):
        bad = fresh_store(path, tmp_path / f"s{k}")
        flip_at(bad / MAIN_FILE, offset + pos, mask)
        with pytest.raises(ManifestError) as info:
            read_manifest(bad)
        msg = str(info.value)
        assert msg.startswith(f"{bad / MAIN_FILE}: ")
        assert any(
            s in msg
            for s in ("manifest hash mismatch", "not valid JSON", "missing field", "is not")
        ), msg
        with pytest.raises(ManifestError):
            restore_all(bad.parent)
        if k % 5 == 0:
            assert run(["ckpt", "verify", str(bad.parent)]) == 1
            assert capsys.readouterr().out.startswith(f"INVALID {bad}: ")
        shutil.rmtree(bad.parent)


def test_bf16_shard_bytes_match_the_stored_bytes(good: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = good
    (shard,) = read_manifest(path).artifact("b16").shards
    stored = {name: n for name, _, n in data_extents(path)}["b16"]
    assert shard.nbytes == stored, f"manifest says {shard.nbytes} bytes, the dataset holds {stored}"
