"""The in-process simulator (``dtm_mpi.comm.sim``): every collective of the ``Comm`` interface
on 1..4 ranks with uneven (§5) blocks, point-to-point transfers, statistics, and the failure
behaviour: bounded waits, collective mismatch detection, and one failing rank poisoning the
world so its peers stop early."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from dtm_mpi.comm.sim import SimComm, run_ranks
from dtm_mpi.errors import (
    CommError,
    CommTimeoutError,
    PoisonedError,
    RankFailure,
    RemoteFailureError,
)
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.sharding import (
    AllgatherSpec,
    AllreduceSpec,
    ExchangeSpec,
    MeshShape,
    RedistStep,
    ReduceScatterSpec,
    StepKind,
    apply_step,
    local_block,
    plan_redistribute,
    rank_spec,
    step_traffic,
)

F32 = DType.F32
KS = [1, 2, 3, 4]


def ttype(
    shape: tuple[int, ...], dims: tuple[tuple[str, ...], ...], partial: Any = None
) -> TensorType:
    return TensorType(F32, shape, Layout(dims, partial))


def line(k: int) -> MeshShape:
    return MeshShape((("dp", k),))


def blocks_of(g: np.ndarray, t: TensorType, mesh: MeshShape) -> list[np.ndarray]:
    return [np.array(g[local_block(t.shape, t.layout, mesh, r)]) for r in range(mesh.size)]


def run_step(step: RedistStep, mesh: MeshShape, inputs: list[np.ndarray]) -> list[Any]:
    """Run one collective step on every rank through ``SimComm``; (output, stats) per rank."""

    def body(comm: SimComm) -> tuple[np.ndarray, Any]:
        spec = rank_spec(step, mesh, comm.rank)
        x = inputs[comm.rank]
        if isinstance(spec, AllgatherSpec):
            out = comm.allgather(x, step.axes, spec)
        elif isinstance(spec, AllreduceSpec):
            out = comm.allreduce(x, step.axes, spec)
        elif isinstance(spec, ReduceScatterSpec):
            out = comm.reduce_scatter(x, step.axes, spec)
        else:
            assert isinstance(spec, ExchangeSpec)
            out = comm.exchange(x, step.axes, spec, step.kind.value)
        return out, comm.stats

    return run_ranks(mesh, body, timeout_s=10.0)


def check_stats(step: RedistStep, mesh: MeshShape, got: list[Any], what: str) -> None:
    """Each rank's statistics: one call of ``what``, the planner's byte counts."""
    for r, (_, stats) in enumerate(got):
        assert stats.calls == Counter({what: 1}), (r, stats.calls)
        traffic = step_traffic(step, mesh, r)
        assert (stats.bytes_sent, stats.bytes_received) == (traffic.sent, traffic.received), r


def contributions(shape: tuple[int, ...], n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


# --- collectives -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [10, 2, 0])
@pytest.mark.parametrize("k", KS)
def test_allgather_uneven(k: int, n: int) -> None:
    mesh = line(k)
    src = ttype((n, 3), (("dp",), ()))
    dst = ttype((n, 3), ((), ()))
    step = RedistStep(StepKind.ALLGATHER, src, dst, ("dp",), dim=0)
    if k > 1 and n > 0:
        assert plan_redistribute(src, dst.layout, mesh).steps == (step,)
    g = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    got = run_step(step, mesh, blocks_of(g, src, mesh))
    for out, _ in got:
        np.testing.assert_array_equal(out, g)
    check_stats(step, mesh, got, "allgather")


def test_allgather_bytes_by_hand() -> None:
    # 10 rows of 3 f32 over 4 ranks: 3, 3, 3, 1 rows
    mesh = line(4)
    src, dst = ttype((10, 3), (("dp",), ())), ttype((10, 3), ((), ()))
    step = RedistStep(StepKind.ALLGATHER, src, dst, ("dp",), dim=0)
    g = np.zeros((10, 3), np.float32)
    got = run_step(step, mesh, blocks_of(g, src, mesh))
    rows = [3, 3, 3, 1]
    for r, (_, stats) in enumerate(got):
        assert stats.bytes_sent == 3 * rows[r] * 3 * 4
        assert stats.bytes_received == (10 - rows[r]) * 3 * 4


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("k", KS)
def test_allreduce_folds_in_group_order(k: int, op: ReduceOp) -> None:
    mesh = line(k)
    src = ttype((5, 3), ((), ()), Partial(op, ("dp",)))
    dst = ttype((5, 3), ((), ()))
    step = RedistStep(StepKind.ALLREDUCE, src, dst, ("dp",), op=op)
    xs = contributions((5, 3), k, seed=k)
    got = run_step(step, mesh, xs)
    ufunc = {
        ReduceOp.SUM: np.add,
        ReduceOp.PROD: np.multiply,
        ReduceOp.MAX: np.maximum,
        ReduceOp.MIN: np.minimum,
    }[op]
    want = xs[0].copy()
    for x in xs[1:]:
        want = ufunc(want, x)
    for out, _ in got:
        np.testing.assert_array_equal(out, want)  # bitwise: a left-to-right fold
    check_stats(step, mesh, got, "allreduce")
    # the inputs are untouched (the fold works on a copy)
    np.testing.assert_array_equal(xs[0], contributions((5, 3), k, seed=k)[0])


def test_allreduce_bytes_by_hand() -> None:
    # 15 elements over 4 ranks: pieces 4, 4, 4, 3; moved = (m - p) + (k-1) p = m + 2p
    mesh = line(4)
    src = ttype((5, 3), ((), ()), Partial(ReduceOp.SUM, ("dp",)))
    step = RedistStep(StepKind.ALLREDUCE, src, ttype((5, 3), ((), ())), ("dp",), op=ReduceOp.SUM)
    got = run_step(step, mesh, contributions((5, 3), 4))
    for r, (_, stats) in enumerate(got):
        p = [4, 4, 4, 3][r]
        assert stats.bytes_sent == stats.bytes_received == (15 + 2 * p) * 4


@pytest.mark.parametrize("n", [10, 2])
@pytest.mark.parametrize("k", KS)
def test_reduce_scatter_uneven(k: int, n: int) -> None:
    mesh = line(k)
    src = ttype((n, 3), ((), ()), Partial(ReduceOp.SUM, ("dp",)))
    dst = ttype((n, 3), (("dp",), ()))
    step = RedistStep(StepKind.REDUCE_SCATTER, src, dst, ("dp",), dim=0, op=ReduceOp.SUM)
    if k > 1:
        assert plan_redistribute(src, dst.layout, mesh).steps == (step,)
    xs = contributions((n, 3), k, seed=n)
    total = xs[0].copy()
    for x in xs[1:]:
        total = total + x
    got = run_step(step, mesh, xs)
    for r, (out, _) in enumerate(got):
        np.testing.assert_array_equal(out, total[local_block(dst.shape, dst.layout, mesh, r)])
    check_stats(step, mesh, got, "reduce_scatter")


@pytest.mark.parametrize("k", KS)
def test_all_to_all_uneven(k: int) -> None:
    mesh = line(k)
    src, dst = ttype((10, 7), (("dp",), ())), ttype((10, 7), ((), ("dp",)))
    step = RedistStep(StepKind.ALL_TO_ALL, src, dst, ("dp",), dim=0, dst_dim=1)
    g = np.arange(70, dtype=np.float32).reshape(10, 7)
    got = run_step(step, mesh, blocks_of(g, src, mesh))
    for r, (out, _) in enumerate(got):
        np.testing.assert_array_equal(out, g[local_block(dst.shape, dst.layout, mesh, r)])
    check_stats(step, mesh, got, "all_to_all")
    ref = apply_step(step, mesh, blocks_of(g, src, mesh))
    for (out, _), want in zip(got, ref, strict=True):
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize(
    ("src_dims", "dst_dims"),
    [((("tp", "dp"),), (("tp",),)), ((("dp", "tp"),), (("tp", "dp"),)), ((("dp",),), (("tp",),))],
)
def test_exchange_non_nesting(src_dims: Any, dst_dims: Any) -> None:
    mesh = MeshShape((("dp", 2), ("tp", 2)))
    src = ttype((10,), src_dims)
    plan = plan_redistribute(src, Layout(dst_dims), mesh)
    (step,) = plan.steps
    assert step.kind is StepKind.EXCHANGE
    g = np.arange(10, dtype=np.float32) * 1.5
    got = run_step(step, mesh, blocks_of(g, src, mesh))
    for r, (out, _) in enumerate(got):
        np.testing.assert_array_equal(out, g[local_block((10,), Layout(dst_dims), mesh, r)])
    check_stats(step, mesh, got, "exchange")


@pytest.mark.parametrize(("k", "root"), [(1, 0), (2, 1), (3, 2), (4, 0), (4, 3)])
def test_broadcast_line(k: int, root: int) -> None:
    mesh = line(k)
    xs = [np.full((3, 2), float(r), np.float32) for r in range(k)]

    def body(comm: SimComm) -> tuple[np.ndarray, Any]:
        return comm.broadcast(xs[comm.rank], ("dp",), root), comm.stats

    got = run_ranks(mesh, body, timeout_s=10.0)
    for r, (out, stats) in enumerate(got):
        np.testing.assert_array_equal(out, xs[root])
        assert out is not xs[root]
        assert stats.calls == Counter({"broadcast": 1})
        size = xs[root].nbytes
        want = ((k - 1) * size, 0) if r == root else (0, size)
        assert (stats.bytes_sent, stats.bytes_received) == want


def test_broadcast_groups_on_2d_mesh() -> None:
    # along tp, root 1: rank (dp, 0) takes the array of rank (dp, 1)
    mesh = MeshShape((("dp", 2), ("tp", 2)))
    got = run_ranks(
        mesh, lambda comm: comm.broadcast(np.array([comm.rank]), ("tp",), 1), timeout_s=10.0
    )
    assert [int(a[0]) for a in got] == [1, 1, 3, 3]
    got = run_ranks(
        mesh, lambda comm: comm.broadcast(np.array([comm.rank]), ("dp",), 0), timeout_s=10.0
    )
    assert [int(a[0]) for a in got] == [0, 1, 0, 1]


def test_groups_run_independently_on_2d_mesh() -> None:
    # an allreduce along tp sums within each dp row only
    mesh = MeshShape((("dp", 2), ("tp", 2)))
    src = TensorType(DType.I64, (2,), Layout(((),), Partial(ReduceOp.SUM, ("tp",))))
    step = RedistStep(
        StepKind.ALLREDUCE, src, src.with_layout(Layout(((),))), ("tp",), op=ReduceOp.SUM
    )
    xs = [np.array([r, 10 * r], np.int64) for r in range(4)]
    got = run_step(step, mesh, xs)
    assert [out.tolist() for out, _ in got] == [[1, 10], [1, 10], [5, 50], [5, 50]]


# --- point to point --------------------------------------------------------------------------


def test_send_recv_and_stats() -> None:
    mesh = line(4)
    payload = np.arange(6, dtype=np.float64).reshape(2, 3)

    def body(comm: SimComm) -> Any:
        if comm.rank == 0:
            comm.send(payload, 2, tag=5)
            comm.send(payload + 1, 2, tag=6)
            payload[...] = -1  # the message was copied when sent
            return None
        if comm.rank == 2:
            b = comm.recv((2, 3), np.dtype(np.float64), 0, tag=6)
            a = comm.recv((2, 3), np.dtype(np.float64), 0, tag=5)
            return a, b
        return None

    got = run_ranks(mesh, body, timeout_s=10.0)
    a, b = got[2]
    np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(b, np.arange(6).reshape(2, 3) + 1)


def test_send_recv_statistics() -> None:
    mesh = line(2)
    x = np.ones((4, 4), np.float32)

    def body(comm: SimComm) -> Any:
        if comm.rank == 0:
            comm.send(x, 1, 0)
        else:
            comm.recv((4, 4), np.dtype(np.float32), 0, 0)
        return comm.stats

    s0, s1 = run_ranks(mesh, body, timeout_s=10.0)
    assert s0.calls == Counter({"send": 1}) and (s0.bytes_sent, s0.bytes_received) == (64, 0)
    assert s1.calls == Counter({"recv": 1}) and (s1.bytes_sent, s1.bytes_received) == (0, 64)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((3, 4), np.float32), ((4, 3), np.float64), ((12,), np.float32)]
)
def test_recv_wrong_shape_or_dtype(shape: tuple[int, ...], dtype: Any) -> None:
    mesh = line(2)

    def body(comm: SimComm) -> Any:
        if comm.rank == 0:
            comm.send(np.zeros((4, 3), np.float32), 1, 3)
            return None
        try:
            comm.recv(shape, np.dtype(dtype), 0, 3)
        except CommError as err:
            return err
        return None

    _, err = run_ranks(mesh, body, timeout_s=10.0)
    assert type(err) is CommError
    assert err.rank == 1
    assert "recv from rank 0 tag 3" in str(err)
    assert "got float32[4, 3]" in str(err)


def test_recv_without_send_times_out() -> None:
    mesh = line(2)

    def body(comm: SimComm) -> Any:
        if comm.rank == 1:
            try:
                comm.recv((1,), np.dtype(np.float32), 0, 9)
            except CommTimeoutError as err:
                return err
        return None

    start = time.monotonic()
    _, err = run_ranks(mesh, body, timeout_s=0.3)
    assert time.monotonic() - start < 5
    assert isinstance(err, CommTimeoutError)
    assert err.op == "recv" and err.rank == 1
    assert "did not complete within 0.3 s" in str(err)


# --- failures --------------------------------------------------------------------------------


def _allreduce_all(comm: SimComm) -> np.ndarray:
    x = np.ones(4, np.float32)
    spec = AllreduceSpec(comm.mesh.group_of(comm.rank, ("dp",)), comm.rank, ReduceOp.SUM, 4)
    return comm.allreduce(x, ("dp",), spec)


def test_missing_rank_times_out_naming_op_and_axes() -> None:
    mesh = line(4)

    def body(comm: SimComm) -> Any:
        if comm.rank == 3:
            return "idle"
        try:
            _allreduce_all(comm)
        except CommTimeoutError as err:
            return err
        return "completed"

    start = time.monotonic()
    got = run_ranks(mesh, body, timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert got[3] == "idle"
    for r in range(3):
        err = got[r]
        assert isinstance(err, CommTimeoutError), (r, err)
        assert (err.op, err.axis, err.rank) == ("allreduce", "dp", r)
        assert f"rank {r}: allreduce on axes dp did not complete within 0.5 s" in str(err)


def test_missing_rank_fails_run_ranks_quickly() -> None:
    mesh = line(4)

    def body(comm: SimComm) -> Any:
        if comm.rank == 3:
            return None
        return _allreduce_all(comm)

    start = time.monotonic()
    with pytest.raises((RemoteFailureError, CommTimeoutError)) as info:
        run_ranks(mesh, body, timeout_s=0.5)
    assert time.monotonic() - start < 5
    err = info.value
    assert isinstance(err, RemoteFailureError)
    ranks = [f.rank for f in err.failures]
    assert ranks and set(ranks) <= {0, 1, 2}
    for f in err.failures:
        assert "allreduce on axes dp did not complete within 0.5 s" in f.message
    assert isinstance(err.__cause__, CommTimeoutError)


@pytest.mark.parametrize("failing", [0, 2, 3])
def test_raising_rank_poisons_peers(failing: int) -> None:
    mesh = line(4)

    def body(comm: SimComm) -> Any:
        if comm.rank == failing:
            time.sleep(0.05)  # let the peers block in the collective first
            raise ValueError(f"boom on {comm.rank}")
        return _allreduce_all(comm)

    start = time.monotonic()
    with pytest.raises(RemoteFailureError) as info:
        run_ranks(mesh, body, timeout_s=30.0)
    assert time.monotonic() - start < 5  # far below the 30 s timeout
    err = info.value
    assert err.failures == (RankFailure(failing, "run", f"boom on {failing}"),)
    assert str(err) == f"run failed on rank(s) {failing}: rank {failing} (run): boom on {failing}"
    assert isinstance(err.__cause__, ValueError)


def test_failure_after_a_collective_stops_the_next_one() -> None:
    mesh = line(3)
    reached: list[int] = []

    def body(comm: SimComm) -> Any:
        _allreduce_all(comm)
        if comm.rank == 1:
            raise RuntimeError("late failure")
        try:
            _allreduce_all(comm)
        except PoisonedError as err:
            reached.append(comm.rank)
            assert isinstance(err.cause, RuntimeError)
            raise
        return None

    start = time.monotonic()
    with pytest.raises(RemoteFailureError) as info:
        run_ranks(mesh, body, timeout_s=30.0, phase="step 0")
    assert time.monotonic() - start < 5
    assert [(f.rank, f.phase, f.message) for f in info.value.failures] == [
        (1, "step 0", "late failure")
    ]
    assert sorted(reached) == [0, 2]


def test_several_failing_ranks_are_all_listed() -> None:
    mesh = line(4)

    def body(comm: SimComm) -> Any:
        if comm.rank in (1, 3):
            raise KeyError(f"rank{comm.rank}")
        return _allreduce_all(comm)

    with pytest.raises(RemoteFailureError) as info:
        run_ranks(mesh, body, timeout_s=30.0)
    assert [f.rank for f in info.value.failures] == [1, 3]
    assert [f.message for f in info.value.failures] == ["'rank1'", "'rank3'"]


def test_collective_mismatch_names_both_calls() -> None:
    mesh = line(2)
    t = ttype((4,), (("dp",),))
    gather = RedistStep(StepKind.ALLGATHER, t, ttype((4,), ((),)), ("dp",), dim=0)

    def body(comm: SimComm) -> Any:
        x = np.ones(2, np.float32)
        try:
            if comm.rank == 0:
                _allreduce_all(comm)
            else:
                comm.allgather(x, ("dp",), rank_spec(gather, mesh, 1))  # type: ignore[arg-type]
        except CommError as err:
            return err
        return None

    got = run_ranks(mesh, body, timeout_s=10.0)
    for r, err in enumerate(got):
        assert type(err) is CommError, (r, err)
        text = str(err)
        assert "collective mismatch on axes dp" in text
        assert "rank 0: allreduce" in text and "rank 1: allgather" in text


def test_collective_mismatch_fails_run_ranks() -> None:
    mesh = line(2)

    def body(comm: SimComm) -> Any:
        if comm.rank == 0:
            return _allreduce_all(comm)
        return comm.broadcast(np.ones(4, np.float32), ("dp",), 0)

    start = time.monotonic()
    with pytest.raises(RemoteFailureError) as info:
        run_ranks(mesh, body, timeout_s=30.0)
    assert time.monotonic() - start < 5
    assert info.value.failures
    for f in info.value.failures:
        assert "rank 0: allreduce, rank 1: broadcast" in f.message


def test_run_ranks_results_in_rank_order() -> None:
    mesh = MeshShape((("dp", 2), ("tp", 3)))

    def call(comm: SimComm) -> Any:
        return comm.rank, comm.mesh.coords(comm.rank)

    got = run_ranks(mesh, call)
    assert got == [(r, mesh.coords(r)) for r in range(6)]
