"""The storage seam (:mod:`dtm_mpi.io.backend`): the checkpoint protocol (manifest, content
hashes, agreement, commit, retention, restore with verification) and the store tools run
unchanged over another shard format, selected by name. The toy backend of
``tests/io/npy_backend.py`` (registered as ``npy-toy`` when imported) stores each shard as a
``.npy`` file and the manifest as plain bytes in ``index.bin`` -- no HDF5 anywhere in the
checkpoint -- and a save, a restore, keep-last-K, the detection of a flipped data byte (naming
tensor, shard and file), ``dtm ckpt``/``dtm store`` and a process that never imports h5py
all work through it. A store records its backend's name in ``store.json`` and is opened by
it again; a store that records none is HDF5; an unknown name is one clear error.

Single process, the self communicator, a one-rank mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.errors import IntegrityError, StorageError, UsageError
from dtm_mpi.io.backend import (
    BACKENDS,
    HDF5,
    ShardBackend,
    parse_backend_name,
    parse_optional_backend_name,
    register_backend,
)
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.store import committed_name, list_checkpoints, read_latest, read_meta
from dtm_mpi.io.tools import (
    CheckStatus,
    put_tensor,
    read_manifest,
    read_tensor,
    remove_checkpoint,
    remove_incomplete,
    store_backend,
    verify_checkpoints,
    verify_isolated,
)
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.mesh import MeshShape
from tests.io.io_helpers import random_value
from tests.io.npy_backend import INDEX, NAME, NPY, NpyBackend, npy_path
from tests.test_cli_run import dtm, one_line_error

ROOT = Path(__file__).resolve().parents[2]
MESH = MeshShape((("x", 1),))
TENSORS = [
    ("w", TensorType(DType.F32, (10, 7), Layout.replicated(2))),
    ("b", TensorType(DType.I64, (5,), Layout.replicated(1))),
    ("s", TensorType(DType.F64, (), Layout(()))),
]
DATA = "data-000000.h5"  # the name the manifest gives data file 0, whatever the format


def _comm() -> Any:
    from mpi4py import MPI

    return MPI.COMM_SELF


def _values(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {name: random_value(t, rng) for name, t in TENSORS}


def _store(path: Path, **kw: Any) -> CheckpointStore:
    return CheckpointStore(path, _comm(), timeout_s=30, chunk_bytes=32, **kw)


def _save(store: CheckpointStore, step: int) -> Path:
    vals = _values(step)
    return store.save(step, MESH, [(TensorSpec(n, t), vals[n]) for n, t in TENSORS])


def _toy_store(path: Path, steps: tuple[int, ...] = (1,), **kw: Any) -> Path:
    store = _store(path, backend=NAME, **kw)
    try:
        for step in steps:
            _save(store, step)
    finally:
        store.close()
    return path


def _same(got: dict[str, np.ndarray], step: int) -> bool:
    want = _values(step)
    return got.keys() == want.keys() and all(got[n].tobytes() == want[n].tobytes() for n in want)


def test_the_protocol_runs_over_another_format(tmp_path: Path) -> None:
    NPY.calls.clear()
    typed: ShardBackend = NpyBackend()  # the protocol, structurally
    assert typed.index_path(tmp_path) == tmp_path / INDEX
    store = _store(tmp_path / "s", keep_last=2, backend=NAME)
    try:
        assert store.backend is NPY
        for step in (1, 2, 3):
            _save(store, step)
        assert _same(store.restore(MESH, TENSORS).values, 3)
    finally:
        store.close()
    assert [e.step for e in list_checkpoints(tmp_path / "s")] == [2, 3]  # keep-last-2
    ckpt = tmp_path / "s" / committed_name(3)
    assert sorted(p.name for p in ckpt.iterdir()) == [DATA, INDEX]  # exactly what it wrote
    assert not (ckpt / INDEX).read_bytes().startswith(b"\x89HDF"), "not an HDF5 file"
    assert sorted(p.name for p in (ckpt / DATA).iterdir()) == [
        "shards__b__0.npy",
        "shards__s__0.npy",
        "shards__w__0.npy",
    ]
    assert {"open_writer", "write_index", "read_index", "open_reader", "remove"} <= set(NPY.calls)
    assert NPY.data_files(ckpt) == [ckpt / DATA]


def test_a_flipped_byte_is_found_through_another_format(tmp_path: Path) -> None:
    store = _store(tmp_path / "s", backend=NAME)
    try:
        path = _save(store, 1)
        npy = npy_path(path / DATA, "/shards/w/0")
        data = bytearray(npy.read_bytes())
        data[-5] ^= 0x10  # the last row of w: its last chunk
        npy.write_bytes(bytes(data))
        with pytest.raises(IntegrityError) as info:
            store.restore(MESH, TENSORS)
        e = info.value
        assert (e.tensor, e.shard, e.file) == ("w", "w:shard:0", str(path / DATA))
    finally:
        store.close()


def test_the_default_backend_is_parallel_hdf5(tmp_path: Path) -> None:
    store = _store(tmp_path / "s")
    try:
        assert store.backend is HDF5 and BACKENDS["hdf5"] is HDF5
        path = _save(store, 1)
    finally:
        store.close()
    assert json.loads((tmp_path / "s" / "store.json").read_text())["backend"] == "hdf5"
    assert HDF5.index_path(path) == path / "checkpoint.h5"
    assert (path / "checkpoint.h5").read_bytes().startswith(b"\x89HDF\r\n\x1a\n")
    assert HDF5.data_files(path) == [path / DATA]
    assert HDF5.format_name == "HDF5" and isinstance(HDF5.parallel, bool)
    assert HDF5.describe().startswith("h5py ") and "HDF5 " in HDF5.describe()


def test_the_store_records_its_backend_and_is_opened_by_that_name(tmp_path: Path) -> None:
    path = _toy_store(tmp_path / "s")
    assert json.loads((path / "store.json").read_text())["backend"] == NAME
    meta = read_meta(path)
    assert meta is not None and meta.backend == NAME
    again = _store(path)  # no backend named: the one the store records
    try:
        assert again.backend is NPY and again.meta.backend == NAME
        assert _same(again.restore(MESH, TENSORS).values, 1)
        _save(again, 2)
    finally:
        again.close()
    assert sorted(p.name for p in (path / committed_name(2)).iterdir()) == [DATA, INDEX]
    _store(path, keep_last=5, backend=NAME).close()  # new settings keep the backend
    doc = json.loads((path / "store.json").read_text())
    assert (doc["keep_last"], doc["backend"]) == (5, NAME)
    with pytest.raises(StorageError) as info:
        _store(path, backend="hdf5")
    assert (
        str(info.value)
        == f"store {path}: {path / 'store.json'} records storage backend {NAME!r}; it cannot be opened with backend 'hdf5'"
    )


def test_an_unknown_backend_is_one_clear_error_naming_the_store_and_the_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "new"
    with pytest.raises(StorageError) as info:
        _store(new, backend="zarr-x")
    text = str(info.value)
    assert (
        f"store {new}: its storage backend 'zarr-x' is not registered in this process (registered: 'hdf5', {NAME!r}"
        in text
    ), text
    assert not new.exists(), "nothing is recorded for a backend this process does not have"

    path = _toy_store(tmp_path / "s")
    doc = json.loads((path / "store.json").read_text())
    (path / "store.json").write_text(json.dumps({**doc, "backend": "zarr-x"}))
    want = f"store {path}: its storage backend 'zarr-x' is not registered in this process"
    with pytest.raises(StorageError, match=want):
        store_backend(path)
    with pytest.raises(StorageError, match=want):
        _store(path)
    for argv in (["ckpt", "ls"], ["ckpt", "verify"], ["store", "ls"], ["ckpt", "rm", "--partial"]):
        code, _, err = dtm(capsys, *argv, str(path))
        assert code == 1 and want in one_line_error(err), (argv, err)

    for bad in (3, "", None, ["hdf5"]):
        (path / "store.json").write_text(json.dumps({**doc, "backend": bad}))
        with pytest.raises(
            StorageError,
            match="not a dtm store settings file \\(backend is the name of a storage backend",
        ):
            store_backend(path)


def test_a_store_that_records_no_backend_is_hdf5(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = _store(path)
    _save(store, 1)
    store.close()
    doc = json.loads((path / "store.json").read_text())
    del doc["backend"]  # as every store.json before the field
    (path / "store.json").write_text(json.dumps(doc))
    meta = read_meta(path)
    assert meta is not None and meta.backend == "hdf5"
    assert store_backend(path) is HDF5
    again = _store(path)
    try:
        assert again.backend is HDF5
        assert _same(again.restore(MESH, TENSORS).values, 1)
    finally:
        again.close()
    with pytest.raises(
        StorageError,
        match=f"records storage backend 'hdf5'; it cannot be opened with backend {NAME!r}",
    ):
        _store(path, backend=NAME)
    (path / "store.json").unlink()  # no store.json at all: its checkpoints are HDF5's too
    assert store_backend(path) is HDF5
    with pytest.raises(StorageError) as info:
        _store(path, backend=NAME)
    assert (
        str(info.value)
        == f"store {path}: it holds checkpoints but no store.json: they are stored with backend 'hdf5'; it cannot be opened with backend {NAME!r}"
    )
    assert not (path / "store.json").exists()


def test_the_store_tools_go_through_the_recorded_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dtm_mpi.io.tools as tools

    monkeypatch.setattr(tools, "_in_mpi", lambda: False)  # a fork
    path = _toy_store(tmp_path / "s", (1, 2))
    ckpt = path / committed_name(2)
    assert [c.status for c in verify_checkpoints(path, every=True, timeout_s=60)] == [
        CheckStatus.OK
    ] * 2
    assert read_manifest(ckpt).step == 2
    assert read_tensor(ckpt, "w").tobytes() == _values(2)["w"].tobytes()

    code, out, _ = dtm(capsys, "ckpt", "ls", str(path))
    assert code == 0 and f"2 checkpoint(s), backend {NAME}" in out.splitlines()[0], out
    code, out, _ = dtm(capsys, "ckpt", "inspect", str(path), "--json")
    assert code == 0 and json.loads(out) == read_manifest(ckpt).to_json()
    code, out, _ = dtm(capsys, "store", "get", str(path), "b", "-o", str(tmp_path / "b.npy"))
    assert code == 0 and np.load(tmp_path / "b.npy").tobytes() == _values(2)["b"].tobytes()

    extra = np.arange(6, dtype=np.float64)
    r = put_tensor(path, _comm(), "extra", extra)
    assert (r.step, r.base) == (3, 2)
    assert sorted(p.name for p in r.path.iterdir()) == [DATA, INDEX]
    assert read_tensor(r.path, "extra").tobytes() == extra.tobytes()
    assert read_tensor(r.path, "w").tobytes() == _values(2)["w"].tobytes()

    npy = npy_path(ckpt / DATA, "/shards/b/0")
    data = bytearray(npy.read_bytes())
    data[-1] ^= 0x01
    npy.write_bytes(bytes(data))
    got = verify_isolated(ckpt, timeout_s=60)
    assert got.status is CheckStatus.DAMAGED and len(got.problems) == 1, got
    assert got.problems[0].startswith(f"{ckpt / DATA}: tensor 'b' shard 'b:shard:0': chunk "), got
    with pytest.raises(IntegrityError, match="content hash"):
        read_tensor(ckpt, "b")

    NPY.calls.clear()
    (path / "ckpt-00000009.partial-00c0ffee").mkdir()
    assert remove_incomplete(path) == [path / "ckpt-00000009.partial-00c0ffee"]
    assert remove_checkpoint(path, 1)[0] == path / committed_name(1)
    assert NPY.calls.count("remove") == 2
    assert [e.step for e in list_checkpoints(path)] == [2, 3] and read_latest(path) == 3


def test_a_spawned_verification_child_finds_the_backend_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a process that initialised MPI the verification child is a new interpreter: it
    imports the module of the store's backend and finds it under the name the store records."""
    import dtm_mpi.io.tools as tools

    monkeypatch.setattr(tools, "_in_mpi", lambda: True)
    ckpt = _toy_store(tmp_path / "s") / committed_name(1)
    assert verify_isolated(ckpt, timeout_s=60).status is CheckStatus.OK
    (ckpt / DATA / "shards__s__0.npy").unlink()
    got = verify_isolated(ckpt, timeout_s=60)
    assert got.status is CheckStatus.DAMAGED and got.problems == (
        f"{npy_path(ckpt / DATA, '/shards/s/0')}: tensor 's' shard 's:shard:0': shard file is missing",
    ), got


