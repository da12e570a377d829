"""MeshShape (ranks <-> coordinates, index along axes, groups), bind_mesh and
parse_mesh_binding (docs/spec/ir.md §5, §6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm_mpi.errors import LayoutError, UsageError
from dtm_mpi.ir.nodes import MeshDecl
from dtm_mpi.sharding import MeshShape, bind_mesh, parse_mesh_binding
from tests.depth import examples

MESH_2x3 = MeshShape((("dp", 2), ("tp", 3)))

meshes = st.lists(st.integers(1, 4), min_size=0, max_size=4).map(
    lambda sizes: MeshShape(tuple((f"a{i}", s) for i, s in enumerate(sizes)))
)


def test_size_names_and_axis_size() -> None:
    assert MESH_2x3.size == 6
    assert MESH_2x3.axis_names == ("dp", "tp")
    assert MESH_2x3.axis_size("tp") == 3
    assert MeshShape(()).size == 1
    with pytest.raises(LayoutError, match="no axis 'pp'"):
        MESH_2x3.axis_size("pp")


def test_coords_are_row_major_first_axis_major() -> None:
    assert [MESH_2x3.coords(r) for r in range(6)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert MESH_2x3.rank_of((1, 2)) == 5


@given(meshes)
def test_coords_rank_round_trip(mesh: MeshShape) -> None:
    seen = set()
    for r in range(mesh.size):
        c = mesh.coords(r)
        assert all(0 <= x < n for x, n in zip(c, mesh.sizes, strict=True))
        assert mesh.rank_of(c) == r
        seen.add(c)
    assert len(seen) == mesh.size


def test_index_along_follows_listed_order() -> None:
    mesh = MeshShape((("dp", 2), ("tp", 2)))
    # §5: for layout {(tp,dp)} the shard index is c_tp * 2 + c_dp
    assert [mesh.index_along(r, ("tp", "dp")) for r in range(4)] == [0, 2, 1, 3]
    assert [mesh.index_along(r, ("dp", "tp")) for r in range(4)] == [0, 1, 2, 3]
    assert [mesh.index_along(r, ("tp",)) for r in range(4)] == [0, 1, 0, 1]
    assert mesh.index_along(3, ()) == 0


def test_group_of_and_groups() -> None:
    assert MESH_2x3.group_of(4, ("tp",)) == (3, 4, 5)
    assert MESH_2x3.group_of(4, ("dp",)) == (1, 4)
    assert MESH_2x3.group_of(4, ()) == (4,)
    assert MESH_2x3.groups(("dp",)) == ((0, 3), (1, 4), (2, 5))
    assert MESH_2x3.groups(("tp", "dp")) == ((0, 3, 1, 4, 2, 5),)
    assert MESH_2x3.group_size(("dp", "tp")) == 6


@settings(max_examples=examples(60))
@given(meshes, st.data())
def test_groups_partition_the_ranks(mesh: MeshShape, data: st.DataObject) -> None:
    perm = data.draw(st.permutations(mesh.axis_names))
    axes = tuple(perm[: data.draw(st.integers(0, len(perm)))])
    groups = mesh.groups(axes)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(mesh.size))
    assert all(len(g) == mesh.group_size(axes) for g in groups)
    for g in groups:
        for i, r in enumerate(g):
            assert mesh.group_of(r, axes) == g
            assert mesh.index_along(r, axes) == i
            others = [p for p, a in enumerate(mesh.axis_names) if a not in axes]
            assert all(mesh.coords(r)[p] == mesh.coords(g[0])[p] for p in others)


@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ((("dp", 2), ("dp", 2)), "'dp' appears twice"),
        ((("dp", 0),), "size >= 1"),
        ((("1x", 2),), "identifier"),
    ],
)
def test_invalid_mesh_shapes(axes: tuple[tuple[str, int], ...], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        MeshShape(axes)


def test_rank_and_axis_errors() -> None:
    with pytest.raises(LayoutError, match=r"rank 6 is out of range 0\.\.5"):
        MESH_2x3.coords(6)
    with pytest.raises(LayoutError, match=r"out of range 0\.\.2 of axis 'tp'"):
        MESH_2x3.rank_of((0, 3))
    with pytest.raises(LayoutError, match="distinct"):
        MESH_2x3.group_of(0, ("dp", "dp"))
    with pytest.raises(LayoutError, match="no axis 'ep'"):
        MESH_2x3.index_along(0, ("ep",))


DECLARED = MeshDecl("m", (("dp", 2), ("tp", 4), ("pp", 1)))


def test_bind_without_binding_puts_all_ranks_on_the_first_axis() -> None:
    assert bind_mesh(DECLARED, 6, None).axes == (("dp", 6), ("tp", 1), ("pp", 1))
    assert bind_mesh(DECLARED, 1).size == 1


def test_bind_with_binding_overrides_named_axes() -> None:
    assert bind_mesh(DECLARED, 8, {"tp": 4}).axes == (("dp", 2), ("tp", 4), ("pp", 1))
    assert bind_mesh(DECLARED, 6, {"dp": 3, "tp": 2}).axes == (("dp", 3), ("tp", 2), ("pp", 1))


def test_bind_errors_name_axis_and_sizes() -> None:
    with pytest.raises(UsageError, match=r"axis 'ep'.*dp, tp, pp"):
        bind_mesh(DECLARED, 8, {"ep": 2})
    with pytest.raises(
        UsageError, match=r"\[dp=2, tp=4, pp=1\] has 8 rank\(s\), but the job has 6"
    ):
        bind_mesh(DECLARED, 6, {"dp": 2})
    with pytest.raises(UsageError, match="must be >= 1"):
        bind_mesh(DECLARED, 8, {"dp": 0})
    with pytest.raises(UsageError, match="number of ranks"):
        bind_mesh(DECLARED, 0)


def test_parse_mesh_binding() -> None:
    assert parse_mesh_binding("dp=2,tp=2") == {"dp": 2, "tp": 2}
    assert parse_mesh_binding(" dp = 4 ") == {"dp": 4}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("dp=2,,tp=2", "entry 2 is empty"),
        ("dp", "'dp' is not AXIS=SIZE"),
        ("dp=x", "size 'x' .*not a positive integer"),
        ("dp=-1", "size '-1'"),
        ("dp=0", "'dp=0': size must be >= 1"),
        ("dp=2,dp=3", "'dp' is given twice"),
        ("2p=2", "'2p' is not an identifier"),
        ("dp=٢", "not a positive integer"),
    ],
)
def test_parse_mesh_binding_errors(text: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_mesh_binding(text)
