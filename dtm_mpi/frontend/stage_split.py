"""Pipeline stages from the frontend: a model's forward cut before named layers.

``splits`` name layers by their path in the model (``blocks.2``: the third block; the paths of
:meth:`~dtm_mpi.frontend.nn.Module.named_layers`). Tracing records where each layer call's ops
start; stage ``k + 1`` starts at the first op of the first call of ``splits[k]``, so the
stages are consecutive runs of the traced forward (:func:`dtm_mpi.ir.stages.partition_stages`
then finds the routes between them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dtm_mpi.errors import UsageError, VerifyError
from dtm_mpi.frontend.mesh import Mesh
from dtm_mpi.frontend.nn import Module as Layer
from dtm_mpi.frontend.tensor import trace_error, tracing
from dtm_mpi.frontend.trace import Input, _split_outputs, _trace
from dtm_mpi.ir.stages import StagePartition, partition_stages

__all__ = ["forward_stages", "stage_cuts"]


def stage_cuts(
    model: Layer, entered: Sequence[tuple[int, str]], splits: Sequence[str]
) -> list[int]:
    """The op positions at which the stages after ``splits`` start (``entered``: the
    tracer's (op position, layer path) of every layer call, in call order)."""
    paths = [p for p, _ in model.named_layers()]
    cuts: list[int] = []
    for k, split in enumerate(splits):
        if split not in paths:
            shown = ", ".join(p for p in paths if p.count(".") <= 1)
            raise UsageError(
                f"pipeline split {split!r}: the model has no layer with this path (its layers: {shown})"
            )
        if split in splits[:k]:
            raise UsageError(f"pipeline split {split!r} is given twice")
        first = next((at for at, path in entered if path == split), None)
        if first is None:
            raise UsageError(
                f"pipeline split {split!r}: the traced function never calls this layer"
            )
        if cuts and first <= cuts[-1]:
            raise UsageError(
                f"pipeline splits follow the forward order: {split!r} runs before {splits[k - 1]!r}"
            )
        cuts.append(first)
    return cuts


def forward_stages(
    model: Layer,
    loss_fn: Callable[..., Any],
    *,
    mesh: Mesh,
    inputs: Mapping[str, Input],
    splits: Sequence[str],
    seed: int = 0,
    name: str = "train",
) -> StagePartition:
    """Trace ``loss_fn(model, **inputs)`` (as :func:`~dtm_mpi.frontend.trace.train_step`
    does, up to the loss and metrics) and cut its forward into ``len(splits) + 1`` stages
    before the layers ``splits`` name."""
    tr, _, _, out = _trace(model, loss_fn, mesh, inputs, name, weights_as_state=True, seed=seed)
    with tracing(tr):
        for _, t in _split_outputs(out, "loss"):
            t.complete()
    cuts = stage_cuts(model, tr.entered, splits)
    try:
        return partition_stages(tr.b.params, tr.b.ops, cuts, fed=tuple(inputs))
    except VerifyError as err:
        raise trace_error(err) from None
