"""Which traced value each layer parameter has in the step being traced."""

from __future__ import annotations

import contextvars
from dataclasses import replace
from typing import Any

from dtm_mpi.errors import TraceError
from dtm_mpi.frontend.tensor import Tensor, Tracer, trace_error, user_span
from dtm_mpi.ir.types import Layout, TensorType

__all__ = ["GATHERED", "TRACED", "regather", "sharded_storage", "traced_parameter"]


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


def regather(tr: Tracer, forward: int, origins: list[int] | None = None) -> list[int]:
    """Gather each sharded parameter again where the reverse pass (the ops from index
    ``forward`` on) first uses it, instead of keeping the forward pass's gather alive until
    then (FSDP): the forward's copy is freed after its last forward use. The same global
    values (a gather is a layout change), so the same bits and program hash. ``origins``
    (the reverse ops' origins, as :func:`~dtm_mpi.ir.autodiff.backward` gives them): returns
    them for the new reverse ops (a gather's is the forward gather's position)."""
    b = tr.b
    at = {op.results[0]: i for i, op in enumerate(b.ops[:forward]) if set(op.results) & tr.gathered}
    body = list(b.ops[:forward])
    out: list[int] = []
    renamed: dict[str, str] = {}
    for j, op in enumerate(b.ops[forward:]):
        for name in op.operands:
            if name in at and name not in renamed:  # its first use in the reverse pass
                again = renamed[name] = b.fresh(name.lstrip("%") + ".again")
                b.types[again] = b.types[name]
                body.append(replace(b.ops[at[name]], results=(again,), result_spans=()))
                out.append(at[name])
        body.append(replace(op, operands=tuple(renamed.get(v, v) for v in op.operands)))
        if origins is not None:
            out.append(origins[j])
    b.ops[:] = body
    return out if origins is not None else []
