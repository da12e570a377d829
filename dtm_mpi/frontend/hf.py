"""Hugging Face models in dtm: :func:`load` a model directory (``config.json`` and
safetensors weights) as a :class:`~dtm_mpi.frontend.llm.Llama` or
:class:`~dtm_mpi.frontend.llm.GPT2` whose parameter paths are the checkpoint's names, with
its weights memory-mapped (each rank of a run reads its own blocks only).

    from dtm_mpi import frontend as dtm

    hf = dtm.hf.load("tiny-llama", mesh={"tp": 2})
    step = dtm.forward_step(hf.model, lambda m, ids: m(ids), mesh=dtm.Mesh(dp=1, tp=2),
                            inputs={"ids": dtm.Input((1, 16), "i32")})
    logits = dtm.fit(step, loader, steps=1, values=hf.weights).tensors[0]["output"]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.layers import Module
from dtm_mpi.frontend.llm import GPT2, Llama
from dtm_mpi.io.hf_files import MappedTensor, architecture, open_weights, read_config

__all__ = ["HFModel", "load", "match_weights", "model_for"]


@dataclass
class HFModel:
    """A loaded Hugging Face model: the dtm ``model``, the ``config`` (``config.json``'s
    fields), its ``architecture`` (``llama``, ``gpt2``), the ``weights`` by parameter path
    (memory-mapped: pass them as ``fit(..., values=weights)``) and the directory."""

    model: Module
    config: dict[str, Any]
    architecture: str
    weights: dict[str, MappedTensor] = field(repr=False)
    path: Path

    @property
    def tokenizer_file(self) -> Path | None:
        """The directory's ``tokenizer.json``, where there is one."""
        p = self.path / "tokenizer.json"
        return p if p.is_file() else None


def model_for(
    config: Mapping[str, Any],
    *,
    mesh: Mapping[str, int] | None = None,
    axis: str | None = "tp",
    dtype: str | None = None,
    where: str = "config.json",
) -> tuple[str, Module]:
    """The architecture and the dtm model a Hugging Face config describes, laid out for a
    mesh of the axis sizes ``mesh`` (the kv heads split over ``axis`` where its size divides
    them)."""
    arch = architecture(config, where)
    try:
        if arch == "llama":
            return arch, Llama.for_mesh(config, dict(mesh or {}), axis=axis, dtype=dtype)
        return arch, GPT2(config, axis=axis, dtype=dtype)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None


def load(
    hf_dir: str | Path,
    *,
    mesh: Mapping[str, int] | None = None,
    axis: str | None = "tp",
    dtype: str | None = None,
) -> HFModel:
    """The model of a Hugging Face directory (``config.json``; ``model.safetensors`` or the
    shards of ``model.safetensors.index.json``; bf16/f16/f32 weights), laid out for a mesh of
    the axis sizes ``mesh``, computing in ``dtype`` (default: the config's). Every parameter
    must be in the files with the shape the config gives it; a missing tensor, a shape that
    disagrees, an unsupported architecture or rope type is one error naming it."""
    path = Path(hf_dir)
    config = read_config(path)
    arch, model = model_for(
        config, mesh=mesh, axis=axis, dtype=dtype, where=str(path / "config.json")
    )
    weights = match_weights(model, open_weights(path, arch), arch, config, path)
    return HFModel(model, config, arch, weights, path)


def match_weights(
    model: Module,
    files: dict[str, MappedTensor],
    arch: str,
    config: Mapping[str, Any],
    path: Path,
) -> dict[str, MappedTensor]:
    """The files' tensor of each parameter of ``model``, by its path: every parameter must be
    there with its shape, and every tensor of the files used (a tied head's copy aside)."""
    files = dict(files)
    tied = bool(config.get("tie_word_embeddings", arch == "gpt2"))
    weights: dict[str, MappedTensor] = {}
    for name, _, _, p in model.named_parameters():
        got = files.pop(name, None)
        if got is None:
            raise UsageError(
                f"{path}: tensor {name!r} is missing from the weight files (the {arch} model needs it)"
            )
        if got.shape != tuple(p.shape):
            raise UsageError(
                f"{got.file}: tensor {name!r} has shape {list(got.shape)}, but the config gives it {list(p.shape)}"
            )
        weights[name] = got
    if tied:
        files.pop("lm_head.weight", None)  # a tied head's copy of the embedding
    if files:
        extra = sorted(files)
        raise UsageError(
            f"{path}: {len(extra)} tensor(s) the {arch} model does not use, e.g. {extra[0]!r} (an architecture variant dtm does not build?)"
        )
    return weights
