"""``dtm ckpt ls|inspect|verify|rm`` and ``dtm store ls|get|put`` through the console entry
point (:func:`dtm_mpi.cli.run`), in one process, on stores saved with
:class:`~dtm_mpi.io.checkpoint.CheckpointStore` on ``MPI.COMM_SELF``: uneven shapes of several
dtypes, a derived and an ephemeral artifact, small chunks (several per shard). A checkpoint is
the directory ``ckpt-N/`` of ``checkpoint.h5`` and (one rank) ``data-000000.h5``."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.cli import main
from dtm_mpi.errors import UsageError
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_files import MAIN_FILE, read_manifest, verify_checkpoint
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.manifest import ArtifactClass
from dtm_mpi.io.store import committed_name, disk_usage, list_checkpoints, read_latest, tree_bytes
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.mesh import MeshShape
from tests.io.io_helpers import flip_byte, random_value
from tests.test_cli_run import dtm, one_line_error

MESH = MeshShape((("x", 1),))
R = Layout.replicated
TENSORS: list[tuple[str, TensorType, ArtifactClass, str | None, str | None]] = [
    ("w", TensorType(DType.F32, (10, 7), Layout((("x",), ()))), ArtifactClass.PRIMARY, None, None),
    ("v", TensorType(DType.F64, (5,), R(1)), ArtifactClass.PRIMARY, None, None),
    (
        "m",
        TensorType(DType.F16, (3, 1, 4), Layout(((), (), ("x",)))),
        ArtifactClass.PRIMARY,
        None,
        None,
    ),
    ("step_count", TensorType(DType.I64, (), R(0)), ArtifactClass.PRIMARY, None, None),
    ("mask", TensorType(DType.BOOL, (6, 2), R(2)), ArtifactClass.PRIMARY, None, None),
    ("w16", TensorType(DType.F16, (10, 7), R(2)), ArtifactClass.DERIVED, "w", "cast:f16"),
    ("scratch", TensorType(DType.F32, (4, 4), R(2)), ArtifactClass.EPHEMERAL, None, None),
]
STORED = [n for n, _, c, _, _ in TENSORS if c is not ArtifactClass.EPHEMERAL]
DATA = "data-000000.h5"  # one rank: one data file


def value(name: str, t: TensorType, step: int) -> np.ndarray:
    return random_value(t, np.random.default_rng(zlib.crc32(f"{name}/{step}".encode())))


def values_at(step: int) -> dict[str, np.ndarray]:
    out = {n: value(n, t, step) for n, t, c, _, _ in TENSORS if c is not ArtifactClass.EPHEMERAL}
    out["w16"] = out["w"].astype(np.float16)
    return out


def make_store(path: Path, steps: tuple[int, ...] = (1, 2), **kw: Any) -> Path:
    store = CheckpointStore(path, comm(), chunk_bytes=64, **kw)
    for step in steps:
        vals = values_at(step)
        items = [(TensorSpec(n, t, c, p, r), vals.get(n)) for n, t, c, p, r in TENSORS]
        store.save(step, MESH, items, module_hash="ab" * 32)
    store.close()
    return path


def comm() -> Any:
    from mpi4py import MPI

    return MPI.COMM_SELF


def serial_only() -> None:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("dtm store put is a serial tool (refused under a multi-rank mpirun)")


def restore_all(path: Path, step: int | None = None) -> dict[str, np.ndarray]:
    m = read_manifest(path / committed_name(step if step is not None else read_latest(path) or 0))
    targets = [
        (a.name, TensorType(a.dtype, a.shape, R(len(a.shape))))
        for a in m.artifacts
        if a.dataset is not None
    ]
    store = CheckpointStore(path, comm())
    try:
        return store.restore(MESH, targets, step=step).values
    finally:
        store.close()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- dtm ckpt ls ------------------------------------------------------------------------------


def test_ckpt_ls_shows_committed_latest_and_incomplete(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = make_store(tmp_path / "s", keep_last=4)
    shutil.copytree(store / committed_name(2), store / "ckpt-00000009.partial-abcd")
    code, out, err = dtm(capsys, "ckpt", "ls", str(store))
    assert code == 0, err
    lines = out.splitlines()
    usage = sum(
        tree_bytes(store / n)
        for n in (committed_name(1), committed_name(2), "ckpt-00000009.partial-abcd")
    )
    assert disk_usage(store) == usage
    assert (
        f"store {store}: quota none, keep_last 4, {usage} bytes in use by 3 checkpoint(s)"
        in lines[0]
    )
    rows = {ln.split()[0]: ln for ln in lines[2:] if ln.split() and ln.split()[0].isdigit()}
    m = read_manifest(store / committed_name(1))
    size = tree_bytes(store / committed_name(1))  # the whole directory
    assert size == sum(p.stat().st_size for p in (store / committed_name(1)).iterdir())
    assert rows["1"].split() == [
        "1",
        "committed",
        committed_name(1),
        str(size),
        "6",
        str(m.data_bytes),
        "x=1",
    ]
    assert rows["2"].split()[:4] == ["2", "committed,", "latest", committed_name(2)]
    assert rows["9"].split()[:3] == ["9", "INCOMPLETE", "ckpt-00000009.partial-abcd"]
    assert rows["9"].split()[4:] == ["-", "-", "-"]
    assert (
        "ckpt-00000009.partial-abcd: INCOMPLETE: a save in progress, cancelled or killed; not loadable"
        in out
    )
    assert (store / "latest").read_text() == committed_name(2) + "\n"
    # without the pointer, latest is the newest committed checkpoint (what a restore loads)
    (store / "latest").unlink()
    out = dtm(capsys, "ckpt", "ls", str(store))[1]
    assert f"{committed_name(2)}: latest because the 'latest' pointer is missing" in out


def test_ckpt_ls_shows_an_invalid_manifest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = make_store(tmp_path / "s", quota_bytes=10**9)
    flip_byte(store / committed_name(1) / MAIN_FILE, "/manifest", 40)
    code, out, err = dtm(capsys, "ckpt", "ls", str(store))
    assert code == 0, err
    assert "quota 1000000000 bytes" in out
    row = next(ln for ln in out.splitlines() if ln.split()[0] == "1")
    assert row.split()[1:3] == ["INVALID", committed_name(1)] and row.split()[4:] == ["-"] * 3
    note = next(ln for ln in out.splitlines() if ln.startswith(f"{committed_name(1)}: INVALID: "))
    assert "manifest hash mismatch" in note or "JSON" in note, note
    assert str(store) not in note, f"the checkpoint is named once, at the start: {note}"
    # the invalid one fails verify (exit 1); the latest still verifies
    code, out, _ = dtm(capsys, "ckpt", "verify", str(store), "--step", "1")
    assert code == 1 and out.startswith(f"INVALID {store / committed_name(1)}: "), out
    assert out.count(str(store)) == 1, f"the checkpoint is named once: {out}"
    assert dtm(capsys, "ckpt", "verify", str(store))[0] == 0


def test_ckpt_ls_empty_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = dtm(capsys, "ckpt", "ls", str(tmp_path))
    assert code == 0, err
    assert "no store.json" in out and "0 bytes in use" in out and "no checkpoints" in out


# --- dtm ckpt inspect -------------------------------------------------------------------------


def test_ckpt_inspect_text_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = make_store(tmp_path / "s")
    code, out, err = dtm(capsys, "ckpt", "inspect", str(store))
    assert code == 0, err
    m = read_manifest(store / committed_name(2))
    assert f"checkpoint {store / committed_name(2)}" in out
    assert "step          2" in out and "mesh          x=1" in out
    assert f"module hash   {'ab' * 32}" in out and f"merkle root   {m.merkle_root}" in out
    assert f"manifest hash {m.to_json()['manifest_hash']}" in out
    assert "data files    1 (data-000000.h5)" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[9:]}
    assert rows["w"][:7] == ["w", "primary", "active", "f32", "[10,7]", "{x,-}", "1"]
    assert rows["w"][7] == "280" and rows["w"][8] == m.artifact("w").merkle_root[:12]
    assert rows["step_count"][:5] == ["step_count", "primary", "active", "i64", "[]"]
    assert rows["m"][3:6] == ["f16", "[3,1,4]", "{-,-,x}"]
    assert rows["w16"][1] == "derived" and rows["w16"][-2:] == ["w", "(cast:f16)"]
    assert rows["scratch"][1] == "ephemeral" and rows["scratch"][6:9] == ["0", "0", "-"]

    code, out, err = dtm(capsys, "ckpt", "inspect", str(store), "--step", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc == read_manifest(store / committed_name(1)).to_json()
    assert doc["step"] == 1 and [a["name"] for a in doc["artifacts"]] == [t[0] for t in TENSORS]


# --- dtm ckpt verify --------------------------------------------------------------------------


def test_ckpt_verify_ok_then_a_flipped_byte(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = make_store(tmp_path / "s")
    latest = store / committed_name(2)
    m = read_manifest(latest)
    code, out, err = dtm(capsys, "ckpt", "verify", str(store))
    assert code == 0, err
    assert out == f"ok {latest}: 6 tensors, {m.data_bytes} bytes verified\n"

    flip_byte(
        latest / DATA, "/shards/w/0", 4 * 7 * 6 + 3
    )  # row 6 of 10; 2 rows of 28 bytes per 64-byte chunk
    code, out, err = dtm(capsys, "ckpt", "verify", str(store))
    assert code == 1
    assert out.startswith(f"DAMAGED {latest / DATA}: tensor 'w' shard 'w:shard:0': chunk 3 "), out
    assert len(out.splitlines()) == 1 and "1 problem(s)" in err
    assert dtm(capsys, "ckpt", "verify", str(store), "--step", "1")[0] == 0
    code, out, _ = dtm(capsys, "ckpt", "verify", str(store), "--all")
    assert code == 1
    assert f"ok {store / committed_name(1)}" in out and "DAMAGED" in out


def test_ckpt_verify_all_counts_incomplete_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = make_store(tmp_path / "s")
    assert dtm(capsys, "ckpt", "verify", str(store), "--all")[0] == 0
    shutil.copytree(store / committed_name(2), store / "ckpt-00000003.partial-0f")
    code, out, _ = dtm(capsys, "ckpt", "verify", str(store), "--all")
    assert code == 1 and f"INCOMPLETE {store / 'ckpt-00000003.partial-0f'}" in out
    assert dtm(capsys, "ckpt", "verify", str(store))[0] == 0  # latest only


# --- dtm ckpt rm ------------------------------------------------------------------------------


def test_ckpt_rm(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = make_store(tmp_path / "s", steps=(1, 2, 3))
    shutil.copytree(store / committed_name(3), store / "ckpt-00000004.partial-ab")
    pointer = store / "latest"

    code, _, err = dtm(capsys, "ckpt", "rm", str(store), "--step", "3")
    assert code == 2 and "--force" in one_line_error(err) and "latest" in err
    assert (store / committed_name(3)).exists()

    code, out, err = dtm(capsys, "ckpt", "rm", str(store), "--step", "1")
    assert code == 0, err
    assert (
        not (store / committed_name(1)).exists() and pointer.read_text() == committed_name(3) + "\n"
    )

    code, out, err = dtm(capsys, "ckpt", "rm", str(store), "--step", "3", "--force")
    assert code == 0, err
    assert "'latest' names checkpoint 2" in out
    assert pointer.read_text() == committed_name(2) + "\n" and read_latest(store) == 2
    assert not (store / committed_name(3)).exists()
    assert same(restore_all(store)["w"], values_at(2)["w"])

    code, out, err = dtm(capsys, "ckpt", "rm", str(store), "--partial")
    assert code == 0, err
    assert [e.path.name for e in list_checkpoints(store)] == [committed_name(2)]
    assert "no incomplete" in dtm(capsys, "ckpt", "rm", str(store), "--partial")[1]

    code, out, err = dtm(capsys, "ckpt", "rm", str(store), "--step", "2", "--force")
    assert code == 0 and "no checkpoint remains" in out, err
    assert not pointer.exists() and list_checkpoints(store) == []

    code, _, err = dtm(capsys, "ckpt", "rm", str(store), "--step", "7")
    assert code == 2 and "no committed checkpoint 7" in one_line_error(err)


# --- dtm store ls / get -----------------------------------------------------------------------


def test_store_ls(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = make_store(tmp_path / "s")
    code, out, err = dtm(capsys, "store", "ls", str(store), "--step", "1")
    assert code == 0, err
    assert out.splitlines()[0] == f"checkpoint {store / committed_name(1)} (step 1): 7 tensor(s)"
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:]}
    assert rows["w"] == ["w", "primary", "active", "f32", "[10,7]", "280"]
    assert rows["v"] == ["v", "primary", "active", "f64", "[5]", "40"]
    assert rows["m"] == ["m", "primary", "active", "f16", "[3,1,4]", "24"]
    assert rows["step_count"] == ["step_count", "primary", "active", "i64", "[]", "8"]
    assert rows["mask"] == ["mask", "primary", "active", "bool", "[6,2]", "12"]
    assert rows["w16"] == ["w16", "derived", "active", "f16", "[10,7]", "140", "w", "(cast:f16)"]
    assert rows["scratch"] == ["scratch", "ephemeral", "active", "f32", "[4,4]", "-"]


def test_store_get_is_bit_exact(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = make_store(tmp_path / "s")
    for step in (None, 1):
        want = values_at(step or 2)
        for name in STORED:
            out_file = tmp_path / f"{name}-{step}.npy"
            argv = ["store", "get", str(store), name, "-o", str(out_file)]
            code, out, err = dtm(capsys, *argv, *(["--step", str(step)] if step else []))
            assert code == 0, err
            assert f"wrote {out_file}: tensor {name!r} of step {step or 2}" in out
            got = np.load(out_file)
            assert same(got, want[name]), name
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_store_get_bf16_writes_the_stored_representation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import h5py

    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001, 0x4049], dtype=np.uint16)
    src = tmp_path / "b.npy"
    np.save(src, bits)
    (tmp_path / "s").mkdir()
    serial_only()
    code, out, err = dtm(capsys, "store", "put", str(tmp_path / "s"), "b", str(src))
    assert code == 0, err
    assert "added 'b': bf16[5]" in out
    path = tmp_path / "s" / committed_name(0)
    with h5py.File(path / MAIN_FILE, "r") as f:  # through the virtual dataset
        stored = f["/tensors/b"][()]
    with h5py.File(path / DATA, "r") as f:
        assert same(f["/shards/b/0"][()], stored)
    code, out, err = dtm(
        capsys, "store", "get", str(tmp_path / "s"), "b", "-o", str(tmp_path / "o.npy")
    )
    assert code == 0, err
    got = np.load(tmp_path / "o.npy")
    assert same(got, stored) and f"bf16 is stored as {stored.dtype}" in out
    # whichever way it is stored, the values are the bf16 numbers of the bits put in
    as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    if got.dtype == np.uint16:
        assert same(got, bits)
    else:
        assert same(got, as_f32)


def test_store_get_a_damaged_chunk_is_an_integrity_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = make_store(tmp_path / "s")
    path = store / committed_name(2)
    flip_byte(path / DATA, "/shards/v/0", 33, 0x01)  # element 4 of 5
    target = tmp_path / "v.npy"
    code, _, err = dtm(capsys, "store", "get", str(store), "v", "-o", str(target))
    line = one_line_error(err)
    assert code == 1
    assert f"{path / DATA}: tensor 'v' shard 'v:shard:0': chunk 0 (rows 0..4)" in line, line
    assert not target.exists() and list(tmp_path.iterdir()) == [store]
    # the other tensors still read
    assert dtm(capsys, "store", "get", str(store), "w", "-o", str(target))[0] == 0


def test_store_get_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = make_store(tmp_path / "s", steps=(1,))
    out_file = str(tmp_path / "x.npy")
    cases = [
        (["store", "get", str(store), "nope", "-o", out_file], "no tensor 'nope'"),
        (["store", "get", str(store), "scratch", "-o", out_file], "ephemeral"),
        (["store", "get", str(store), "w", "-o", str(tmp_path / "x.npz")], "use a .npy"),
        (
            ["store", "get", str(store), "w", "-o", str(tmp_path / "no" / "x.npy")],
            "does not exist",
        ),
        (
            ["store", "get", str(store), "w", "-o", out_file, "--step", "5"],
            "no committed checkpoint 5",
        ),
        (["store", "get", str(tmp_path / "none"), "w", "-o", out_file], "does not exist"),
        (["store", "get", str(store), "w"], "required: -o"),
    ]
    for argv, want in cases:
        code, _, err = dtm(capsys, *argv)
        assert code == 2 and want in one_line_error(err), (argv, err)


# --- dtm store put ----------------------------------------------------------------------------


def test_store_put_replaces_copy_on_write(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    serial_only()
    store = make_store(tmp_path / "s")
    old = store / committed_name(2)
    old_bytes = {p.name: p.read_bytes() for p in old.iterdir()}
    new_w = np.arange(70, dtype=np.float32).reshape(10, 7) / 7
    np.save(tmp_path / "w.npy", new_w)
    code, out, err = dtm(capsys, "store", "put", str(store), "w", str(tmp_path / "w.npy"))
    assert code == 0, err
    assert (
        f"wrote {store / committed_name(3)}: step 3, 7 tensor(s) (copy of step 2); replaced 'w': f32[10,7], primary"
        in out
    )
    assert read_latest(store) == 3
    assert {p.name: p.read_bytes() for p in old.iterdir()} == old_bytes  # the old one is untouched
    assert verify_checkpoint(store / committed_name(3)) == []

    m = read_manifest(store / committed_name(3))
    old = read_manifest(store / committed_name(2))
    assert m.names == old.names and m.module_hash == old.module_hash and m.chunk_bytes == 64
    for a, b in zip(m.artifacts, old.artifacts, strict=True):
        assert (a.cls, a.parent, a.rebuild, a.dtype, a.shape) == (
            b.cls,
            b.parent,
            b.rebuild,
            b.dtype,
            b.shape,
        )
        assert (a.dataset is None) == (b.cls is ArtifactClass.EPHEMERAL)
    got, before = restore_all(store), values_at(2)
    assert same(got["w"], new_w)
    assert same(got["w16"], new_w.astype(np.float16))  # derived from w: rebuilt, not stale
    assert "rebuilt from the new value: w16 (derived)" in out
    for name in STORED:
        if name not in ("w", "w16"):
            assert same(got[name], before[name]), name
    assert same(restore_all(store, step=2)["w"], before["w"])


def test_store_put_adds_a_tensor_with_its_class(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    serial_only()
    store = make_store(tmp_path / "s", steps=(1,))
    extra = np.arange(12, dtype=">i4").reshape(4, 3)  # big-endian in the file: stored native
    np.save(tmp_path / "extra.npy", extra)
    argv = ["store", "put", str(store), "extra", str(tmp_path / "extra.npy"), "--step", "10"]
    code, out, err = dtm(capsys, *argv, "--class", "derived", "--parent", "w", "--rebuild", "copy")
    assert code == 0, err
    assert "added 'extra': i32[4,3], derived" in out
    m = read_manifest(store / committed_name(10))
    a = m.artifact("extra")
    assert (a.cls, a.parent, a.rebuild, a.dtype) == (ArtifactClass.DERIVED, "w", "copy", DType.I32)
    assert m.names[-1] == "extra" and len(m.names) == len(TENSORS) + 1
    got = restore_all(store)
    assert same(got["extra"], extra.astype(np.int32))
    assert same(got["mask"], values_at(1)["mask"])
    assert [e.step for e in list_checkpoints(store)] == [1, 10]

    # replacing it without --class keeps its class, parent and rebuild
    np.save(tmp_path / "extra.npy", extra[:2])
    code, out, err = dtm(capsys, "store", "put", str(store), "extra", str(tmp_path / "extra.npy"))
    assert code == 0, err
    assert "step 11" in out and "replaced 'extra': i32[2,3], derived" in out
    assert read_manifest(store / committed_name(11)).artifact("extra").parent == "w"


def test_store_put_into_an_empty_store_and_retention(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    serial_only()
    store = tmp_path / "s"
    CheckpointStore(store, comm(), keep_last=2).close()
    for k in range(3):
        np.save(tmp_path / "x.npy", np.full((3,), k, dtype=np.float64))
        code, out, err = dtm(capsys, "store", "put", str(store), "x", str(tmp_path / "x.npy"))
        assert code == 0, err
        assert f"step {k}," in out
        assert ("first checkpoint of the store" in out) == (k == 0), out
    assert [e.step for e in list_checkpoints(store)] == [1, 2]  # keep_last=2 applied
    assert same(restore_all(store)["x"], np.full((3,), 2, dtype=np.float64))


def test_store_put_respects_the_quota(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    serial_only()
    store = make_store(tmp_path / "s", steps=(1,))
    CheckpointStore(store, comm(), quota_bytes=disk_usage(store) + 1000).close()
    np.save(tmp_path / "x.npy", np.zeros(8, np.float32))
    code, _, err = dtm(capsys, "store", "put", str(store), "x", str(tmp_path / "x.npy"))
    assert code == 1 and "quota" in one_line_error(err)
    assert [e.step for e in list_checkpoints(store)] == [1]


def test_store_put_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    serial_only()
    store = make_store(tmp_path / "s", steps=(1, 2))
    good = tmp_path / "g.npy"
    np.save(good, np.zeros((2, 2), np.float32))
    np.save(tmp_path / "c.npy", np.zeros(3, np.complex64))
    np.save(tmp_path / "u.npy", np.zeros(3, np.uint32))
    put = ["store", "put", str(store)]
    cases = [
        ([*put, "y", str(tmp_path / "c.npy")], "dtype complex64 is not a dtm dtype"),
        ([*put, "y", str(tmp_path / "u.npy")], "dtype uint32 is not a dtm dtype"),
        ([*put, "y", str(tmp_path / "none.npy")], "does not exist"),
        ([*put, "y", str(good), "--step", "2"], "must be newer than every committed checkpoint"),
        ([*put, "y", str(good), "--step", "-1"], "--step must be >= 0"),
        ([*put, "y", str(good), "--class", "derived"], "needs --parent and --rebuild"),
        ([*put, "y", str(good), "--class", "primary", "--parent", "w"], "derived only"),
        ([*put, "y", str(good), "--parent", "nope", "--rebuild", "copy"], "parent 'nope'"),
        ([*put, "y", str(good), "--parent", "scratch", "--rebuild", "copy"], "parent 'scratch'"),
        ([*put, "y", str(good), "--parent", "y", "--rebuild", "copy"], "parent 'y'"),
        ([*put, "bad name", str(good)], "stored tensor name"),
        ([*put, "y", str(good), "--class", "ephemeral"], "invalid choice"),
        (["store", "put", str(tmp_path / "none"), "y", str(good)], "does not exist"),
    ]
    for argv, want in cases:
        code, _, err = dtm(capsys, *argv)
        assert code == 2 and want in one_line_error(err), (argv, err)
    assert [e.step for e in list_checkpoints(store)] == [1, 2]


# --- usage ------------------------------------------------------------------------------------


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = make_store(tmp_path / "s", steps=(1,))
    missing = str(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    cases = [
        (["ckpt"], "required: ACTION"),
        (["store"], "required: ACTION"),
        (["ckpt", "ls", missing], f"store {missing} does not exist"),
        (["ckpt", "ls", str(tmp_path / "file")], "is not a directory"),
        (["ckpt", "inspect", missing], "does not exist"),
        (["ckpt", "inspect", str(store), "--step", "3"], "no committed checkpoint 3 (it has: 1)"),
        (["ckpt", "verify", missing], "does not exist"),
        (["ckpt", "verify", str(store), "--step", "1", "--all"], "not allowed with"),
        (["ckpt", "rm", str(store)], "one of the arguments --step --partial is required"),
        (["ckpt", "rm", str(store), "--step", "1", "--partial"], "not allowed with"),
        (["ckpt", "rm", missing, "--partial"], "does not exist"),
        (["store", "ls", missing], "does not exist"),
        (["store", "ls", str(store), "--step", "x"], "invalid int value"),
    ]
    for argv, want in cases:
        code, _, err = dtm(capsys, *argv)
        assert code == 2 and want in one_line_error(err), (argv, err)
    with pytest.raises(UsageError, match="does not exist"):
        main(["ckpt", "ls", missing])


def test_an_empty_store_has_no_latest(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv in (["ckpt", "inspect"], ["ckpt", "verify"], ["store", "ls"]):
        code, _, err = dtm(capsys, *argv, str(tmp_path))
        assert code == 1 and f"store {tmp_path} has no committed checkpoint" in one_line_error(err)
    assert dtm(capsys, "ckpt", "verify", str(tmp_path), "--all")[0] == 0
