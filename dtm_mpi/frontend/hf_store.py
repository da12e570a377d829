"""Hugging Face checkpoints into and out of a dtm store (``dtm hf import`` / ``dtm hf export``).

:func:`import_checkpoint` checks a model directory against the model its ``config.json``
builds (:func:`~dtm_mpi.frontend.hf.load`'s checks: every parameter there with its shape, no
tensor unused) and saves the weights as a new checkpoint of the store, under the checkpoint's
names, in the files' dtypes (bf16 stays bf16); ``config.json`` and the tokenizer and generation
files go to ``STORE/hf/``. A run then starts from them with ``train_step(...,
weights_from_store=True)`` or ``forward_step(..., weights_from_store=True)``, each rank reading
its blocks, on any mesh.

:func:`export_checkpoint` writes a checkpoint of the store (default: the latest) back as a
model directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads: ``config.json``
(its ``dtype``/``torch_dtype`` the weights'), ``model.safetensors`` or shards with
``model.safetensors.index.json`` above ``max_shard_bytes``, and the files ``STORE/hf/`` holds.
Every chunk read is checked against its content hash.

Both are serial tools (one process); the import holds the model's weights in memory once.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.hf import match_weights, model_for
from dtm_mpi.io.hf_files import open_weights, read_config, write_weights
from dtm_mpi.ir.types import DType

__all__ = [
    "HF_SUBDIR",
    "SIDE_FILES",
    "Exported",
    "Imported",
    "export_checkpoint",
    "import_checkpoint",
    "save_hf_files",
    "store_config",
    "write_random_model",
]

HF_SUBDIR = "hf"
"""The store's directory that keeps an imported model's config and tokenizer files."""

SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""The files of a model directory besides its config and weights that travel with it."""

_TORCH_NAMES = {
    DType.F32: "float32",
    DType.F16: "float16",
    DType.BF16: "bfloat16",
    DType.F64: "float64",
}


@dataclass(frozen=True, slots=True)
class Imported:
    architecture: str
    tensors: int
    bytes: int
    step: int
    checkpoint: Path
    side_files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Exported:
    architecture: str
    tensors: int
    step: int
    files: tuple[Path, ...]


def store_config(store: Path) -> dict[str, Any]:
    """The Hugging Face config an import saved in ``store`` (an error naming the store where
    there is none)."""
    d = store / HF_SUBDIR
    if not (d / "config.json").is_file():
        raise UsageError(
            f"store {store}: no {HF_SUBDIR}/config.json (a store made by `dtm hf import` has one; "
            "else pass --config HF_DIR/config.json)"
        )
    return read_config(d)


def import_checkpoint(hf_dir: str | Path, store: Path, comm: Any) -> Imported:
    """Save the weights of the model directory ``hf_dir`` as a new checkpoint of ``store``
    (made when missing) and its config and side files in ``store/hf/``; ``comm`` a
    one-process communicator. Nothing is written when a check fails."""
    from dtm_mpi.io.tools import bf16_bits, put_tensors

    src = Path(hf_dir)
    config = read_config(src)
    arch, model = model_for(config, where=str(src / "config.json"))
    weights = match_weights(model, open_weights(src, arch), arch, config, src)
    values: dict[str, np.ndarray] = {}
    for name, t in weights.items():
        value = np.asarray(t)
        values[name] = bf16_bits(value) if t.dtm_dtype is DType.BF16 else value
    store.mkdir(parents=True, exist_ok=True)
    put = put_tensors(store, comm, values, where=dict.fromkeys(values, str(src)))
    side = save_hf_files(store, config, src)
    return Imported(
        arch, len(values), sum(v.nbytes for v in values.values()), put.step, put.path, side
    )


