"""Where a language model comes from for a run that does not train it (``dtm generate``): a
Hugging Face model directory (``config.json`` and safetensors, memory-mapped: each rank reads
its blocks) or a store made by ``dtm hf import`` (its ``hf/config.json``, the weights of its
latest checkpoint -- e.g. after training -- read by each rank as ``init store`` parameters).
The tokenizer file sits beside the config in both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.hf import load, model_for
from dtm_mpi.frontend.hf_store import HF_SUBDIR, store_config
from dtm_mpi.frontend.layers import Module
from dtm_mpi.frontend.tokenizer import TOKENIZER_FILE

__all__ = ["ModelSource", "open_model"]


@dataclass(frozen=True)
class ModelSource:
    """A model to run: its ``config`` and ``architecture``, the dtm ``model`` laid out for the
    mesh, and either ``weights`` (a model directory's tensors, by parameter path) or a
    ``store`` whose latest checkpoint holds them; ``meta_dir`` keeps the tokenizer files."""

    path: Path
    config: dict[str, Any]
    architecture: str
    model: Module
    weights: dict[str, Any] | None
    store: Path | None
    meta_dir: Path

    @property
    def tokenizer_file(self) -> Path | None:
        p = self.meta_dir / TOKENIZER_FILE
        return p if p.is_file() else None

    @property
    def what(self) -> str:
        return f"store {self.path}" if self.store is not None else f"model directory {self.path}"


def open_model(
    path: str | Path, *, sizes: Mapping[str, int] | None = None, dtype: str | None = None
) -> ModelSource:
    """The model of ``path``: a Hugging Face directory (it has ``config.json``) or a store of
    ``dtm hf import`` (it has ``hf/config.json`` and a committed checkpoint), laid out for
    the axis sizes ``sizes``, computing in ``dtype`` (default: the config's)."""
    from dtm_mpi.io.tools import committed

    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"{p}: no such model directory or store")
    if (p / "config.json").is_file():
        hf = load(p, mesh=sizes, dtype=dtype)
        return ModelSource(p, hf.config, hf.architecture, hf.model, hf.weights, None, p)
    if not (p / HF_SUBDIR / "config.json").is_file():
        raise UsageError(
            f"{p}: neither a Hugging Face model directory (no config.json) nor a store made by "
            f"`dtm hf import` (no {HF_SUBDIR}/config.json)"
        )
    config = store_config(p)
    arch, model = model_for(
        config, mesh=sizes, dtype=dtype, where=str(p / HF_SUBDIR / "config.json")
    )
    if not committed(p):
        raise UsageError(f"store {p} has no committed checkpoint to take the weights from")
    return ModelSource(p, config, arch, model, None, p, p / HF_SUBDIR)
