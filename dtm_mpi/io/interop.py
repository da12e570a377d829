"""Store tensors to and from the files other tools read (``dtm store export|import``).

* **safetensors** (Hugging Face's format, through the ``safetensors`` package): what PyTorch
  and Hugging Face tools load (``safetensors.torch.load_file``, ``from_pretrained``). Every
  dtm dtype has its safetensors dtype; bf16 travels as BFLOAT16 (the stored binary32 values
  are bf16 values, so nothing is rounded). The header's metadata says ``format: pt`` (what
  ``transformers`` expects) and where the tensors came from (store, step).
* **npz** (numpy): bf16 as its raw bits (uint16), as ``dtm store put`` takes it.

A **tensor map** (``--map``, :mod:`dtm_mpi.io.tensor_map`: a JSON or TOML table, ``"from" =
"to"`` or a transform: transpose, split along a dim, concatenate) renames and reshapes on the
way: on export from store names to the file's, on import from the file's to the store's; with
a map, exactly the mapped tensors move (a mapped name that is missing is an error naming it),
without one every tensor does. An import is one new checkpoint of the store (copy-on-write: the older ones stay).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError
from dtm_mpi.io.tensor_map import MapEntry, apply_entry, as_entries
from dtm_mpi.ir.types import DType

TensorMap = Sequence[MapEntry] | Mapping[str, str]
"""A tensor map: its entries (:func:`~dtm_mpi.io.tensor_map.read_tensor_map`), or a plain
``{from: to}`` renaming."""

__all__ = ["FORMATS", "SAFETENSORS_DTYPES", "TensorMap", "export_tensors", "import_tensors"]

FORMATS = ("safetensors", "npz")

# dtm dtype <-> safetensors dtype (the header's name, and TensorSpec's)
_TO_ST: dict[DType, tuple[str, str]] = {
    DType.F16: ("F16", "float16"),
    DType.BF16: ("BF16", "bfloat16"),
    DType.F32: ("F32", "float32"),
    DType.F64: ("F64", "float64"),
    DType.I8: ("I8", "int8"),
    DType.I32: ("I32", "int32"),
    DType.I64: ("I64", "int64"),
    DType.U8: ("U8", "uint8"),
    DType.BOOL: ("BOOL", "bool"),
}
SAFETENSORS_DTYPES: dict[str, tuple[DType, str]] = {
    # safetensors dtype -> (dtm dtype, numpy dtype of the stored bytes)
    "F16": (DType.F16, "<f2"),
    "BF16": (DType.BF16, "<u2"),  # the bits; put as bf16
    "F32": (DType.F32, "<f4"),
    "F64": (DType.F64, "<f8"),
    "I8": (DType.I8, "i1"),
    "I32": (DType.I32, "<i4"),
    "I64": (DType.I64, "<i8"),
    "U8": (DType.U8, "u1"),
    "BOOL": (DType.BOOL, "?"),
}


@dataclass(frozen=True, slots=True)
class Moved:
    """What an export or import moved: (from name, to name, dtype, shape) per tensor, and the
    checkpoint (its step) read or written."""

    tensors: tuple[tuple[str, str, DType, tuple[int, ...]], ...]
    step: int
    path: Path


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError:
        raise UsageError(
            "the safetensors format needs the safetensors package: pip install 'dtm_mpi[interop]' "
            "(or safetensors>=0.8)"
        ) from None
    return safetensors


def format_of(path: Path, given: str | None) -> str:
    """The file format: ``given``, else from the suffix (``.safetensors``, ``.npz``)."""
    fmt = given or {".safetensors": "safetensors", ".npz": "npz"}.get(path.suffix.lower())
    if fmt not in FORMATS:
        raise UsageError(
            f"{path}: say --format safetensors or npz (the name ends in neither .safetensors nor .npz)"
        )
    return fmt


def _entries(rename: TensorMap | None) -> tuple[MapEntry, ...] | None:
    if rename is None:
        return None
    if isinstance(rename, Mapping):
        return as_entries(rename, "the tensor map")
    return tuple(rename)


def _selection(
    available: Sequence[str], names: Sequence[str], rename: TensorMap | None, where: str
) -> list[MapEntry]:
    """The entries that move: the mapped ones with a map (those with a source in ``names``,
    if given), else ``names`` or everything as they are."""
    have = set(available)
    entries = _entries(rename)
    if entries is not None:
        chosen = [e for e in entries if not names or any(n in names for n in e.sources)]
    else:
        chosen = [MapEntry((n,), (n,)) for n in (names or available)]
    missing = [n for e in chosen for n in e.sources if n not in have]
    if missing:
        raise UsageError(
            f"{where} has no tensor {missing[0]!r} (it has: {', '.join(sorted(have)) or 'none'})"
        )
    if not chosen:
        raise UsageError(f"{where}: no tensor selected")
    return chosen


def _moved(
    e: MapEntry, dtypes: Sequence[DType], values: Sequence[np.ndarray]
) -> list[tuple[str, DType, np.ndarray]]:
    """(target, dtype, value) of entry ``e`` from its sources' dtypes and values."""
    if any(d is not dtypes[0] for d in dtypes):
        got = ", ".join(f"{n} {d.value}" for n, d in zip(e.sources, dtypes, strict=True))
        raise UsageError(f"{e.where}: the tensors joined must have one dtype; got {got}")
    return [(t, dtypes[0], v) for t, v in zip(e.targets, apply_entry(e, values), strict=True)]


