"""Moving tensors from one mesh to another in memory (a live resize): pure planning.

The ranks of the old mesh (``0 .. N-1``) and of the new one (``0 .. N'-1``) are numbered in one
communicator that holds both (the old world when the job shrinks, the merged one when it grows):
a number below both sizes is the same process on both meshes. For every tensor, every rank of
the new mesh needs its new block; the old mesh's distinct blocks partition the global array, so
the new block is cut into its intersections with them, and each piece comes from a rank that
holds that old block: the receiving rank itself where it does (a local copy, no message), else
one of the block's holders, chosen by the receiver's number so that replicas share the sending.

Every rank computes the same plan from (tensor types, old mesh, new mesh): at most one piece per
(tensor, sender, receiver), so the messages of one tensor between two ranks never need telling
apart, and each rank knows exactly what it sends and receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtm_mpi.errors import PlanError
from dtm_mpi.ir.types import TensorType
from dtm_mpi.sharding.blocks import Pin, holds, intersect_regions, local_block, region_size
from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["Piece", "RemeshPlan", "plan_remesh"]

Region = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """Part ``region`` (global indices) of tensor ``tensor``: held by ``src`` on the old mesh,
    needed by ``dst`` on the new one (``src == dst``: a local copy)."""

    tensor: int
    src: int
    dst: int
    region: Region


@dataclass(frozen=True, slots=True)
class RemeshPlan:
    """Every piece that moves (or is copied locally), in (tensor, receiver, sender) order."""

    old: MeshShape
    new: MeshShape
    types_old: tuple[TensorType, ...]
    types_new: tuple[TensorType, ...]
    pieces: tuple[Piece, ...]
    pins_old: tuple[Pin | None, ...] = ()
    """Per tensor: held only by the old mesh's ranks at this (axis, coordinate) (a pipeline
    stage's state; empty: none pinned)."""
    pins_new: tuple[Pin | None, ...] = ()
    """The same on the new mesh."""

    def holds_new(self, tensor: int, rank: int) -> bool:
        """Whether ``rank`` holds a block of ``tensor`` on the new mesh."""
        pin = self.pins_new[tensor] if self.pins_new else None
        return holds(self.new, rank, pin)

    @property
    def ranks(self) -> int:
        """The ranks of the communicator holding both meshes."""
        return max(self.old.size, self.new.size)

    def sends(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.src == rank and p.dst != rank]

    def receives(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst == rank and p.src != rank]

    def local(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst == rank and p.src == rank]

    def moved_bytes(self) -> int:
        """Bytes crossing between processes (local copies excluded)."""
        return sum(
            region_size(p.region) * self.types_old[p.tensor].dtype.itemsize
            for p in self.pieces
            if p.src != p.dst
        )


def _holders(
    t: TensorType, mesh: MeshShape, pin: Pin | None = None
) -> list[tuple[Region, list[int]]]:
    """Each distinct non-empty block of ``t`` on ``mesh`` and every rank holding it (with
    ``pin``: only the ranks at that (axis, coordinate))."""
    held: dict[tuple[tuple[int, int], ...], tuple[Region, list[int]]] = {}
    for rank in range(mesh.size):
        if not holds(mesh, rank, pin):
            continue
        region = local_block(t.shape, t.layout, mesh, rank)
        if all(s.stop > s.start for s in region):
            key = tuple((s.start, s.stop) for s in region)
            held.setdefault(key, (region, []))[1].append(rank)
    return list(held.values())


def plan_remesh(
    types_old: Sequence[TensorType],
    old: MeshShape,
    types_new: Sequence[TensorType],
    new: MeshShape,
    pins_old: Sequence[Pin | None] = (),
    pins_new: Sequence[Pin | None] = (),
) -> RemeshPlan:
    """The plan moving tensors laid out as ``types_old`` on ``old`` to ``types_new`` on ``new``
    (the same tensors: equal shapes and dtypes, complete values); ``pins_old``/``pins_new``:
    per tensor, held only by the ranks at an (axis, coordinate) of that mesh (a pipelined
    run's stage state; empty: none). Pure: every rank computes the same plan."""
    n = len(types_old)
    p_old = tuple(pins_old) if pins_old else (None,) * n
    p_new = tuple(pins_new) if pins_new else (None,) * len(types_new)
    if len(types_old) != len(types_new) or len(p_old) != n or len(p_new) != len(types_new):
        raise PlanError(f"remesh: {len(types_old)} tensors before, {len(types_new)} after")
    pieces: list[Piece] = []
    for i, (a, b) in enumerate(zip(types_old, types_new, strict=True)):
        if a.shape != b.shape or a.dtype is not b.dtype:
            raise PlanError(
                f"remesh: tensor {i} is {a} before and {b} after; only its layout may change"
            )
        if a.layout.partial is not None or b.layout.partial is not None:
            raise PlanError(f"remesh: tensor {i} ({a}) is a pending reduction; reduce it first")
        held = _holders(a, old, p_old[i])
        for dst in range(new.size):
            if not holds(new, dst, p_new[i]):
                continue
            want = local_block(b.shape, b.layout, new, dst)
            if any(s.stop <= s.start for s in want):
                continue
            for region, ranks in held:
                part = intersect_regions(want, region)
                if part is None:
                    continue
                src = dst if dst in ranks else ranks[dst % len(ranks)]
                pieces.append(Piece(i, src, dst, part))
    return RemeshPlan(old, new, tuple(types_old), tuple(types_new), tuple(pieces), p_old, p_new)
