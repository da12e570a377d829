"""The checkpoint directory of format version 2, single process (``MPI.COMM_SELF``, a 1-rank
mesh): ``ckpt-N/`` holds ``checkpoint.h5`` (root attributes, one virtual dataset per stored
tensor, the manifest) and ``data-000000.h5`` (one dataset per shard); ``latest`` names the
directory; a reader without dtm_mpi reads every tensor through the virtual datasets, also
after the store moved; ``verify_checkpoint`` checks that the virtual datasets map the
manifest's shards; ``store.json`` version 1 is read and rewritten as version 2; single-file
checkpoints of version 1 are listed with a note and never read; saving an existing step
replaces it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from dtm_mpi.cli import run
from dtm_mpi.errors import ManifestError, StorageError
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_files import MAIN_FILE, read_manifest, verify_checkpoint
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.manifest import ArtifactClass
from dtm_mpi.io.store import (
    committed_name,
    disk_usage,
    legacy_files,
    list_checkpoints,
    read_latest,
    read_meta,
    tree_bytes,
)
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.mesh import MeshShape
from tests.io.io_helpers import PLAIN_READER, random_value

MESH = MeshShape((("x", 1),))
DATA = "data-000000.h5"  # one rank: one data file
R = Layout.replicated
TENSORS = [
    ("w", TensorType(DType.F32, (6, 2), Layout((("x",), ())))),
    ("w2", TensorType(DType.F32, (6, 2), R(2))),
    ("v", TensorType(DType.F64, (5,), R(1))),
    ("step_count", TensorType(DType.I64, (), R(0))),
    ("mask", TensorType(DType.BOOL, (3, 2), R(2))),
    ("b16", TensorType(DType.BF16, (4, 3), R(2))),
    ("empty", TensorType(DType.F32, (0, 3), R(2))),
]
T16 = TensorType(DType.F16, (6, 2), R(2))
EPH = TensorType(DType.F32, (2,), R(1))


def values_at(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {name: random_value(t, rng) for name, t in TENSORS}


def store_at(path: Path, **kw: Any) -> CheckpointStore:
    from mpi4py import MPI

    return CheckpointStore(path, MPI.COMM_SELF, timeout_s=30, **kw)


def save(path: Path, step: int, **kw: Any) -> Path:
    """Checkpoint ``step`` of every tensor of TENSORS (values_at(step)), a derived one and an
    ephemeral one."""
    vals = values_at(step)
    items: list[tuple[TensorSpec, np.ndarray | None]] = [
        (TensorSpec(n, t), vals[n]) for n, t in TENSORS
    ]
    items.append(
        (
            TensorSpec("w16", T16, ArtifactClass.DERIVED, "w", "cast:f16"),
            vals["w"].astype(np.float16),
        )
    )
    items.append((TensorSpec("scratch", EPH, ArtifactClass.EPHEMERAL), None))
    s = store_at(path, **kw)
    try:
        return s.save(step, MESH, items)
    finally:
        s.close()


def restore(path: Path, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    s = store_at(path)
    try:
        got = s.restore(MESH, TENSORS, step=step)
    finally:
        s.close()
    return got.step, got.values


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("per_file", [1, 0, 2], ids=["G=1", "G=all", "G=2"])
def test_a_checkpoint_is_a_directory_of_a_main_file_and_data_files(
    tmp_path: Path, per_file: int
) -> None:
    path = save(tmp_path, 3, ranks_per_file=per_file)  # one rank: one data file whatever G
    assert path == tmp_path / "ckpt-00000003" == tmp_path / committed_name(3) and path.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003", "latest", "store.json"]
    assert sorted(p.name for p in path.iterdir()) == [MAIN_FILE, DATA]
    assert (tmp_path / "latest").read_text() == "ckpt-00000003\n"
    assert json.loads((tmp_path / "store.json").read_text())["version"] == 2
    m = read_manifest(path)
    stored = [a for a in m.artifacts if a.cls is not ArtifactClass.EPHEMERAL]
    with h5py.File(path / MAIN_FILE, "r") as f:
        assert (f.attrs["dtm_format"], int(f.attrs["format_version"]), int(f.attrs["step"])) == (
            "dtm-checkpoint",
            2,
            3,
        )
        assert sorted(f["tensors"]) == sorted(a.name for a in stored)  # not the ephemeral one
        for a in stored:
            d = f["tensors"][a.name]
            assert d.shape == a.shape and d.is_virtual == bool(a.shards), a.name
    with h5py.File(path / DATA, "r") as f:
        assert (
            f.attrs["dtm_format"],
            int(f.attrs["format_version"]),
            int(f.attrs["step"]),
            int(f.attrs["file_index"]),
        ) == ("dtm-checkpoint-data", 2, 3, 0)
        names: list[str] = []
        f.visititems(lambda n, o: names.append("/" + n) if isinstance(o, h5py.Dataset) else None)
        want = sorted(s.dataset for a in stored for s in a.shards)
        assert sorted(names) == want and all(s.file == DATA for a in stored for s in a.shards)
        for a in stored:
            for s in a.shards:
                assert s.dataset == f"/shards/{a.name}/{s.index}" and f[s.dataset].shape == s.extent
    assert m.artifact("empty").shards == ()
    step, got = restore(tmp_path)
    assert step == 3 and all(same(got[n], v) for n, v in values_at(3).items())
    # a partial directory is not a checkpoint; a file with a checkpoint's name is no checkpoint
    shutil.copytree(path, tmp_path / "ckpt-00000004.partial-ab")
    (tmp_path / "ckpt-00000005").write_bytes(b"")
    entries = list_checkpoints(tmp_path)
    assert [(e.step, e.committed, e.path.name) for e in entries] == [
        (3, True, "ckpt-00000003"),
        (4, False, "ckpt-00000004.partial-ab"),
    ]
    assert read_latest(tmp_path) == 3
    s = store_at(tmp_path)
    with pytest.raises(StorageError, match="has no committed checkpoint 4"):
        s.restore(MESH, TENSORS, step=4)
    s.close()


def test_plain_h5py_reads_every_tensor_after_the_store_moved(tmp_path: Path) -> None:
    """Without dtm_mpi (``python -I``, started in another directory): every tensor of the
    moved store read bit-exactly from ``checkpoint.h5`` through its virtual dataset (bf16 as
    the stored binary32, a scalar, a zero-size one), the sources named relatively."""
    save(tmp_path / "store", 5)
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    (tmp_path / "store").rename(moved)
    want = tmp_path / "want.npz"
    np.savez(want, **values_at(5), w16=values_at(5)["w"].astype(np.float16))
    main = moved / committed_name(5) / MAIN_FILE
    proc = subprocess.run(
        [sys.executable, "-I", "-c", PLAIN_READER, str(main), str(want), "5"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd="/",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and f"plain-ok True {[DATA]} False" in out, out


def _plain(f: h5py.File, name: str, value: np.ndarray) -> None:
    del f[f"tensors/{name}"]
    f.create_dataset(f"tensors/{name}", data=value)


def _virtual(f: h5py.File, name: str, file: str, dataset: str, rows: int = 6) -> None:
    """Replace /tensors/<name> (6x2 f32) by a virtual dataset mapping the first ``rows``
    rows of ``file``:``dataset``."""
    del f[f"tensors/{name}"]
    layout = h5py.VirtualLayout(shape=(6, 2), dtype=np.float32)
    layout[:rows] = h5py.VirtualSource(file, dataset, shape=(6, 2), dtype=np.float32)[:rows]
    f.create_virtual_dataset(f"tensors/{name}", layout)


DAMAGE = {  # how /tensors/w is damaged: what the report must say
    "plain": (lambda f, v: _plain(f, "w", v["w"]), ["dataset /tensors/w is not a virtual dataset"]),
    "other shard": (
        lambda f, v: _virtual(f, "w", DATA, "/shards/w2/0"),
        ["dataset /tensors/w maps ", "'shards/w2/0'", "'shards/w/0'"],
    ),
    "other file": (
        lambda f, v: _virtual(f, "w", "data-000001.h5", "/shards/w/0"),
        ["dataset /tensors/w maps ", "'data-000001.h5'"],
    ),
    "part": (
        lambda f, v: _virtual(f, "w", DATA, "/shards/w/0", rows=3),
        ["dataset /tensors/w maps "],
    ),
    "shape": (
        lambda f, v: _plain(f, "w", v["w"][:5]),
        ["dataset /tensors/w shape [5, 2] is not [6, 2]"],
    ),
    "missing": (lambda f, v: f.__delitem__("tensors/w"), ["dataset is missing"]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_checks_that_the_virtual_datasets_map_the_manifests_shards(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The main file's /tensors/w replaced (plain dataset with the right values, a virtual one
    over another shard or file or over half the shard, another shape, none):
    ``verify_checkpoint`` and ``dtm ckpt verify`` report it on the main file, naming the
    tensor. Restore reads the shards from their data files, not through the virtual datasets:
    it is not affected."""
    path = save(tmp_path, 1)
    main = path / MAIN_FILE
    assert verify_checkpoint(path) == []
    change, fragments = DAMAGE[damage]
    with h5py.File(main, "r+") as f:
        change(f, values_at(1))
    problems = verify_checkpoint(path)
    assert len(problems) == 1, [str(p) for p in problems]
    p = problems[0]
    assert (p.tensor, p.shard, p.file) == ("w", "*", str(main)), str(p)
    assert all(m in str(p) for m in fragments), str(p)
    capsys.readouterr()
    assert run(["ckpt", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (
        out.startswith(f"DAMAGED {main}: tensor 'w' shard '*': {fragments[0]}")
        and len(out.splitlines()) == 1
    ), out
    step, got = restore(tmp_path)
    assert step == 1 and same(got["w"], values_at(1)["w"])


def test_store_json_version_1_is_read_and_rewritten_as_version_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1 = {"format": "dtm-store", "version": 1, "quota_bytes": 10**9, "keep_last": 2}
    (tmp_path / "store.json").write_text(json.dumps(v1))
    meta = read_meta(tmp_path)
    assert meta is not None and (meta.quota_bytes, meta.keep_last) == (10**9, 2)
    assert run(["ckpt", "ls", str(tmp_path)]) == 0  # a reading tool: read, not rewritten
    assert "quota 1000000000 bytes, keep_last 2" in capsys.readouterr().out
    assert json.loads((tmp_path / "store.json").read_text()) == v1
    store_at(tmp_path).close()  # opening the store rewrites it, settings kept
    assert json.loads((tmp_path / "store.json").read_text()) == {
        **v1,
        "version": 2,
        "backend": "hdf5",
    }
    for step in (1, 2, 3):  # and they apply: keep_last 2
        save(tmp_path, step)
    assert [e.step for e in list_checkpoints(tmp_path)] == [2, 3]
    for bad in (3, "1", 1.0, None):
        (tmp_path / "store.json").write_text(json.dumps({**v1, "version": bad}))
        with pytest.raises(StorageError, match="not a dtm store settings file"):
            read_meta(tmp_path)
        with pytest.raises(StorageError, match="not a dtm store settings file"):
            store_at(tmp_path)


def _version_1_file(path: Path) -> None:
    """A single-file checkpoint as dtm_mpi 0.1 wrote it (only what a reader looks at)."""
    with h5py.File(path, "w") as f:
        f.attrs["dtm_format"] = "dtm-checkpoint"
        f.attrs["format_version"] = 1
        f.create_dataset("tensors/w", data=np.zeros((6, 2), np.float32))
        f.create_dataset("manifest", data=np.bytes_(b"{}"))


def test_a_version_1_checkpoint_file_is_listed_with_a_note_and_never_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "ckpt-00000007.h5"
    _version_1_file(old)
    shutil.copy(old, tmp_path / "ckpt-00000008.h5.partial-ab")
    (tmp_path / "latest").write_text("ckpt-00000007.h5\n")  # a version-1 pointer
    note = "a single-file checkpoint of format version 1, which this dtm_mpi does not read (not part of the store; it counts against the quota)"
    legacy = old.stat().st_size * 2
    assert legacy_files(tmp_path) == [old, tmp_path / "ckpt-00000008.h5.partial-ab"]
    assert list_checkpoints(tmp_path) == [] and read_latest(tmp_path) is None
    assert disk_usage(tmp_path) == legacy
    assert run(["ckpt", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"ckpt-00000007.h5: {note}" in out and f"ckpt-00000008.h5.partial-ab: {note}" in out, out
    assert f"{legacy} bytes in use by 0 checkpoint(s)" in out and "no checkpoints" in out, out
    s = store_at(tmp_path)
    with pytest.raises(StorageError, match="has no committed checkpoint"):
        s.restore(MESH, TENSORS)
    with pytest.raises(StorageError, match="has no committed checkpoint 7"):
        s.restore(MESH, TENSORS, step=7)
    s.close()
    # a new checkpoint beside them: the only one the store reads; the old files stay, counted
    path = save(tmp_path, 2)
    assert (tmp_path / "latest").read_text() == "ckpt-00000002\n"
    assert [e.step for e in list_checkpoints(tmp_path)] == [2] and read_latest(tmp_path) == 2
    assert restore(tmp_path)[0] == 2
    assert disk_usage(tmp_path) == tree_bytes(path) + legacy
    assert run(["ckpt", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"ckpt-00000007.h5: {note}" in out and "ckpt-00000002" in out, out
    assert run(["ckpt", "verify", str(tmp_path), "--all"]) == 0
    assert run(["ckpt", "rm", str(tmp_path), "--partial"]) == 0  # not a partial of this format
    assert old.exists() and (tmp_path / "ckpt-00000008.h5.partial-ab").exists()
    # a version-1 file where a main file is expected: refused, naming the version
    (tmp_path / "ckpt-00000009").mkdir()
    shutil.copy(old, tmp_path / "ckpt-00000009" / MAIN_FILE)
    main = tmp_path / "ckpt-00000009" / MAIN_FILE
    with pytest.raises(ManifestError) as info:
        read_manifest(tmp_path / "ckpt-00000009")
    msg = str(info.value)  # names the main file once, and the version as a number
    assert (
        msg.startswith(
            f"{main}: checkpoint format version 1 is not supported (this reads version 2)"
        )
        and "single-file layout" in msg
    ), msg
    # a main file without its manifest (an interrupted write): named as such
    with h5py.File(main, "r+") as f:
        f.attrs["format_version"] = 2
        del f["manifest"]
    with pytest.raises(ManifestError) as info:
        read_manifest(tmp_path / "ckpt-00000009")
    assert str(info.value) == f"{main}: no manifest: the checkpoint is incomplete"


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    """Step 3 saved again (after step 5): the new checkpoint takes its name, the old directory
    is gone (no retired one left behind), ``latest`` names it and a restore gives the new
    values; step 5 is untouched."""
    first = save(tmp_path, 3)
    old_data = (first / DATA).stat().st_ino
    save(tmp_path, 5)
    s = store_at(tmp_path)
    new = {
        n: v + np.asarray(1, v.dtype)
        if v.dtype.kind == "f"
        else ~v
        if v.dtype == np.bool_
        else v + 1
        for n, v in values_at(3).items()
    }
    path = s.save(3, MESH, [(TensorSpec(n, t), new[n]) for n, t in TENSORS])
    s.close()  # waits for the background removal of the replaced directory
    assert path == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000003",
        "ckpt-00000005",
        "latest",
        "store.json",
    ]
    assert (path / DATA).stat().st_ino != old_data
    assert read_manifest(path).names == tuple(n for n, _ in TENSORS)  # the new manifest
    assert (tmp_path / "latest").read_text() == "ckpt-00000003\n"
    step, got = restore(tmp_path)
    assert step == 3 and all(same(got[n], v) for n, v in new.items())
    step, got = restore(tmp_path, 5)
    assert step == 5 and all(same(got[n], v) for n, v in values_at(5).items())
    assert verify_checkpoint(path) == []


@pytest.mark.parametrize(
    ("attr", "value", "message"),
    [
        ("dtm_format", "something else", "not a dtm dtm-checkpoint-data file"),
        (
            "format_version",
            1,
            "checkpoint format version 1 is not supported (this reads version 2)",
        ),
        (
            "format_version",
            "two",
            "checkpoint format version 'two' is not supported (this reads version 2)",
        ),
    ],
    ids=["format", "version 1", "not a number"],
)
def test_a_data_file_of_another_format_is_an_integrity_error_naming_it(
    tmp_path: Path, attr: str, value: Any, message: str
) -> None:
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    with h5py.File(path / DATA, "r+") as f:
        f.attrs[attr] = value
    s = store_at(tmp_path)
    with pytest.raises(StorageError) as info:
        s.restore(MESH, TENSORS)
    e = info.value
    assert (type(e).__name__, getattr(e, "file", None)) == ("IntegrityError", str(path / DATA)), (
        str(e)
    )
    assert message in str(e), str(e)
    assert s.restore(MESH, TENSORS, fallback=True).step == 1
    s.close()
    problems = verify_checkpoint(path)
    assert problems and all(p.file == str(path / DATA) and message in str(p) for p in problems), [
        str(p) for p in problems
    ]