def save_hf_files(
    store: str | Path, config: Mapping[str, Any], src: str | Path | None = None
) -> tuple[str, ...]:
    """Keep ``config`` (a Hugging Face ``config.json``'s fields) and the tokenizer and
    generation files of the directory ``src`` in ``store/hf/``, as an import does, so that a
    model trained from scratch into ``store`` exports (:func:`export_checkpoint`) and
    generates from it; the names of the files copied. One process calls it."""
    dst = Path(store) / HF_SUBDIR
    dst.mkdir(parents=True, exist_ok=True)
    _write_json(dst / "config.json", config)
    if src is None:
        return ()
    copied: list[str] = []
    for name in SIDE_FILES:
        path = Path(src) / name
        if path.is_file():
            tmp = dst / (name + ".tmp")
            shutil.copyfile(path, tmp)
            tmp.replace(dst / name)
            copied.append(name)
    return tuple(copied)


def write_random_model(out: str | Path, config: Mapping[str, Any], seed: int = 0) -> Path:
    """A Hugging Face model directory ``out`` (``config.json`` and ``model.safetensors``) of
    the model ``config`` describes, with random weights drawn as transformers initialises
    them (normal(0, 0.02); vectors, the norms' weights, at one), in float32."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    arch, model = model_for(config)
    rng = np.random.default_rng(seed)
    tensors = []
    for name, _, _, p in model.named_parameters():
        shape = tuple(p.shape)
        value = (
            np.ones(shape, np.float32)
            if len(shape) == 1
            else (0.02 * rng.standard_normal(shape)).astype(np.float32)
        )
        tensors.append((name, DType.F32, value))
    write_weights(d, arch, tensors)
    _write_json(d / "config.json", config)
    return d


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def export_checkpoint(
    store: Path,
    out_dir: str | Path,
    *,
    step: int | None = None,
    config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    warn: Any = None,
) -> Exported:
    """Write checkpoint ``step`` (default: the latest) of ``store`` as the Hugging Face model
    directory ``out_dir``, described by ``config`` (default: the one the import saved). Every
    parameter of that model must be in the checkpoint with its shape; other tensors (an
    optimizer's state) stay behind. ``warn``: serve a damaged chunk from another checkpoint
    and say so (else a damaged chunk is an error)."""
    from dtm_mpi.io.recovery import read_served
    from dtm_mpi.io.tools import checkpoint_path, read_manifest, store_backend

    if max_shard_bytes <= 0:
        raise UsageError(f"--max-shard-size must be > 0; got {max_shard_bytes}")
    cfg = dict(config) if config is not None else store_config(store)
    arch, model = model_for(cfg)
    ckpt = checkpoint_path(store, step)
    backend = store_backend(store)
    m = read_manifest(ckpt, backend)
    have = {a.name: a for a in m.artifacts}
    items: list[tuple[str, DType, np.ndarray]] = []
    dtypes = set()
    for name, _, _, p in model.named_parameters():
        a = have.get(name)
        if a is None:
            raise UsageError(
                f"checkpoint {ckpt}: no tensor {name!r} (the {arch} model of the config needs it)"
            )
        if tuple(a.shape) != tuple(p.shape):
            raise UsageError(
                f"checkpoint {ckpt}: tensor {name!r} has shape {list(a.shape)}, but the config gives it {list(p.shape)}"
            )
        if a.dtype not in _TORCH_NAMES:
            raise UsageError(f"checkpoint {ckpt}: tensor {name!r} is {a.dtype}, not a float dtype")
        items.append((name, a.dtype, read_served(store, m, name, backend=backend, warn=warn)))
        dtypes.add(a.dtype)
    out = Path(out_dir)
    meta = {"dtm_store": str(store), "dtm_step": str(m.step)}
    written = write_weights(out, arch, items, max_shard_bytes=max_shard_bytes, metadata=meta)
    # the weights' dtype (the widest where they differ), as transformers reads it
    widest = max(dtypes, key=lambda d: (d.itemsize, d is DType.F16)) if dtypes else DType.F32
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = _TORCH_NAMES[widest]
    side = store / HF_SUBDIR
    for name in SIDE_FILES:
        if (side / name).is_file():
            tmp = out / (name + ".tmp")
            shutil.copyfile(side / name, tmp)
            tmp.replace(out / name)
    _write_json(out / "config.json", cfg)
    return Exported(arch, len(items), m.step, (*written, out / "config.json"))
