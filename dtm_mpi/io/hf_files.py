"""Hugging Face checkpoint directories: ``config.json`` and the weights in safetensors files
(``model.safetensors``, or shards listed by ``model.safetensors.index.json``), read and written
without the ``safetensors`` or ``transformers`` packages.

Reading is memory-mapped: :func:`open_weights` parses each file's header only, and a
:class:`MappedTensor` reads just the block asked for (``tensor[rows, cols]``) from the mapped
file, so a rank of a run takes its own block of every weight and never the whole model. bf16
tensors come as binary32 holding the bf16 values (how dtm holds bf16), f16/f32/f64 as they are.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (``{name:
{"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative
to the data that follows the header), then the data, row-major little-endian.

The conversion of each architecture's names is one table (:data:`CONVERSIONS`): a rule maps a
name pattern of the files to one of the model (``*`` stands for the same text on both sides),
with a transform (``identity`` or ``transpose``), and is read in both directions (import and
export); names the table marks ``unused`` (tied heads, buffers such as a rotary table) are
skipped on import and not written on export.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError
from dtm_mpi.io.interop import SAFETENSORS_DTYPES
from dtm_mpi.ir.types import DType

__all__ = [
    "CONVERSIONS",
    "INDEX_NAME",
    "SINGLE_NAME",
    "MappedTensor",
    "NameRule",
    "architecture",
    "open_weights",
    "read_config",
    "to_hf_name",
    "to_model_name",
    "write_weights",
]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024

_DTYPES = SAFETENSORS_DTYPES  # safetensors dtype -> (dtm dtype, numpy dtype of the bytes)
_ST_NAME = {d: name for name, (d, _) in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class NameRule:
    """``hf`` (a name of the files, ``*`` for any text) is the model's ``model`` name (``*``
    the same text), stored after ``transform`` (``identity``, or ``transpose`` of a matrix);
    ``model`` None: the files' tensor is not used by the model (skipped; not exported)."""

    hf: str
    model: str | None
    transform: str = "identity"

    def match(self, name: str, *, reverse: bool = False) -> str | None:
        """``name`` (a file's, or with ``reverse`` the model's) under this rule, or None."""
        src, dst = (self.model, self.hf) if reverse else (self.hf, self.model)
        if src is None:
            return None
        m = re.fullmatch(re.escape(src).replace(r"\*", "(.*)"), name)
        if m is None:
            return None
        if dst is None:
            return ""
        out = dst
        for part in m.groups():
            out = out.replace("*", part, 1)
        return out


CONVERSIONS: dict[str, tuple[NameRule, ...]] = {
    # LlamaForCausalLM: the model's tree is HF's; older checkpoints carry the rotary table, a
    # tied model may carry its head's copy of the embedding.
    "llama": (
        NameRule("model.layers.*.self_attn.rotary_emb.inv_freq", None),
        NameRule("*", "*"),
    ),
    # GPT2LMHeadModel: Conv1D weights are [in, out] in both; the head is tied to wte; old
    # checkpoints carry the causal-mask buffers.
    "gpt2": (
        NameRule("lm_head.weight", None),
        NameRule("transformer.h.*.attn.bias", None),
        NameRule("transformer.h.*.attn.masked_bias", None),
        NameRule("h.*.attn.bias", None),
        NameRule("h.*.attn.masked_bias", None),
        NameRule("transformer.*", "transformer.*"),
        NameRule("*", "transformer.*"),  # checkpoints saved from GPT2Model: no prefix
    ),
}
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "llama": "llama",
    "GPT2LMHeadModel": "gpt2",
    "gpt2": "gpt2",
}


