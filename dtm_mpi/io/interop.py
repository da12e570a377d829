"""Store tensors to and from the files other tools read (``dtm store export|import``).

* **safetensors** (Hugging Face's format, through the ``safetensors`` package): what PyTorch
  and Hugging Face tools load (``safetensors.torch.load_file``, ``from_pretrained``). Every
  dtm dtype has its safetensors dtype; bf16 travels as BFLOAT16 (the stored binary32 values
  are bf16 values, so nothing is rounded). The header's metadata says ``format: pt`` (what
  ``transformers`` expects) and where the tensors came from (store, step).
* **npz** (numpy): bf16 as its raw bits (uint16), as ``dtm store put`` takes it.

A **name map** (a JSON or TOML table ``"from" = "to"``) renames on the way: on export from
store names to the file's, on import from the file's to the store's; with a map, exactly the
mapped tensors move (a mapped name that is missing is an error naming it), without one every
tensor does. An import is one new checkpoint of the store (copy-on-write: the older ones stay).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.types import DType

__all__ = ["FORMATS", "SAFETENSORS_DTYPES", "export_tensors", "import_tensors", "read_name_map"]

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


def read_name_map(path: str | Path) -> dict[str, str]:
    """A name map file: a JSON object or a TOML table of ``"from" = "to"`` strings."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        doc = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--map {p}: cannot read it: {exc}") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"--map {p}: not a JSON object or TOML table: {exc}") from None
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.items()
    ):
        raise UsageError(f'--map {p}: every entry must be "from" = "to" (strings)')
    targets = list(doc.values())
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise UsageError(f"--map {p}: two names map to {twice[0]!r}")
    return dict(doc)


def _selection(
    available: Sequence[str], names: Sequence[str], rename: Mapping[str, str] | None, where: str
) -> list[tuple[str, str]]:
    """(from, to) pairs: the mapped names with a map, else ``names`` or everything."""
    have = set(available)
    if rename is not None:
        chosen = [n for n in rename if not names or n in names]
        pairs = [(n, rename[n]) for n in chosen]
    else:
        pairs = [(n, n) for n in (names or available)]
    missing = [a for a, _ in pairs if a not in have]
    if missing:
        raise UsageError(
            f"{where} has no tensor {missing[0]!r} (it has: {', '.join(sorted(have)) or 'none'})"
        )
    if not pairs:
        raise UsageError(f"{where}: no tensor selected")
    return pairs


def export_tensors(
    store: Path,
    out: Path,
    *,
    names: Sequence[str] = (),
    fmt: str | None = None,
    step: int | None = None,
    rename: Mapping[str, str] | None = None,
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
    pairs = _selection(stored, names, rename, f"checkpoint {ckpt}")
    values: dict[str, tuple[DType, np.ndarray]] = {}
    for src, dst in pairs:
        a = m.artifact(src)
        value = read_served(store, m, src, backend=backend, warn=warn)
        if a.dtype is DType.BF16:  # held as binary32 holding bf16 values: the upper half
            value = bf16_bits(value)
        values[dst] = (a.dtype, np.ascontiguousarray(value))
    meta = {"format": "pt", "dtm_store": str(store), "dtm_step": str(m.step)}
    if fmt == "npz":
        from dtm_mpi.io.arrays import save_npz

        save_npz(str(out), {k: v for k, (_, v) in values.items()})
    else:
        _write_safetensors(out, values, meta)
    moved = tuple((s, d, values[d][0], tuple(values[d][1].shape)) for s, d in pairs)
    return Moved(moved, m.step, out)


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
    rename: Mapping[str, str] | None = None,
) -> Moved:
    """Put tensors of the file ``path`` into ``store`` as one new checkpoint (``comm``: a
    one-process communicator)."""
    from dtm_mpi.io.ckpt_plan import valid_tensor_name
    from dtm_mpi.io.tools import put_tensors

    fmt = format_of(path, fmt)
    tensors = read_file_tensors(path, fmt)
    pairs = _selection(list(tensors), names, rename, str(path))
    for src, dst in pairs:
        if not valid_tensor_name(dst):
            hint = " (give it a store name with --map)" if src == dst else ""
            raise UsageError(
                f"{path}: tensor {src!r} cannot be stored as {dst!r}: a store name is letters, "
                f"digits, '_', '.' and '-', starting with a letter or '_'{hint}"
            )
    values = {dst: tensors[src][1] for src, dst in pairs}
    put = put_tensors(store, comm, values, where={d: f"{path}: {s}" for s, d in pairs})
    moved = tuple((s, d, tensors[s][0], tuple(tensors[s][1].shape)) for s, d in pairs)
    return Moved(moved, put.step, put.path)
