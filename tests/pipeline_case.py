"""What the pipeline tests share: a small float64 GPT and its loss, token batches, the
unpipelined step's loss and gradients (the forward and its reverse pass in one function, as
train_step traces them, evaluated by the single-process reference), and the global value of a
parameter assembled from the blocks the ranks hold."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from dtm_mpi import frontend as dtm
from dtm_mpi.frontend import functional as fn
from dtm_mpi.frontend.step_trace import split_outputs, trace_model
from dtm_mpi.frontend.tensor import tracing
from dtm_mpi.ir.autodiff import backward
from dtm_mpi.ir.nodes import Module
from dtm_mpi.ir.registry import required_version
from dtm_mpi.ir.types import Layout
from dtm_mpi.runtime.reference import evaluate_function
from dtm_mpi.runtime.values import init_global
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape

T, VOCAB = 6, 11


def gpt() -> dtm.nn.GPT:
    """Four blocks, float64 (so pipelined and unpipelined sums differ only in rounding)."""
    return dtm.nn.GPT(VOCAB, T, 12, 6, 4, dtype="f64")


def lm_loss(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
    logits = m(ids)
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def token_inputs(batch: int) -> dict[str, dtm.Input]:
    return {k: dtm.Input((batch, T), "i32", ("dp", None)) for k in ("ids", "tgt")}


def token_batch(batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, VOCAB, size=(batch, T)).astype(np.int32) for k in ("ids", "tgt")}


def unpipelined(
    model: dtm.nn.Module,
    loss_fn: Callable[..., Any],
    mesh: dtm.Mesh,
    inputs: Mapping[str, dtm.Input],
    data: Mapping[str, np.ndarray],
) -> tuple[float, dict[str, np.ndarray]]:
    """The whole batch's loss and the gradient of every parameter, by name."""
    tr, _, weights, out = trace_model(
        model, loss_fn, mesh, inputs, "ref", weights_as_state=True, seed=0
    )
    with tracing(tr):
        loss = split_outputs(out, "loss")[0][1].complete()
        grads = backward(
            tr.b, list(tr.b.ops), loss.value, [v for _, v in weights], stop=tr.detached
        )
    f = tr.b.function("ref", [loss.value, *grads], entry=True)
    module = Module(required_version(f.body), "ref", (mesh.ir(),), (f,))
    args = tuple(data[p.name[1:]] if p.name[1:] in data else init_global(p) for p in f.params)
    got = evaluate_function(module, f, args, 0)
    return float(got[0]), {v.name: g for (_, v), g in zip(weights, got[1:], strict=True)}


def assembled(
    blocks: Sequence[Mapping[str, np.ndarray]],
    name: str,
    like: np.ndarray,
    layout: Layout,
    shape: MeshShape,
) -> np.ndarray:
    """The global value of ``name`` from the ranks' blocks (``blocks[r]``: rank ``r``'s, by
    name; a rank without it holds none); NaN where no rank holds a block."""
    out = np.full_like(like, np.nan)
    for r, held in enumerate(blocks):
        if name in held:
            out[local_block(like.shape, layout, shape, r)] = held[name]
    return out
