"""Layers and models (``dtm.nn``): the building blocks of :mod:`dtm_mpi.frontend.layers`
(``Module``, ``Parameter``, ``Linear``, the Megatron-parallel layers, ``GPT``) and the LLM
layers and models of :mod:`dtm_mpi.frontend.llm`, whose module trees mirror Hugging Face's
(``Llama``, ``GPT2``, ``RMSNorm``, ``SwiGLU``, ``GroupedQueryAttention``, ``TorchLinear``)."""

from __future__ import annotations

from dtm_mpi.frontend.layers import (
    GPT,
    MLP,
    ColumnParallelLinear,
    Embedding,
    LayerNorm,
    Linear,
    Module,
    MultiHeadAttention,
    Parameter,
    RowParallelLinear,
    Sequential,
    TransformerBlock,
)
from dtm_mpi.frontend.llm import (
    GPT2,
    GroupedQueryAttention,
    Llama,
    RMSNorm,
    SwiGLU,
    TorchLinear,
)

__all__ = [
    "GPT",
    "GPT2",
    "MLP",
    "ColumnParallelLinear",
    "Embedding",
    "GroupedQueryAttention",
    "LayerNorm",
    "Linear",
    "Llama",
    "Module",
    "MultiHeadAttention",
    "Parameter",
    "RMSNorm",
    "RowParallelLinear",
    "Sequential",
    "SwiGLU",
    "TorchLinear",
    "TransformerBlock",
]
