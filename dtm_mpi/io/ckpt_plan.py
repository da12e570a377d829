"""Checkpoint plans: pure functions of (tensors, mesh) that every rank computes identically.

**Save.** The owner of each distinct block (:func:`~dtm_mpi.sharding.blocks.block_owners`:
the lowest rank holding it) writes it as one dataset of its own in a data file of the
checkpoint; replicas write nothing. Ranks ``g*G .. g*G+G-1`` (``G = ranks_per_file``) share
data file ``g``, opened with the MPI-IO driver on their communicator; ``G = 1`` (the default)
is one file per writing rank, which measured fastest (a shared file serialises page-cache
writes on one inode on Linux file systems). The checkpoint's main file maps every shard into
one global virtual dataset per tensor. A shard is
hashed in chunks: runs of ``chunk_rows`` rows (dimension 0 of the shard) of about
``chunk_bytes``, each a hyperslab of its own, so a restore on another mesh can read and verify
any chunk by itself.

**Restore** onto any mesh and layout: every stored chunk is read exactly once, by one rank (the
rank whose target block holds most of it; ties go to the least-loaded rank, then the lowest),
verified against its hash in memory, and its pieces sent to every rank whose target block
intersects it. On the mesh and layout it was saved with, each chunk is read by a rank that
needs it; only replicas (ranks holding copies of the same block) receive pieces from others. Reads are cut into rounds of at most ``round_bytes`` per rank, so
memory beyond the restored blocks stays bounded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtm_mpi.errors import LayoutError, ManifestError, UsageError
from dtm_mpi.io.hashing import shard_hash
from dtm_mpi.io.manifest import (
    ArtifactClass,
    ArtifactRecord,
    Lifecycle,
    Manifest,
    ShardRecord,
    data_file_name,
    shard_dataset,
    stored_itemsize,
)
from dtm_mpi.ir.types import TensorType
from dtm_mpi.sharding.blocks import (
    Pin,
    block_owners,
    intersect_regions,
    local_block,
    pinned_block,
    region_size,
)
from dtm_mpi.sharding.mesh import MeshShape

__all__ = [
    "CHUNK_BYTES",
    "ROUND_BYTES",
    "Piece",
    "ReadItem",
    "RestorePlan",
    "SavePlan",
    "ShardPlan",
    "TensorSpec",
    "chunk_rows_for",
    "plan_manifest",
    "plan_restore",
    "plan_save",
    "valid_tensor_name",
]

CHUNK_BYTES = 8 << 20
"""Default bytes per hashed chunk (a run of whole rows of a shard)."""
ROUND_BYTES = 16 << 20
"""Default bytes one rank reads per restore round."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


def valid_tensor_name(name: str) -> bool:
    """Whether ``name`` may name a stored tensor (letters, digits, ``_.-``; not a digit first)."""
    return _NAME.match(name) is not None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor to save: its name, global type (layout on the saving mesh) and class."""

    name: str
    type: TensorType
    cls: ArtifactClass = ArtifactClass.PRIMARY
    parent: str | None = None
    rebuild: str | None = None
    pin: Pin | None = None
    """Held only by the ranks at this (axis, coordinate) of the mesh (a pipeline stage's
    state): one of them writes each block."""
    state: Lifecycle = Lifecycle.ACTIVE
    """Its lifecycle state in the new checkpoint (a copy carries a DEPRECATED tensor's)."""


@dataclass(frozen=True, slots=True)
class ShardPlan:
    index: int
    owner: int
    coords: tuple[int, ...]
    offset: tuple[int, ...]
    extent: tuple[int, ...]
    nbytes: int
    chunk_rows: int
    nchunks: int

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + e) for o, e in zip(self.offset, self.extent, strict=True))


