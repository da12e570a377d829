"""Damaged chunks and their recovery (dtm_mpi/io/recovery.py, ``dtm store recover``, degraded
``dtm store get``): the scan finds exactly the flipped chunks; the plan takes the same bytes
from another checkpoint, else the parent of a derived tensor, else the task that wrote it,
else says unrecoverable; a degraded read returns the original bytes with a warning; a repair
writes a new whole checkpoint, leaves out what only a task can rebuild, and refuses to lose
data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.cli import main
from dtm_mpi.errors import IntegrityError, StorageError
from dtm_mpi.io.recovery import (
    ChunkRef,
    Source,
    read_degraded,
    recovery_plan,
    repair,
)
from dtm_mpi.io.store import committed_name, read_latest
from dtm_mpi.io.task_records import TaskRecord, write_record
from dtm_mpi.io.tools import put_tensor, put_tensors, read_manifest, read_tensor, store_backend
from tests.io.io_helpers import flip_byte
from tests.test_cli_store import comm


def _store(tmp_path: Path) -> Path:
    """Step 0: z; step 1: a (the same bytes in every later step) and w; step 2: w16, derived
    from w (cast:f16); step 3: w replaced (w16 rebuilt); a record says task 'train' wrote w."""
    store = tmp_path / "s"
    store.mkdir()
    rng = np.random.default_rng(1)
    put_tensor(store, comm(), "z", np.arange(3, dtype=np.int64))
    put_tensors(
        store,
        comm(),
        {"a": rng.standard_normal((40, 8)), "w": rng.standard_normal((6, 4)).astype(np.float32)},
    )
    put_tensor(
        store,
        comm(),
        "w16",
        np.zeros((6, 4), np.float16),
        cls="derived",
        parent="w",
        rebuild="cast:f16",
    )
    put_tensor(store, comm(), "w", rng.standard_normal((6, 4)).astype(np.float32))
    write_record(store, TaskRecord("train", "k" * 64, 2, (("w", "f32[6,4]:x"),)))
    return store


def _flip(store: Path, step: int, tensor: str) -> None:
    flip_byte(store / committed_name(step) / "data-000000.h5", f"/shards/{tensor}/0", 5)


def _plan(store: Path, step: int) -> list:  # type: ignore[type-arg]
    backend = store_backend(store)
    return list(recovery_plan(store, read_manifest(store / committed_name(step), backend), backend))


def test_the_plan_prefers_the_same_bytes_then_the_parent_then_the_task(tmp_path: Path) -> None:
    store = _store(tmp_path)
    latest = read_latest(store)
    assert latest == 3
    for t in ("a", "w", "w16"):
        _flip(store, latest, t)
    plan = {r.damaged.tensor: r for r in _plan(store, latest)}
    assert set(plan) == {"a", "w", "w16"}
    assert plan["a"].source is Source.REPLICA and plan["a"].replica == ChunkRef(
        2, "a", "a:shard:0", 0
    )
    assert plan["w"].source is Source.TASK and plan["w"].task == "train"
    assert plan["w16"].source is Source.NONE  # its parent w is damaged too
    assert "rebuilt by task 'train'" in str(plan["w"])


def test_a_derived_tensor_is_rebuilt_from_a_whole_parent(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _flip(store, 3, "w16")
    (plan,) = _plan(store, 3)
    assert plan.source is Source.PARENT and plan.parent == "w"
    put, dropped = repair(store, 3, [plan], comm(), backend=store_backend(store))
    assert dropped == () and put.step == 4
    ckpt = store / committed_name(4)
    np.testing.assert_array_equal(
        read_tensor(ckpt, "w16"), read_tensor(ckpt, "w").astype(np.float16)
    )
    assert _plan(store, 4) == []


def test_a_degraded_read_serves_the_same_bytes_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    want = read_tensor(store / committed_name(3), "a")
    _flip(store, 3, "a")
    with pytest.raises(IntegrityError):
        read_tensor(store / committed_name(3), "a")
    said: list[str] = []
    got = read_degraded(store, 3, "a", backend=store_backend(store), warn=said.append)
    assert got.tobytes() == want.tobytes()
    assert len(said) == 1 and "served from step 2 tensor 'a'" in said[0]
    out = tmp_path / "a.npy"
    assert main(["store", "get", str(store), "a", "-o", str(out)]) == 0
    assert np.load(out).tobytes() == want.tobytes()
    assert "1 damaged chunk(s) served from replicas" in capsys.readouterr().out
    with pytest.raises(IntegrityError):
        main(["store", "get", str(store), "a", "-o", str(out), "--strict"])
    npz = tmp_path / "a.npz"
    assert main(["store", "export", str(store), "a", "-o", str(npz)]) == 0
    assert np.load(npz)["a"].tobytes() == want.tobytes()
    assert "served from step 2 tensor 'a'" in capsys.readouterr().err
    with pytest.raises(IntegrityError):
        main(["store", "export", str(store), "a", "-o", str(npz), "--strict"])
    _flip(store, 3, "w")  # w changed at step 3: no replica; its task is named
    with pytest.raises(IntegrityError, match=r"cannot be served degraded.*rebuilt by task 'train'"):
        read_degraded(store, 3, "w", backend=store_backend(store), warn=said.append)


def test_repair_leaves_out_what_a_task_rebuilds_and_refuses_to_lose_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    a = read_tensor(store / committed_name(3), "a")
    _flip(store, 3, "a")
    _flip(store, 3, "w")
    assert main(["store", "recover", str(store), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "2 damaged chunk(s): 1 by replica, 1 by task" in text
    assert read_latest(store) == 3  # a dry run writes nothing
    assert main(["store", "recover", str(store)]) == 0
    assert "left out w, w16" in capsys.readouterr().out  # w16 derives from w
    m = read_manifest(store / committed_name(4))
    assert "w" not in m.names and "w16" not in m.names
    assert read_tensor(store / committed_name(4), "a").tobytes() == a.tobytes()
    assert _plan(store, 4) == []
    # a tensor no checkpoint, parent or task can give back: nothing is written
    store2 = tmp_path / "t"
    store2.mkdir()
    put_tensors(store2, comm(), {"only": np.arange(10.0)})
    _flip(store2, 0, "only")
    with pytest.raises(
        StorageError, match=r"cannot repair: .*'only'.*unrecoverable.*nothing was written"
    ):
        repair(store2, 0, _plan(store2, 0), comm(), backend=store_backend(store2))
    assert read_latest(store2) == 0
