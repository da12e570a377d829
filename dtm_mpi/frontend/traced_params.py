"""Which traced value each layer parameter has in the step being traced."""

from __future__ import annotations

import contextvars
from typing import Any

from dtm_mpi.errors import TraceError
from dtm_mpi.frontend.tensor import Tensor, trace_error, user_span

__all__ = ["TRACED", "traced_parameter"]

TRACED: contextvars.ContextVar[dict[tuple[int, str], Tensor] | None] = contextvars.ContextVar(
    "dtm_traced_params", default=None
)
"""(id of the owning layer, attribute) -> traced value, while a step is traced."""


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
    return got
