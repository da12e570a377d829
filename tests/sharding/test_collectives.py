"""Reference semantics of the steps on one group (numpy) and apply_plan's argument checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dtm_mpi.errors import PlanError
from dtm_mpi.ir.types import DType, Layout, ReduceOp, TensorType
from dtm_mpi.sharding import (
    ExchangeSpec,
    MakePartialSpec,
    MeshShape,
    all_to_all,
    allgather,
    allreduce,
    apply_plan,
    exchange,
    make_partial,
    plan_redistribute,
    rank_spec,
    reduce_arrays,
    reduce_scatter,
    reduction_identity,
)


def test_allgather_concatenates_in_group_order() -> None:
    blocks = [np.array([[1, 2]]), np.array([[3, 4], [5, 6]]), np.zeros((0, 2), dtype=int)]
    outs = allgather(blocks, 0)
    assert len(outs) == 3
    for o in outs:
        assert o.tolist() == [[1, 2], [3, 4], [5, 6]]
    outs[0][0, 0] = 99  # members get their own arrays
    assert outs[1][0, 0] == 1


def test_allreduce_folds_left_to_right() -> None:
    a, b, c = np.array([1e16]), np.array([1.0]), np.array([-1e16])
    # binary64: (1e16 + 1) rounds to 1e16, so the order of the fold decides the result
    assert allreduce([a, b, c], ReduceOp.SUM)[0][0] == 0.0
    assert allreduce([c, a, b], ReduceOp.SUM)[0][0] == 1.0
    assert allreduce([np.array([3, -2]), np.array([1, 5])], ReduceOp.MAX)[1].tolist() == [3, 5]
    assert allreduce([np.array([3, -2]), np.array([1, 5])], ReduceOp.MIN)[0].tolist() == [1, -2]
    assert allreduce([np.array([3, -2]), np.array([1, 5])], ReduceOp.PROD)[0].tolist() == [3, -10]


def test_reduce_arrays_checks() -> None:
    with pytest.raises(PlanError, match="at least one"):
        reduce_arrays([], ReduceOp.SUM)
    with pytest.raises(PlanError, match="differ in shape"):
        reduce_arrays([np.zeros(2), np.zeros(3)], ReduceOp.SUM)
    a = np.array([1, 2])
    reduce_arrays([a, a], ReduceOp.SUM)
    assert a.tolist() == [1, 2]  # inputs untouched


def test_reduce_scatter_pieces() -> None:
    contribs = [np.arange(6).reshape(2, 3), np.ones((2, 3), dtype=int)]
    outs = reduce_scatter(contribs, ReduceOp.SUM, 1, [(0, 2), (2, 1)])
    assert outs[0].tolist() == [[1, 2], [4, 5]]
    assert outs[1].tolist() == [[3], [6]]
    with pytest.raises(PlanError, match="2 members but 1 pieces"):
        reduce_scatter(contribs, ReduceOp.SUM, 1, [(0, 3)])


def test_all_to_all_moves_pieces() -> None:
    # two members, each holds rows of a 4x4 array; afterwards each holds columns
    g = np.arange(16).reshape(4, 4)
    blocks = [g[0:2], g[2:4]]
    outs = all_to_all(blocks, 0, 1, [(0, 2), (2, 2)])
    assert np.array_equal(outs[0], g[:, 0:2])
    assert np.array_equal(outs[1], g[:, 2:4])


def test_exchange_matches_global_view() -> None:
    mesh = MeshShape((("dp", 2), ("tp", 2)))
    src = TensorType(DType.I32, (10,), Layout((("dp",),)))
    plan = plan_redistribute(src, Layout((("tp",),)), mesh)
    (step,) = plan.steps
    g = np.arange(10, dtype=np.int32)
    ins = [g[0:5], g[0:5], g[5:10], g[5:10]]
    specs = [rank_spec(step, mesh, r) for r in range(4)]
    outs = exchange(ins, specs)  # type: ignore[arg-type]
    assert [o.tolist() for o in outs] == [g[0:5].tolist(), g[5:10].tolist()] * 2


def test_exchange_detects_missing_transfers() -> None:
    mesh = MeshShape((("dp", 2),))
    src = TensorType(DType.F32, (4, 4), Layout((("dp",), ())))
    (step,) = plan_redistribute(src, Layout(((), ("dp",))), mesh).steps
    specs = [rank_spec(step, mesh, r) for r in range(2)]
    assert isinstance(specs[1], ExchangeSpec)
    broken = [specs[0], dataclasses.replace(specs[1], sends=())]
    ins = [np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32)]
    with pytest.raises(PlanError, match="no transfer"):
        exchange(ins, broken)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("op", "dtype", "want"),
    [
        (ReduceOp.SUM, np.float32, 0.0),
        (ReduceOp.PROD, np.int64, 1),
        (ReduceOp.MAX, np.float64, -np.inf),
        (ReduceOp.MIN, np.float16, np.inf),
        (ReduceOp.MAX, np.int8, -128),
        (ReduceOp.MIN, np.int32, 2**31 - 1),
        (ReduceOp.MAX, np.uint8, 0),
        (ReduceOp.MIN, np.uint8, 255),
        (ReduceOp.SUM, np.bool_, False),
        (ReduceOp.MIN, np.bool_, True),
    ],
)
def test_reduction_identities(op: ReduceOp, dtype: type, want: object) -> None:
    got = reduction_identity(op, np.dtype(dtype))
    assert got == want
    assert np.asarray(got).dtype == np.dtype(dtype)
    x = np.array([5], dtype=dtype) if dtype is not np.bool_ else np.array([True])
    assert reduce_arrays([x, np.full_like(x, got)], op).tolist() == x.tolist()


def test_make_partial_places_block_in_identity() -> None:
    a = np.array([1.0, 2.0])
    spec = MakePartialSpec(True, ReduceOp.MAX, (slice(1, 3),), (4,))
    assert make_partial(a, spec).tolist() == [-np.inf, 1.0, 2.0, -np.inf]
    drop = MakePartialSpec(False, ReduceOp.SUM, (slice(0, 2),), (2,))
    assert make_partial(a, drop).tolist() == [0.0, 0.0]
    same = MakePartialSpec(True, ReduceOp.SUM, (slice(0, 2),), (2,))
    assert make_partial(a, same) is a


def test_apply_plan_checks_its_arguments() -> None:
    mesh = MeshShape((("dp", 2),))
    src = TensorType(DType.F64, (4,), Layout((("dp",),)))
    plan = plan_redistribute(src, Layout(((),)), mesh)
    good = [np.zeros(2), np.ones(2)]
    assert [o.tolist() for o in apply_plan(plan, mesh, good)] == [[0, 0, 1, 1]] * 2
    with pytest.raises(PlanError, match="made for mesh"):
        apply_plan(plan, MeshShape((("dp", 2), ("tp", 1))), good)
    with pytest.raises(PlanError, match="got 1 local arrays"):
        apply_plan(plan, mesh, good[:1])
    with pytest.raises(PlanError, match=r"rank 1: input .* local shape \(2,\); got \(3,\)"):
        apply_plan(plan, mesh, [np.zeros(2), np.zeros(3)])
