"""The layers every model is built of: modules holding parameters (shape, dtype, layout over the mesh, init) and a
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
from dtm_mpi.frontend.functional import gelu, layer_norm
from dtm_mpi.frontend.tensor import Tensor, as_layout, tracer_or_none
from dtm_mpi.frontend.traced_params import traced_parameter
from dtm_mpi.ir.nodes import Init, InitKind
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = [
    "ColumnParallelLinear",
    "Embedding",
    "GPT",
    "LayerNorm",
    "Linear",
    "MLP",
    "Module",
    "MultiHeadAttention",
    "Parameter",
    "RowParallelLinear",
    "Sequential",
    "TransformerBlock",
]


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
        s = (
            self.seed
            if self.seed is not None
            else int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
        )
        order = ("mean", "std") if kind is InitKind.NORMAL else ("low", "high")
        given = dict(self.args)
        return Init(kind, (("seed", s), *((k, float(given[k])) for k in order if k in given)))


class Module:
    """A layer: parameters and submodules as attributes, ``forward`` on traced tensors."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = tracer_or_none()
        if tracer is not None:  # where this layer's ops start (pipeline stages split there)
            tracer.enter(self)
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward")

    def param(self, name: str) -> Tensor:
        """The traced value of parameter ``name`` of this module (inside a traced step)."""
        return traced_parameter(self, name)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Module, str, Parameter]]:
        """(path, owner, attribute, parameter) of every parameter, in attribute order; a layer
        used twice (tied weights) gives its parameters once, under the first path."""
        seen: set[tuple[int, str]] = set()
        for item in self._walk(prefix):
            if (id(item[1]), item[2]) not in seen:
                seen.add((id(item[1]), item[2]))
                yield item

    def named_layers(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """(path, layer) of every layer below this one (``blocks.2``, ``blocks.2.attn``),
        parameterless ones too, in attribute order; a layer used twice under its first path."""
        seen: set[int] = set()
        for path, layer in self._layers(prefix):
            if id(layer) not in seen:
                seen.add(id(layer))
                yield path, layer

    def _members(self, prefix: str) -> Iterator[tuple[str, str, Parameter | Module]]:
        """(path, attribute, value) of this layer's parameters and direct sublayers (a list or
        tuple of layers gives one per element, ``attr.i``), in attribute order."""
        for key, value in vars(self).items():
            if key.startswith("_"):
                continue
            path = f"{prefix}{key}"
            if isinstance(value, Parameter | Module):
                yield path, key, value
            elif (
                isinstance(value, list | tuple)
                and value
                and all(isinstance(v, Module) for v in value)
            ):
                for i, sub in enumerate(value):
                    yield f"{path}.{i}", key, sub

    def _layers(self, prefix: str) -> Iterator[tuple[str, Module]]:
        for path, _, value in self._members(prefix):
            if isinstance(value, Module):
                yield path, value
                yield from value._layers(path + ".")

    def _walk(self, prefix: str) -> Iterator[tuple[str, Module, str, Parameter]]:
        for path, key, value in self._members(prefix):
            if isinstance(value, Parameter):
                yield path, self, key, value
            else:
                yield from value._walk(path + ".")


def _uniform(fan_in: int) -> tuple[str, tuple[tuple[str, float], ...]]:
    bound = 1.0 / math.sqrt(fan_in)
    return "uniform", (("low", -bound), ("high", bound))


class Linear(Module):
    """``y = x @ weight + bias``; weight ``[in, out]`` laid out by ``layout`` (default
    replicated), initialised uniform(+-1/sqrt(in)) as PyTorch does."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        *,
        bias: bool = True,
        dtype: str | DType = DType.F32,
        layout: Sequence[Any] | None = None,
        bias_layout: Sequence[Any] | None = None,
    ) -> None:
        dt = DType(dtype) if isinstance(dtype, str) else dtype
        init, args = _uniform(n_in)
        self.weight = Parameter((n_in, n_out), dt, as_layout(layout, 2), init, args)
        self.bias = Parameter((n_out,), dt, as_layout(bias_layout, 1), init, args) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x  # [B, T, D] -> [B*T, D]
        y = flat @ self.param("weight")
        if self.bias is not None:
            y = y + self.param("bias")
        return y.reshape((*lead, y.shape[-1])) if x.ndim > 2 else y


class ColumnParallelLinear(Linear):
    """Output features split over ``axis``: the result is split there too (no communication)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        *,
        axis: str = "tp",
        bias: bool = True,
        dtype: str | DType = DType.F32,
    ) -> None:
        super().__init__(
            n_in, n_out, bias=bias, dtype=dtype, layout=(None, axis), bias_layout=(axis,)
        )


