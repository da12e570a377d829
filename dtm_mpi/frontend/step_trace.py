"""Tracing a function of a model into an IR function body (shared by the steps of
:mod:`dtm_mpi.frontend.trace` and the pipeline stages of :mod:`dtm_mpi.frontend.stage_split`):
the per-step inputs, the model's parameters as entry parameters, the user's function run on
traced tensors, and what it returned."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtm_mpi.errors import TraceError, UsageError, VerifyError
from dtm_mpi.frontend.layers import Module as Layer
from dtm_mpi.frontend.mesh import Mesh
from dtm_mpi.frontend.precision import MixedPrecision, parse_precision
from dtm_mpi.frontend.tensor import Tensor, Tracer, as_layout, parse_dtype, tracing, user_span
from dtm_mpi.frontend.traced_params import GATHERED, sharded_storage
from dtm_mpi.frontend.traced_params import TRACED as _TRACED
from dtm_mpi.ir.build import FunctionBuilder, Value
from dtm_mpi.ir.nodes import Init, InitKind
from dtm_mpi.ir.types import Layout, TensorType

__all__ = ["Input", "split_outputs", "trace_model"]


@dataclass(frozen=True)
class Input:
    """A per-step input: global shape, dtype and layout (e.g. the batch dim over ``dp``)."""

    shape: tuple[int, ...]
    dtype: str = "f32"
    layout: Sequence[Any] | None = None

    def type(self) -> TensorType:
        return TensorType(
            parse_dtype(self.dtype), tuple(self.shape), as_layout(self.layout, len(self.shape))
        )


def _module_name(name: str) -> str:
    if not name.replace("_", "a").isalnum() or name[0].isdigit():
        raise UsageError(f"program name {name!r}: use letters, digits and '_'")
    return name


def trace_model(
    model: Layer,
    fn: Callable[..., Any],
    mesh: Mesh,
    inputs: Mapping[str, Input],
    name: str,
    *,
    weights_as_state: bool,
    seed: int,
    from_store: bool = False,
    shard_params: str | None = None,
    precision: MixedPrecision | None = None,
) -> tuple[Tracer, list[Value], list[tuple[str, Value]], Any]:
    b = FunctionBuilder(mesh.ir(), module_name=_module_name(name))
    tr = Tracer(b)
    master = None
    if precision is not None:  # each use of a parameter reads its copy in the compute dtype
        tr.compute, master = parse_precision(precision)
    tr.paths = {id(layer): path for path, layer in model.named_layers()}
    given = []
    for key, spec in inputs.items():
        if not isinstance(spec, Input):
            raise UsageError(
                f"input {key!r}: expected an Input(shape, dtype, layout); got {spec!r}"
            )
        given.append(b.add_param(key, _checked(f"input {key!r}", key, spec.type, b)))
    bound: dict[tuple[int, str], Tensor] = {}
    gathered: dict[tuple[int, str], Layout] = {}
    weights: list[tuple[str, Value]] = []
    for path, owner, attr, p in model.named_parameters():
        t = _checked(f"parameter {path!r} of {type(owner).__name__}", path, p.type, b)
        if shard_params is not None:  # stored split, gathered at each use (ZeRO-3)
            stored = sharded_storage(t, shard_params)
            if stored != t:
                gathered[(id(owner), attr)] = t.layout
                t = stored
        if master is not None and t.dtype.is_float and t.dtype is not master:
            raise UsageError(
                f"parameter {path!r} of {type(owner).__name__} is {t.dtype}; a MixedPrecision "
                f"step keeps its master weights in {master}: build the model in {master}"
            )
        if weights_as_state and not t.dtype.is_float:
            raise UsageError(
                f"parameter {path!r} of {type(owner).__name__} is {t.dtype}: trained parameters are floating (an integer table is an input)"
            )
        try:
            init = (
                Init(InitKind.STORE)
                if from_store
                else p.ir_init(path, seed)
                if weights_as_state
                else None
            )
        except ValueError:
            raise UsageError(
                f"parameter {path!r}: init {p.init!r} is not one of {', '.join(k.value for k in InitKind if k is not InitKind.STORE)}"
            ) from None
        v = b.add_param(path, t, state=weights_as_state, init=init)
        bound[(id(owner), attr)] = Tensor(v, tr)
        weights.append((path, v))
    token, gather_token = _TRACED.set(bound), GATHERED.set(gathered)
    try:
        with tracing(tr):
            out = fn(model, **{k: Tensor(v, tr) for k, v in zip(inputs, given, strict=True)})
    finally:
        _TRACED.reset(token)
        GATHERED.reset(gather_token)
    return tr, given, weights, out


_NAME = re.compile(r"[A-Za-z0-9_.]+\Z")


def _checked(
    what: str, name: str, make_type: Callable[[], TensorType], b: FunctionBuilder
) -> TensorType:
    """The type of an input or parameter, refused (one line naming it) where its name is not
    an IR value name, a size is negative, or its layout names an axis the mesh lacks or one
    axis twice."""
    from dtm_mpi.ir.verify import check_layout

    if not _NAME.match(name):
        raise UsageError(f"{what}: names are letters, digits, '_' and '.'")
    try:
        t = make_type()
    except (ValueError, TraceError) as exc:
        raise UsageError(f"{what}: {getattr(exc, 'message', exc)}") from None
    if any(not isinstance(n, int) or n < 0 for n in t.shape):
        raise UsageError(f"{what}: sizes must be integers >= 0; got {list(t.shape)}")
    try:
        check_layout(t, b.mesh, user_span(), "")
    except VerifyError as err:
        raise UsageError(f"{what}: {err.message.strip()}") from None
    return t


def split_outputs(out: Any, what: str) -> list[tuple[str, Tensor]]:
    """(name, scalar tensor) of what the traced function returned: a tensor (``loss``), or
    (loss, {name: tensor}), or {name: tensor}."""
    if isinstance(out, Tensor):
        return [("loss", out)]
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], Tensor)
        and isinstance(out[1], Mapping)
    ):
        return [("loss", out[0]), *out[1].items()]
    if isinstance(out, Mapping) and all(isinstance(v, Tensor) for v in out.values()):
        return list(out.items())
    raise UsageError(
        f"the {what} function must return a scalar tensor, (loss, {{name: tensor}}) or {{name: tensor}}; got {type(out).__name__}"
    )