@dataclass(frozen=True, slots=True)
class SavePlan:
    mesh: MeshShape
    specs: tuple[TensorSpec, ...]
    shards: tuple[tuple[ShardPlan, ...], ...]  # per spec (ephemeral: none)
    chunk_bytes: int
    ranks_per_file: int = 1

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for per in self.shards for s in per)

    def file_index(self, rank: int) -> int:
        """The data file ``rank`` writes into (with the other ranks of its group)."""
        return rank // self.ranks_per_file

    def group(self, rank: int) -> range:
        """The ranks that share ``rank``'s data file."""
        g = self.file_index(rank) * self.ranks_per_file
        return range(g, min(g + self.ranks_per_file, self.mesh.size))

    def file_shards(self, index: int) -> list[tuple[int, ShardPlan]]:
        """(spec index, shard) of every shard stored in data file ``index``, in the order
        its datasets are created (manifest order, then shard index)."""
        return [
            (i, s)
            for i, per in enumerate(self.shards)
            for s in per
            if self.file_index(s.owner) == index
        ]

    @property
    def files(self) -> tuple[int, ...]:
        """The data files that hold at least one shard (only these are created)."""
        return tuple(sorted({self.file_index(s.owner) for per in self.shards for s in per}))

    def owned(self, rank: int) -> list[tuple[int, ShardPlan]]:
        """(spec index, shard) of every shard ``rank`` writes."""
        return [(i, s) for i, per in enumerate(self.shards) for s in per if s.owner == rank]


