"""shard_bounds (the uneven-split rule of docs/spec/ir.md §5), splits_nest, local blocks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtm_mpi.errors import LayoutError
from dtm_mpi.ir.types import Layout, Partial, ReduceOp
from dtm_mpi.sharding import (
    MeshShape,
    block_owners,
    check_layout,
    local_block,
    local_offsets,
    local_shape,
    shard_bounds,
    shard_index,
    splits_nest,
)

MESH = MeshShape((("dp", 2), ("tp", 2)))


def intervals(n: int, k: int) -> list[tuple[int, int]]:
    return [(s, s + m) for s, m in (shard_bounds(n, k, i) for i in range(k))]


@pytest.mark.parametrize(
    ("n", "k", "want"),
    [
        (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
        (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_spec_examples(n: int, k: int, want: list[tuple[int, int]]) -> None:
    assert intervals(n, k) == want


@given(st.integers(0, 200), st.integers(1, 40))
def test_blocks_tile_and_follow_the_ceil_rule(n: int, k: int) -> None:
    blocks = [shard_bounds(n, k, i) for i in range(k)]
    b = -(-n // k)
    pos = 0
    for start, length in blocks:
        assert start == min(pos, n)
        assert 0 <= length <= b
        pos = start + length
    assert pos == n
    lengths = [m for _, m in blocks]
    assert lengths == sorted(lengths, reverse=True)
    assert all(m == b for m in lengths[: n // b if b else 0])


def test_shard_bounds_errors() -> None:
    with pytest.raises(LayoutError, match=r"shard index 4 is out of range 0\.\.3"):
        shard_bounds(10, 4, 4)
    with pytest.raises(LayoutError, match=">= 1"):
        shard_bounds(10, 0, 0)
    with pytest.raises(LayoutError, match=">= 0"):
        shard_bounds(-1, 2, 0)


def test_splits_nest_examples() -> None:
    assert not splits_nest(10, 2, 2)  # (B,A) blocks [0,3)[3,6)[6,9)[9,10) vs B [0,5)[5,10)
    assert splits_nest(8, 2, 2)
    assert splits_nest(10, 1, 4)  # nothing above: always
    assert splits_nest(1, 2, 2)  # clamped at n
    assert splits_nest(5, 2, 3)  # ceil(5/2)=3 == 3*ceil(5/6)


@given(st.integers(0, 120), st.integers(1, 6), st.integers(1, 6))
def test_splits_nest_matches_the_definition(n: int, ko: int, ki: int) -> None:
    coarse = intervals(n, ko)
    fine = intervals(n, ko * ki)
    merged = [(fine[i * ki][0], fine[i * ki + ki - 1][1]) for i in range(ko)]
    assert splits_nest(n, ko, ki) == (merged == coarse)


def test_local_block_shape_offsets() -> None:
    layout = Layout((("tp", "dp"), ()))
    # rank 1 = (dp=0, tp=1): index along (tp,dp) = 1*2 + 0 = 2 -> [6,9) of 10
    assert shard_index(MESH, 1, ("tp", "dp")) == 2
    assert local_block((10, 3), layout, MESH, 1) == (slice(6, 9), slice(0, 3))
    assert local_shape((10, 3), layout, MESH, 3) == (1, 3)
    assert local_offsets((10, 3), layout, MESH, 2) == (3, 0)
    # partial is ignored for blocks
    pending = Layout((("dp",), ()), Partial(ReduceOp.SUM, ("tp",)))
    assert local_block((5, 2), pending, MESH, 3) == (slice(3, 5), slice(0, 2))


@given(st.lists(st.integers(0, 9), min_size=1, max_size=3), st.data())
def test_local_blocks_cover_the_array_once_per_replica(
    shape: list[int], data: st.DataObject
) -> None:
    rank = len(shape)
    dims = [()] * rank
    for axis in ("dp", "tp"):
        d = data.draw(st.integers(-1, rank - 1))
        if d >= 0:
            dims[d] = dims[d] + (axis,)
    layout = Layout(tuple(dims))
    used = [a for e in dims for a in e]
    copies = 4 // MESH.group_size(tuple(used))
    count: dict[tuple[int, ...], int] = {}
    for r in range(MESH.size):
        block = local_block(shape, layout, MESH, r)
        for idx in itertools.product(*(range(s.start, s.stop) for s in block)):
            count[idx] = count.get(idx, 0) + 1
    total = 1
    for n in shape:
        total *= n
    assert len(count) == total
    assert all(c == copies for c in count.values())


@pytest.mark.parametrize(
    ("shape", "layout", "match"),
    [
        ((4,), Layout(((), ())), "one entry per dimension"),
        ((4,), Layout((("ep",),)), "no axis 'ep'"),
        ((4, 4), Layout((("dp",), ("dp",))), "'dp' is used more than once"),
        ((4,), Layout((("dp",),), Partial(ReduceOp.SUM, ("dp",))), "'dp' is used more than once"),
        ((4,), Layout(((),), Partial(ReduceOp.SUM, ())), "at least one axis"),
        ((-1,), Layout(((),)), ">= 0"),
    ],
)
def test_check_layout_errors(shape: tuple[int, ...], layout: Layout, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        check_layout(shape, layout, MESH)
    with pytest.raises(LayoutError):
        local_block(shape, layout, MESH, 0)


@pytest.mark.parametrize(
    "mesh", [MeshShape((("dp", 3),)), MESH, MeshShape((("dp", 1), ("tp", 3)))], ids=str
)
@pytest.mark.parametrize("shape", [(5, 7), (10,), (2,), (), (0, 3)])
def test_block_owners_cover_every_element_once(mesh: MeshShape, shape: tuple[int, ...]) -> None:
    """Each element is in exactly one owned block, the owner holds that block, no owned block
    is empty, and the owner is the lowest rank holding it."""
    rank = len(shape)
    names = mesh.axis_names
    cases = [((),) * rank]
    if rank:
        cases.append(((names[0],),) + ((),) * (rank - 1))
        cases.append((names,) + ((),) * (rank - 1))
    if rank > 1:
        cases.append(((names[-1],), (names[0],)) if len(names) > 1 else ((), (names[0],)))
    for dims in cases:
        layout = Layout(tuple(dims))
        owners = block_owners(shape, layout, mesh)
        count: dict[tuple[int, ...], int] = {}
        for owner, region in owners:
            assert region == local_block(shape, layout, mesh, owner)
            cells = list(itertools.product(*(range(s.start, s.stop) for s in region)))
            assert cells, f"empty block owned by rank {owner}"
            for idx in cells:
                count[idx] = count.get(idx, 0) + 1
            holders = [r for r in range(mesh.size) if local_block(shape, layout, mesh, r) == region]
            assert owner == min(holders)
        total = 1
        for n in shape:
            total *= n
        assert len(count) == total and all(c == 1 for c in count.values()), (dims, owners)
        assert [o for o, _ in owners] == sorted(o for o, _ in owners)


def test_a_pinned_value_is_held_and_owned_by_the_ranks_of_its_coordinate_only() -> None:
    from dtm_mpi.sharding.blocks import block_owners, holds, pinned_block
    from dtm_mpi.sharding.mesh import MeshShape

    mesh = MeshShape((("pp", 2), ("tp", 2)))
    layout = Layout(((), ("tp",)))
    assert [holds(mesh, r, ("pp", 1)) for r in range(4)] == [False, False, True, True]
    assert pinned_block((4, 6), layout, mesh, 3, ("pp", 1)) == (slice(0, 4), slice(3, 6))
    assert pinned_block((4, 6), layout, mesh, 1, ("pp", 1)) == (slice(0, 0), slice(0, 0))
    assert [o for o, _ in block_owners((4, 6), layout, mesh, ("pp", 1))] == [2, 3]
    assert [o for o, _ in block_owners((4, 6), layout, mesh)] == [0, 1]
    with pytest.raises(LayoutError, match="splits over the pinned axis 'pp'"):
        block_owners((4, 6), Layout((("pp",), ())), mesh, ("pp", 0))
