"""The MPI communicator (dtm_mpi.comm.mpi_comm) under real MPI: every redistribution plan gives
exactly the reference result (dtm_mpi.sharding.collectives.apply_plan) on every rank, at any
job size, with uneven blocks, in deterministic and default mode, with messages split into
tiny chunks, for float16/bool/int data; point-to-point and broadcast; byte accounting."""

from __future__ import annotations

from itertools import product
from typing import Any

import numpy as np
import pytest

from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.runtime.executor import run_redistribution
from dtm_mpi.sharding.collectives import apply_plan
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.redistribute import plan_redistribute

pytestmark = pytest.mark.mpi(min_size=1)


def meshes(size: int) -> list[MeshShape]:
    out = [MeshShape((("x", size),))]
    if size % 2 == 0 and size > 2:
        out.append(MeshShape((("a", 2), ("b", size // 2))))
    if size > 1:
        out.append(MeshShape((("a", 1), ("b", size))))
    return out


def layouts(mesh: MeshShape, rank: int) -> list[Layout]:
    axes = mesh.axis_names
    out = [Layout(((), ()))]
    for a in axes:
        out += [
            Layout(((a,), ())),
            Layout(((), (a,))),
            Layout(((), ()), Partial(ReduceOp.SUM, (a,))),
        ]
    if len(axes) == 2:
        a, b = axes
        out += [
            Layout(((a, b), ())),
            Layout(((b, a), ())),
            Layout(((a,), (b,))),
            Layout(((a,), ()), Partial(ReduceOp.SUM, (b,))),
        ]
    return out


def contributions(t: TensorType, mesh: MeshShape, g: np.ndarray, seed: int) -> list[np.ndarray]:
    """Every rank's local block of the global value ``g`` in ``t``'s layout (for a pending
    sum: random integer-valued contributions that add up to the block)."""
    from dtm_mpi.sharding.blocks import local_block

    rng = np.random.default_rng(seed)
    blocks = [g[local_block(t.shape, t.layout, mesh, r)].copy() for r in range(mesh.size)]
    p = t.layout.partial
    if p is None:
        return blocks
    for group in mesh.groups(p.axes):
        noise = [rng.integers(-5, 6, size=blocks[group[0]].shape).astype(g.dtype) for _ in group]
        total = sum(noise[1:], np.zeros_like(noise[0]))
        blocks[group[0]] = blocks[group[0]] - total
        for r, n in zip(group[1:], noise[1:], strict=True):
            blocks[r] = n
    return blocks


def run_all(comm: Any, **kwargs: Any) -> int:
    rank, size = comm.Get_rank(), comm.Get_size()
    checked = 0
    for mesh in meshes(size):
        session = MpiSession(mesh, timeout_s=30, world=comm, join=False)
        groups = sorted(
            {
                axes
                for n in range(1, len(mesh.axis_names) + 1)
                for axes in product(mesh.axis_names, repeat=n)
                if len(set(axes)) == n
            }
        )
        session.join_mesh(groups)
        mc = MpiComm(session, **kwargs)
        g = np.random.default_rng(7).integers(-9, 10, size=(5, 7)).astype(np.float64)
        for i, (src_l, dst_l) in enumerate(product(layouts(mesh, rank), repeat=2)):
            src = TensorType(DType.F64, (5, 7), src_l)
            try:
                plan = plan_redistribute(src, dst_l, mesh)
            except Exception:  # forbidden conversion (e.g. partial -> other partial op)
                continue
            locals_ = contributions(src, mesh, g, seed=i)
            want = apply_plan(plan, mesh, locals_)[rank]
            before = (mc.stats.bytes_sent, mc.stats.bytes_received)
            got = run_redistribution(plan, plan.rank_specs(rank), locals_[rank], mc)
            assert got.shape == want.shape, (str(plan), got.shape, want.shape)
            assert np.array_equal(got, want), f"rank {rank}: {plan}"
            assert mc.stats.bytes_sent - before[0] == plan.bytes_sent(rank), str(plan)
            assert mc.stats.bytes_received - before[1] == plan.bytes_received(rank), str(plan)
            checked += 1
        session.close()
    return checked


def test_every_plan_matches_the_reference(comm: Any) -> None:
    assert run_all(comm) > 10


def test_deterministic_mode_matches_the_reference(comm: Any) -> None:
    assert run_all(comm, deterministic=True) > 10


def test_tiny_chunks_match_the_reference(comm: Any) -> None:
    assert run_all(comm, max_msg_elems=3) > 10


@pytest.mark.parametrize("dtype", ["float16", "bool", "int8", "float32"])
def test_dtypes_move_bit_exactly(comm: Any, dtype: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session, max_msg_elems=5)
    dt = {"float16": DType.F16, "bool": DType.BOOL, "int8": DType.I8, "float32": DType.F32}[dtype]
    g = (np.random.default_rng(1).standard_normal((7, 3)) * 50).astype(dtype)
    src = TensorType(dt, (7, 3), Layout((("x",), ())))
    plan = plan_redistribute(src, Layout(((), ())), mesh)
    locals_ = contributions(src, mesh, g, 0)
    got = run_redistribution(plan, plan.rank_specs(rank), locals_[rank], mc)
    assert got.dtype == g.dtype and np.array_equal(got.view("u1"), g.view("u1"))
    if dtype in ("float16", "int8", "float32"):  # a max over the ranks, folded or by MPI
        pending = TensorType(dt, (7, 3), Layout(((), ()), Partial(ReduceOp.MAX, ("x",))))
        contrib = [np.full((7, 3), r, dtype=dtype) for r in range(size)]
        plan = plan_redistribute(pending, Layout(((), ())), mesh)
        got = run_redistribution(plan, plan.rank_specs(rank), contrib[rank], mc)
        assert np.array_equal(got, np.full((7, 3), size - 1, dtype=dtype))
    session.close()


def test_send_recv_and_broadcast(comm: Any) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    session.join_mesh([("x",)])
    mc = MpiComm(session, max_msg_elems=4)
    data = np.arange(10, dtype=np.float32) + 100 * rank
    # a ring: every rank sends to the next, then receives from the previous
    mc.send(data, (rank + 1) % size, tag=5)
    got = mc.recv((10,), np.dtype(np.float32), (rank - 1) % size, tag=5)
    mc.flush()
    assert np.array_equal(got, np.arange(10, dtype=np.float32) + 100 * ((rank - 1) % size))
    root = size - 1
    b = mc.broadcast(np.full(3, rank, dtype=np.int64), ("x",), root)
    assert np.array_equal(b, np.full(3, root))
    assert mc.stats.calls["send"] == 1 and mc.stats.calls["recv"] == 1
    session.close()


def test_repeated_allreduce_takes_the_prepared_path(comm: Any) -> None:
    """The executor reuses its specs every step; the second call of a spec takes the
    prepared fast path and must give the same result and accounting."""
    from dtm_mpi.sharding.steps import AllreduceSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session)
    spec = AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, 6)
    for step in range(3):
        x = np.full((2, 3), rank + step, dtype=np.float64)
        got = mc.allreduce(x, ("x",), spec)
        assert np.array_equal(got, np.full((2, 3), sum(r + step for r in range(size))))
        assert got is not x
    assert mc.stats.calls["allreduce"] == 3
    assert mc.stats.bytes_sent == mc.stats.bytes_received
    if size > 1:
        assert mc.stats.bytes_sent > 0
    session.close()


def test_output_reuse_never_overwrites_a_live_value(comm: Any) -> None:
    """Outputs are reused only when nobody holds them or a view of them."""
    from dtm_mpi.sharding.steps import AllreduceSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session)
    for n in (6, 40_000):  # a small output and a page-aligned one
        spec = AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, n)
        kept = [
            mc.allreduce(np.full(n, float(step), dtype=np.float64), ("x",), spec)
            for step in range(3)
        ]
        views = [k[1:] for k in kept]
        for step, (k, v) in enumerate(zip(kept, views, strict=True)):
            assert np.all(k == step * size) and np.all(v == step * size)
        only_view = mc.allreduce(np.full(n, 7.0), ("x",), spec)[2:]
        again = mc.allreduce(np.full(n, 9.0), ("x",), spec)
        assert np.all(only_view == 7.0 * size) and np.all(again == 9.0 * size)
        # a dropped page-aligned output is handed back on the next call (warm memory, no
        # allocation); small outputs are plain allocations, as cheap as a cache lookup
        first = mc.allreduce(np.ones(n), ("x",), spec)
        address = first.ctypes.data
        del first
        second = mc.allreduce(np.ones(n), ("x",), spec)
        assert (second.ctypes.data == address) == (second.nbytes >= 64 << 10)
        assert np.all(second == size)
    session.close()


