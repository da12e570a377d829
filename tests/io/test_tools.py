"""The store tools' public API (:mod:`dtm_mpi.io.tools`) called directly, as a program other
than the CLI would: results are values, errors are the hierarchy's (no printing, no exit
codes). The CLI's behaviour on top of it is tested in ``tests/test_cli_store.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import IntegrityError, StorageError, UsageError
from dtm_mpi.io.manifest import ArtifactClass
from dtm_mpi.io.store import committed_name, list_checkpoints, read_latest
from dtm_mpi.io.tools import (
    CheckStatus,
    checkpoint_path,
    put_tensor,
    read_tensor,
    remove_checkpoint,
    remove_incomplete,
    store_dir,
    verify_checkpoints,
)
from dtm_mpi.ir.types import DType
from tests.io.io_helpers import flip_byte
from tests.test_cli_store import DATA, comm, make_store, same, serial_only, values_at


def test_naming_a_store_and_a_checkpoint(tmp_path: Path) -> None:
    store = make_store(tmp_path / "s")
    assert store_dir(str(store)) == store
    assert checkpoint_path(store, None) == store / committed_name(2)
    assert checkpoint_path(store, 1) == store / committed_name(1)
    with pytest.raises(UsageError, match="has no committed checkpoint 5 \\(it has: 1, 2\\)"):
        checkpoint_path(store, 5)
    with pytest.raises(UsageError, match="does not exist"):
        store_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match="has no committed checkpoint"):
        checkpoint_path(tmp_path / "empty", None)


def test_read_tensor_and_verify(tmp_path: Path) -> None:
    store = make_store(tmp_path / "s")
    assert same(read_tensor(store / committed_name(1), "w"), values_at(1)["w"])
    checks = verify_checkpoints(store, every=True)
    assert [(c.path.name, c.status) for c in checks] == [
        (committed_name(1), CheckStatus.OK),
        (committed_name(2), CheckStatus.OK),
    ]
    assert checks[0].tensors == 6 and checks[0].data_bytes > 0
    flip_byte(store / committed_name(2) / DATA, "/shards/v/0", 1)
    with pytest.raises(IntegrityError) as info:
        read_tensor(store / committed_name(2), "v")
    assert (info.value.tensor, info.value.shard) == ("v", "v:shard:0")
    (check,) = verify_checkpoints(store)
    assert check.status is CheckStatus.DAMAGED and len(check.problems) == 1
    assert check.problems[0].startswith(
        f"{store / committed_name(2) / DATA}: tensor 'v' shard 'v:shard:0': chunk 0 "
    )


def test_remove(tmp_path: Path) -> None:
    store = make_store(tmp_path / "s", steps=(1, 2))
    (store / "ckpt-00000003.partial-0a").mkdir()
    assert [p.name for p in remove_incomplete(store)] == ["ckpt-00000003.partial-0a"]
    with pytest.raises(UsageError, match="add --force"):
        remove_checkpoint(store, 2)
    assert remove_checkpoint(store, 1) == (store / committed_name(1), None)
    assert remove_checkpoint(store, 2, force=True) == (
        store / committed_name(2),
        "no checkpoint remains",
    )
    assert list_checkpoints(store) == [] and read_latest(store) is None


def test_put_tensor(tmp_path: Path) -> None:
    serial_only()
    store = make_store(tmp_path / "s", steps=(1,))
    new_w = np.full((10, 7), 0.5, dtype=np.float32)
    r = put_tensor(store, comm(), "w", new_w)
    assert (r.step, r.base, r.replaced, r.dtype, r.shape, r.cls, r.rebuilt) == (
        2,
        1,
        True,
        DType.F32,
        (10, 7),
        ArtifactClass.PRIMARY,
        ("w16",),
    )
    assert same(read_tensor(r.path, "w16"), new_w.astype(np.float16))
    with pytest.raises(UsageError, match="must be newer"):
        put_tensor(store, comm(), "w", new_w, step=2)
    with pytest.raises(UsageError, match="is not a dtm dtype"):
        put_tensor(store, comm(), "z", np.zeros(3, dtype=np.complex64))
