"""Where a run's data source stands, saved in each of its checkpoints and checked on resume.

A loader that can say where it stands (:class:`DataPosition`: :class:`~dtm_mpi.frontend.
token_data.TokenLoader` does) has its position saved beside the state in every checkpoint of
a run, as small replicated tensors whose names start with ``data.`` (a dot: never an IR
value's name, so they cannot collide with a parameter; io/TOKENS.md §4). They are ordinary
PRIMARY artifacts: hashed into the checkpoint's Merkle root like the weights, verified when
read, readable with h5py. On resume the loader is shown what the checkpoint recorded and
refuses data that is not the data the run was trained on (a changed token file, another
context, batch or seed), on every rank alike; a checkpoint that recorded no position (written
before, or by a run fed otherwise) resumes as it did.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from dtm_mpi.errors import UsageError, agreed

if TYPE_CHECKING:
    from dtm_mpi.ir.types import TensorType

__all__ = [
    "PREFIX",
    "DataPosition",
    "check_position",
    "position_items",
    "position_targets",
]

PREFIX = "data."
"""The name prefix of a data position's tensors in a checkpoint."""


@runtime_checkable
class DataPosition(Protocol):
    """A data source that can say where it stands after a step, and check a saved position."""

    def position_tensors(self, done: int) -> dict[str, np.ndarray]:
        """Its position after step ``done`` as small arrays named ``data.*``, whose dtypes
        and shapes do not depend on ``done``."""
        ...

    def check_position(self, saved: Mapping[str, np.ndarray], done: int, where: str) -> None:
        """Raise :class:`~dtm_mpi.errors.UsageError` where ``saved`` (the tensors a
        checkpoint ``where`` recorded after step ``done``) is not this source's position
        after that step."""
        ...


def _checked(data: DataPosition, done: int) -> dict[str, np.ndarray]:
    got = data.position_tensors(done)
    for name, a in got.items():
        if not name.startswith(PREFIX) or len(name) == len(PREFIX):
            raise UsageError(
                f"a data position tensor must be named {PREFIX}<name>; the loader gave {name!r}"
            )
        if not isinstance(a, np.ndarray) or a.dtype not in (np.dtype("<i8"), np.dtype("u1")):
            raise UsageError(f"data position tensor {name!r} must be an int64 or uint8 array")
    return got


def position_targets(data: DataPosition) -> list[tuple[str, TensorType]]:
    """The tensors ``data`` saves, with their replicated types (the restore's targets)."""
    from dtm_mpi.ir.types import DType, Layout, TensorType

    return [
        (
            name,
            TensorType(
                DType.I64 if a.dtype.kind == "i" else DType.U8,
                tuple(a.shape),
                Layout.replicated(a.ndim),
            ),
        )
        for name, a in _checked(data, 0).items()
    ]


def position_items(data: DataPosition, done: int) -> list[tuple[Any, np.ndarray]]:
    """What a save after step ``done`` adds: each position tensor's spec and its whole value
    (replicated: every rank's block is the whole array)."""
    from dtm_mpi.io.ckpt_plan import TensorSpec

    types = dict(position_targets(data))
    return [
        (TensorSpec(name, types[name]), np.ascontiguousarray(a))
        for name, a in _checked(data, done).items()
    ]


def check_position(
    data: DataPosition, values: Mapping[str, np.ndarray], done: int, where: str
) -> None:
    """Check the position ``values`` of a restored checkpoint ``where`` (after step
    ``done``) recorded, if it recorded one, against ``data`` (its refusal agreed: every rank
    holds the same values)."""
    saved = {k: np.asarray(v) for k, v in values.items() if k.startswith(PREFIX)}
    if not saved:
        return
    try:
        data.check_position(saved, done, where)
    except UsageError as exc:
        raise agreed(exc) from None
