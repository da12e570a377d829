"""Checkpoints under real MPI and parallel HDF5: save on one mesh, restore on another
(1->4, 4->1, 2->3, 3->2, 2x2->4x1 and back, same mesh), uneven shapes, bit-identical; atomic
commit, latest pointer and retention; integrity errors naming tensor, shard and file; quota,
async save and cancel. Size-agnostic: a case whose meshes need more ranks than the job has is
skipped; the suite runs at 2, 3 and 4 ranks."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.errors import CancelledError, IntegrityError, QuotaError, StorageError
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.manifest import ArtifactClass
from dtm_mpi.io.plan import TensorSpec
from dtm_mpi.io.store import committed_name, list_checkpoints, read_latest, read_manifest
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape
from tests.io.io_helpers import flip_byte

pytestmark = pytest.mark.mpi(min_size=2)


def mesh_of(text: str) -> MeshShape:
    """ "4" -> x=4; "2x2" -> x=2,y=2; "4x1" -> x=4,y=1."""
    sizes = [int(s) for s in text.split("x")]
    return MeshShape(tuple(zip(("x", "y"), sizes, strict=False)))


def tensors(mesh: MeshShape, transposed: bool = False) -> list[tuple[str, TensorType]]:
    """Uneven shapes and several dtypes; layouts over the mesh's axes (swapped when
    ``transposed``, so the same tensors land differently on the same mesh)."""
    axes = mesh.axis_names
    a0 = axes[-1] if transposed else axes[0]
    a1 = axes[0] if transposed else axes[-1]
    both = tuple(reversed(axes)) if transposed else axes
    return [
        ("w", TensorType(DType.F32, (10, 7), Layout(((a0,), ())))),
        ("v", TensorType(DType.F64, (5,), Layout((both,)))),
        (
            "m",
            TensorType(
                DType.F16,
                (3, 1, 4),
                Layout(((), (), (a1,)) if len(axes) > 1 or transposed else ((a0,), (), ())),
            ),
        ),
        ("step_count", TensorType(DType.I64, (), Layout(()))),
        ("mask", TensorType(DType.BOOL, (6, 2), Layout(((), ())))),
        ("big", TensorType(DType.F32, (257, 33), Layout(((a1,), ())))),
    ]


def global_value(name: str, t: TensorType) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    from dtm_mpi.ir.ops._common import np_dtype

    dt = np_dtype(t.dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=t.shape).astype(bool)
    if dt.kind == "i":
        return rng.integers(-(2**40), 2**40, size=t.shape).astype(dt)
    return rng.standard_normal(size=t.shape).astype(dt)


VALUES = {name: global_value(name, t) for name, t in tensors(MeshShape((("x", 1),)))}


def block_at(name: str, t: TensorType, mesh: MeshShape, rank: int, step: int) -> np.ndarray:
    """The local block of tensor ``name`` as saved at ``step`` (floats shifted by the step)."""
    block = np.array(VALUES[name][local_block(t.shape, t.layout, mesh, rank)])
    return block + np.asarray(step, dtype=block.dtype) if block.dtype.kind == "f" else block


def sub(comm: Any, n: int) -> Any:
    """The first ``n`` ranks of ``comm`` (None on the others)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    got = comm.Split(0 if rank < n else MPI.UNDEFINED, rank)
    return None if got == MPI.COMM_NULL else got


def save_on(path: Path, comm: Any, mesh: MeshShape, step: int, transposed: bool = False, **kw: Any) -> None:  # fmt: skip
    c = sub(comm, mesh.size)
    if c is not None:
        store = CheckpointStore(path, c, timeout_s=60, **kw)
        rank = c.Get_rank()
        items = []
        for name, t in tensors(mesh, transposed):
            items.append((TensorSpec(name, t), block_at(name, t, mesh, rank, step)))
        store.save(step, mesh, items)
        store.close()
        c.Free()
    comm.Barrier()


