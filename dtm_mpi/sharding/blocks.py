"""Local blocks: which part of a global array each rank holds (docs/spec/ir.md §5).

A dimension of size ``n`` split over axes ``(a1, …, am)`` (major first) has ``k = s1·…·sm``
shards; the rank with index ``i`` along those axes (:meth:`MeshShape.index_along`) holds shard
``i``. With ``b = ceil(n / k)``::

    start_i  = min(i · b, n)
    length_i = max(0, min(b, n - i · b))

(the ``torch.chunk`` rule: all shards but the trailing ones hold ``b`` elements, trailing ones
may be short or empty). A rank's local block is the product over dimensions of its shard of each
split dimension and the full range of each ``-`` dimension. A pending reduction does not change
blocks: it is ignored here.

**Pins.** A value may be held only by the ranks at one coordinate of one axis (a pipeline
stage's parameters: the ranks of its ``pp`` coordinate), a *pin* ``(axis, coordinate)``: on
those ranks its blocks are as above (its layout never splits over the pinned axis), the other
ranks hold an empty block and own nothing.

**Nesting.** Under this rule a split over ``(F…, A…)`` refines the split over ``(F…)`` only when
:func:`splits_nest` holds: for ``n = 10`` over ``(B, A)`` with sizes 2x2 the blocks are
``[0,3) [3,6) [6,9) [9,10)`` but over ``B`` alone ``[0,5) [5,10)``, so element 5 is in the second
``B`` block but in the first group of ``(B, A)`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtm_mpi.errors import LayoutError
from dtm_mpi.ir.types import Layout
from dtm_mpi.sharding.mesh import MeshShape

__all__ = [
    "Pin",
    "block_owners",
    "holds",
    "intersect_regions",
    "check_layout",
    "dim_bounds",
    "local_block",
    "local_offsets",
    "local_shape",
    "pinned_block",
    "region_size",
    "shard_bounds",
    "shard_index",
    "splits_nest",
]


Pin = tuple[str, int]
"""``(axis, coordinate)``: a value held only by the ranks at that coordinate of that axis."""


def holds(mesh: MeshShape, rank: int, pin: Pin | None) -> bool:
    """Whether ``rank`` holds a value pinned to ``pin`` (every rank when None)."""
    return pin is None or mesh.index_along(rank, (pin[0],)) == pin[1]


def shard_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """``(start, length)`` of shard ``i`` of ``k`` of a dimension of size ``n`` (§5)."""
    if n < 0:
        raise LayoutError(f"dimension size must be >= 0; got {n}")
    if k < 1:
        raise LayoutError(f"number of shards must be >= 1; got {k}")
    if not 0 <= i < k:
        raise LayoutError(f"shard index {i} is out of range 0..{k - 1}")
    b = -(-n // k)
    return min(i * b, n), max(0, min(b, n - i * b))


def splits_nest(n: int, k_outer: int, k_inner: int) -> bool:
    """Whether splitting a dimension of size ``n`` into ``k_outer · k_inner`` shards refines its
    split into ``k_outer`` shards: shards ``i·k_inner … i·k_inner + k_inner - 1`` of the fine
    split together are shard ``i`` of the coarse split, for every ``i``.

    True when ``ceil(n/k_outer) == k_inner · ceil(n/(k_outer·k_inner))``, and also in the few
    cases where the difference is clamped away at ``n`` (e.g. ``n <= 1``, or ``k_outer == 1``).
    """
    if k_outer < 1 or k_inner < 1:
        raise LayoutError(f"shard counts must be >= 1; got {k_outer} and {k_inner}")
    b_coarse = -(-n // k_outer)
    b_fine = -(-n // (k_outer * k_inner))
    if b_coarse == k_inner * b_fine:
        return True
    return all(min(i * k_inner * b_fine, n) == min(i * b_coarse, n) for i in range(1, k_outer))


def shard_index(mesh: MeshShape, rank: int, axes: tuple[str, ...]) -> int:
    """The shard of a dimension split over ``axes`` that ``rank`` holds (§5)."""
    return mesh.index_along(rank, axes)


def dim_bounds(n: int, axes: tuple[str, ...], mesh: MeshShape, rank: int) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s part of a dimension of size ``n`` split over ``axes``
    (``(0, n)`` when ``axes`` is empty)."""
    if not axes:
        return 0, n
    return shard_bounds(n, mesh.group_size(axes), mesh.index_along(rank, axes))


