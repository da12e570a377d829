"""Bound meshes: axis sizes fixed at launch, ranks <-> coordinates, groups of ranks along axes.

A :class:`MeshShape` is a mesh with the sizes an executor actually runs with (docs/spec/ir.md
§6). Ranks ``0 … P-1`` map to coordinates row-major, first axis major::

    rank = ((c1 · N2 + c2) · N3 + c3) · … · Nm + cm

The *index of a rank along a list of axes* ``[x1, …, xj]`` is the row-major index of its
coordinates on those axes in the listed order (§5: the shard index of a dimension split over
``(x1, …, xj)``; §6: the coordinate used by ``broadcast … root R``). The *group* of a rank along
axes ``A`` is the set of ranks that share its coordinates on every axis not in ``A``, ordered by
their index along ``A``; the groups along ``A`` partition the ranks.

:func:`bind_mesh` binds the sizes of a declared :class:`~dtm_mpi.ir.nodes.MeshDecl` for a job of
``nranks`` ranks (§6 "Binding sizes at launch"); :func:`parse_mesh_binding` reads the launcher's
``--mesh dp=2,tp=2`` text. Everything here is pure: every rank computes the same result.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dtm_mpi.errors import LayoutError, UsageError
from dtm_mpi.ir.nodes import MeshDecl

__all__ = ["MeshShape", "bind_mesh", "parse_mesh_binding"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _axes_text(axes: Iterable[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{a}={n}" for a, n in axes) + "]"


@dataclass(frozen=True, slots=True)
class MeshShape:
    """A mesh with bound sizes: ``axes`` is the ordered tuple of ``(name, size)``, major first."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for entry in self.axes:
            name, size = entry
            if not isinstance(name, str) or not _NAME.match(name):
                raise LayoutError(f"mesh axis name must be an identifier; got {name!r}")
            if name in seen:
                raise LayoutError(
                    f"mesh axis names must be unique; {name!r} appears twice in "
                    f"{_axes_text(self.axes)}"
                )
            seen.add(name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LayoutError(f"mesh axis {name!r} must have a size >= 1; got {size!r}")

    @staticmethod
    def from_mesh(mesh: MeshDecl) -> MeshShape:
        """The mesh with its declared (default) sizes."""
        return MeshShape(tuple(mesh.axes))

    @property
    def size(self) -> int:
        """The number of ranks: the product of the axis sizes (1 for a mesh without axes)."""
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    def axis_size(self, name: str) -> int:
        for a, s in self.axes:
            if a == name:
                return s
        raise LayoutError(f"mesh {self} has no axis {name!r}")

    def axis_position(self, name: str) -> int:
        """The position of axis ``name`` in the mesh (0 = major)."""
        for i, (a, _) in enumerate(self.axes):
            if a == name:
                return i
        raise LayoutError(f"mesh {self} has no axis {name!r}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is out of range 0..{self.size - 1} of mesh {self}")

    def _check_axes(self, axes: tuple[str, ...]) -> tuple[int, ...]:
        positions = tuple(self.axis_position(a) for a in axes)
        if len(set(axes)) != len(axes):
            raise LayoutError(f"axes must be distinct; got ({','.join(axes)})")
        return positions

    def coords(self, rank: int) -> tuple[int, ...]:
        """The coordinates of ``rank``, one per axis in mesh order (row-major, §6)."""
        self._check_rank(rank)
        out = [0] * len(self.axes)
        for i in range(len(self.axes) - 1, -1, -1):
            size = self.axes[i][1]
            out[i] = rank % size
            rank //= size
        return tuple(out)

    def rank_of(self, coords: Iterable[int]) -> int:
        """The rank with these coordinates (one per axis, in mesh order)."""
        cs = tuple(coords)
        if len(cs) != len(self.axes):
            raise LayoutError(f"mesh {self} needs {len(self.axes)} coordinate(s); got {cs}")
        rank = 0
        for (name, size), c in zip(self.axes, cs, strict=True):
            if not 0 <= c < size:
                raise LayoutError(f"coordinate {c} is out of range 0..{size - 1} of axis {name!r}")
            rank = rank * size + c
        return rank

    def index_along(self, rank: int, axes: tuple[str, ...]) -> int:
        """The row-major index of ``rank``'s coordinates on ``axes`` in the listed order (§5, §6).

        ``()`` gives 0. For ``("tp", "dp")`` on ``[dp=2, tp=2]`` it is ``c_tp · 2 + c_dp``.
        """
        positions = self._check_axes(axes)
        cs = self.coords(rank)
        index = 0
        for p in positions:
            index = index * self.axes[p][1] + cs[p]
        return index

    def group_size(self, axes: tuple[str, ...]) -> int:
        """The number of ranks in a group along ``axes``: the product of their sizes."""
        n = 1
        for p in self._check_axes(axes):
            n *= self.axes[p][1]
        return n

    def group_of(self, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
        """The ranks that equal ``rank`` on every axis not in ``axes``, ordered by their index
        along ``axes`` (so ``group_of(r, A)[index_along(r, A)] == r``)."""
        positions = self._check_axes(axes)
        base = list(self.coords(rank))
        out = []
        for combo in itertools.product(*(range(self.axes[p][1]) for p in positions)):
            for p, c in zip(positions, combo, strict=True):
                base[p] = c
            out.append(self.rank_of(base))
        return tuple(out)

    def groups(self, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Every group along ``axes`` (each ordered as :meth:`group_of`), ordered by their first
        member, which is the smallest rank of the group; together they partition the ranks."""
        positions = self._check_axes(axes)
        firsts = (r for r in range(self.size) if all(self.coords(r)[p] == 0 for p in positions))
        return tuple(self.group_of(r, axes) for r in firsts)

    def __str__(self) -> str:
        return _axes_text(self.axes)


def bind_mesh(mesh: MeshDecl, nranks: int, binding: Mapping[str, int] | None = None) -> MeshShape:
    """Bind the sizes of ``mesh`` for a job of ``nranks`` ranks (docs/spec/ir.md §6).

    With ``binding`` (the launcher's ``--mesh``), the named axes take the given sizes and the
    others keep their declared sizes; naming an axis the mesh does not have is an error. Without
    it, the first axis gets ``nranks`` and every other axis 1. Either way the product of the
    bound sizes must equal ``nranks``. Errors are :class:`UsageError` (a launch problem).
    """
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise UsageError(f"the number of ranks must be >= 1; got {nranks!r}")
    names = mesh.axis_names
    if binding is not None:
        for axis, size in binding.items():
            if axis not in names:
                raise UsageError(
                    f"--mesh sets axis {axis!r}, but mesh @{mesh.name} has axes "
                    f"{', '.join(names) or '(none)'}"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise UsageError(f"--mesh size of axis {axis!r} must be >= 1; got {size!r}")
        axes = tuple((a, binding.get(a, n)) for a, n in mesh.axes)
    else:
        axes = tuple((a, nranks if i == 0 else 1) for i, (a, _) in enumerate(mesh.axes))
    shape = MeshShape(axes)
    if shape.size != nranks:
        how = "with --mesh" if binding is not None else "without --mesh"
        raise UsageError(
            f"mesh @{mesh.name} bound {how} to {shape} has {shape.size} rank(s), but the job has "
            f"{nranks}; the product of the axis sizes must equal the number of ranks"
        )
    return shape


def parse_mesh_binding(text: str) -> dict[str, int]:
    """Parse a launcher ``--mesh`` value ``AXIS=SIZE[,AXIS=SIZE…]`` (e.g. ``dp=2,tp=2``).

    Spaces around names and sizes are ignored. Sizes are decimal integers >= 1. Raises
    :class:`UsageError` naming the bad entry for an empty value or entry, an entry without
    ``=``, a bad axis name, a bad or non-positive size, or an axis given twice.
    """
    if not text.strip():
        raise UsageError("--mesh is empty; expected AXIS=SIZE[,AXIS=SIZE...], e.g. dp=2,tp=2")
    out: dict[str, int] = {}
    for i, entry in enumerate(text.split(",")):
        if not entry.strip():
            raise UsageError(f"--mesh {text!r}: entry {i + 1} is empty; expected AXIS=SIZE")
        name, eq, value = entry.partition("=")
        name, value = name.strip(), value.strip()
        if not eq:
            raise UsageError(f"--mesh {text!r}: entry {entry.strip()!r} is not AXIS=SIZE")
        if not _NAME.match(name):
            raise UsageError(
                f"--mesh {text!r}: entry {entry.strip()!r}: axis name {name!r} is not an identifier"
            )
        if not (value.isascii() and value.isdigit()):
            raise UsageError(
                f"--mesh {text!r}: entry {entry.strip()!r}: size {value!r} is not a positive "
                "integer"
            )
        size = int(value)
        if size < 1:
            raise UsageError(f"--mesh {text!r}: entry {entry.strip()!r}: size must be >= 1")
        if name in out:
            raise UsageError(f"--mesh {text!r}: axis {name!r} is given twice")
        out[name] = size
    return out