def read_config(hf_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model directory (one error naming the file where it
    is missing or not a JSON object)."""
    path = Path(hf_dir) / "config.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"{path}: no such file (a Hugging Face model directory has config.json)"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: not a JSON object")
    return doc


def architecture(config: Mapping[str, Any], where: str = "config.json") -> str:
    """The architecture a config describes (``llama``, ``gpt2``), from its ``architectures``
    or ``model_type``; another is an error naming the supported ones."""
    names = [*(config.get("architectures") or []), config.get("model_type")]
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[str(name)]
    got = ", ".join(str(n) for n in names if n) or "none given"
    raise UsageError(
        f"{where}: architecture {got} is not supported (supported: LlamaForCausalLM, GPT2LMHeadModel)"
    )


def to_model_name(arch: str, name: str) -> str | None:
    """The model's name of a files' tensor (None: not used by the model)."""
    for rule in CONVERSIONS[arch]:
        got = rule.match(name)
        if got is not None:
            return got or None
    return name


def to_hf_name(arch: str, name: str) -> tuple[str, str]:
    """The files' name of a model tensor, and the transform the rule applies."""
    for rule in CONVERSIONS[arch]:
        got = rule.match(name, reverse=True)
        if got:
            return got, rule.transform
    return name, "identity"


def _transform_of(arch: str, name: str) -> str:
    for rule in CONVERSIONS[arch]:
        if rule.match(name) is not None:
            return rule.transform
    return "identity"


class MappedTensor:
    """One tensor of a safetensors file, memory-mapped: ``shape``, ``dtype`` (the numpy dtype
    of the values it gives: float32 for bf16), ``dtm_dtype``, and ``tensor[region]`` reading
    only that block (a tuple of slices; bf16 widened to binary32). ``transposed``: the stored
    matrix's transpose (a view: no copy until a block is read)."""

    __slots__ = ("_raw", "dtm_dtype", "file", "name", "transposed")

    def __init__(
        self, name: str, file: Path, raw: np.ndarray, dtm_dtype: DType, transposed: bool = False
    ) -> None:
        self.name, self.file, self._raw = name, file, raw
        self.dtm_dtype, self.transposed = dtm_dtype, transposed

    @property
    def _view(self) -> np.ndarray:
        return self._raw.T if self.transposed else self._raw

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._view.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return (
            np.dtype(np.float32)
            if self.dtm_dtype is DType.BF16
            else self._raw.dtype.newbyteorder("=")
        )

    @property
    def nbytes(self) -> int:
        return int(self._raw.nbytes)

    def __getitem__(self, region: Any) -> np.ndarray:
        block = np.array(self._view[region], order="C")
        if self.dtm_dtype is DType.BF16:
            return (block.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return block.astype(block.dtype.newbyteorder("="), copy=False)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[tuple(slice(None) for _ in self.shape)]
        return whole if dtype is None else whole.astype(dtype)

    def __repr__(self) -> str:
        return f"MappedTensor({self.name!r}, {self.dtm_dtype.value}{list(self.shape)}, {self.file.name})"


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and the offset of its data."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UsageError(
                    f"{path}: not a safetensors file (shorter than its 8-byte header length)"
                )
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or n > path.stat().st_size - 8:
                raise UsageError(
                    f"{path}: not a safetensors file (header length {n} is beyond the file)"
                )
            doc = json.loads(f.read(n).decode("utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(
            f"{path}: not a safetensors file (its header is not JSON: {exc})"
        ) from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return doc, 8 + n


def _open_file(
    path: Path, arch: str, wanted: set[str] | None
) -> Iterator[tuple[str, MappedTensor]]:
    doc, base = _header(path)
    size = path.stat().st_size
    mm: np.memmap[Any, Any] | None = None
    for name, meta in doc.items():
        if name == "__metadata__":
            continue
        if wanted is not None and name not in wanted:
            continue
        try:
            kind, shape = str(meta["dtype"]), [int(s) for s in meta["shape"]]
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(
                f"{path}: tensor {name!r} has a malformed header entry {meta!r}"
            ) from None
        if kind not in _DTYPES:
            raise UsageError(
                f"{path}: tensor {name!r} is {kind}, which dtm does not read (it reads {', '.join(_DTYPES)})"
            )
        dtype, npd = _DTYPES[kind]
        count = math.prod(shape)
        if end - begin != count * np.dtype(npd).itemsize or base + end > size or begin < 0:
            raise UsageError(
                f"{path}: tensor {name!r} ({kind}{shape}) has data offsets [{begin}, {end}] that do not fit its shape or the file ({size} bytes)"
            )
        if mm is None:
            mm = np.memmap(path, dtype=np.uint8, mode="r")
        raw = mm[base + begin : base + end].view(np.dtype(npd)).reshape(shape)
        yield name, MappedTensor(name, path, raw, dtype, _transform_of(arch, name) == "transpose")


def weight_files(hf_dir: str | Path) -> dict[str, Path]:
    """The weight files of a model directory and, for each tensor, its file (from the index
    of a sharded checkpoint; a single file lists its own)."""
    d = Path(hf_dir)
    index = d / INDEX_NAME
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
            weight_map = doc["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(
                f"{index}: not a safetensors index (a JSON object with a weight_map): {exc}"
            ) from None
        if not isinstance(weight_map, dict):
            raise UsageError(f"{index}: its weight_map is not a JSON object")
        return {str(k): d / str(v) for k, v in weight_map.items()}
    single = d / SINGLE_NAME
    if not single.is_file():
        raise UsageError(
            f"{d}: no {SINGLE_NAME} and no {INDEX_NAME} (the weights of a Hugging Face model)"
        )
    doc, _ = _header(single)
    return {k: single for k in doc if k != "__metadata__"}


def open_weights(hf_dir: str | Path, arch: str) -> dict[str, MappedTensor]:
    """Every tensor of the directory's weight files by its model name (:data:`CONVERSIONS`),
    memory-mapped; tensors the model does not use are left out."""
    files = weight_files(hf_dir)
    by_file: dict[Path, set[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, set()).add(name)
    out: dict[str, MappedTensor] = {}
    for path, names in by_file.items():
        for name, tensor in _open_file(path, arch, names):
            model_name = to_model_name(arch, name)
            if model_name is not None:
                out[model_name] = tensor
        missing = sorted(
            names
            - {t.name for t in out.values() if t.file == path}
            - {n for n in names if to_model_name(arch, n) is None}
        )
        if missing:
            raise UsageError(
                f"{path}: the index lists {missing[0]!r}, which the file does not hold"
            )
    return out


def _bf16_bits(value: np.ndarray) -> np.ndarray:
    """binary32 values that are bf16 values, as their upper 16 bits."""
    bits = np.ascontiguousarray(value, dtype=np.float32).view(np.uint32)
    return (bits >> np.uint32(16)).astype(np.uint16)


def write_weights(
    hf_dir: str | Path,
    arch: str,
    tensors: Sequence[tuple[str, DType, np.ndarray]],
    *,
    max_shard_bytes: int = 5 * 1024**3,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``(model name, dtype, global value)`` tensors as the files' names and layout
    (:data:`CONVERSIONS` read backwards), in ``model.safetensors``, or in shards
    ``model-0000K-of-0000N.safetensors`` of at most ``max_shard_bytes`` each (a tensor larger
    than that alone in its shard) with ``model.safetensors.index.json`` where they do not fit
    one. Each file is written to a temporary name and renamed into place. Returns the files."""
    d = Path(hf_dir)
    d.mkdir(parents=True, exist_ok=True)
    items: list[tuple[str, str, np.ndarray]] = []
    for name, dtype, value in tensors:
        hf_name, transform = to_hf_name(arch, name)
        v = np.asarray(value)
        if transform == "transpose":
            v = v.T
        raw = _bf16_bits(v) if dtype is DType.BF16 else np.ascontiguousarray(v)
        items.append(
            (hf_name, _ST_NAME[dtype], raw.astype(raw.dtype.newbyteorder("<"), copy=False))
        )
    shards: list[list[tuple[str, str, np.ndarray]]] = [[]]
    used = 0
    for item in items:
        if shards[-1] and used + item[2].nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += item[2].nbytes
    meta = {"format": "pt", **(metadata or {})}
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    written = []
    for fname, shard in zip(names, shards, strict=True):
        written.append(_write_file(d / fname, shard, meta))
    index = d / INDEX_NAME
    if len(shards) > 1:
        weight_map = {
            n: fname for fname, shard in zip(names, shards, strict=True) for n, _, _ in shard
        }
        total = sum(v.nbytes for _, _, v in items)
        doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _atomic_text(index, json.dumps(doc, indent=2) + "\n")
        written.append(index)
    elif index.exists():
        index.unlink()
    return written


def _write_file(
    path: Path, shard: Sequence[tuple[str, str, np.ndarray]], meta: Mapping[str, str]
) -> Path:
    header: dict[str, Any] = {"__metadata__": dict(meta)}
    offset = 0
    for name, kind, v in shard:
        header[name] = {
            "dtype": kind,
            "shape": list(v.shape),
            "data_offsets": [offset, offset + v.nbytes],
        }
        offset += v.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, _, v in shard:
            f.write(np.ascontiguousarray(v).data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
