"""The device mesh as the frontend declares it: named axes and their sizes."""

from __future__ import annotations

from dtm_mpi.errors import LayoutError, UsageError
from dtm_mpi.ir.nodes import MeshDecl as IrMesh
from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["Mesh", "require_axis"]


def require_axis(what: str, axis: str, axes: tuple[str, ...]) -> None:
    """Raise :class:`UsageError` naming ``what`` unless ``axis`` is one of the mesh's ``axes``
    (a sharding option's axis: ``AdamW(shard='dp')``, ``train_step(shard_params='dp')``)."""
    if axis not in axes:
        raise UsageError(f"{what}: the mesh has no axis {axis!r} (axes: {', '.join(axes)})")


class Mesh:
    """A mesh of named axes, major axis first: ``Mesh(dp=2, tp=2)``. The sizes are the ones
    the module declares; a run may bind other sizes (``binding``), as ``dtm run --mesh``."""

    __slots__ = ("name", "shape")

    def __init__(self, name: str = "m", **axes: int) -> None:
        if not axes:
            raise UsageError("a mesh needs at least one axis, e.g. Mesh(dp=2, tp=2)")
        try:
            self.shape = MeshShape(tuple(axes.items()))  # the sharding layer's checks
        except LayoutError as exc:
            raise UsageError(str(exc)) from None
        self.name = name

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        return self.shape.axes

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self.shape.axis_names

    @property
    def size(self) -> int:
        return self.shape.size

    def ir(self) -> IrMesh:
        return IrMesh(self.name, self.axes)

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{a}={s}' for a, s in self.axes)})"