def export_tensors(
    store: Path,
    out: Path,
    *,
    names: Sequence[str] = (),
    fmt: str | None = None,
    step: int | None = None,
    rename: TensorMap | None = None,
    warn: Callable[[str], None] | None = None,
) -> Moved:
    """Write tensors of checkpoint ``step`` (default: latest) of ``store`` to ``out``, every
    chunk verified against its content hash on the way; with ``warn``, a damaged chunk is
    served from the same bytes in another checkpoint and ``warn`` told (io/recovery.py),
    else it is an error."""
    from dtm_mpi.io.arrays import check_output_path
    from dtm_mpi.io.manifest import ArtifactClass
    from dtm_mpi.io.recovery import read_served
    from dtm_mpi.io.tools import bf16_bits, checkpoint_path, read_manifest, store_backend

    fmt = format_of(out, fmt)
    check_output_path(str(out), "." + fmt)
    ckpt = checkpoint_path(store, step)
    backend = store_backend(store)
    m = read_manifest(ckpt, backend)
    stored = [a.name for a in m.artifacts if a.cls is not ArtifactClass.EPHEMERAL]
    chosen = _selection(stored, names, rename, f"checkpoint {ckpt}")
    values: dict[str, tuple[DType, np.ndarray]] = {}
    moved = []
    for e in chosen:
        dtypes = [m.artifact(src).dtype for src in e.sources]
        read = [read_served(store, m, src, backend=backend, warn=warn) for src in e.sources]
        for dst, dtype, got in _moved(e, dtypes, read):
            # bf16 is held as binary32 holding bf16 values: the upper half
            value = bf16_bits(got) if dtype is DType.BF16 else got
            values[dst] = (dtype, np.ascontiguousarray(value))
            moved.append(("+".join(e.sources), dst, dtype, tuple(value.shape)))
    meta = {"format": "pt", "dtm_store": str(store), "dtm_step": str(m.step)}
    if fmt == "npz":
        from dtm_mpi.io.arrays import save_npz

        save_npz(str(out), {k: v for k, (_, v) in values.items()})
    else:
        _write_safetensors(out, values, meta)
    return Moved(tuple(moved), m.step, out)


def _write_safetensors(
    out: Path, values: Mapping[str, tuple[DType, np.ndarray]], meta: dict[str, str]
) -> None:
    st = _safetensors()
    keep = []
    specs = {}
    for name, (dtype, v) in values.items():
        little = v.astype(v.dtype.newbyteorder("<"), copy=False) if v.dtype.byteorder == ">" else v
        keep.append(little)
        specs[name] = st.TensorSpec(
            dtype=_TO_ST[dtype][1],
            shape=list(little.shape),
            data_ptr=little.ctypes.data,
            data_len=little.nbytes,
        )
    data = bytes(st.serialize(specs, metadata=meta))
    from dtm_mpi.io.arrays import write_bytes_atomic

    write_bytes_atomic(out, data)
    del keep


def read_file_tensors(path: Path, fmt: str) -> dict[str, tuple[DType, np.ndarray]]:
    """Every tensor of a safetensors or npz file, as (dtm dtype, value; bf16 as its bits)."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    if fmt == "npz":
        from dtm_mpi.io.arrays import load_arrays
        from dtm_mpi.io.tools import dtm_dtype

        arrays = load_arrays([str(path)])
        return {k: (dtm_dtype(v, f"{path}: {k}"), v) for k, v in arrays.items()}
    st = _safetensors()
    try:
        items = st.deserialize(path.read_bytes())
    except Exception as exc:  # the package's SafetensorError: a damaged or foreign file
        raise UsageError(f"{path}: not a readable safetensors file: {exc}") from None
    out: dict[str, tuple[DType, np.ndarray]] = {}
    for name, t in items:
        kind = SAFETENSORS_DTYPES.get(str(t["dtype"]))
        if kind is None:
            raise UsageError(
                f"{path}: tensor {name!r} is {t['dtype']}, which dtm does not store "
                f"(it stores {', '.join(SAFETENSORS_DTYPES)})"
            )
        dtype, npd = kind
        value = np.frombuffer(bytes(t["data"]), dtype=np.dtype(npd)).reshape(t["shape"])
        out[name] = (dtype, value.astype(value.dtype.newbyteorder("="), copy=True))
    return out


def import_tensors(
    store: Path,
    path: Path,
    comm: Any,
    *,
    names: Sequence[str] = (),
    fmt: str | None = None,
    rename: TensorMap | None = None,
) -> Moved:
    """Put tensors of the file ``path`` into ``store`` as one new checkpoint (``comm``: a
    one-process communicator)."""
    from dtm_mpi.io.ckpt_plan import valid_tensor_name
    from dtm_mpi.io.tools import put_tensors

    fmt = format_of(path, fmt)
    tensors = read_file_tensors(path, fmt)
    chosen = _selection(list(tensors), names, rename, str(path))
    for e in chosen:
        for dst in e.targets:
            if not valid_tensor_name(dst):
                src = "+".join(e.sources)
                hint = " (give it a store name with --map)" if (src,) == e.targets else ""
                raise UsageError(
                    f"{path}: tensor {src!r} cannot be stored as {dst!r}: a store name is letters, "
                    f"digits, '_', '.' and '-', starting with a letter or '_'{hint}"
                )
    values: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    moved = []
    for e in chosen:
        got = [tensors[src] for src in e.sources]
        for dst, dtype, value in _moved(e, [d for d, _ in got], [v for _, v in got]):
            values[dst] = value
            where[dst] = f"{path}: {'+'.join(e.sources)}"
            moved.append(("+".join(e.sources), dst, dtype, tuple(value.shape)))
    put = put_tensors(store, comm, values, where=where)
    return Moved(tuple(moved), put.step, put.path)
