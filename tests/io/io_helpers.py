"""Helpers shared by the store tests: random tensor values of every dtype, and flipping one
byte of a dataset's stored data in a checkpoint file (as silent corruption would)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dtm_mpi.ir.ops._common import np_dtype
from dtm_mpi.ir.types import TensorType


def random_value(t: TensorType, rng: np.random.Generator) -> np.ndarray:
    """A global value of ``t`` in the runtime's representation (bool, wide ints, normals)."""
    dt = np_dtype(t.dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=t.shape).astype(bool)
    if dt.kind == "i":
        return np.asarray(rng.integers(-(2**40), 2**40, size=t.shape), dtype=dt)
    return np.asarray(rng.standard_normal(size=t.shape), dtype=dt)


def flip_byte(path: Path, dataset: str, position: int, mask: int = 0x40) -> None:
    """XOR byte ``position`` of ``dataset``'s contiguous data in ``path`` with ``mask``."""
    import h5py

    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + position)
        byte = fh.read(1)
        fh.seek(offset + position)
        fh.write(bytes([byte[0] ^ mask]))