def test_a_transient_steps_outputs_are_not_kept(comm: Any) -> None:
    """A step marked transient (a gather of a parameter stored sharded) gets a fresh output
    every call and the output cache holds none of them; another step's output is kept."""
    from dtm_mpi.sharding.steps import AllreduceSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    session = MpiSession(MeshShape((("x", size),)), [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session)
    n = 40_000  # page-aligned outputs, which are kept unless transient
    kept, fresh = (AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, n) for _ in range(2))
    mc.transient(fresh)
    for step in range(3):
        for spec in (kept, fresh):
            got = mc.allreduce(np.full(n, float(step)), ("x",), spec)
            assert np.all(got == step * size)
            del got
    assert id(kept) in mc._outputs._kept and id(fresh) not in mc._outputs._kept
    session.close()


def test_uniform_exchange_is_a_plain_alltoall(comm: Any) -> None:
    """An exchange whose spec says every pair moves the same back-to-back run (the bench's
    all_to_all) gives the alltoall result, repeatedly (prepared path, reused output)."""
    from dtm_mpi.sharding.steps import ExchangeSpec, Transfer

    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session)
    per = 3
    regions = [(slice(j * per, (j + 1) * per),) for j in range(size)]
    spec = ExchangeSpec(
        tuple(range(size)),
        rank,
        tuple(Transfer(j, regions[j], per) for j in range(size)),
        tuple(Transfer(j, regions[j], per) for j in range(size)),
        (size * per,),
        per,
        per,
    )
    for step in range(3):
        x = np.array([100 * rank + j + step for j in range(size) for _ in range(per)], np.int64)
        got = mc.exchange(x, ("x",), spec, "all_to_all")
        want = np.array([100 * i + rank + step for i in range(size) for _ in range(per)])
        assert np.array_equal(got, want), (step, got, want)
    assert mc.stats.calls["all_to_all"] == 3
    session.close()