def restore_on(path: Path, comm: Any, mesh: MeshShape, step: int | None, transposed: bool = False, all_ranks: Any = None, **kw: Any) -> None:  # fmt: skip
    c = sub(comm, mesh.size)
    ok, message = True, ""
    if c is not None:
        store = CheckpointStore(path, c, timeout_s=60)
        got = store.restore(mesh, tensors(mesh, transposed), step=step, **kw)
        rank = c.Get_rank()
        for name, t in tensors(mesh, transposed):
            want = block_at(name, t, mesh, rank, got.step)
            have = got.values[name]
            if have.shape != want.shape or have.dtype != want.dtype or have.tobytes() != want.tobytes():  # fmt: skip
                ok, message = False, f"rank {rank}: tensor {name} differs"
        store.close()
        c.Free()
    assert all_ranks is not None
    all_ranks(ok, message)


CASES = [("1", "4"), ("4", "1"), ("2", "3"), ("3", "2"), ("2x2", "4x1"), ("4x1", "2x2"),
         ("3", "3"), ("2", "2"), ("1", "2")]  # fmt: skip


@pytest.mark.parametrize(("src", "dst"), CASES, ids=[f"{a}->{b}" for a, b in CASES])
def test_save_on_one_mesh_restore_on_another_bit_identical(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any, src: str, dst: str
) -> None:
    a, b = mesh_of(src), mesh_of(dst)
    if max(a.size, b.size) > comm.Get_size():
        pytest.skip(f"needs {max(a.size, b.size)} ranks")
    save_on(mpi_tmp_path, comm, a, 3)
    restore_on(mpi_tmp_path, comm, b, None, all_ranks=all_ranks)
    restore_on(mpi_tmp_path, comm, b, 3, transposed=True, all_ranks=all_ranks)