def test_registering_a_backend() -> None:
    assert parse_optional_backend_name(NAME) is NPY and parse_backend_name(NAME, "here") is NPY
    assert parse_optional_backend_name("nope") is None
    with pytest.raises(
        StorageError, match="store here: its storage backend 'nope' is not registered"
    ):
        parse_backend_name("nope", "here")
    register_backend(NAME, NPY)  # the same again: nothing changes
    assert BACKENDS[NAME] is NPY
    with pytest.raises(
        UsageError, match=f"storage backend name {NAME!r} is taken \\(by NpyBackend\\)"
    ):
        register_backend(NAME, NpyBackend())
    with pytest.raises(
        UsageError, match="storage backend name 'hdf5' is taken \\(by Hdf5Backend\\)"
    ):
        register_backend("hdf5", NPY)
    for bad in ("", "NPY", "1npy", "n p y", "x" * 65):
        with pytest.raises(UsageError, match="use lowercase letters, digits"):
            register_backend(bad, NpyBackend())
    assert set(BACKENDS) >= {"hdf5", NAME}


PLAIN_TOY_RUN = """\
import sys
import numpy as np
from mpi4py import MPI
from tests.io.npy_backend import NAME
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.tools import CheckStatus, read_tensor, verify_isolated
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.mesh import MeshShape

t = TensorType(DType.F32, (4, 3), Layout.replicated(2))
mesh = MeshShape((("x", 1),))
value = np.arange(12, dtype=np.float32).reshape(4, 3)
store = CheckpointStore(sys.argv[1], MPI.COMM_SELF, timeout_s=30, backend=NAME)
try:
    path = store.save(1, mesh, [(TensorSpec("w", t), value)])
    assert store.restore(mesh, [("w", t)]).values["w"].tobytes() == value.tobytes()
finally:
    store.close()
assert read_tensor(path, "w").tobytes() == value.tobytes()
assert verify_isolated(path, timeout_s=60).status is CheckStatus.OK  # (a spawned child: MPI is on)
print("h5py imported:", "h5py" in sys.modules)
"""


def test_a_store_of_another_backend_never_imports_h5py(tmp_path: Path) -> None:
    """Save, restore, read and verify through the toy backend in a fresh process: h5py is
    never imported (nothing outside the HDF5 backend needs it)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    out = subprocess.run(
        [sys.executable, "-c", PLAIN_TOY_RUN, str(tmp_path / "s")],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "h5py imported: False", out.stdout