def test_started_allreduces_complete_in_order_on_the_side_thread(comm: Any) -> None:
    """``start_allreduce`` with ``DTM_OVERLAP``: several allreduces in flight on the side
    thread (a duplicate of the group's communicator) while this thread runs a blocking
    allreduce on the group itself; each handle's ``wait`` gives the sum, the accounting
    counts each, and the session closes the thread and the duplicates."""
    from dtm_mpi.sharding.steps import AllreduceSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session)
    mc.side_thread = True
    xs = [np.full(1000 * (i + 1), rank + i, dtype=np.float32) for i in range(4)]
    handles = [
        mc.start_allreduce(x, ("x",), AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, x.size))
        for x in xs
    ]
    own = mc.allreduce(np.ones(5), ("x",), AllreduceSpec(tuple(range(size)), rank, ReduceOp.SUM, 5))
    assert np.array_equal(own, np.full(5, float(size)))
    for i, (x, h) in enumerate(zip(xs, handles, strict=True)):
        got = h.wait()
        assert h.test() and np.array_equal(
            got, np.full(x.size, sum(r + i for r in range(size)), dtype=np.float32)
        )
    assert mc.stats.calls["allreduce"] == 5
    if size > 1:
        assert session.watchdog is None or ("x",) in session._side
    session.close()
    assert session._side_thread is None


