"""Which traced value each layer parameter has in the step being traced."""

from __future__ import annotations

import contextvars
from typing import Any

from dtm_mpi.errors import TraceError
from dtm_mpi.frontend.tensor import Tensor, trace_error, user_span
from dtm_mpi.ir.types import Layout, TensorType

__all__ = ["GATHERED", "TRACED", "sharded_storage", "traced_parameter"]


def sharded_storage(t: TensorType, axis: str) -> TensorType:
    """The type a parameter of type ``t`` is stored in when parameters are sharded over
    ``axis`` (ZeRO-3): its first dim also split over the axis (innermost), unless ``t`` is a
    scalar or already uses the axis (then ``t``)."""
    if t.rank == 0 or axis in t.layout.used_axes:
        return t
    dims = t.layout.dims
    return t.with_layout(Layout(((*dims[0], axis), *dims[1:]), t.layout.partial))


TRACED: contextvars.ContextVar[dict[tuple[int, str], Tensor] | None] = contextvars.ContextVar(
    "dtm_traced_params", default=None
)
"""(id of the owning layer, attribute) -> traced value, while a step is traced."""

GATHERED: contextvars.ContextVar[dict[tuple[int, str], Layout] | None] = contextvars.ContextVar(
    "dtm_gathered_params", default=None
)
"""(id of the owning layer, attribute) -> the layout a parameter stored sharded
(``train_step(shard_params=...)``) is gathered to at each use, while a step is traced."""


def traced_parameter(owner: Any, name: str) -> Tensor:
    """The traced value of ``owner``'s parameter ``name`` in the step being traced."""
    traced = TRACED.get()
    if traced is None:
        raise TraceError(
            "layers run only inside a traced step (train_step / eval_step)", user_span()
        )
    got = traced.get((id(owner), name))
    if got is None:
        raise trace_error(f"{type(owner).__name__} has no parameter {name!r} in this model")
    gather = (GATHERED.get() or {}).get((id(owner), name))
    out = got
    if gather is not None:
        out = got.redistribute(gather)  # an allgather, here
        out.tracer.gathered.add(out.value.name)
    compute = out.tracer.compute  # mixed precision: the master's copy in the compute dtype
    if compute is not None and out.dtype.is_float and out.dtype is not compute:
        out = out.cast(compute)
    return out
