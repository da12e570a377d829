"""Checkpoints under real MPI and parallel HDF5: save on one mesh, restore on another
(1->4, 4->1, 2->3, 3->2, 2x2->4x1 and back, same mesh), uneven shapes, bit-identical; atomic
commit, latest pointer and retention; integrity errors naming tensor, shard and data file;
quota, async save and cancel; the checkpoint directory (``checkpoint.h5`` + one data file per
group of ``ranks_per_file`` ranks) and readers without dtm_mpi. Size-agnostic: a case whose
meshes need more ranks than the job has is skipped; the suite runs at 2, 3 and 4 ranks."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.errors import CancelledError, IntegrityError, QuotaError, StorageError
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_files import MAIN_FILE, read_manifest
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.io.manifest import ArtifactClass
from dtm_mpi.io.store import committed_name, list_checkpoints, read_latest
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape
from tests.io.io_helpers import PLAIN_READER, flip_element

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
    from dtm_mpi.ir.dtypes import np_dtype

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


def save_on(
    path: Path, comm: Any, mesh: MeshShape, step: int, transposed: bool = False, **kw: Any
) -> None:
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


def restore_on(
    path: Path,
    comm: Any,
    mesh: MeshShape,
    step: int | None,
    transposed: bool = False,
    all_ranks: Any = None,
    **kw: Any,
) -> None:
    c = sub(comm, mesh.size)
    ok, message = True, ""
    if c is not None:
        store = CheckpointStore(path, c, timeout_s=60)
        got = store.restore(mesh, tensors(mesh, transposed), step=step, **kw)
        rank = c.Get_rank()
        for name, t in tensors(mesh, transposed):
            want = block_at(name, t, mesh, rank, got.step)
            have = got.values[name]
            if (
                have.shape != want.shape
                or have.dtype != want.dtype
                or have.tobytes() != want.tobytes()
            ):
                ok, message = False, f"rank {rank}: tensor {name} differs"
        store.close()
        c.Free()
    assert all_ranks is not None
    all_ranks(ok, message)


CASES = [
    ("1", "4"),
    ("4", "1"),
    ("2", "3"),
    ("3", "2"),
    ("2x2", "4x1"),
    ("4x1", "2x2"),
    ("3", "3"),
    ("2", "2"),
    ("1", "2"),
]


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


def test_small_chunks_and_rounds_restore_bit_identical(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
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


def test_flipped_byte_is_an_integrity_error_naming_tensor_and_shard(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
    mesh = mesh_of(str(comm.Get_size()))
    save_on(mpi_tmp_path, comm, mesh, 1)
    save_on(mpi_tmp_path, comm, mesh, 2)
    path = mpi_tmp_path / committed_name(2)
    # row 200 of 257: in the shard of the last rank that holds rows, in that rank's data file
    data, shard = comm.bcast(
        flip_element(path, "big", (200, 1), byte=1) if comm.Get_rank() == 0 else None
    )
    assert data.parent == path and data.name.startswith("data-") and shard.startswith("big:shard:")
    store = CheckpointStore(mpi_tmp_path, comm, timeout_s=60)
    with pytest.raises(IntegrityError) as info:
        store.restore(mesh, tensors(mesh))
    msg = str(info.value)
    assert f"tensor 'big' shard {shard!r}" in msg and str(data) in msg, msg
    assert (info.value.tensor, info.value.shard, info.value.file) == ("big", shard, str(data))
    # the newest checkpoint that verifies
    got = store.restore(mesh, tensors(mesh), fallback=True)
    all_ranks(got.step == 1, f"fallback restored step {got.step}")
    store.close()


def test_quota_refuses_before_writing(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:
    mesh = mesh_of(str(comm.Get_size()))
    save_on(mpi_tmp_path, comm, mesh, 1)
    used = sum(e.nbytes for e in list_checkpoints(mpi_tmp_path))
    store = CheckpointStore(mpi_tmp_path, comm, quota_bytes=used + 1000, timeout_s=60)
    items = [
        (
            TensorSpec(n, t),
            np.array(VALUES[n][local_block(t.shape, t.layout, mesh, comm.Get_rank())]),
        )
        for n, t in tensors(mesh)
    ]
    with pytest.raises(QuotaError, match="quota"):
        store.save(2, mesh, items)
    names = sorted(p.name for p in mpi_tmp_path.iterdir())
    all_ranks(names == ["ckpt-00000001", "latest", "store.json"], f"files after refusal: {names}")
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
    handle = store.save_async(
        3, mesh, items, before_tensor=lambda i: gate.wait(30) if i == 2 else None
    )
    partial = [p for p in mpi_tmp_path.iterdir() if ".partial-" in p.name]
    handle.cancel_requested = True
    gate.set()
    assert handle.cancel() is True
    with pytest.raises(CancelledError):
        handle.wait()
    comm.Barrier()
    left = sorted(p.name for p in mpi_tmp_path.iterdir())
    all_ranks(
        len(partial) <= 1 and all(p.name.startswith("ckpt-00000003.partial-") for p in partial),
        f"one partial directory at most: {partial}",
    )
    all_ranks(
        left == ["ckpt-00000001", "ckpt-00000002", "latest", "store.json"], f"after cancel: {left}"
    )
    all_ranks(read_latest(mpi_tmp_path) == 2, "latest still 2")
    store.close()
    restore_on(mpi_tmp_path, comm, mesh, None, all_ranks=all_ranks)


def test_plain_h5py_reads_a_moved_checkpoint(comm: Any, mpi_tmp_path: Path, all_ranks: Any) -> None:
    """The checkpoint is plain HDF5: a process without dtm_mpi (``python -I``, started in
    another directory) reads every tensor bit-exactly from ``checkpoint.h5`` through its
    virtual datasets, after the whole store directory was moved (the sources are relative)."""
    import subprocess
    import sys

    n = comm.Get_size()
    mesh = mesh_of(str(n))
    save_on(mpi_tmp_path / "store", comm, mesh, 5, ranks_per_file=1)
    ok, out = True, ""
    if comm.Get_rank() == 0:
        moved = mpi_tmp_path / "elsewhere" / "moved"
        moved.parent.mkdir()
        (mpi_tmp_path / "store").rename(moved)
        want = mpi_tmp_path / "want.npz"
        np.savez(
            want,
            **{
                k: v + np.asarray(5, v.dtype) if v.dtype.kind == "f" else v
                for k, v in VALUES.items()
            },
        )
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
        files = str(
            [f"data-{r:06d}.h5" for r in range(n)]
        )  # one rank per file: every rank owns a shard of 'w'
        ok = proc.returncode == 0 and f"plain-ok True {files} False" in out
    all_ranks(ok, out)


def test_ephemeral_never_stored_and_derived_rebuilt(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
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
        flip_element(path, "w16", (0, 1), byte=1)
    comm.Barrier()
    got = store.restore(mesh, [("w16", t16)])  # rebuilt from w
    all_ranks(got.values["w16"].tobytes() == g[blk].astype(np.float16).tobytes(), "rebuilt w16")
    if rank == 0:
        flip_element(path, "w", (0, 0))
    comm.Barrier()
    with pytest.raises(IntegrityError, match="'w'"):
        store.restore(mesh, [("w", t32)])
    store.close()


def test_restore_in_place_into_callers_arrays(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
    """``into=`` fills the caller's arrays (resharded: saved split one way, restored split the
    other), returns those very arrays, and a bad array on one rank only is an error on all."""
    from dtm_mpi.errors import UsageError
    from dtm_mpi.sharding.blocks import local_shape

    n = comm.Get_size()
    src, dst = mesh_of(str(n)), mesh_of(f"1x{n}")
    save_on(mpi_tmp_path, comm, src, 2)
    rank = comm.Get_rank()
    targets = tensors(dst, True)
    from dtm_mpi.ir.dtypes import np_dtype

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
    all_ranks(
        mine["big"].tobytes() == block_at("big", dict(targets)["big"], dst, rank, 2).tobytes(),
        "filled",
    )
    bad = dict(mine)
    if rank == n - 1:  # one rank only: every rank must raise, none may hang
        bad["big"] = np.empty((1, 1), dtype=np.float32)
    with pytest.raises(UsageError, match="'into' array for tensor 'big'"):
        store.restore(dst, targets, into=bad)
    with pytest.raises(UsageError, match="not a target"):
        store.restore(dst, targets, into={"nope": mine["w"]})
    store.close()


# --- the checkpoint directory: ranks_per_file -------------------------------------------------


def data_files(n: int, per_file: int) -> list[str]:
    """The data files of an ``n``-rank save with ``per_file`` ranks per file (0: all) when
    every rank owns a shard: rank r writes into file r // G."""
    g = n if per_file == 0 else per_file
    return [f"data-{i:06d}.h5" for i in sorted({r // g for r in range(n)})]


def stored_datasets(path: Path) -> dict[str, set[str]]:
    """Data file name -> the datasets it holds, of checkpoint directory ``path``."""
    import h5py

    out: dict[str, set[str]] = {}
    for p in sorted(path.glob("data-*.h5")):
        names = out.setdefault(p.name, set())
        with h5py.File(p, "r") as f:
            for group in f["shards"].values():
                names.update(d.name for d in group.values() if isinstance(d, h5py.Dataset))
            assert list(f) == ["shards"], list(f)
    return out


@pytest.mark.parametrize("per_file", [1, 2, 0], ids=["G=1", "G=2", "G=all"])
def test_ranks_per_file_layout_and_bit_identical_restores(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any, per_file: int
) -> None:
    """One data file per group of G ranks (at 3 ranks G=2 gives the groups {0,1} and {2}),
    each holding exactly the shards its ranks own as ``/shards/<t>/<i>``; the checkpoint
    restores bit-identically whatever G wrote it: on the same mesh, resharded onto another
    layout and onto fewer ranks."""
    n = comm.Get_size()
    g = n if per_file == 0 else min(per_file, n)
    mesh = mesh_of(str(n))
    save_on(mpi_tmp_path, comm, mesh, 2, ranks_per_file=per_file)
    path = mpi_tmp_path / committed_name(2)
    problems: list[str] = []
    if comm.Get_rank() == 0:
        names = sorted(p.name for p in path.iterdir())
        if names != sorted([MAIN_FILE, *data_files(n, per_file)]):
            problems.append(f"directory holds {names}")
        want: dict[str, set[str]] = {}
        for a in read_manifest(path).artifacts:
            for s in a.shards:
                if (s.file, s.dataset) != (
                    f"data-{s.owner // g:06d}.h5",
                    f"/shards/{a.name}/{s.index}",
                ):
                    problems.append(f"{s.id} of rank {s.owner} is {s.file}:{s.dataset}")
                want.setdefault(s.file, set()).add(s.dataset)
        if stored_datasets(path) != want:
            problems.append(f"data files hold {stored_datasets(path)}, the manifest says {want}")
    problems = comm.bcast(problems)
    all_ranks(not problems, "; ".join(problems))
    restore_on(mpi_tmp_path, comm, mesh, None, all_ranks=all_ranks)
    restore_on(mpi_tmp_path, comm, mesh_of(f"1x{n}"), 2, transposed=True, all_ranks=all_ranks)
    restore_on(mpi_tmp_path, comm, mesh_of(str(max(1, n - 1))), 2, all_ranks=all_ranks)


def test_checkpoints_of_different_ranks_per_file_in_one_store(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
    """Each save chooses its own layout (rank 0's ``ranks_per_file``: the others' is ignored);
    a restore reads whichever it finds."""
    n = comm.Get_size()
    mesh = mesh_of(str(n))
    rank = comm.Get_rank()
    save_on(mpi_tmp_path, comm, mesh, 1, ranks_per_file=0)
    save_on(mpi_tmp_path, comm, mesh, 2, ranks_per_file=1 if rank == 0 else 0)
    one = sorted(p.name for p in (mpi_tmp_path / committed_name(1)).iterdir())
    two = sorted(p.name for p in (mpi_tmp_path / committed_name(2)).iterdir())
    all_ranks(one == [MAIN_FILE, "data-000000.h5"], f"G=all wrote {one}")
    all_ranks(two == sorted([MAIN_FILE, *data_files(n, 1)]), f"rank 0's G=1 wrote {two}")
    restore_on(mpi_tmp_path, comm, mesh_of(f"1x{n}"), 1, transposed=True, all_ranks=all_ranks)
    restore_on(mpi_tmp_path, comm, mesh, 2, all_ranks=all_ranks)


def test_a_damaged_chunk_that_crosses_ranks_keeps_the_exchange_aligned(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any
) -> None:
    """A chunk that cannot be read still sends its planned bytes: the other pieces of the
    round stay where they belong. Replicated tensors in chunks of one row: every chunk is read
    by one rank and sent to all others; the derived one's dataset is gone (rebuilt from its
    parent), the primary one must arrive intact on every rank."""
    import h5py

    n, rank = comm.Get_size(), comm.Get_rank()
    mesh = mesh_of(str(n))
    rep = Layout(((), ()))
    tp = TensorType(DType.F32, (4 * n, 2), rep)
    td = TensorType(DType.F16, (4 * n, 2), rep)
    p = np.arange(8 * n, dtype=np.float32).reshape(4 * n, 2) + 1
    store = CheckpointStore(mpi_tmp_path, comm, timeout_s=60, chunk_bytes=8, ranks_per_file=1)
    store.save(
        1,
        mesh,
        [
            (
                TensorSpec("d", td, ArtifactClass.DERIVED, parent="p", rebuild="cast:f16"),
                np.full(p.shape, -1, np.float16),
            ),
            (TensorSpec("p", tp), p.copy()),
        ],
    )
    if rank == 0:
        with h5py.File(mpi_tmp_path / committed_name(1) / "data-000000.h5", "r+") as f:
            del f["shards/d/0"]
    comm.Barrier()
    got = store.restore(mesh, [("d", td), ("p", tp)])
    all_ranks(
        got.values["p"].tobytes() == p.tobytes(),
        f"p arrived shifted or partly: {got.values['p'].tolist()}",
    )
    all_ranks(got.values["d"].tobytes() == p.astype(np.float16).tobytes(), "d rebuilt from p")
    store.close()


def test_a_missing_data_file_fails_every_rank_and_derived_are_rebuilt(
    comm: Any, mpi_tmp_path: Path, all_ranks: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last rank's data file disappears: a primary tensor with a shard in it is an
    IntegrityError on every rank naming tensor, shard and that file; a derived tensor with a
    shard in it is rebuilt from its parent (replicated: stored by rank 0, in data-000000.h5);
    ``dtm ckpt verify`` reports both shards."""
    from dtm_mpi.cli import run

    n, rank = comm.Get_size(), comm.Get_rank()
    mesh = mesh_of(str(n))
    split = Layout((("x",), ()))
    tp = TensorType(DType.F32, (10, 3), Layout(((), ())))
    tq = TensorType(DType.F32, (10, 3), split)
    td = TensorType(DType.F16, (10, 3), split)
    tp_split = TensorType(DType.F32, (10, 3), split)
    p = VALUES["big"][:10, :3]
    blk = local_block(tq.shape, split, mesh, rank)
    store = CheckpointStore(mpi_tmp_path, comm, timeout_s=60, ranks_per_file=1)
    store.save(
        1,
        mesh,
        [
            (TensorSpec("p", tp), np.array(p)),
            (TensorSpec("q", tq), np.array(p[blk]) * 2),
            (
                TensorSpec("d", td, ArtifactClass.DERIVED, parent="p", rebuild="cast:f16"),
                np.full(p[blk].shape, -1, np.float16),
            ),
        ],
    )
    path = mpi_tmp_path / committed_name(1)
    gone = path / f"data-{n - 1:06d}.h5"
    last = f"{n - 1}"
    if rank == 0:
        gone.unlink()
    comm.Barrier()
    with pytest.raises(IntegrityError) as info:
        store.restore(mesh, [("p", tp_split), ("q", tq)])
    e = info.value
    all_ranks((e.tensor, e.shard, e.file) == ("q", f"q:shard:{last}", str(gone)), str(e))
    all_ranks(str(e) == f"{gone}: tensor 'q' shard 'q:shard:{last}': data file is missing", str(e))
    all_ranks(len(set(comm.allgather(str(e)))) == 1, "every rank raises the same error")
    got = store.restore(mesh, [("d", td), ("p", tp_split)])  # d rebuilt from p; p intact
    all_ranks(got.values["d"].tobytes() == p[blk].astype(np.float16).tobytes(), "d rebuilt from p")
    all_ranks(got.values["p"].tobytes() == p[blk].tobytes(), "p restored")
    store.close()
    ok, out = True, ""
    if rank == 0:
        capsys.readouterr()
        code = run(["ckpt", "verify", str(mpi_tmp_path)])
        out = capsys.readouterr().out
        lines = sorted(out.splitlines())
        want = sorted(
            f"DAMAGED {gone}: tensor {t!r} shard '{t}:shard:{last}': data file is missing"
            for t in ("d", "q")
        )
        ok = code == 1 and lines == want
    all_ranks(ok, out)
