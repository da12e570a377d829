"""Tensor maps (``dtm store export|import --map FILE``): which tensors move, under which names,
through which transform.

A map is a JSON object or a TOML table; each key names a tensor at the source of the move
(the store's on export, the file's on import) and its value says what it becomes:

* ``"a" = "b"``: renamed;
* ``"a" = { to = "b", transpose = true }``: renamed and transposed (a matrix; Conv1D's
  ``[in, out]`` against a Linear's ``[out, in]``);
* ``"a" = { to = ["q", "k", "v"], split = 1 }``: cut along dim 1 into equal parts, one per
  name (GPT-2's fused ``c_attn``);
* ``"a" = { to = "qkv", concat = 1, with = ["b", "c"] }``: ``a`` then ``b`` and ``c`` joined
  along dim 1 (the same fusion, the other way).

These are the transforms of the Hugging Face conversion tables
(:data:`dtm_mpi.io.hf_files.CONVERSIONS`: rename, transpose), plus split and concatenate. With a
map exactly the mapped tensors move; a source used twice, a target named twice, a missing
source or a shape the transform cannot take is an error naming the map's entry.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError

__all__ = ["MapEntry", "TRANSFORMS", "apply_entry", "as_entries", "read_tensor_map"]

TRANSFORMS = ("rename", "transpose", "split", "concat")


@dataclass(frozen=True, slots=True)
class MapEntry:
    """``sources`` (one; several for ``concat``) become ``targets`` (one; several for
    ``split``) by ``transform`` (one of :data:`TRANSFORMS`) along ``dim``; ``where``: the
    entry, for messages."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    transform: str = "rename"
    dim: int = 0
    where: str = ""


def _entry(key: str, value: object, where: str) -> MapEntry:
    at = f"{where}: entry {key!r}"
    if isinstance(value, str):
        return MapEntry((key,), (value,), "rename", 0, at)
    if not isinstance(value, dict):
        raise UsageError(f"{at}: want a name or a table (to = ..., and transpose, split or concat)")
    unknown = sorted(set(value) - {"to", "transpose", "split", "concat", "with"})
    if unknown:
        raise UsageError(
            f"{at}: unknown key {unknown[0]!r} (keys: to, transpose, split, concat, with)"
        )
    to = value.get("to")
    kinds = [k for k in ("transpose", "split", "concat") if k in value]
    if len(kinds) > 1:
        raise UsageError(f"{at}: give one of transpose, split, concat; got {', '.join(kinds)}")
    kind = kinds[0] if kinds else "rename"
    if kind == "split":
        if not (isinstance(to, list) and len(to) >= 2 and all(isinstance(t, str) for t in to)):
            raise UsageError(f"{at}: split needs to = [two or more names]")
        targets = tuple(to)
    else:
        if not isinstance(to, str):
            raise UsageError(f"{at}: to must be a name")
        targets = (to,)
    if kind == "transpose" and value["transpose"] is not True:
        raise UsageError(f"{at}: transpose must be true")
    sources = (key,)
    if kind == "concat":
        more = value.get("with")
        if not (isinstance(more, list) and more and all(isinstance(m, str) for m in more)):
            raise UsageError(f"{at}: concat needs with = [the other names, in order]")
        sources = (key, *more)
    elif "with" in value:
        raise UsageError(f"{at}: with belongs to concat")
    dim = value.get(kind, 0) if kind in ("split", "concat") else 0
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise UsageError(f"{at}: {kind} takes a dim (an integer)")
    return MapEntry(sources, targets, kind, dim, at)


def as_entries(doc: Mapping[str, object], where: str) -> tuple[MapEntry, ...]:
    """The entries of a parsed map (a ``{from: to}`` table or richer), checked: each source
    used once, each target named once."""
    entries = tuple(_entry(str(k), v, where) for k, v in doc.items())
    for side, names in (
        ("source", [s for e in entries for s in e.sources]),
        ("target", [t for e in entries for t in e.targets]),
    ):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            what = "is used by two entries" if side == "source" else "is the target of two entries"
            raise UsageError(f"{where}: {twice[0]!r} {what}")
    return entries


def read_tensor_map(path: str | Path) -> tuple[MapEntry, ...]:
    """A map file (the module doc): JSON where it ends in ``.json``, else TOML."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        doc = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--map {p}: cannot read it: {exc}") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"--map {p}: not a JSON object or TOML table: {exc}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--map {p}: not a JSON object or TOML table")
    return as_entries(doc, f"--map {p}")


def _shape(x: np.ndarray) -> str:
    return "[" + ",".join(map(str, x.shape)) + "]"


def apply_entry(entry: MapEntry, values: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The target values of ``entry`` from its sources' ``values`` (in order)."""
    at = entry.where or f"{entry.sources[0]!r}"
    if entry.transform == "rename":
        return [values[0]]
    if entry.transform == "transpose":
        (x,) = values
        if x.ndim != 2:
            raise UsageError(f"{at}: transpose takes a matrix; {entry.sources[0]} is {_shape(x)}")
        return [np.ascontiguousarray(x.T)]
    first = values[0]
    if not -first.ndim <= entry.dim < first.ndim:
        raise UsageError(
            f"{at}: dim {entry.dim} is out of range for {entry.sources[0]} {_shape(first)}"
        )
    d = entry.dim % first.ndim
    if entry.transform == "split":
        k = len(entry.targets)
        if first.shape[d] % k:
            raise UsageError(
                f"{at}: {entry.sources[0]} {_shape(first)} does not split into {k} equal parts along dim {d}"
            )
        return [np.ascontiguousarray(p) for p in np.split(first, k, axis=d)]
    out: list[Any] = list(values)
    for name, v in zip(entry.sources[1:], out[1:], strict=True):
        same = v.ndim == first.ndim and all(
            a == b for i, (a, b) in enumerate(zip(v.shape, first.shape, strict=True)) if i != d
        )
        if not same or v.dtype != first.dtype:
            raise UsageError(
                f"{at}: {name} {v.dtype}{_shape(v)} does not join {entry.sources[0]} "
                f"{first.dtype}{_shape(first)} along dim {d}"
            )
    return [np.concatenate(out, axis=d)]
