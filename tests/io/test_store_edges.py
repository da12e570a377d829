"""Edge cases of the checkpoint store found in review, single process (``MPI.COMM_SELF``, a
1-rank mesh: a checkpoint is the directory ``ckpt-N/`` of ``checkpoint.h5`` and one data file
``data-000000.h5``): damaged data files, main files and pointers, stale derived artifacts,
zero-size tensors, the quota estimate, retired checkpoints left by a crash, duplicate restore
targets, a poisoned store."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from dtm_mpi.cli import run
from dtm_mpi.errors import IntegrityError, ManifestError, PoisonedError, QuotaError, UsageError
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_files import MAIN_FILE
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.manifest import ArtifactClass, Lifecycle, parse_manifest
from dtm_mpi.io.store import committed_name, disk_usage, list_checkpoints, read_latest, tree_bytes
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.mesh import MeshShape

MESH = MeshShape((("x", 1),))
T32 = TensorType(DType.F32, (6, 2), Layout((("x",), ())))
T16 = TensorType(DType.F16, (6, 2), Layout((("x",), ())))
G = np.arange(12, dtype=np.float32).reshape(6, 2)


def store_at(path: Path, **kw: Any) -> CheckpointStore:
    from mpi4py import MPI

    return CheckpointStore(path, MPI.COMM_SELF, timeout_s=30, **kw)


def save_w(path: Path, step: int, **kw: Any) -> None:
    s = store_at(path, **kw)
    s.save(step, MESH, [(TensorSpec("w", T32), G + step)])
    s.close()


DATA = "data-000000.h5"  # one rank: one data file


def rewrite_manifest(path: Path, change: Any) -> None:
    """Replace the manifest of checkpoint directory ``path`` by ``change(manifest)``
    (resealed: a valid main file)."""
    with h5py.File(path / MAIN_FILE, "r+") as f:
        m = change(parse_manifest(bytes(f["manifest"][()])))
        text = m.sealed().to_bytes()
        del f["manifest"]
        f.create_dataset("manifest", data=np.bytes_(text), dtype=f"S{len(text)}")
        f.attrs["manifest_hash"] = m.sealed().to_json()["manifest_hash"]


def test_a_damaged_latest_pointer_falls_back_to_the_newest(tmp_path: Path) -> None:
    save_w(tmp_path, 1)
    save_w(tmp_path, 2)
    (tmp_path / "latest").write_bytes(b"\xff\xfe not utf-8")
    assert read_latest(tmp_path) == 2
    assert [e.latest for e in list_checkpoints(tmp_path)] == [False, False]
    s = store_at(tmp_path)
    assert s.restore(MESH, [("w", T32)]).step == 2
    s.close()
    assert run(["ckpt", "ls", str(tmp_path)]) == 0


def test_a_misshapen_or_missing_dataset_is_an_integrity_error_and_falls_back(
    tmp_path: Path,
) -> None:
    save_w(tmp_path, 1)
    save_w(tmp_path, 2)
    path = tmp_path / committed_name(2)
    data = path / DATA
    with h5py.File(data, "r+") as f:
        del f["shards/w/0"]
        f.create_dataset("shards/w/0", data=np.zeros((5, 2), np.float32))
    s = store_at(tmp_path)
    with pytest.raises(
        IntegrityError,
        match=r"dataset /shards/w/0 is float32\[5, 2\], the manifest says f32\[6, 2\]",
    ) as info:
        s.restore(MESH, [("w", T32)])
    assert (info.value.tensor, info.value.shard, info.value.file) == ("w", "w:shard:0", str(data))
    got = s.restore(MESH, [("w", T32)], fallback=True)
    assert got.step == 1 and got.values["w"].tobytes() == (G + 1).tobytes()
    with h5py.File(data, "r+") as f:
        del f["shards/w/0"]
    with pytest.raises(IntegrityError, match="dataset /shards/w/0 is missing") as info:
        s.restore(MESH, [("w", T32)])
    assert info.value.file == str(data)
    data.write_bytes(b"not hdf5 at all")
    with pytest.raises(IntegrityError, match="data file cannot be read as HDF5") as info:
        s.restore(MESH, [("w", T32)])
    assert info.value.file == str(data)
    data.unlink()
    with pytest.raises(IntegrityError, match="data file is missing") as info:
        s.restore(MESH, [("w", T32)])
    assert (info.value.tensor, info.value.shard, info.value.file) == ("w", "w:shard:0", str(data))
    assert s.restore(MESH, [("w", T32)], fallback=True).step == 1
    (path / MAIN_FILE).write_bytes(b"not hdf5 at all")
    with pytest.raises(ManifestError, match="cannot be read as HDF5") as minfo:
        s.restore(MESH, [("w", T32)])
    assert str(minfo.value).startswith(f"{path / MAIN_FILE}: ")
    assert s.restore(MESH, [("w", T32)], fallback=True).step == 1
    s.close()


def test_a_stale_derived_artifact_is_rebuilt_from_its_parent(tmp_path: Path) -> None:
    s = store_at(tmp_path)
    s.save(
        1,
        MESH,
        [
            (TensorSpec("w", T32), G),
            (
                TensorSpec("w16", T16, ArtifactClass.DERIVED, "w", "cast:f16"),
                np.full((6, 2), -1, np.float16),
            ),
        ],
    )
    assert (
        s.restore(MESH, [("w16", T16)]).values["w16"].tobytes()
        == np.full((6, 2), -1, np.float16).tobytes()
    )

    def stale(m: Any) -> Any:
        arts = tuple(
            dataclasses.replace(a, state=Lifecycle.STALE) if a.name == "w16" else a
            for a in m.artifacts
        )
        return dataclasses.replace(m, artifacts=arts)

    rewrite_manifest(tmp_path / committed_name(1), stale)
    got = s.restore(MESH, [("w16", T16)]).values["w16"]
    assert got.tobytes() == G.astype(np.float16).tobytes()
    s.close()


def test_zero_size_tensors_save_and_restore(tmp_path: Path) -> None:
    t = TensorType(DType.F32, (0, 4), Layout((("x",), ())))
    s = store_at(tmp_path)
    s.save(
        1, MESH, [(TensorSpec("empty", t), np.zeros((0, 4), np.float32)), (TensorSpec("w", T32), G)]
    )
    got = s.restore(MESH, [("empty", t), ("w", T32)]).values
    assert got["empty"].shape == (0, 4) and got["w"].tobytes() == G.tobytes()
    s.close()


def test_quota_estimate_counts_dataset_alignment(tmp_path: Path) -> None:
    """Datasets of 4 MiB or more start on 1 MiB boundaries: the estimate includes that, so a
    quota the file would overrun refuses the save before writing."""
    big = TensorType(DType.F32, (1 << 20 | 1,), Layout((("x",),)))
    items = [(TensorSpec(f"t{i}", big), np.zeros(1 << 20 | 1, np.float32)) for i in range(3)]
    s = store_at(tmp_path / "a")
    path = s.save(1, MESH, items)
    s.close()
    size = os.path.getsize(path / DATA)
    data = 3 * 4 * (1 << 20 | 1)
    assert size > data + 2 * (1 << 20)  # the padding is real
    assert tree_bytes(path) == size + os.path.getsize(path / MAIN_FILE)
    s = store_at(tmp_path / "b", quota_bytes=data + (512 << 10))
    with pytest.raises(QuotaError, match="needs about"):
        s.save(1, MESH, items)
    assert list_checkpoints(tmp_path / "b") == []
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["store.json"]  # nothing written
    s.close()


def test_retired_files_left_by_a_crash_are_counted_shown_and_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_w(tmp_path, 1, keep_last=1)
    orphan = tmp_path / f".deleting-{committed_name(0)}"
    orphan.mkdir()  # as a crash between the rename and the removal leaves it: a directory
    (orphan / DATA).write_bytes(b"x" * 1000)
    one = tree_bytes(tmp_path / committed_name(1))
    assert one > 1000 and one == sum(
        p.stat().st_size for p in (tmp_path / committed_name(1)).iterdir()
    )
    assert disk_usage(tmp_path) == one + 1000
    capsys.readouterr()
    assert run(["ckpt", "ls", str(tmp_path)]) == 0
    assert (
        f"{orphan.name}: retired (by keep_last, a save that replaced its step, or dtm ckpt rm), not deleted yet"
        in capsys.readouterr().out
    )
    assert run(["ckpt", "rm", str(tmp_path), "--partial"]) == 0
    assert not orphan.exists()
    orphan.mkdir()
    (orphan / MAIN_FILE).write_bytes(b"x")
    save_w(tmp_path, 2, keep_last=1)  # the next retention removes leftovers (close waits)
    assert not orphan.exists() and [e.step for e in list_checkpoints(tmp_path)] == [2]
    assert not (tmp_path / committed_name(1)).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [committed_name(2), "latest", "store.json"]


def test_duplicate_restore_targets_are_refused(tmp_path: Path) -> None:
    save_w(tmp_path, 1)
    s = store_at(tmp_path)
    with pytest.raises(UsageError, match="'w' requested twice"):
        s.restore(MESH, [("w", T32), ("w", T32)])
    s.close()


def test_store_put_rebuilds_derived_children_of_a_replaced_tensor(tmp_path: Path) -> None:
    s = store_at(tmp_path)
    s.save(
        1,
        MESH,
        [
            (TensorSpec("w", T32), G),
            (TensorSpec("w16", T16, ArtifactClass.DERIVED, "w", "cast:f16"), G.astype(np.float16)),
            (TensorSpec("w16b", T16, ArtifactClass.DERIVED, "w16", "copy"), G.astype(np.float16)),
        ],
    )
    s.close()
    new = np.full((6, 2), 100.0, np.float32)
    np.save(tmp_path / "new.npy", new)
    assert run(["store", "put", str(tmp_path), "w", str(tmp_path / "new.npy")]) == 0
    s = store_at(tmp_path)
    got = s.restore(MESH, [("w", T32), ("w16", T16), ("w16b", T16)])
    assert got.step == 2
    assert got.values["w16"].tobytes() == new.astype(np.float16).tobytes()
    assert got.values["w16b"].tobytes() == new.astype(np.float16).tobytes()
    s.close()


def test_a_timed_out_exchange_poisons_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtm_mpi.errors import CommTimeoutError
    from dtm_mpi.io import checkpoint

    save_w(tmp_path, 1)
    s = store_at(tmp_path)

    def stuck(*args: Any, **kwargs: Any) -> Any:
        raise CommTimeoutError("bcast did not complete", op="bcast")

    monkeypatch.setattr(checkpoint, "bcast_obj", stuck)
    with pytest.raises(CommTimeoutError):
        s.restore(MESH, [("w", T32)])
    monkeypatch.undo()
    with pytest.raises(PoisonedError, match="bcast did not complete"):
        s.restore(MESH, [("w", T32)])


def test_retention_waits_for_a_slow_deletion_at_most_its_bound(tmp_path: Path) -> None:
    """Rank 0 never waits unboundedly for the background deletion while other ranks wait for
    its verdict: past the bound it is a StorageError (and the deletion goes on)."""
    import threading

    from dtm_mpi.errors import StorageError
    from dtm_mpi.io.commit import Retention

    release = threading.Event()
    retention = Retention(tmp_path)
    retention._reaper = threading.Thread(target=release.wait, daemon=True)
    retention._reaper.start()
    with pytest.raises(StorageError, match=r"deleting retired checkpoints took more than 0\.05 s"):
        retention.wait(0.05)
    release.set()
    retention.wait(5)
    assert retention._reaper is None
