"""The device mesh as the frontend declares it: named axes and their sizes."""

from __future__ import annotations

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.nodes import Mesh as IrMesh

__all__ = ["Mesh"]


class Mesh:
    """A mesh of named axes, major axis first: ``Mesh(dp=2, tp=2)``. The sizes are the ones
    the module declares; a run may bind other sizes (``binding``), as ``dtm run --mesh``."""

    __slots__ = ("axes", "name")

    def __init__(self, name: str = "m", **axes: int) -> None:
        if not axes:
            raise UsageError("a mesh needs at least one axis, e.g. Mesh(dp=2, tp=2)")
        for axis, size in axes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UsageError(f"mesh axis {axis!r} needs a size >= 1; got {size!r}")
        self.name = name
        self.axes: tuple[tuple[str, int], ...] = tuple(axes.items())

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def size(self) -> int:
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    def ir(self) -> IrMesh:
        return IrMesh(self.name, self.axes)

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{a}={s}' for a, s in self.axes)})"