def test_started_allgathers_complete_on_the_side_thread_or_at_once(comm: Any) -> None:
    """``start_allgather`` with ``DTM_OVERLAP`` (a prefetched gather of a parameter stored
    sharded): equal blocks split along the first dim go to the side thread while this thread
    runs a blocking allgather of its own; uneven blocks and a split along an inner dim run
    the blocking path at once. Every handle gives the members' blocks concatenated, and each
    call is counted once."""
    from dtm_mpi.comm.interface import Completed
    from dtm_mpi.sharding.steps import AllgatherSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session)
    mc.side_thread = True
    group = tuple(range(size))

    def block(rows: int, cols: int, seed: int) -> np.ndarray:
        return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 1000 * seed

    # (this member's block, the spec, the whole array, whether it may go to the side thread)
    cases = []
    for i, (rows, cols) in enumerate([(3, 5), (64, 33), (1, 1)]):
        whole = np.concatenate([block(rows, cols, 10 * r + i) for r in group], axis=0)
        spec = AllgatherSpec(group, rank, 0, (rows,) * size, (rows * cols,) * size)
        cases.append((block(rows, cols, 10 * rank + i), spec, whole, True))
    extents = tuple(2 + r for r in group)  # uneven blocks
    whole = np.concatenate([block(extents[r], 4, 7 * r) for r in group], axis=0)
    spec = AllgatherSpec(group, rank, 0, extents, tuple(4 * e for e in extents))
    cases.append((block(extents[rank], 4, 7 * rank), spec, whole, False))
    whole = np.concatenate([block(4, 3, 5 * r) for r in group], axis=1)  # an inner dim
    cases.append(
        (
            block(4, 3, 5 * rank),
            AllgatherSpec(group, rank, 1, (3,) * size, (12,) * size),
            whole,
            False,
        )
    )
    handles = [mc.start_allgather(x, ("x",), spec) for x, spec, _, _ in cases]
    own = mc.allgather(
        np.full(2, rank, np.int64), ("x",), AllgatherSpec(group, rank, 0, (2,) * size, (2,) * size)
    )
    assert np.array_equal(own, np.repeat(np.arange(size), 2))
    for (_, _, whole, side), h in zip(cases, handles, strict=True):
        got = h.wait()
        assert h.test() and got.shape == whole.shape and np.array_equal(got, whole)
        assert isinstance(h, Completed) != (side and session.watchdog is not None)
    assert mc.stats.calls["allgather"] == len(cases) + 1
    session.close()
    assert session._side_thread is None


@pytest.mark.parametrize("dim", [0, 1])
def test_large_reduce_scatters_fold_the_pieces_in_group_order(comm: Any, dim: int) -> None:
    """Reduce-scatters of float32 arrays below and above the size where the pieces move by an
    all-to-all and are folded here (FOLDED_RS_FROM x p^2), along either dimension, with uneven
    pieces: each member gets its piece of the sum; the folded ones are exactly the members'
    pieces added in group order (whatever MPI's algorithm), and the bytes counted are a
    reduce-scatter's either way."""
    from dtm_mpi.comm.mpi_comm import FOLDED_RS_FROM, FOLDED_RS_UP_TO
    from dtm_mpi.sharding.steps import ReduceScatterSpec

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("a reduce-scatter needs 2 or more ranks")
    mesh = MeshShape((("x", size),))
    session = MpiSession(mesh, [("x",)], timeout_s=30, world=comm)
    mc = MpiComm(session)
    big = FOLDED_RS_FROM * size * size // 4  # float32 elements at the threshold
    calls: list[str] = []  # the MPI calls each reduce-scatter makes
    real_call = mc.call

    def recorded(comm_: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real_call(comm_, name, *args, **kwargs)

    mc.call = recorded  # type: ignore[method-assign]
    for rows in (max(size, big // 1024 // 8), big // 1024 + size):  # below, then above
        shape = (rows, 1024) if dim == 0 else (16, rows * 64)
        n = shape[dim]
        cuts = [n * j // size + (j % 2) for j in range(size)] + [n]  # uneven
        cuts[0] = 0
        pieces = tuple((cuts[j], cuts[j + 1] - cuts[j]) for j in range(size))
        other = shape[1 - dim]
        counts = tuple(length * other for _, length in pieces)
        spec = ReduceScatterSpec(tuple(range(size)), rank, ReduceOp.SUM, dim, pieces, counts)
        xs = [
            np.random.default_rng([r, rows, dim]).standard_normal(shape).astype(np.float32)
            for r in range(size)
        ]
        before = mc.stats.bytes_sent
        calls.clear()
        got = mc.reduce_scatter(xs[rank], ("x",), spec)
        folds = xs[0].nbytes >= FOLDED_RS_FROM * size * size and size <= FOLDED_RS_UP_TO
        assert calls == (["Alltoallv"] if folds else ["Reduce_scatter"]), (rank, calls)
        start, length = pieces[rank]
        index = [slice(None), slice(None)]
        index[dim] = slice(start, start + length)
        mine = [x[tuple(index)] for x in xs]
        folded = np.array(mine[0], copy=True)
        for m in mine[1:]:
            folded += m
        assert got.shape == folded.shape
        if folds:
            assert np.array_equal(got, folded), rank
        else:
            np.testing.assert_allclose(got, folded, rtol=1e-5, atol=1e-5)
        assert mc.stats.bytes_sent - before == xs[rank].nbytes - got.nbytes
    session.close()
