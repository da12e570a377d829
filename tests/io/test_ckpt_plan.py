"""Checkpoint plans without MPI: plan_save (shards tile each tensor once, written by the lowest
holder, chunks of whole rows of at most chunk_bytes) and plan_restore, executed here in numpy:
on every mesh and layout every rank's target block is covered exactly once with the right
values, every stored chunk is read exactly once and matches its hash, nothing crosses ranks
when restoring onto the saving mesh and layout (without replicas), and a rank reads at most
round_bytes + one chunk per round. Meshes 1..4, 2x2, 4x1, 1x3; uneven shapes. Data files:
ranks r // G share file r // G (``ranks_per_file`` G, 0: all), and every shard is named in
the manifest by its owner's data file and its dataset ``/shards/<tensor>/<index>``."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm_mpi.errors import LayoutError, ManifestError, UsageError
from dtm_mpi.io.ckpt_plan import (
    CHUNK_BYTES,
    ROUND_BYTES,
    Piece,
    RestorePlan,
    SavePlan,
    TensorSpec,
    chunk_rows_for,
    plan_manifest,
    plan_restore,
    plan_save,
)
from dtm_mpi.io.hashing import chunk_hash
from dtm_mpi.io.manifest import ArtifactClass, Manifest
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.sharding.mesh import MeshShape
from tests.depth import examples

MESHES = {
    "1": MeshShape((("x", 1),)),
    "2": MeshShape((("x", 2),)),
    "3": MeshShape((("x", 3),)),
    "4": MeshShape((("x", 4),)),
    "2x2": MeshShape((("x", 2), ("y", 2))),
    "4x1": MeshShape((("x", 4), ("y", 1))),
    "1x3": MeshShape((("x", 1), ("y", 3))),
}
SHAPES = [(10, 7), (5,), (3, 1, 4), (), (257, 33)]
DTYPES = [DType.F32, DType.F16, DType.I64, DType.BOOL, DType.F64]
KINDS = ["rep", "d0", "d1", "both", "group"]
CHUNK = {(257, 33): 4000}  # bytes per chunk for the test; 64 for the small shapes
ROUND = 100


def layout_of(kind: str, mesh: MeshShape, ndim: int) -> Layout:
    """Replicated, split on dim 0, on dim 1, dims 0 and 1 over both axes, or dim 0 over the
    group (y, x); a kind that the shape or mesh does not allow falls back to a simpler one."""
    axes = mesh.axis_names
    dims: list[tuple[str, ...]] = [()] * ndim
    if kind == "d0" and ndim >= 1:
        dims[0] = (axes[0],)
    elif kind == "d1" and ndim >= 2:
        dims[1] = (axes[-1],)
    elif kind == "both" and ndim >= 2 and len(axes) == 2:
        dims[0], dims[1] = (axes[0],), (axes[1],)
    elif kind == "both" and ndim >= 1:
        dims[0] = axes
    elif kind == "group" and ndim >= 1:
        dims[-1] = tuple(reversed(axes))
    return Layout(tuple(dims))


# --- an independent model of blocks (docs/spec/ir.md §5, §6) ------------------------------------


def ref_coords(mesh: MeshShape, rank: int) -> dict[str, int]:
    out = {}
    for name, size in reversed(mesh.axes):
        rank, out[name] = divmod(rank, size)
    return out


def ref_block(
    shape: tuple[int, ...], layout: Layout, mesh: MeshShape, rank: int
) -> tuple[slice, ...]:
    coords, sizes = ref_coords(mesh, rank), dict(mesh.axes)
    out = []
    for n, axes in zip(shape, layout.dims, strict=True):
        k, i = 1, 0
        for a in axes:
            i, k = i * sizes[a] + coords[a], k * sizes[a]
        b = -(-n // k)
        start = min(i * b, n)
        out.append(slice(start, start + max(0, min(b, n - i * b))))
    return tuple(out)


def size_of(region: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in region)


def bounds(region: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
    """A hashable form of a region (slices are hashable only from Python 3.12)."""
    return tuple((s.start, s.stop) for s in region)


def value_of(shape: tuple[int, ...], dtype: DType, seed: int) -> np.ndarray:
    n = math.prod(shape)
    base = (np.arange(n, dtype=np.int64) * 7919 + seed) % 2003
    if dtype is DType.BOOL:
        return (base % 2 == 1).reshape(shape)
    return base.astype(dtype.numpy_name).reshape(shape)


def manifest_of(plan: SavePlan, values: dict[str, np.ndarray]) -> Manifest:
    """The sealed manifest of ``plan`` with every chunk hashed from ``values`` (rows of the
    shard, hashed with xxhash directly)."""
    hashes: dict[tuple[int, int], tuple[str, ...]] = {}
    for i, (spec, per) in enumerate(zip(plan.specs, plan.shards, strict=True)):
        for s in per:
            block = np.ascontiguousarray(values[spec.name][s.region])
            rows = (
                [block]
                if block.ndim == 0
                else [block[c * s.chunk_rows : (c + 1) * s.chunk_rows] for c in range(s.nchunks)]
            )
            hashes[(i, s.index)] = tuple(xxhash.xxh3_128_hexdigest(r.tobytes()) for r in rows)
    return plan_manifest(plan, 1, hashes)


# --- save --------------------------------------------------------------------------------------


def check_save(plan: SavePlan, chunk_bytes: int) -> None:
    mesh = plan.mesh
    for spec, per in zip(plan.specs, plan.shards, strict=True):
        t = spec.type
        blocks = [ref_block(t.shape, t.layout, mesh, r) for r in range(mesh.size)]
        # (a) exact tiling: every element in exactly one shard
        count = np.zeros(t.shape, dtype=np.int64)
        for s in per:
            count[s.region] += 1
        assert (count == 1).all(), f"{spec.name}: shards do not tile {t.shape}"
        # owners: the lowest rank holding the block; shards in owner order, one per block
        distinct = {bounds(b) for b in blocks if size_of(b) > 0}
        assert len(per) == len(distinct)
        assert [s.index for s in per] == list(range(len(per)))
        assert [s.owner for s in per] == sorted(s.owner for s in per)
        for s in per:
            holders = [r for r, b in enumerate(blocks) if b == s.region]
            assert holders and s.owner == holders[0], (spec.name, s)
            assert s.coords == tuple(ref_coords(mesh, s.owner)[a] for a in mesh.axis_names)
            assert s.extent == tuple(x.stop - x.start for x in s.region)
            assert s.nbytes == size_of(s.region) * t.dtype.itemsize > 0
            # chunks: whole rows, at most chunk_bytes unless one row, as many rows as fit
            if not s.extent:
                assert (s.chunk_rows, s.nchunks) == (1, 1)
                continue
            rows, row = s.extent[0], math.prod(s.extent[1:]) * t.dtype.itemsize
            assert 1 <= s.chunk_rows <= rows
            assert s.chunk_rows == 1 or s.chunk_rows * row <= chunk_bytes
            assert s.chunk_rows == rows or (s.chunk_rows + 1) * row > chunk_bytes
            assert s.nchunks == -(-rows // s.chunk_rows)
            assert s.chunk_rows == chunk_rows_for(s.extent, t.dtype.itemsize, chunk_bytes)
    for r in range(mesh.size):
        assert plan.owned(r) == [
            (i, s) for i, per in enumerate(plan.shards) for s in per if s.owner == r
        ]
    assert plan.data_bytes == sum(s.nbytes for per in plan.shards for s in per)


def kinds_of(mesh: MeshShape) -> list[str]:
    """The kinds that give distinct layouts on ``mesh`` (on one axis 'both' is 'd0')."""
    seen: dict[tuple[Layout, ...], str] = {}
    for k in KINDS:
        seen.setdefault(tuple(layout_of(k, mesh, len(s)) for s in SHAPES), k)
    return list(seen.values())


SAVE_CASES = [(m, k) for m in MESHES for k in kinds_of(MESHES[m])]


def specs_for(mesh: MeshShape, kind: str) -> list[TensorSpec]:
    return [
        TensorSpec(f"t{i}", TensorType(DTYPES[i], shape, layout_of(kind, mesh, len(shape))))
        for i, shape in enumerate(SHAPES)
    ]


VALUES = {f"t{i}": value_of(shape, DTYPES[i], i) for i, shape in enumerate(SHAPES)}


@pytest.mark.parametrize(("mesh", "kind"), SAVE_CASES, ids=[f"{m}-{k}" for m, k in SAVE_CASES])
def test_save_plan_tiles_owners_and_chunks(mesh: str, kind: str) -> None:
    for chunk_bytes in (1, 40, 1000, CHUNK_BYTES):
        check_save(plan_save(specs_for(MESHES[mesh], kind), MESHES[mesh], chunk_bytes), chunk_bytes)


def test_save_plan_examples() -> None:
    """Hand-checked: (10,7) f32 split over x on a 2x2 mesh (rank = 2x + y): rows [0,5) owned by
    rank 0, [5,10) by rank 2; (5,) over (x,y): [0,2) [2,4) [4,5) by ranks 0, 1, 2 (rank 3's block
    is empty)."""
    mesh = MESHES["2x2"]
    plan = plan_save(
        [
            TensorSpec("w", TensorType(DType.F32, (10, 7), Layout((("x",), ())))),
            TensorSpec("b", TensorType(DType.F16, (5,), Layout((("x", "y"),)))),
            TensorSpec("e", TensorType(DType.F32, (4,), Layout(((),))), ArtifactClass.EPHEMERAL),
        ],
        mesh,
        chunk_bytes=64,
    )
    w, b, e = plan.shards
    assert [(s.owner, s.coords, s.offset, s.extent, s.chunk_rows, s.nchunks) for s in w] == [
        (0, (0, 0), (0, 0), (5, 7), 2, 3),
        (2, (1, 0), (5, 0), (5, 7), 2, 3),
    ]
    assert [(s.owner, s.offset, s.extent) for s in b] == [
        (0, (0,), (2,)),
        (1, (2,), (2,)),
        (2, (4,), (1,)),
    ]
    assert e == ()
    assert plan.owned(3) == [] and [i for i, _ in plan.owned(0)] == [0, 1]
    assert plan.data_bytes == 10 * 7 * 4 + 5 * 2


def test_zero_size_tensor_has_no_shards() -> None:
    mesh = MESHES["2"]
    spec = TensorSpec("z", TensorType(DType.F32, (0, 3), Layout((("x",), ()))))
    plan = plan_save([spec], mesh)
    assert plan.shards == ((),) and plan.data_bytes == 0
    m = manifest_of(plan, {"z": np.zeros((0, 3), np.float32)})
    r = plan_restore(m, [("z", spec.type)], MESHES["3"])
    assert r.items == () and r.pieces == () and r.rounds == 0


def test_chunk_rows_for() -> None:
    assert chunk_rows_for((), 8, 1) == 1
    assert chunk_rows_for((10,), 4, 12) == 3
    assert chunk_rows_for((10, 7), 4, 64) == 2  # 28-byte rows
    assert chunk_rows_for((10, 7), 4, 27) == 1  # a row larger than chunk_bytes: one row
    assert chunk_rows_for((3, 7), 4, 1 << 20) == 3  # never more than the rows
    assert chunk_rows_for((5, 0), 4, 64) == 5  # empty rows: all at once


# --- restore, simulated -------------------------------------------------------------------------


def pieces_by_item(plan: RestorePlan) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = {k: [] for k in range(len(plan.items))}
    for p in plan.pieces:
        out[p.item].append(p)
    return out


def simulate(
    plan: RestorePlan, manifest: Manifest, values: dict[str, np.ndarray], round_bytes: int
) -> None:
    """Execute ``plan`` in numpy and check every property of the module doc."""
    mesh = plan.mesh
    # every stored chunk read exactly once, from the region its shard record names
    read = Counter((plan.targets[it.tensor][0], it.shard, it.chunk) for it in plan.items)
    stored = {
        (a.name, s.index, c) for a in plan.artifacts for s in a.shards for c in range(len(s.chunks))
    }
    assert set(read) == stored and set(read.values()) <= {1}
    for it in plan.items:
        a = plan.artifacts[it.tensor]
        assert a == manifest.artifact(plan.targets[it.tensor][0])
        s = a.shards[it.shard]
        assert it.region == s.chunk_region(it.chunk)
        assert chunk_hash(values[a.name][it.region]) == s.chunks[it.chunk]  # verified in memory
        assert 0 <= it.reader < mesh.size
    # items in (round, tensor, shard, chunk) order, pieces in (item, dest) order
    keys = [(it.round, it.tensor, it.shard, it.chunk) for it in plan.items]
    assert keys == sorted(keys)
    assert [(p.item, p.dest) for p in plan.pieces] == sorted((p.item, p.dest) for p in plan.pieces)
    assert plan.rounds == 1 + max((it.round for it in plan.items), default=-1)
    # bounded rounds: per rank and round at most round_bytes + one chunk
    load: Counter[tuple[int, int]] = Counter()
    biggest = 0
    for it in plan.items:
        nbytes = size_of(it.region) * plan.artifacts[it.tensor].dtype.itemsize
        load[(it.reader, it.round)] += nbytes
        biggest = max(biggest, nbytes)
    assert all(v <= round_bytes + biggest for v in load.values()), (
        max(load.values()),
        round_bytes,
        biggest,
    )
    # every rank's target block covered exactly once, with the stored values
    outs: dict[tuple[int, int], np.ndarray] = {}
    counts: dict[tuple[int, int], np.ndarray] = {}
    blocks: dict[tuple[int, int], tuple[slice, ...]] = {}
    for ti, (name, t) in enumerate(plan.targets):
        for r in range(mesh.size):
            block = blocks[ti, r] = ref_block(t.shape, t.layout, mesh, r)
            assert plan.block(ti, r) == block
            shape = tuple(s.stop - s.start for s in block)
            outs[ti, r] = np.zeros(shape, dtype=values[name].dtype)
            counts[ti, r] = np.zeros(shape, dtype=np.int64)
    per_item: Counter[int] = Counter()
    for p in plan.pieces:
        it = plan.items[p.item]
        name = plan.targets[it.tensor][0]
        block = blocks[it.tensor, p.dest]
        assert all(
            i.start <= q.start < q.stop <= i.stop for q, i in zip(p.region, it.region, strict=True)
        )
        assert all(
            b.start <= q.start < q.stop <= b.stop for q, b in zip(p.region, block, strict=True)
        )
        local = tuple(
            slice(q.start - b.start, q.stop - b.start) for q, b in zip(p.region, block, strict=True)
        )
        outs[it.tensor, p.dest][local] = values[name][p.region]
        counts[it.tensor, p.dest][local] += 1
        per_item[p.item] += 1
    for (ti, r), c in counts.items():
        name, t = plan.targets[ti]
        assert (c == 1).all(), f"{name} on rank {r}: covered {np.unique(c)} times"
        assert outs[ti, r].tobytes() == values[name][blocks[ti, r]].tobytes()
    # the reader is a rank that needs the chunk, one with the largest part of it
    by_item = pieces_by_item(plan)
    for k, it in enumerate(plan.items):
        mine = by_item[k]
        assert per_item[k] == len(mine) >= 1
        best = max(size_of(p.region) for p in mine)
        assert any(p.dest == it.reader and size_of(p.region) == best for p in mine)


def replicas(shape: tuple[int, ...], layout: Layout, mesh: MeshShape) -> bool:
    blocks = [ref_block(shape, layout, mesh, r) for r in range(mesh.size)]
    nonempty = [bounds(b) for b in blocks if size_of(b) > 0]
    return len(nonempty) != len(set(nonempty))


RESTORE_CASES = SAVE_CASES


@pytest.mark.parametrize(
    ("mesh", "kind"), RESTORE_CASES, ids=[f"{m}-{k}" for m, k in RESTORE_CASES]
)
def test_restore_onto_every_mesh_and_layout(mesh: str, kind: str) -> None:
    src = MESHES[mesh]
    specs = [s for s in specs_for(src, kind) if s.type.shape != (257, 33)]
    manifest = manifest_of(plan_save(specs, src, 64), VALUES)
    # the big tensor in a manifest of its own, with bigger chunks (keeps the plans small)
    big_specs = [s for s in specs_for(src, kind) if s.type.shape == (257, 33)]
    big = manifest_of(plan_save(big_specs, src, CHUNK[(257, 33)]), VALUES)
    for dst_name, dst in MESHES.items():
        for dst_kind in kinds_of(dst):
            for m, ss, rb in ((manifest, specs, ROUND), (big, big_specs, 20 * ROUND)):
                targets = [
                    (s.name, s.type.with_layout(layout_of(dst_kind, dst, len(s.type.shape))))
                    for s in ss
                ]
                rp = plan_restore(m, targets, dst, rb)
                simulate(rp, m, VALUES, rb)
                if dst_name == mesh and dst_kind == kind:
                    check_same_mesh(rp)


def check_same_mesh(plan: RestorePlan) -> None:
    """Restoring onto the saving mesh and layout: each chunk is read by a rank holding all of
    it, every piece is the whole chunk, and without replicas nothing crosses ranks."""
    by_item = pieces_by_item(plan)
    for k, it in enumerate(plan.items):
        name, t = plan.targets[it.tensor]
        mine = by_item[k]
        assert all(p.region == it.region for p in mine)
        holders = {p.dest for p in mine}
        assert it.reader in holders
        reader_block = ref_block(t.shape, t.layout, plan.mesh, it.reader)
        assert all(ref_block(t.shape, t.layout, plan.mesh, d) == reader_block for d in holders)
        if not replicas(t.shape, t.layout, plan.mesh):
            assert holders == {it.reader}, (name, it, holders)
            assert it.reader == plan.artifacts[it.tensor].shards[it.shard].owner


def test_same_mesh_with_replicas_spreads_the_reads() -> None:
    """A replicated tensor on 2 ranks: each chunk is read once, by the less loaded replica, and
    sent to the other (a replicated block is needed by every rank; it is read only once)."""
    mesh = MESHES["2"]
    t = TensorType(DType.F32, (8, 4), Layout(((), ())))
    plan = plan_save([TensorSpec("r", t)], mesh, 16)
    m = manifest_of(plan, {"r": value_of((8, 4), DType.F32, 0)})
    rp = plan_restore(m, [("r", t)], mesh, 1000)
    assert [it.reader for it in rp.items] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert {(p.item, p.dest) for p in rp.pieces} == {(k, d) for k in range(8) for d in (0, 1)}
    simulate(rp, m, {"r": value_of((8, 4), DType.F32, 0)}, 1000)


def test_rounds_split_reads_by_bytes() -> None:
    mesh = MESHES["1"]
    t = TensorType(DType.F64, (10, 2), Layout(((), ())))
    plan = plan_save([TensorSpec("a", t)], mesh, 32)  # 16-byte rows: chunks of 2 rows
    m = manifest_of(plan, {"a": value_of((10, 2), DType.F64, 1)})
    assert [len(s.chunks) for s in m.artifact("a").shards] == [5]
    rp = plan_restore(m, [("a", t)], mesh, round_bytes=64)
    assert [it.round for it in rp.items] == [0, 0, 1, 1, 2] and rp.rounds == 3
    assert plan_restore(m, [("a", t)], mesh).rounds == 1 and ROUND_BYTES >= 160
    # a round number is the reader's running byte count // round_bytes (at least 1): rounds
    # in between may be empty
    assert plan_restore(m, [("a", t)], mesh, round_bytes=1).rounds == 129
    assert plan_restore(m, [("a", t)], mesh, round_bytes=0).rounds == 129


def test_restore_several_tensors_share_the_rounds() -> None:
    src, dst = MESHES["2x2"], MESHES["3"]
    specs = specs_for(src, "both")
    m = manifest_of(plan_save(specs, src, 64), VALUES)
    targets = [(s.name, s.type.with_layout(layout_of("d0", dst, len(s.type.shape)))) for s in specs]
    rp = plan_restore(m, targets, dst, 300)
    assert rp.rounds > 1
    assert {it.tensor for it in rp.items} == set(range(len(specs)))
    simulate(rp, m, VALUES, 300)


@st.composite
def layouts(draw: st.DrawFn, mesh: MeshShape, ndim: int) -> Layout:
    axes = list(draw(st.permutations(mesh.axis_names)))
    dims: list[tuple[str, ...]] = [()] * ndim
    for a in axes:
        d = draw(st.integers(-1, ndim - 1)) if ndim else -1
        if d >= 0:
            dims[d] = (*dims[d], a)
    return Layout(tuple(dims))


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_restore_property(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 9), max_size=3), label="shape"))
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    src = MESHES[data.draw(st.sampled_from(sorted(MESHES)), label="src")]
    dst = MESHES[data.draw(st.sampled_from(sorted(MESHES)), label="dst")]
    saved = TensorType(dtype, shape, data.draw(layouts(src, len(shape)), label="saved"))
    target = saved.with_layout(data.draw(layouts(dst, len(shape)), label="target"))
    chunk_bytes = data.draw(st.integers(1, 200), label="chunk_bytes")
    round_bytes = data.draw(st.integers(1, 500), label="round_bytes")
    plan = plan_save([TensorSpec("a", saved)], src, chunk_bytes)
    check_save(plan, chunk_bytes)
    values = {"a": value_of(shape, dtype, 5)}
    m = manifest_of(plan, values)
    simulate(plan_restore(m, [("a", target)], dst, round_bytes), m, values, round_bytes)
    same = plan_restore(m, [("a", saved)], src, round_bytes)
    simulate(same, m, values, round_bytes)
    check_same_mesh(same)


# --- errors ------------------------------------------------------------------------------------

T = TensorType(DType.F32, (10, 7), Layout((("x",), ())))


def _manifest() -> Manifest:
    mesh = MESHES["2"]
    specs = [TensorSpec("w", T), TensorSpec("tmp", T, ArtifactClass.EPHEMERAL)]
    return manifest_of(plan_save(specs, mesh), {"w": value_of((10, 7), DType.F32, 0)})


@pytest.mark.parametrize(
    ("targets", "error", "needle"),
    [
        ([("nope", T)], ManifestError, "ckpt.h5: no tensor 'nope' (it has w, tmp)"),
        ([("tmp", T)], ManifestError, "ckpt.h5: tensor 'tmp' is ephemeral: never stored"),
        (
            [("w", T.with_dtype(DType.F64))],
            ManifestError,
            "tensor 'w' is f32[10, 7], not f64[10, 7]",
        ),
        (
            [("w", TensorType(DType.F32, (7, 10), Layout(((), ()))))],
            ManifestError,
            "tensor 'w' is f32[10, 7], not f32[7, 10]",
        ),
        (
            [("w", T.with_layout(Layout(((), ()), Partial(ReduceOp.SUM, ("x",)))))],
            LayoutError,
            "tensor 'w': cannot restore into a pending reduction",
        ),
        ([("w", T.with_layout(Layout((("q",), ()))))], LayoutError, "no axis 'q'"),
        ([("w", T), ("nope", T)], ManifestError, "no tensor 'nope'"),
    ],
)
def test_restore_errors(
    targets: list[tuple[str, TensorType]], error: type[Exception], needle: str
) -> None:
    with pytest.raises(error) as info:
        plan_restore(_manifest(), targets, MESHES["3"], where="ckpt.h5")
    assert needle in str(info.value), str(info.value)


def test_restore_of_an_empty_manifest_names_none() -> None:
    with pytest.raises(ManifestError, match=r"no tensor 'w' \(it has none\)"):
        plan_restore(Manifest(1, (("x", 1),), (), 64).sealed(), [("w", T)], MESHES["1"])


D, E = ArtifactClass.DERIVED, ArtifactClass.EPHEMERAL
PARTIAL = T.with_layout(Layout((("x",), ()), Partial(ReduceOp.SUM, ("y",))))


@pytest.mark.parametrize(
    ("specs", "chunk_bytes", "error", "needle"),
    [
        ([TensorSpec("9w", T)], 64, UsageError, "tensor '9w': a stored tensor name is letters"),
        ([TensorSpec("a/b", T)], 64, UsageError, "tensor 'a/b': a stored tensor name"),
        ([TensorSpec("", T)], 64, UsageError, "a stored tensor name"),
        ([TensorSpec("w", T), TensorSpec("w", T)], 64, UsageError, "tensor 'w' is given twice"),
        ([TensorSpec("w", PARTIAL)], 64, LayoutError, "tensor 'w': layout"),
        ([TensorSpec("w", PARTIAL)], 64, LayoutError, "pending reduction; reduce it before saving"),
        (
            [TensorSpec("w", T, D)],
            64,
            UsageError,
            "tensor 'w': a derived artifact needs a parent and a rebuild instruction",
        ),
        (
            [TensorSpec("p", T), TensorSpec("w", T, D, "p")],
            64,
            UsageError,
            "needs a parent and a rebuild",
        ),
        (
            [TensorSpec("p", T), TensorSpec("w", T, parent="p")],
            64,
            UsageError,
            "tensor 'w': only derived artifacts have a parent",
        ),
        ([TensorSpec("w", T, rebuild="copy")], 64, UsageError, "only derived artifacts"),
        (
            [TensorSpec("w", T, D, "q", "copy")],
            64,
            UsageError,
            "tensor 'w': parent 'q' is not saved with it",
        ),
        ([TensorSpec("w", T.with_layout(Layout((("q",), ()))))], 64, LayoutError, "no axis 'q'"),
        (
            [TensorSpec("w", T.with_layout(Layout((("x",),))))],
            64,
            LayoutError,
            "one entry per dimension",
        ),
        ([TensorSpec("w", T)], 0, UsageError, "chunk_bytes must be > 0; got 0"),
    ],
)
def test_save_errors(
    specs: list[TensorSpec], chunk_bytes: int, error: type[Exception], needle: str
) -> None:
    with pytest.raises(error) as info:
        plan_save(specs, MESHES["2"], chunk_bytes)
    assert needle in str(info.value), str(info.value)


def test_save_accepts_derived_and_ephemeral() -> None:
    specs = [
        TensorSpec("w", T),
        TensorSpec("w16", T.with_dtype(DType.F16), D, "w", "cast:f16"),
        TensorSpec("tmp", T, E),
    ]
    plan = plan_save(specs, MESHES["2"], 64)
    assert [len(p) for p in plan.shards] == [2, 2, 0]
    assert plan.data_bytes == 10 * 7 * (4 + 2)


def test_save_refuses_a_derived_artifact_of_an_ephemeral_one() -> None:
    specs = [TensorSpec("tmp", T, E), TensorSpec("w", T, D, "tmp", "copy")]
    with pytest.raises(UsageError, match="'tmp'"):
        plan_save(specs, MESHES["2"], 64)


def test_every_rank_plans_the_same() -> None:
    """Pure: the same inputs give equal plans (every rank computes its own)."""
    for mesh, kind in itertools.islice(SAVE_CASES, 0, None, 4):
        a = plan_save(specs_for(MESHES[mesh], kind), MESHES[mesh], 64)
        b = plan_save(specs_for(MESHES[mesh], kind), MESHES[mesh], 64)
        assert a == b
        m = manifest_of(a, VALUES)
        targets = [
            (s.name, s.type.with_layout(layout_of(kind, MESHES["3"], len(s.type.shape))))
            for s in a.specs
        ]
        assert plan_restore(m, targets, MESHES["3"], ROUND) == plan_restore(
            m, targets, MESHES["3"], ROUND
        )


# --- data files (ranks_per_file) ---------------------------------------------------------------

PER_FILE = [1, 2, 3, 0, 8]


@pytest.mark.parametrize("per_file", PER_FILE, ids=[f"G={g or 'all'}" for g in PER_FILE])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_save_plan_data_files(mesh: str, per_file: int) -> None:
    """file_index, group, files and file_shards against the rule r // G (G clamped to the
    mesh; 0: all ranks), for every layout kind: the shards do not depend on G, every shard
    is in exactly one file (its owner's), in manifest order, and only files that hold a
    shard are listed."""
    m = MESHES[mesh]
    n = m.size
    g = n if per_file == 0 else min(per_file, n)
    for kind in kinds_of(m):
        plan = plan_save(specs_for(m, kind), m, 64, per_file)
        assert plan.ranks_per_file == g
        assert plan.shards == plan_save(specs_for(m, kind), m, 64).shards
        for r in range(n):
            assert plan.file_index(r) == r // g
            assert list(plan.group(r)) == [q for q in range(n) if q // g == r // g]
        every = [(i, s) for i, per in enumerate(plan.shards) for s in per]
        assert plan.files == tuple(sorted({s.owner // g for _, s in every}))
        for f in range(-(-n // g)):
            assert plan.file_shards(f) == [(i, s) for i, s in every if s.owner // g == f]
            assert bool(plan.file_shards(f)) == (f in plan.files)
        assert sorted((i, s.index) for f in plan.files for i, s in plan.file_shards(f)) == [
            (i, s.index) for i, s in every
        ]
        for a in manifest_of(plan, VALUES).artifacts:
            for s in a.shards:
                assert (s.file, s.dataset) == (
                    f"data-{s.owner // g:06d}.h5",
                    f"/shards/{a.name}/{s.index}",
                )


def test_save_plan_data_files_examples() -> None:
    """Hand-checked on 4 ranks with G=3: groups {0,1,2} and {3} (uneven); a tensor split over
    x has a shard in both files, a replicated one only in rank 0's; a zero-size tensor in
    none."""
    mesh = MESHES["4"]
    split = TensorSpec("w", TensorType(DType.F32, (8, 2), Layout((("x",), ()))))
    rep = TensorSpec("r", TensorType(DType.F32, (3,), Layout(((),))))
    empty = TensorSpec("z", TensorType(DType.F32, (0,), Layout((("x",),))))
    plan = plan_save([split, rep, empty], mesh, 64, ranks_per_file=3)
    assert [plan.file_index(r) for r in range(4)] == [0, 0, 0, 1]
    assert [plan.group(r) for r in range(4)] == [range(0, 3)] * 3 + [range(3, 4)]
    assert plan.files == (0, 1)
    assert [(i, s.index, s.owner) for i, s in plan.file_shards(0)] == [
        (0, 0, 0),
        (0, 1, 1),
        (0, 2, 2),
        (1, 0, 0),
    ]
    assert [(i, s.index, s.owner) for i, s in plan.file_shards(1)] == [(0, 3, 3)]
    assert plan_save([rep], mesh, 64, 3).files == (0,)
    assert plan_save([rep], mesh, 64, 1).files == (0,)
    assert plan_save([split], mesh, 64, 1).files == (0, 1, 2, 3)
    assert plan_save([split], mesh, 64, 0).files == (0,)
    assert plan_save([empty], mesh, 64, 2).files == ()
    assert plan_save([split], mesh, 64, 99).ranks_per_file == 4  # clamped to the mesh
    with pytest.raises(UsageError, match="ranks_per_file must be >= 1"):
        plan_save([split], mesh, 64, -1)
