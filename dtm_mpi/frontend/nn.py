"""Layers: modules holding parameters (shape, dtype, layout over the mesh, init) and a
``forward`` written with traced tensors.

A parameter becomes a ``state`` parameter of the traced training step, named by its path in
the model (``layers.0.weight``) and initialised by the IR's own ``init`` (so every mesh and
the simulator start from the same values, and a checkpoint restores it by name). The seed of
each parameter's init is derived from its path and the model's seed: the traced module, and
its hash, are the same on every run.

Tensor parallelism follows Megatron: :class:`ColumnParallelLinear` splits the output features
over ``tp`` (no communication forward), :class:`RowParallelLinear` splits the input features
(its matmul leaves a pending sum that the next op completes with one allreduce). Data
parallelism is the batch dim of the inputs split over ``dp``; the weight gradients' allreduce
over ``dp`` comes out of the reverse pass.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.binding import bound_parameter
from dtm_mpi.frontend.functional import gelu, layer_norm
from dtm_mpi.frontend.tensor import Tensor, as_layout
from dtm_mpi.ir.nodes import Init, InitKind
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = [
    "ColumnParallelLinear", "LayerNorm", "Linear", "MLP", "Module", "Parameter",
    "RowParallelLinear", "Sequential",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Parameter:
    """A trainable tensor: global shape, dtype, layout and init (``normal``/``uniform`` with
    their arguments, ``zeros``, ``ones``)."""

    shape: tuple[int, ...]
    dtype: DType | str = DType.F32
    layout: Layout | Sequence[Any] | None = None
    """Per dim: None (not split), an axis name, or a tuple of axis names; None: replicated."""
    init: str = "normal"
    args: tuple[tuple[str, float], ...] = (("std", 0.02),)
    seed: int | None = None
    """The init's seed (default: derived from the parameter's path and the model's seed)."""

    def type(self) -> TensorType:
        dtype = self.dtype if isinstance(self.dtype, DType) else DType(self.dtype)
        return TensorType(dtype, tuple(self.shape), as_layout(self.layout, len(self.shape)))

    def ir_init(self, path: str, seed: int) -> Init:
        kind = InitKind(self.init)
        if kind in (InitKind.ZEROS, InitKind.ONES):
            return Init(kind)
        digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
        s = self.seed if self.seed is not None else int.from_bytes(digest[:4], "little") & 0x7FFFFFFF  # fmt: skip
        order = ("mean", "std") if kind is InitKind.NORMAL else ("low", "high")
        given = dict(self.args)
        return Init(kind, (("seed", s), *((k, float(given[k])) for k in order if k in given)))


class Module:
    """A layer: parameters and submodules as attributes, ``forward`` on traced tensors."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward")

    def param(self, name: str) -> Tensor:
        """The traced value of parameter ``name`` of this module (inside a traced step)."""
        return bound_parameter(self, name)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Module, str, Parameter]]:
        """(path, owner, attribute, parameter) of every parameter, in attribute order."""
        for key, value in vars(self).items():
            if key.startswith("_"):
                continue
            path = f"{prefix}{key}"
            if isinstance(value, Parameter):
                yield path, self, key, value
            elif isinstance(value, Module):
                yield from value.named_parameters(path + ".")
            elif isinstance(value, list | tuple) and value and all(isinstance(v, Module) for v in value):  # fmt: skip
                for i, sub in enumerate(value):
                    yield from sub.named_parameters(f"{path}.{i}.")


def _uniform(fan_in: int) -> tuple[str, tuple[tuple[str, float], ...]]:
    bound = 1.0 / math.sqrt(fan_in)
    return "uniform", (("low", -bound), ("high", bound))


class Linear(Module):
    """``y = x @ weight + bias``; weight ``[in, out]`` laid out by ``layout`` (default
    replicated), initialised uniform(+-1/sqrt(in)) as PyTorch does."""

    def __init__(self, n_in: int, n_out: int, *, bias: bool = True, dtype: str | DType = DType.F32, layout: Sequence[Any] | None = None, bias_layout: Sequence[Any] | None = None) -> None:  # fmt: skip
        dt = DType(dtype) if isinstance(dtype, str) else dtype
        init, args = _uniform(n_in)
        self.weight = Parameter((n_in, n_out), dt, as_layout(layout, 2), init, args)
        self.bias = Parameter((n_out,), dt, as_layout(bias_layout, 1), init, args) if bias else None  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.param("weight")
        if self.bias is not None:
            y = y + self.param("bias")
        return y


class ColumnParallelLinear(Linear):
    """Output features split over ``axis``: the result is split there too (no communication)."""

    def __init__(self, n_in: int, n_out: int, *, axis: str = "tp", bias: bool = True, dtype: str | DType = DType.F32) -> None:  # fmt: skip
        super().__init__(n_in, n_out, bias=bias, dtype=dtype, layout=(None, axis), bias_layout=(axis,))  # fmt: skip


class RowParallelLinear(Linear):
    """Input features split over ``axis`` (the input split there, as a column-parallel layer
    leaves it): the product is a pending sum, completed by one allreduce before the bias."""

    def __init__(self, n_in: int, n_out: int, *, axis: str = "tp", bias: bool = True, dtype: str | DType = DType.F32) -> None:  # fmt: skip
        super().__init__(n_in, n_out, bias=bias, dtype=dtype, layout=(axis, None))


class LayerNorm(Module):
    def __init__(self, dim: int, *, eps: float = 1e-5, dtype: str | DType = DType.F32) -> None:
        dt = DType(dtype) if isinstance(dtype, str) else dtype
        self.weight = Parameter((dim,), dt, None, "ones", ())
        self.bias = Parameter((dim,), dt, None, "zeros", ())
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.param("weight"), self.param("bias"), self.eps)


class MLP(Module):
    """A Megatron MLP block: column-parallel up-projection, gelu, row-parallel down."""

    def __init__(self, dim: int, hidden: int, *, axis: str = "tp", dtype: str | DType = DType.F32) -> None:  # fmt: skip
        self.up = ColumnParallelLinear(dim, hidden, axis=axis, dtype=dtype)
        self.down = RowParallelLinear(hidden, dim, axis=axis, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down(gelu(self.up(x)))
        return out


class Sequential(Module):
    def __init__(self, *layers: Module | Any) -> None:
        for layer in layers:
            if not (isinstance(layer, Module) or callable(layer)):
                raise UsageError(f"Sequential takes layers or functions; got {layer!r}")
        self.layers = [layer for layer in layers if isinstance(layer, Module)]
        self._steps = list(layers)

    def forward(self, x: Tensor) -> Tensor:
        for step in self._steps:
            x = step(x)
        return x
