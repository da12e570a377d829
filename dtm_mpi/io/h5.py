"""Thin parallel-HDF5 helpers: open with ``driver='mpio'``, create datasets without fill, and
move one hyperslab per rank per call with a collective transfer.

Every rank takes part in every collective call, also with nothing to move: the call is made
with an empty selection (h5py's high-level slicing skips empty selections, and a rank that
skips a collective transfer hangs the others — a well-known parallel-HDF5 trap). Data is
written in the array's own type (no conversion on the write path) from C-contiguous arrays
without copies, and datasets are contiguous, allocated early and never filled (the data
overwrites every byte anyway).
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

__all__ = ["ALIGN_BYTES", "ALIGN_FROM", "create_dataset", "open_file", "read_slab", "write_slab"]

ALIGN_FROM = 4 << 20
ALIGN_BYTES = 1 << 20
"""Objects of at least ``ALIGN_FROM`` bytes start on ``ALIGN_BYTES`` boundaries (stripe and
page friendly on parallel file systems; smaller ones are packed: aligning them would waste up
to a MiB each)."""


def open_file(path: str, mode: str, comm: Any = None) -> h5py.File:
    """Collective when ``comm`` is given: open ``path`` on every rank of ``comm`` with the
    MPI-IO driver; without ``comm``, a serial open (tools, single process)."""
    kwargs: dict[str, Any] = {}
    if mode != "r":
        kwargs = {"alignment_threshold": ALIGN_FROM, "alignment_interval": ALIGN_BYTES}
    if comm is not None:
        return h5py.File(path, mode, driver="mpio", comm=comm, **kwargs)
    return h5py.File(path, mode, **kwargs)


def create_dataset(f: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> h5py.Dataset:  # fmt: skip
    """Collective under MPI-IO: a contiguous dataset of ``shape`` and ``dtype``, never filled."""
    return f.create_dataset(name, shape=shape, dtype=dtype, fill_time="never")


def _dxpl(collective: bool) -> Any:
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    if collective:
        dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    return dxpl


def _spaces(
    dset: h5py.Dataset, region: tuple[slice, ...] | None, buf_shape: tuple[int, ...],
    within: tuple[slice, ...] | None,
) -> tuple[Any, Any]:  # fmt: skip
    fspace = dset.id.get_space()
    if region is None:  # this rank moves nothing but takes part
        fspace.select_none()
        mspace = h5py.h5s.create_simple((1,))
        mspace.select_none()
        return mspace, fspace
    if not region:  # a 0-d dataset
        return h5py.h5s.create(h5py.h5s.SCALAR), fspace
    fspace.select_hyperslab(tuple(s.start for s in region), tuple(s.stop - s.start for s in region))  # fmt: skip
    mspace = h5py.h5s.create_simple(buf_shape)
    if within is not None:
        mspace.select_hyperslab(tuple(s.start for s in within), tuple(s.stop - s.start for s in within))  # fmt: skip
    return mspace, fspace


def write_slab(
    dset: h5py.Dataset, region: tuple[slice, ...] | None, data: np.ndarray | None,
    collective: bool = True,
) -> None:  # fmt: skip
    """Collective when ``collective``: write ``data`` (C-contiguous, the dataset's dtype) to
    the global hyperslab ``region``; ``region=None``: take part without writing."""
    if region is None or data is None:
        mspace, fspace = _spaces(dset, None, (), None)
        dset.id.write(mspace, fspace, np.empty(1, dtype=dset.dtype), dxpl=_dxpl(collective))
        return
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    mspace, fspace = _spaces(dset, region, data.shape, None)
    dset.id.write(mspace, fspace, data, dxpl=_dxpl(collective))


def read_slab(
    dset: h5py.Dataset, region: tuple[slice, ...] | None, out: np.ndarray | None,
    within: tuple[slice, ...] | None = None, collective: bool = True,
) -> None:  # fmt: skip
    """Collective when ``collective``: read the global hyperslab ``region`` into ``out``
    (C-contiguous; all of it, or the part ``within`` of the same shape as ``region``);
    ``region=None``: take part without reading."""
    if region is None or out is None:
        mspace, fspace = _spaces(dset, None, (), None)
        dset.id.read(mspace, fspace, np.empty(1, dtype=dset.dtype), dxpl=_dxpl(collective))
        return
    mspace, fspace = _spaces(dset, region, out.shape, within)
    dset.id.read(mspace, fspace, out, dxpl=_dxpl(collective))