def check_layout(shape: Sequence[int], layout: Layout, mesh: MeshShape) -> None:
    """Raise :class:`LayoutError` unless ``layout`` fits ``shape`` on ``mesh``: one entry per
    dimension, sizes >= 0, every axis an axis of the mesh, no axis used twice (split or pending),
    and a pending reduction names at least one axis (§4.3-§4.5)."""
    where = f"layout {layout or '{}'} of shape [{','.join(map(str, shape))}]"
    if len(layout.dims) != len(shape):
        raise LayoutError(
            f"{where}: needs one entry per dimension ({len(shape)}); got {len(layout.dims)}"
        )
    for entry in layout.dims:
        if not isinstance(entry, tuple) or not all(isinstance(a, str) for a in entry):
            raise LayoutError(f"{where}: each entry must be a tuple of axis names; got {entry!r}")
    for n in shape:
        if n < 0:
            raise LayoutError(f"{where}: dimension sizes must be >= 0; got {n}")
    if layout.partial is not None and not layout.partial.axes:
        raise LayoutError(f"{where}: a pending reduction needs at least one axis")
    seen: set[str] = set()
    for axis in layout.used_axes:
        if axis not in mesh.axis_names:
            raise LayoutError(f"{where}: mesh {mesh} has no axis {axis!r}")
        if axis in seen:
            raise LayoutError(f"{where}: axis {axis!r} is used more than once")
        seen.add(axis)


def _bounds(
    shape: Sequence[int], layout: Layout, mesh: MeshShape, rank: int
) -> list[tuple[int, int]]:
    check_layout(shape, layout, mesh)
    return [dim_bounds(n, axes, mesh, rank) for n, axes in zip(shape, layout.dims, strict=True)]


def local_block(
    shape: Sequence[int], layout: Layout, mesh: MeshShape, rank: int
) -> tuple[slice, ...]:
    """``rank``'s local block of a global array of ``shape`` in ``layout``: one slice per dim."""
    return tuple(slice(s, s + n) for s, n in _bounds(shape, layout, mesh, rank))


def local_shape(
    shape: Sequence[int], layout: Layout, mesh: MeshShape, rank: int
) -> tuple[int, ...]:
    """The shape of ``rank``'s local array."""
    return tuple(n for _, n in _bounds(shape, layout, mesh, rank))


def local_offsets(
    shape: Sequence[int], layout: Layout, mesh: MeshShape, rank: int
) -> tuple[int, ...]:
    """The global index of the first element of ``rank``'s local block, per dimension."""
    return tuple(s for s, _ in _bounds(shape, layout, mesh, rank))


def pinned_block(
    shape: Sequence[int], layout: Layout, mesh: MeshShape, rank: int, pin: Pin | None
) -> tuple[slice, ...]:
    """:func:`local_block`, or the empty block (``0:0`` in every dimension) on a rank that
    does not hold a value pinned to ``pin`` (a scalar has no empty block: its whole value)."""
    if holds(mesh, rank, pin):
        return local_block(shape, layout, mesh, rank)
    check_layout(shape, layout, mesh)
    return tuple(slice(0, 0) for _ in shape)


def block_owners(
    shape: Sequence[int], layout: Layout, mesh: MeshShape, pin: Pin | None = None
) -> list[tuple[int, tuple[slice, ...]]]:
    """Every distinct non-empty block of ``layout`` once, as (owner, region), in owner order.

    Ranks that differ only along axes the layout does not split hold the same block; the
    lowest of them owns it (the one that sends it to an output, or writes it to a
    checkpoint); with ``pin``, the lowest of those that hold it. A pending reduction is
    ignored, as everywhere in this module: reduce first."""
    if pin is not None and pin[0] in layout.used_axes:
        raise LayoutError(f"layout {layout} splits over the pinned axis {pin[0]!r}")
    owners: dict[tuple[tuple[int, int], ...], tuple[int, tuple[slice, ...]]] = {}
    for rank in range(mesh.size):
        if not holds(mesh, rank, pin):
            continue
        bounds = _bounds(shape, layout, mesh, rank)
        if any(n == 0 for _, n in bounds):
            continue
        key = tuple(bounds)
        if key not in owners:
            owners[key] = (rank, tuple(slice(s, s + n) for s, n in bounds))
    return list(owners.values())


def intersect_regions(a: Sequence[slice], b: Sequence[slice]) -> tuple[slice, ...] | None:
    """The common part of two regions (one ``slice(start, stop)`` per dim), None if empty."""
    out = []
    for x, y in zip(a, b, strict=True):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def region_size(region: Sequence[slice]) -> int:
    """How many elements a region holds."""
    n = 1
    for s in region:
        n *= s.stop - s.start
    return n
