"""Helpers shared by the store tests: random tensor values of every dtype, where a shard's bytes
are in a checkpoint directory (data file, dataset, file offset), and flipping one byte of them
(as silent corruption would)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.types import TensorType


def random_value(t: TensorType, rng: np.random.Generator) -> np.ndarray:
    """A global value of ``t`` in the runtime's representation (bool, wide ints, normals)."""
    dt = np_dtype(t.dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=t.shape).astype(bool)
    if dt.kind == "i":
        return np.asarray(rng.integers(-(2**40), 2**40, size=t.shape), dtype=dt)
    return np.asarray(rng.standard_normal(size=t.shape), dtype=dt)


PLAIN_READER = """\
import json, sys
import h5py, numpy as np
assert 'dtm_mpi' not in sys.modules
main, want_file, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
want = np.load(want_file)
with h5py.File(main, 'r') as f:
    m = json.loads(f['manifest'][()])
    assert m['format'] == 'dtm-manifest' and m['step'] == step, m['step']
    classes = {a['name']: a['class'] for a in m['artifacts']}
    sources = set()
    for k in want.files:
        d = f['tensors'][k]
        got = d[()]
        assert got.dtype == want[k].dtype and got.shape == want[k].shape, (k, got.dtype, got.shape)
        assert np.asarray(got).tobytes() == want[k].tobytes(), k
        assert d.attrs['artifact_class'] == classes[k], k
        assert d.is_virtual or d.size == 0, k
        for s in d.virtual_sources() if d.is_virtual else ():
            assert not s.file_name.startswith('/'), s.file_name  # relative: the directory can move
            sources.add(s.file_name)
    print('plain-ok', sorted(want.files) == sorted(f['tensors']), sorted(sources), 'dtm_mpi' in sys.modules)
"""
"""A reader without dtm_mpi (run it with ``python -I -c PLAIN_READER MAIN WANT.npz STEP``):
every tensor of ``WANT.npz`` read from ``MAIN`` (a ``checkpoint.h5``) through its virtual
dataset, bit-exactly; prints ``plain-ok True [data files] False`` when all is well."""


def flip_byte(path: Path, dataset: str, position: int, mask: int = 0x40) -> None:
    """XOR byte ``position`` of ``dataset``'s contiguous data in the HDF5 file ``path`` with
    ``mask`` (a data file's ``/shards/<t>/<i>``, or the main file's ``/manifest``)."""
    import h5py

    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    assert offset is not None, f"{path}:{dataset} has no contiguous storage"
    with open(path, "r+b") as fh:
        fh.seek(offset + position)
        byte = fh.read(1)
        fh.seek(offset + position)
        fh.write(bytes([byte[0] ^ mask]))


def shard_at(ckpt: Path, tensor: str, index: tuple[int, ...]) -> tuple[Path, str, str, int]:
    """Where element ``index`` (global) of ``tensor`` is stored in checkpoint directory
    ``ckpt``: (data file path, shard dataset, shard id, byte offset of the element inside
    the shard's dataset)."""
    from dtm_mpi.io.ckpt_files import read_manifest
    from dtm_mpi.io.manifest import stored_itemsize

    a = read_manifest(ckpt).artifact(tensor)
    for s in a.shards:
        if all(o <= i < o + e for i, o, e in zip(index, s.offset, s.extent, strict=True)):
            local = tuple(i - o for i, o in zip(index, s.offset, strict=True))
            flat = int(np.ravel_multi_index(local, s.extent)) if s.extent else 0
            return ckpt / s.file, s.dataset, s.id, flat * stored_itemsize(a.dtype)
    raise AssertionError(f"no shard of {tensor!r} holds {index}")


def flip_element(
    ckpt: Path, tensor: str, index: tuple[int, ...], byte: int = 0, mask: int = 0x40
) -> tuple[Path, str]:
    """Flip byte ``byte`` of element ``index`` of ``tensor`` in its shard's data file; returns
    (that data file, the shard id)."""
    path, dataset, shard, at = shard_at(ckpt, tensor, index)
    flip_byte(path, dataset, at + byte, mask)
    return path, shard
