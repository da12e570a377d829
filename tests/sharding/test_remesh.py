"""Moving tensors between meshes (dtm_mpi/sharding/remesh.py, dtm_mpi/runtime/remesh.py): for
every pair of meshes and layouts, the pieces rebuild each new block exactly, come from a rank
holding them (the receiver itself when it can), one per (tensor, sender, receiver); and the
same through the simulated communicator."""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest

from dtm_mpi.comm.sim import run_ranks
from dtm_mpi.errors import PlanError
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.runtime.remesh import move_blocks
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.remesh import plan_remesh

SHAPE = (7, 5)


def mesh(text: str) -> MeshShape:
    return MeshShape(tuple((k, int(v)) for k, v in (kv.split("=") for kv in text.split(","))))


MESHES = ["dp=2,tp=2", "dp=1,tp=3", "dp=2,tp=1", "dp=1,tp=1", "dp=2,tp=3", "dp=3,tp=1"]
DIMS = [
    ((), ()),
    (("dp",), ()),
    ((), ("tp",)),
    (("dp",), ("tp",)),
    (("tp", "dp"), ()),
    (("tp",), ("dp",)),
]


def types(dims: tuple[tuple[str, ...], ...]) -> list[TensorType]:
    return [TensorType(DType.F32, SHAPE, Layout(dims)), TensorType(DType.I64, (), Layout(()))]


def globals_() -> list[np.ndarray]:
    return [np.arange(35, dtype=np.float32).reshape(SHAPE), np.array(9, dtype=np.int64)]


def old_blocks(ts: list[TensorType], m: MeshShape, rank: int) -> list[np.ndarray]:
    return [
        g[local_block(t.shape, t.layout, m, rank)].copy()
        for g, t in zip(globals_(), ts, strict=True)
    ]


@pytest.mark.parametrize(("a", "b"), list(product(MESHES, MESHES)))
def test_the_pieces_rebuild_every_new_block(a: str, b: str) -> None:
    old, new = mesh(a), mesh(b)
    for da, db in product(DIMS, DIMS):
        ta, tb = types(da), types(db)
        plan = plan_remesh(ta, old, tb, new)
        seen = set()
        for p in plan.pieces:
            key = (p.tensor, p.src, p.dst)
            assert key not in seen  # one message per tensor and pair at most
            seen.add(key)
            t = ta[p.tensor]
            held = local_block(t.shape, t.layout, old, p.src)
            assert all(
                h.start <= r.start and r.stop <= h.stop for h, r in zip(held, p.region, strict=True)
            )
            if p.dst < old.size and p.src != p.dst:  # the receiver did not hold it itself
                mine = local_block(t.shape, t.layout, old, p.dst)
                assert not all(
                    h.start <= r.start and r.stop <= h.stop
                    for h, r in zip(mine, p.region, strict=True)
                )
        for dst in range(new.size):  # assembled from the senders' old blocks
            for i, (g, t) in enumerate(zip(globals_(), tb, strict=True)):
                want = g[local_block(t.shape, t.layout, new, dst)]
                got = np.full(want.shape, -1, dtype=want.dtype)
                offs = [s.start for s in local_block(t.shape, t.layout, new, dst)]
                for p in plan.pieces:
                    if p.tensor == i and p.dst == dst:
                        got[
                            tuple(
                                slice(r.start - o, r.stop - o)
                                for r, o in zip(p.region, offs, strict=True)
                            )
                        ] = g[p.region]
                assert np.array_equal(got, want), (a, b, da, db, dst, i)
        if a == b and da == db:
            assert plan.moved_bytes() == 0


def test_a_changed_tensor_or_a_pending_sum_is_refused() -> None:
    m = mesh("dp=2,tp=2")
    t = TensorType(DType.F32, SHAPE, Layout(((), ())))
    with pytest.raises(PlanError, match="only its layout may change"):
        plan_remesh([t], m, [TensorType(DType.F64, SHAPE, Layout(((), ())))], m)
    with pytest.raises(PlanError, match="pending reduction"):
        plan_remesh(
            [TensorType(DType.F32, SHAPE, Layout(((), ()), Partial(ReduceOp.SUM, ("dp",))))],
            m,
            [t],
            m,
        )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("dp=2,tp=2", "dp=1,tp=3"),
        ("dp=1,tp=3", "dp=2,tp=2"),
        ("dp=2,tp=3", "dp=1,tp=1"),
        ("dp=1,tp=1", "dp=3,tp=1"),
    ],
)
def test_move_blocks_through_the_simulated_communicator(a: str, b: str) -> None:
    old, new = mesh(a), mesh(b)
    ta, tb = types((("dp",), ("tp",))), types((("tp",), ()))
    plan = plan_remesh(ta, old, tb, new)
    union = MeshShape((("u", plan.ranks),))

    def rank_fn(comm):  # type: ignore[no-untyped-def]
        r = comm.rank
        return move_blocks(plan, r, old_blocks(ta, old, r) if r < old.size else None, comm)

    outs = run_ranks(union, rank_fn, timeout_s=30)
    for r, got in enumerate(outs):
        if r >= new.size:
            assert got is None
            continue
        assert got is not None
        for g, t, x in zip(globals_(), tb, got, strict=True):
            assert np.array_equal(x, g[local_block(t.shape, t.layout, new, r)])


def test_pinned_state_moves_from_and_to_the_ranks_of_its_stage() -> None:
    """A pipelined run's state (tensor k pinned to pp coordinate k on the old mesh) moves
    onto a mesh without pipeline stages and back: each piece comes from a rank of its old
    stage and goes to the ranks of its new one; the others hold none (None)."""
    t = TensorType(DType.F32, (4, 2), Layout(((), ("tp",))))
    staged = MeshShape((("pp", 2), ("dp", 1), ("tp", 2)))
    flat = MeshShape((("pp", 1), ("dp", 2), ("tp", 1)))
    pins = [("pp", 0), ("pp", 1)]
    down = plan_remesh([t, t], staged, [t, t], flat, pins, [("pp", 0), ("pp", 0)])
    assert {p.src for p in down.pieces if p.tensor == 0} == {0, 1}  # stage 0: ranks 0, 1
    assert {p.src for p in down.pieces if p.tensor == 1} == {2, 3}  # stage 1: ranks 2, 3
    assert {p.dst for p in down.pieces} == {0, 1}
    up = plan_remesh([t, t], flat, [t, t], staged, [("pp", 0), ("pp", 0)], pins)
    assert {p.dst for p in up.pieces if p.tensor == 1} == {2, 3}
    assert not up.holds_new(1, 0) and up.holds_new(0, 0) and not up.holds_new(0, 2)
    values = [np.arange(8, dtype=np.float32).reshape(4, 2) + 10 * k for k in range(2)]

    def rank(comm: object) -> list[np.ndarray | None] | None:
        r = comm.rank  # type: ignore[attr-defined]
        mine = [
            values[k][local_block(t.shape, t.layout, staged, r)]
            if staged.index_along(r, ("pp",)) == k
            else None
            for k in range(2)
        ]
        flat_blocks = move_blocks(down, r, mine, comm)  # type: ignore[arg-type]
        return move_blocks(up, r, flat_blocks if r < 2 else None, comm)  # type: ignore[arg-type]

    got = run_ranks(MeshShape((("x", 4),)), rank, timeout_s=30)
    for r, blocks in enumerate(got):
        assert blocks is not None
        k = staged.index_along(r, ("pp",))
        assert blocks[1 - k] is None
        held = blocks[k]
        assert held is not None
        np.testing.assert_array_equal(held, values[k][local_block(t.shape, t.layout, staged, r)])