class RowParallelLinear(Linear):
    """Input features split over ``axis`` (the input split there, as a column-parallel layer
    leaves it): the product is a pending sum, completed by one allreduce before the bias."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        *,
        axis: str = "tp",
        bias: bool = True,
        dtype: str | DType = DType.F32,
    ) -> None:
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

    def __init__(
        self, dim: int, hidden: int, *, axis: str = "tp", dtype: str | DType = DType.F32
    ) -> None:
        self.up = ColumnParallelLinear(dim, hidden, axis=axis, dtype=dtype)
        self.down = RowParallelLinear(hidden, dim, axis=axis, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down(gelu(self.up(x)))
        return out


class Embedding(Module):
    """Rows of a ``[vocab, dim]`` table by integer ids, **vocab-parallel** over ``axis`` as
    Megatron does: each rank holds a range of the vocabulary, looks up the ids that fall in
    it (``take``: zero rows for the others) and one allreduce sums the ranks' partial rows.
    Its gradient is the matching ``scatter_add`` into the rank's rows."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        *,
        axis: str | None = "tp",
        std: float = 0.02,
        dtype: str | DType = DType.F32,
    ) -> None:
        dt = DType(dtype) if isinstance(dtype, str) else dtype
        self.weight = Parameter((vocab, dim), dt, (axis, None), "normal", (("std", std),))
        self.axis = axis

    def forward(self, ids: Tensor) -> Tensor:
        return self.param("weight").take(ids, 0).complete()


class MultiHeadAttention(Module):
    """Causal multi-head self-attention laid out as Megatron's: one GEMM per projection,
    ``wq``, ``wk`` and ``wv`` ``[dim, dim]`` **column-parallel** over ``axis`` (head ``i`` is
    columns ``i*head_dim ..``, so a rank computes whole heads: the axis size must divide
    ``heads``), the heads' scores as batched matmuls, and the output projection ``wo``
    **row-parallel** (a pending sum over the heads, one allreduce)."""

    def __init__(
        self, dim: int, heads: int, *, axis: str = "tp", dtype: str | DType = DType.F32
    ) -> None:
        if dim % heads:
            raise UsageError(f"dim {dim} is not a multiple of heads {heads}")
        dt = DType(dtype) if isinstance(dtype, str) else dtype
        init, args = _uniform(dim)
        self.wq = Parameter((dim, dim), dt, (None, axis), init, args)
        self.wk = Parameter((dim, dim), dt, (None, axis), init, args)
        self.wv = Parameter((dim, dim), dt, (None, axis), init, args)
        self.wo = Parameter((dim, dim), dt, (axis, None), init, args)
        self.bo = Parameter((dim,), dt, None, "zeros", ())
        self.heads, self.head_dim, self.axis = heads, dim // heads, axis

    def forward(self, x: Tensor) -> Tensor:
        from dtm_mpi.frontend.functional import causal_mask

        b, t, d = x.shape
        h, e = self.heads, self.head_dim
        flat = x.reshape(b * t, d)

        def split_heads(name: str) -> Tensor:  # [B*T, D] @ [D, D] -> [B, H, T, E]
            return (flat @ self.param(name)).reshape(b, t, h, e).transpose(0, 2, 1, 3)

        q, k, v = split_heads("wq"), split_heads("wk"), split_heads("wv")
        scores = causal_mask((q @ k.T) * (1.0 / math.sqrt(e)))
        o = (scores.softmax(-1) @ v).transpose(0, 2, 1, 3).reshape(b * t, d)
        out = (o @ self.param("wo")).reshape(b, t, d)  # pending over the heads' ranks
        return out + self.param("bo")


class TransformerBlock(Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        hidden: int | None = None,
        axis: str = "tp",
        dtype: str | DType = DType.F32,
    ) -> None:
        self.ln1 = LayerNorm(dim, dtype=dtype)
        self.attn = MultiHeadAttention(dim, heads, axis=axis, dtype=dtype)
        self.ln2 = LayerNorm(dim, dtype=dtype)
        self.mlp = MLP(dim, hidden or 4 * dim, axis=axis, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(Module):
    """A decoder-only transformer: a vocab-parallel token embedding and learned positions,
    ``layers`` :class:`TransformerBlock` s, a final layer norm and a vocab-parallel head;
    ``ids`` ``[B, T]`` (T <= ``context``) give logits ``[B, T, vocab]`` with the vocabulary
    split over ``axis`` (what :func:`~dtm_mpi.frontend.functional.cross_entropy` takes)."""

    def __init__(
        self,
        vocab: int,
        context: int,
        dim: int,
        heads: int,
        layers: int,
        *,
        axis: str = "tp",
        dtype: str | DType = DType.F32,
    ) -> None:
        self.tok = Embedding(vocab, dim, axis=axis, dtype=dtype)
        self.pos = Parameter((context, dim), dtype, None, "normal", (("std", 0.02),))
        self.blocks = [TransformerBlock(dim, heads, axis=axis, dtype=dtype) for _ in range(layers)]
        self.ln = LayerNorm(dim, dtype=dtype)
        self.head = ColumnParallelLinear(dim, vocab, axis=axis, bias=False, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids) + self.param("pos")
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(self.ln(x))
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