def chunk_rows_for(extent: Sequence[int], itemsize: int, chunk_bytes: int) -> int:
    """Rows (dimension 0) per chunk of a shard with ``extent``: about ``chunk_bytes``, at
    least one row (a 0-d shard is one chunk of one "row")."""
    if not extent:
        return 1
    row = math.prod(extent[1:]) * itemsize
    return max(1, min(extent[0], chunk_bytes // max(row, 1)))


def _check_spec(spec: TensorSpec, mesh: MeshShape, names: set[str]) -> None:
    where = f"tensor {spec.name!r}"
    if not _NAME.match(spec.name):
        raise UsageError(
            f"{where}: a stored tensor name is letters, digits, '_', '.', '-' (not starting with a digit)"
        )
    if spec.name in names:
        raise UsageError(f"{where} is given twice")
    if spec.type.layout.partial is not None:
        raise LayoutError(
            f"{where}: layout {spec.type.layout} has a pending reduction; reduce it before saving"
        )
    if spec.cls is ArtifactClass.DERIVED and (spec.parent is None or spec.rebuild is None):
        raise UsageError(f"{where}: a derived artifact needs a parent and a rebuild instruction")
    if spec.cls is not ArtifactClass.DERIVED and (spec.parent or spec.rebuild):
        raise UsageError(f"{where}: only derived artifacts have a parent and rebuild instruction")
    local_block(spec.type.shape, spec.type.layout, mesh, 0)  # checks the layout on the mesh


def plan_save(
    specs: Sequence[TensorSpec],
    mesh: MeshShape,
    chunk_bytes: int = CHUNK_BYTES,
    ranks_per_file: int = 1,
) -> SavePlan:
    """Who writes which hyperslab of which tensor, in chunks, into which data file (module
    doc; ``ranks_per_file`` 0 means all ranks share one). Raises on names that repeat or
    cannot be dataset names, pending reductions, layouts that do not fit the mesh, and
    derived artifacts without parent (every rank raises the same error)."""
    if chunk_bytes <= 0:
        raise UsageError(f"chunk_bytes must be > 0; got {chunk_bytes}")
    if ranks_per_file < 0:
        raise UsageError(f"ranks_per_file must be >= 1 (0: all ranks); got {ranks_per_file}")
    ranks_per_file = ranks_per_file or mesh.size
    names: set[str] = set()
    for spec in specs:
        _check_spec(spec, mesh, names)
        names.add(spec.name)
    classes = {spec.name: spec.cls for spec in specs}
    for spec in specs:
        if spec.parent is not None and spec.parent not in names:
            raise UsageError(f"tensor {spec.name!r}: parent {spec.parent!r} is not saved with it")
        if spec.parent is not None and classes[spec.parent] is ArtifactClass.EPHEMERAL:
            raise UsageError(
                f"tensor {spec.name!r}: parent {spec.parent!r} is ephemeral (never stored): nothing to rebuild from"
            )
    plans: list[tuple[ShardPlan, ...]] = []
    for spec in specs:
        if spec.cls is ArtifactClass.EPHEMERAL:
            plans.append(())
            continue
        t = spec.type
        per = []
        for i, (owner, region) in enumerate(block_owners(t.shape, t.layout, mesh, spec.pin)):
            extent = tuple(s.stop - s.start for s in region)
            rows = chunk_rows_for(extent, stored_itemsize(t.dtype), chunk_bytes)
            nrows = extent[0] if extent else 1
            shard = ShardPlan(
                i,
                owner,
                mesh.coords(owner),
                tuple(s.start for s in region),
                extent,
                math.prod(extent) * stored_itemsize(t.dtype),
                rows,
                -(-nrows // rows),
            )
            per.append(shard)
        plans.append(tuple(per))
    return SavePlan(mesh, tuple(specs), tuple(plans), chunk_bytes, min(ranks_per_file, mesh.size))


def plan_manifest(
    plan: SavePlan,
    step: int,
    chunk_hashes: Mapping[tuple[int, int], tuple[str, ...]],
    module_hash: str | None = None,
    dtm_version: str = "",
) -> Manifest:
    """The sealed manifest of ``plan`` saved as ``step``, from the chunk hashes of every shard
    (``chunk_hashes[(spec index, shard index)]``): every artifact ACTIVE, shard hashes and
    Merkle roots computed. Pure: every rank builds the same one from the gathered hashes."""
    arts = []
    for i, spec in enumerate(plan.specs):
        t = spec.type
        shards = tuple(
            ShardRecord(
                f"{spec.name}:shard:{s.index}",
                s.index,
                s.owner,
                s.coords,
                s.offset,
                s.extent,
                s.nbytes,
                s.chunk_rows,
                chunk_hashes[(i, s.index)],
                shard_hash(chunk_hashes[(i, s.index)]),
                data_file_name(plan.file_index(s.owner)),
                shard_dataset(spec.name, s.index),
            )
            for s in plan.shards[i]
        )
        dataset = None if spec.cls is ArtifactClass.EPHEMERAL else f"/tensors/{spec.name}"
        arts.append(
            ArtifactRecord(
                spec.name,
                spec.cls,
                spec.state,
                t.dtype,
                t.shape,
                t.layout,
                dataset,
                spec.parent,
                spec.rebuild,
                shards,
            )
        )
    m = Manifest(step, plan.mesh.axes, tuple(arts), plan.chunk_bytes, module_hash, dtm_version)
    return m.sealed()


# --- restore ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadItem:
    """One stored chunk, read by ``reader`` in ``round``."""

    tensor: int  # index into RestorePlan.targets
    shard: int
    chunk: int
    region: tuple[slice, ...]  # global hyperslab
    reader: int
    round: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.region)


@dataclass(frozen=True, slots=True)
class Piece:
    """The part ``region`` (global) of read item ``item`` that rank ``dest`` needs."""

    item: int  # index into RestorePlan.items
    dest: int
    region: tuple[slice, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.region)


@dataclass(frozen=True, slots=True)
class RestorePlan:
    mesh: MeshShape
    targets: tuple[tuple[str, TensorType], ...]  # the tensors restored, in order
    artifacts: tuple[ArtifactRecord, ...]  # their manifest records
    items: tuple[ReadItem, ...]  # in (round, tensor, shard, chunk) order
    pieces: tuple[Piece, ...]  # in (item, dest) order
    rounds: int
    pins: tuple[Pin | None, ...] = ()  # per target: held only at that (axis, coordinate)

    def block(self, t: int, rank: int) -> tuple[slice, ...]:
        _, tt = self.targets[t]
        pin = self.pins[t] if self.pins else None
        return pinned_block(tt.shape, tt.layout, self.mesh, rank, pin)


def plan_restore(
    manifest: Manifest,
    targets: Sequence[tuple[str, TensorType]],
    mesh: MeshShape,
    round_bytes: int = ROUND_BYTES,
    where: str = "checkpoint",
    pins: Mapping[str, Pin] | None = None,
) -> RestorePlan:
    """Which rank reads which chunk in which round, and where each piece goes (module doc);
    a target in ``pins`` goes to the ranks at its (axis, coordinate) only. Raises :class:`ManifestError` when a target is missing from the manifest, has another
    dtype or shape, or is ephemeral (it has no stored data)."""
    names = [name for name, _ in targets]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UsageError(f"restore: tensor(s) {', '.join(map(repr, twice))} requested twice")
    arts = []
    for name, t in targets:
        a = manifest.artifact(name) if name in manifest.names else None
        if a is None:
            raise ManifestError(
                f"{where}: no tensor {name!r} (it has {', '.join(manifest.names) or 'none'})"
            )
        if a.cls is ArtifactClass.EPHEMERAL:
            raise ManifestError(f"{where}: tensor {name!r} is ephemeral: never stored")
        if a.dtype != t.dtype or a.shape != t.shape:
            raise ManifestError(
                f"{where}: tensor {name!r} is {a.dtype}{list(a.shape)}, not {t.dtype}{list(t.shape)}"
            )
        if t.layout.partial is not None:
            raise LayoutError(
                f"tensor {name!r}: cannot restore into a pending reduction ({t.layout})"
            )
        arts.append(a)
    ranks = range(mesh.size)
    pinned = tuple((pins or {}).get(name) for name, _ in targets)
    blocks = [
        [pinned_block(t.shape, t.layout, mesh, r, pin) for r in ranks]
        for (_, t), pin in zip(targets, pinned, strict=True)
    ]
    load = [0] * mesh.size
    staged: list[tuple[int, int, int, tuple[slice, ...], int, int]] = []
    piece_lists: list[list[tuple[int, tuple[slice, ...]]]] = []
    for ti, a in enumerate(arts):
        itemsize = stored_itemsize(a.dtype)
        for s in a.shards:
            for c in range(len(s.chunks)):
                region = s.chunk_region(c)
                needs = []
                for r in ranks:
                    got = intersect_regions(region, blocks[ti][r])
                    if got is not None:
                        needs.append((r, got))
                if not needs:  # cannot happen for a tiling shard set; keep plans total
                    continue
                best = max(region_size(g) for _, g in needs)
                reader = min((load[r], r) for r, g in needs if region_size(g) == best)[1]
                nbytes = region_size(region) * itemsize
                rnd = load[reader] // max(1, round_bytes)
                load[reader] += nbytes
                staged.append((rnd, ti, s.index, region, c, reader))
                piece_lists.append(needs)
    order = sorted(
        range(len(staged)), key=lambda k: (staged[k][0], staged[k][1], staged[k][2], staged[k][4])
    )
    items, pieces = [], []
    for new, k in enumerate(order):
        rnd, ti, shard, region, c, reader = staged[k]
        items.append(ReadItem(ti, shard, c, region, reader, rnd))
        pieces += [Piece(new, dest, got) for dest, got in piece_lists[k]]
    rounds = 1 + max((it.round for it in items), default=-1)
    plan = RestorePlan(
        mesh, tuple(targets), tuple(arts), tuple(items), tuple(pieces), rounds, pinned
    )
    _check_message_sizes(plan)
    return plan


MAX_MESSAGE = 2**31 - 1
"""The most bytes one rank sends another in one exchange (an MPI count)."""


def _check_message_sizes(plan: RestorePlan) -> None:
    """Refuse (on every rank alike) a plan whose exchange would pass ``MAX_MESSAGE`` bytes
    between two ranks in one round: only a single row of 2 GiB or more can do that."""
    sizes: dict[tuple[int, int, int], int] = {}
    for p in plan.pieces:
        item = plan.items[p.item]
        if p.dest != item.reader:
            key = (item.round, item.reader, p.dest)
            nbytes = region_size(p.region) * stored_itemsize(plan.artifacts[item.tensor].dtype)
            sizes[key] = sizes.get(key, 0) + nbytes
            if sizes[key] > MAX_MESSAGE:
                name = plan.targets[item.tensor][0]
                raise UsageError(
                    f"restore: tensor {name!r} would send {sizes[key]} bytes from rank {item.reader} to rank {p.dest} in one round, over the MPI count limit; rows of 2 GiB or more cannot be resharded"
                )
