"""Reading program inputs and writing program outputs: ``.npy``, ``.npz`` and HDF5 files.

Inputs map names (entry parameters without ``%``) to global arrays:

* ``NAME.npy`` gives the array ``NAME`` (the file's stem);
* ``FILE.npz`` gives each array it holds under its own name;
* ``FILE.h5`` / ``FILE.hdf5`` gives each top-level dataset under its own name (read serially
  with h5py, by :func:`dtm_mpi.io.h5.read_top_datasets`: h5py lives in the HDF5 backend's
  modules only).

A file that cannot be read (missing, a directory, corrupt, truncated, not the format its suffix
says) is one :class:`~dtm_mpi.errors.UsageError` naming the file, never a library's exception.

A name given twice is an error naming both files. Outputs go to one ``.npz`` written to a
temporary file in the same directory and renamed into place, so a failed write never leaves a
partial file under the requested name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from dtm_mpi.errors import UsageError

__all__ = ["check_output_path", "load_arrays", "save_npy", "save_npz", "write_bytes_atomic"]


def _load_one(path: Path) -> dict[str, np.ndarray]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            return {path.stem: np.load(path, allow_pickle=False)}
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        if suffix in (".h5", ".hdf5"):
            # A user's input file, not the checkpoint store: HDF5 whatever backend a store
            # uses. Read by the HDF5 backend's h5 module: h5py is imported nowhere else.
            from dtm_mpi.io.h5 import read_top_datasets

            return read_top_datasets(path)
    except FileNotFoundError:
        raise UsageError(f"input file {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"input {path} is a directory, not a file") from None
    except PermissionError:
        raise UsageError(f"cannot read input file {path}: permission denied") from None
    except Exception as err:  # zipfile.BadZipFile, zlib.error, EOFError, h5py's OSError, ...
        why = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(
            f"cannot read input file {path}: not a valid {suffix} file ({why})"
        ) from None
    raise UsageError(f"input file {path}: unknown type {suffix!r} (use .npy, .npz, .h5 or .hdf5)")


def load_arrays(paths: Sequence[str]) -> dict[str, np.ndarray]:
    """Every array of every input file, by name."""
    arrays: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for p in paths:
        for name, value in _load_one(Path(p)).items():
            if name in arrays:
                raise UsageError(f"input {name!r} is given twice: in {origin[name]} and in {p}")
            arrays[name] = value
            origin[name] = p
    return arrays


def check_output_path(path: str, suffix: str = ".npz") -> Path:
    """``path`` as an output file name, refused before any work: a ``suffix`` name in an
    existing directory, not itself a directory."""
    target = Path(path)
    if target.suffix.lower() != suffix:
        raise UsageError(f"output {path}: use a {suffix} file name")
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise UsageError(f"output {path}: directory {directory} does not exist")
    if target.is_dir():
        raise UsageError(f"output {path} is a directory; give a file name")
    return target


def _write_atomic(target: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write`` into a temporary file beside ``target``, fsync, then rename it into place:
    a failed write never leaves a partial file under the requested name."""
    directory = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` atomically (never a partial file under that name)."""

    def write(f: BinaryIO) -> None:
        f.write(data)

    _write_atomic(target, write)


def save_npz(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` (.npz) atomically."""
    _write_atomic(check_output_path(path), lambda f: np.savez(f, **dict(arrays)))  # type: ignore[arg-type]


def save_npy(path: str, value: np.ndarray) -> None:
    """Write ``value`` to ``path`` (.npy) atomically."""
    _write_atomic(check_output_path(path, ".npy"), lambda f: np.save(f, value, allow_pickle=False))