def test_small_chunks_and_rounds_restore_bit_identical(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:  # fmt: skip
    """Many chunks per shard and many rounds: every chunk hashed and verified on its own."""
    n = comm.Get_size()
    src, dst = mesh_of(str(n)), mesh_of(f"1x{n}")
    save_on(mpi_tmp_path, comm, src, 1, chunk_bytes=64)
    c = sub(comm, n)
    store = CheckpointStore(mpi_tmp_path, c, timeout_s=60, round_bytes=200)
    got = store.restore(dst, tensors(dst, True))
    ok = all(
        got.values[name].tobytes() == block_at(name, t, dst, c.Get_rank(), 1).tobytes()
        for name, t in tensors(dst, True)
    )
    manifest = read_manifest(mpi_tmp_path / committed_name(1))
    assert max(len(s.chunks) for a in manifest.artifacts for s in a.shards) > 10
    store.close()
    c.Free()
    all_ranks(ok, "small chunks: values differ")


def test_commit_latest_and_retention(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:
    mesh = mesh_of(str(comm.Get_size()))
    for step in (1, 2, 3, 4):
        save_on(mpi_tmp_path, comm, mesh, step, keep_last=2)
    entries = list_checkpoints(mpi_tmp_path)
    all_ranks([e.step for e in entries] == [3, 4], f"kept {[e.step for e in entries]}")
    all_ranks(all(e.committed for e in entries) and entries[-1].latest, "latest is step 4")
    all_ranks(read_latest(mpi_tmp_path) == 4, "read_latest")
    restore_on(mpi_tmp_path, comm, mesh, None, all_ranks=all_ranks)
    restore_on(mpi_tmp_path, comm, mesh, 3, all_ranks=all_ranks)


def test_flipped_byte_is_an_integrity_error_naming_tensor_and_shard(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:  # fmt: skip
    mesh = mesh_of(str(comm.Get_size()))
    save_on(mpi_tmp_path, comm, mesh, 1)
    save_on(mpi_tmp_path, comm, mesh, 2)
    path = mpi_tmp_path / committed_name(2)
    if comm.Get_rank() == 0:
        flip_byte(path, "/tensors/big", 4 * 33 * 200 + 5)  # row 200 of 257
    comm.Barrier()
    store = CheckpointStore(mpi_tmp_path, comm, timeout_s=60)
    with pytest.raises(IntegrityError) as info:
        store.restore(mesh, tensors(mesh))
    msg = str(info.value)
    assert "'big'" in msg and "big:shard:" in msg and str(path) in msg, msg
    assert info.value.tensor == "big" and info.value.file == str(path)
    # the newest checkpoint that verifies
    got = store.restore(mesh, tensors(mesh), fallback=True)
    all_ranks(got.step == 1, f"fallback restored step {got.step}")
    store.close()


def test_quota_refuses_before_writing(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:
    mesh = mesh_of(str(comm.Get_size()))
    save_on(mpi_tmp_path, comm, mesh, 1)
    used = sum(e.nbytes for e in list_checkpoints(mpi_tmp_path))
    store = CheckpointStore(mpi_tmp_path, comm, quota_bytes=used + 1000, timeout_s=60)
    items = [(TensorSpec(n, t), np.array(VALUES[n][local_block(t.shape, t.layout, mesh, comm.Get_rank())])) for n, t in tensors(mesh)]  # fmt: skip
    with pytest.raises(QuotaError, match="quota"):
        store.save(2, mesh, items)
    names = sorted(p.name for p in mpi_tmp_path.iterdir())
    all_ranks(
        names == ["ckpt-00000001.h5", "latest", "store.json"], f"files after refusal: {names}"
    )
    store.close()


def test_async_save_then_cancel(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:
    import threading

    mesh = mesh_of(str(comm.Get_size()))
    save_on(mpi_tmp_path, comm, mesh, 1)
    store = CheckpointStore(mpi_tmp_path, comm, timeout_s=60)
    rank = comm.Get_rank()
    items = [(TensorSpec(n, t), block_at(n, t, mesh, rank, 2)) for n, t in tensors(mesh)]
    # async: the snapshot is taken at the call; changing the arrays afterwards changes nothing
    handle = store.save_async(2, mesh, items)
    for _, a in items:
        a[...] = 0
    all_ranks(handle.wait() == mpi_tmp_path / committed_name(2), "async save committed")
    restore_on(mpi_tmp_path, comm, mesh, 2, all_ranks=all_ranks)
    # cancel: the writer waits at tensor 2 until the cancel is requested
    gate = threading.Event()
    handle = store.save_async(3, mesh, items, before_tensor=lambda i: gate.wait(30) if i == 2 else None)  # fmt: skip
    partial = [p for p in mpi_tmp_path.iterdir() if ".partial-" in p.name]
    handle.cancel_requested = True
    gate.set()
    assert handle.cancel() is True
    with pytest.raises(CancelledError):
        handle.wait()
    comm.Barrier()
    left = sorted(p.name for p in mpi_tmp_path.iterdir())
    all_ranks(len(partial) <= 1, "one partial file at most")
    all_ranks(left == ["ckpt-00000001.h5", "ckpt-00000002.h5", "latest", "store.json"], f"after cancel: {left}")  # fmt: skip
    all_ranks(read_latest(mpi_tmp_path) == 2, "latest still 2")
    store.close()
    restore_on(mpi_tmp_path, comm, mesh, None, all_ranks=all_ranks)


def test_plain_h5py_reads_a_checkpoint(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:
    """The file is plain HDF5: a process without dtm_mpi reads every tensor back."""
    import subprocess
    import sys

    mesh = mesh_of(str(comm.Get_size()))
    save_on(mpi_tmp_path, comm, mesh, 5)
    ok, out = True, ""
    if comm.Get_rank() == 0:
        np.savez(mpi_tmp_path / "want.npz", **{k: v + np.asarray(5, v.dtype) if v.dtype.kind == "f" else v for k, v in VALUES.items()})  # fmt: skip
        code = (
            "import sys, json, h5py, numpy as np\n"
            "assert 'dtm_mpi' not in sys.modules\n"
            f"f = h5py.File({str(mpi_tmp_path / committed_name(5))!r}, 'r')\n"
            f"want = np.load({str(mpi_tmp_path / 'want.npz')!r})\n"
            "for k in want.files:\n"
            "    got = f['tensors'][k][()]\n"
            "    assert np.asarray(got).tobytes() == want[k].tobytes(), k\n"
            "    assert f['tensors'][k].attrs['artifact_class'] == 'PRIMARY'\n"
            "m = json.loads(f['manifest'][()])\n"
            "assert m['format'] == 'dtm-manifest' and m['step'] == 5\n"
            "print('plain-ok', sorted(want.files) == sorted(f['tensors']), 'dtm_mpi' in sys.modules)\n"
        )  # fmt: skip
        proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=False, timeout=60)  # fmt: skip
        out = proc.stdout + proc.stderr
        ok = proc.returncode == 0 and "plain-ok True False" in out
    all_ranks(ok, out)


def test_ephemeral_never_stored_and_derived_rebuilt(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:  # fmt: skip
    mesh = mesh_of(str(comm.Get_size()))
    rank = comm.Get_rank()
    t32 = TensorType(DType.F32, (9, 4), Layout((("x",), ())))
    t16 = TensorType(DType.F16, (9, 4), Layout((("x",), ())))
    g = VALUES["big"][:9, :4]
    blk = local_block(t32.shape, t32.layout, mesh, rank)
    store = CheckpointStore(mpi_tmp_path, comm, timeout_s=60)
    store.save(
        1,
        mesh,
        [
            (TensorSpec("w", t32), np.array(g[blk])),
            (
                TensorSpec("w16", t16, ArtifactClass.DERIVED, parent="w", rebuild="cast:f16"),
                g[blk].astype(np.float16),
            ),
            (TensorSpec("scratch", t32, ArtifactClass.EPHEMERAL), None),
        ],
    )
    path = mpi_tmp_path / committed_name(1)
    manifest = read_manifest(path)
    scratch = manifest.artifact("scratch")
    all_ranks(scratch.shards == () and scratch.dataset is None, "ephemeral has no data")
    with pytest.raises(StorageError, match="ephemeral"):
        store.restore(mesh, [("scratch", t32)])
    if rank == 0:
        flip_byte(path, "/tensors/w16", 3)
    comm.Barrier()
    got = store.restore(mesh, [("w16", t16)])  # rebuilt from w
    all_ranks(got.values["w16"].tobytes() == g[blk].astype(np.float16).tobytes(), "rebuilt w16")
    if rank == 0:
        flip_byte(path, "/tensors/w", 0)
    comm.Barrier()
    with pytest.raises(IntegrityError, match="'w'"):
        store.restore(mesh, [("w", t32)])
    store.close()


def test_restore_in_place_into_callers_arrays(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:  # fmt: skip
    """``into=`` fills the caller's arrays (resharded: saved split one way, restored split the
    other), returns those very arrays, and a bad array on one rank only is an error on all."""
    from dtm_mpi.errors import UsageError
    from dtm_mpi.sharding.blocks import local_shape

    n = comm.Get_size()
    src, dst = mesh_of(str(n)), mesh_of(f"1x{n}")
    save_on(mpi_tmp_path, comm, src, 2)
    rank = comm.Get_rank()
    targets = tensors(dst, True)
    from dtm_mpi.ir.ops._common import np_dtype

    mine = {
        name: np.full(local_shape(t.shape, t.layout, dst, rank), 7, dtype=np_dtype(t.dtype))
        for name, t in targets
        if name in ("w", "big")
    }
    store = CheckpointStore(mpi_tmp_path, comm, timeout_s=60)
    got = store.restore(dst, targets, into=mine)
    for name, t in targets:
        want = block_at(name, t, dst, rank, 2).tobytes()
        all_ranks(got.values[name].tobytes() == want, f"rank {rank}: {name} differs")
    all_ranks(all(got.values[k] is a for k, a in mine.items()), "the caller's arrays are returned")
    all_ranks(mine["big"].tobytes() == block_at("big", dict(targets)["big"], dst, rank, 2).tobytes(), "filled")  # fmt: skip
    bad = dict(mine)
    if rank == n - 1:  # one rank only: every rank must raise, none may hang
        bad["big"] = np.empty((1, 1), dtype=np.float32)
    with pytest.raises(UsageError, match="'into' array for tensor 'big'"):
        store.restore(dst, targets, into=bad)
    with pytest.raises(UsageError, match="not a target"):
        store.restore(dst, targets, into={"nope": mine["w"]})
    store.close()
