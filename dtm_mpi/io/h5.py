"""Thin parallel-HDF5 helpers for the data files of a checkpoint: open with ``driver='mpio'``
on the communicator of the ranks that share the file, create shard datasets without fill, and
write each shard whole from its owner; what the h5py build offers (:func:`mpi_build`,
:func:`library_text`); and reading a user's HDF5 input file (:func:`read_top_datasets`).
One of the HDF5 backend's modules (with :mod:`dtm_mpi.io.ckpt_files`): no other module of
dtm_mpi imports h5py (tests/io/test_h5py_confined.py).

Dataset creation and attributes are collective over the file's communicator (every rank of it
creates every dataset, in the same order: parallel HDF5's metadata rule); each shard's data is
then written by its owner alone with an independent transfer (its own dataset, so nothing to
coordinate). Data is written in the array's own type (no conversion on the write path) from
C-contiguous arrays without copies, and datasets are contiguous, allocated early and never
filled (the data overwrites every byte anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

__all__ = [
    "ALIGN_BYTES",
    "ALIGN_FROM",
    "create_dataset",
    "library_text",
    "mpi_build",
    "open_file",
    "read_top_datasets",
    "write_whole",
]

ALIGN_FROM = 4 << 20
ALIGN_BYTES = 1 << 20
"""Objects of at least ``ALIGN_FROM`` bytes start on ``ALIGN_BYTES`` boundaries (stripe and
page friendly on parallel file systems; smaller ones are packed: aligning them would waste up
to a MiB each)."""


def open_file(path: str, mode: str, comm: Any = None) -> h5py.File:
    """Collective when ``comm`` is given: open ``path`` on every rank of ``comm`` with the
    MPI-IO driver; without ``comm``, a serial open (tools, single process)."""
    kwargs: dict[str, Any] = {"libver": "earliest"}
    if mode != "r":
        kwargs |= {"alignment_threshold": ALIGN_FROM, "alignment_interval": ALIGN_BYTES}
    if comm is not None:
        return h5py.File(path, mode, driver="mpio", comm=comm, **kwargs)
    return h5py.File(path, mode, **kwargs)


def create_dataset(
    f: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> h5py.Dataset:
    """Collective under MPI-IO: a contiguous dataset of ``shape`` and ``dtype``, allocated
    early, never filled (intermediate groups are created)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return f.create_dataset(name, shape=shape, dtype=dtype, dcpl=dcpl)


def write_whole(dset: h5py.Dataset, data: np.ndarray) -> None:
    """Write all of ``dset`` from ``data`` (its shape and dtype) with an independent
    transfer: the caller is the only rank writing this dataset."""
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    dset.id.write(h5py.h5s.ALL, h5py.h5s.ALL, data)


def mpi_build() -> bool:
    """Whether this h5py is built with MPI (its ``mpio`` driver: parallel HDF5)."""
    return bool(h5py.get_config().mpi)


def library_text() -> str:
    """h5py's and HDF5's versions and whether they are parallel, as one line."""
    return f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, parallel: {mpi_build()}"


def read_top_datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset at the top level of the HDF5 file ``path``, read whole (serially), by
    name; groups are skipped. h5py's exceptions pass through (the caller names the file)."""
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        for key, item in f.items():
            if isinstance(item, h5py.Dataset):
                out[key] = item[()]
    return out
