"""LLM layers and models whose module trees mirror Hugging Face transformers' modeling code, so
that their parameter paths *are* the checkpoints' names (``model.layers.0.self_attn.q_proj.weight``)
and their numerics follow the reference op for op.

* :class:`TorchLinear`: ``torch.nn.Linear``'s layout (weight ``[out, in]``, ``y = x W^T + b``),
  column- or row-parallel over a mesh axis as Megatron splits it.
* :class:`RMSNorm`, :class:`SwiGLU`, :class:`GroupedQueryAttention` (rotary embeddings in HF's
  half-split ``rotate_half`` convention; query head ``h`` uses kv head ``h // n_rep``).
* :class:`Llama` (``LlamaForCausalLM``) and :class:`GPT2` (``GPT2LMHeadModel``, its Conv1D
  weights ``[in, out]`` and its fused ``c_attn`` as one tensor), built from a config with the
  fields of the checkpoint's ``config.json`` (:class:`LlamaConfig`, :class:`GPT2Config`).

Tensor parallelism over ``axis`` (default ``tp``; None: no split): the query heads, the MLP's
hidden features and the vocabulary are split over it. The kv heads split too where the axis
size divides ``num_key_value_heads`` (``kv_split=True``, what :meth:`Llama.for_mesh` picks);
else ``kv_split=False``, the stated layout: ``k_proj``/``v_proj`` replicated, every rank of
the axis computing every kv head and taking the ones its query heads use (no communication).
GPT-2's fused ``c_attn`` is stored whole on every rank of the axis: each rank takes its heads'
columns of the query, key and value thirds (a local slice of the weight, never of the
activations), so the attention runs split over the heads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.functional import (
    arange,
    assign,
    causal_mask,
    gelu,
    rms_norm,
    rotary,
    rotary_tables,
    state,
    where,
)
from dtm_mpi.frontend.layers import Embedding, LayerNorm, Linear, Module, Parameter
from dtm_mpi.frontend.tensor import Tensor, current_tracer, trace_error
from dtm_mpi.ir.types import DType

__all__ = [
    "GPT2",
    "GPT2Config",
    "GroupedQueryAttention",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "SwiGLU",
    "TorchLinear",
    "rope_inv_freq",
]


def _dtype(dtype: str | DType) -> DType:
    return DType(dtype) if isinstance(dtype, str) else dtype


class TorchLinear(Module):
    """``y = x @ weight.T + bias`` with ``torch.nn.Linear``'s layout: weight ``[out, in]``
    (the checkpoint's), bias ``[out]``. ``parallel``: ``"column"`` splits the output features
    over ``axis`` (the result split there, no communication), ``"row"`` the input features (a
    pending sum, completed by one allreduce before the bias), None: replicated. Initialised
    uniform(+-1/sqrt(in)) as torch does."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        *,
        bias: bool = True,
        parallel: str | None = None,
        axis: str | None = "tp",
        dtype: str | DType = DType.F32,
    ) -> None:
        if parallel not in (None, "column", "row"):
            raise UsageError(f"parallel is 'column', 'row' or None; got {parallel!r}")
        dt = _dtype(dtype)
        bound = 1.0 / math.sqrt(n_in)
        args = (("low", -bound), ("high", bound))
        split = axis if parallel is not None else None
        layout = (split, None) if parallel == "column" else (None, split)
        self.weight = Parameter((n_out, n_in), dt, layout, "uniform", args)
        bias_layout = (split,) if parallel == "column" else None
        self.bias = Parameter((n_out,), dt, bias_layout, "uniform", args) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
        y = flat @ self.param("weight").T
        if self.bias is not None:
            y = y + self.param("bias")
        return y.reshape((*lead, y.shape[-1])) if x.ndim != 2 else y


class RMSNorm(Module):
    """Hugging Face's ``LlamaRMSNorm``: the ``rms_norm`` op (``x`` in binary32, ``x *
    rsqrt(mean(x^2) + eps)``, cast back, times ``weight``); weight initialised to ones."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype: str | DType = DType.F32) -> None:
        self.weight = Parameter((dim,), _dtype(dtype), None, "ones", ())
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.param("weight"), self.eps)


class SwiGLU(Module):
    """Llama's MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, the gate and up
    projections column-parallel over ``axis``, the down projection row-parallel."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        bias: bool = False,
        axis: str | None = "tp",
        dtype: str | DType = DType.F32,
    ) -> None:
        kw: dict[str, Any] = {"bias": bias, "axis": axis, "dtype": dtype}
        self.gate_proj = TorchLinear(dim, hidden, parallel="column", **kw)
        self.up_proj = TorchLinear(dim, hidden, parallel="column", **kw)
        self.down_proj = TorchLinear(hidden, dim, parallel="row", **kw)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(self.gate_proj(x).silu() * self.up_proj(x))
        return out


def _softmax_f32(scores: Tensor) -> Tensor:
    """Softmax over the last dim in binary32, cast back (HF's ``softmax(..., dtype=float32)``)."""
    if scores.dtype in (DType.F32, DType.F64):
        return scores.softmax(-1)
    return scores.cast(DType.F32).softmax(-1).cast(scores.dtype)


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, upcast: bool) -> Tensor:
    """Causal attention of ``[B, H, T, E]`` queries, keys and values (heads aligned):
    ``softmax(q k^T * scale, masked) v``, ``[B, H, T, E]``."""
    scores = causal_mask((q @ k.T) * scale)
    probs = _softmax_f32(scores) if upcast else scores.softmax(-1)
    return probs @ v


class GroupedQueryAttention(Module):
    """Causal self-attention with grouped-query heads (Llama's ``LlamaAttention``):
    ``q_proj`` ``[heads * head_dim, dim]``, ``k_proj``/``v_proj`` ``[kv_heads * head_dim,
    dim]``, ``o_proj`` ``[dim, heads * head_dim]`` (torch's layout), rotary embeddings applied
    to queries and keys, query head ``h`` attending with kv head ``h // (heads / kv_heads)``.
    The heads split over ``axis`` (``q_proj`` column-parallel, ``o_proj`` row-parallel); the kv
    heads too with ``kv_split`` (the axis size must divide ``kv_heads``), else replicated (the
    module doc)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int,
        *,
        head_dim: int | None = None,
        bias: bool = False,
        axis: str | None = "tp",
        kv_split: bool = True,
        dtype: str | DType = DType.F32,
    ) -> None:
        if heads % kv_heads:
            raise UsageError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
        e = head_dim or dim // heads
        kw: dict[str, Any] = {"bias": bias, "axis": axis, "dtype": dtype}
        self.q_proj = TorchLinear(dim, heads * e, parallel="column", **kw)
        self.k_proj = TorchLinear(dim, kv_heads * e, parallel="column" if kv_split else None, **kw)
        self.v_proj = TorchLinear(dim, kv_heads * e, parallel="column" if kv_split else None, **kw)
        self.o_proj = TorchLinear(heads * e, dim, parallel="row", **kw)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, e
        self.axis, self.kv_split = axis, kv_split

    def _check_mesh(self) -> None:
        mesh = current_tracer().b.mesh
        if self.axis is None or mesh is None or self.axis not in mesh.axis_names:
            return
        n = mesh.size_of(self.axis)
        if self.heads % n:
            raise trace_error(
                f"{self.heads} attention heads do not split over {self.axis}={n}: the axis size must divide the heads"
            )
        if self.kv_split and self.kv_heads % n:
            raise trace_error(
                f"{self.kv_heads} kv heads do not split over {self.axis}={n}: build the attention with kv_split=False (k_proj and v_proj replicated), or use an axis size that divides them"
            )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        self._check_mesh()
        b, t, _ = x.shape
        h, kvh, e = self.heads, self.kv_heads, self.head_dim

        def heads_of(proj: TorchLinear, n: int) -> Tensor:  # [B, T, n*E] -> [B, n, T, E]
            y: Tensor = proj(x)
            return y.reshape(b, t, n, e).transpose(0, 2, 1, 3)

        q = rotary(heads_of(self.q_proj, h), cos, sin)
        k = rotary(heads_of(self.k_proj, kvh), cos, sin)
        v = heads_of(self.v_proj, kvh)
        if h != kvh:  # HF's repeat_kv: kv head j serves query heads j*n_rep .. (j+1)*n_rep - 1
            rep = h // kvh
            k, v = (
                y.reshape(b, kvh, 1, t, e).broadcast_to((b, kvh, rep, t, e)).reshape(b, h, t, e)
                for y in (k, v)
            )
        if k.layout != q.layout:  # kv replicated, queries split: each rank takes its heads' kv
            k, v = k.redistribute(q.layout), v.redistribute(q.layout)
        o = _attend(q, k, v, e**-0.5, upcast=True)
        out: Tensor = self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, h * e))
        return out

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, length: int, cache: str
    ) -> Tensor:
        """One token per sequence: ``x`` ``[B, 1, dim]`` at position ``pos`` (``i32[1]``),
        its keys and values written into the key/value cache (the states ``{cache}.k`` and
        ``{cache}.v``, ``[B, kv_heads, length, head_dim]``) at ``pos``, attending to the cache's
        positions ``0 .. pos``."""
        self._check_mesh()
        b = x.shape[0]
        h, kvh, e = self.heads, self.kv_heads, self.head_dim

        def heads_of(proj: TorchLinear, n: int) -> Tensor:  # [B, 1, n*E] -> [B, n, 1, E]
            y: Tensor = proj(x)
            return y.reshape(b, 1, n, e).transpose(0, 2, 1, 3)

        q = rotary(heads_of(self.q_proj, h), cos, sin)
        k1 = rotary(heads_of(self.k_proj, kvh), cos, sin)
        v1 = heads_of(self.v_proj, kvh)
        full = (b, kvh, length, e)
        layout = [k1.layout.dims[0], k1.layout.dims[1], (), ()]
        slots = arange(length, DType.I32).reshape(1, 1, length, 1).broadcast_to(full)
        at = pos.reshape(1, 1, 1, 1).broadcast_to(full)
        before, upto = (slots < at).redistribute(layout), (slots <= at).redistribute(layout)
        news = []
        for which, new in (("k", k1), ("v", v1)):
            old = state(f"{cache}.{which}", full, new.dtype, layout)
            wide = new.broadcast_to(full).redistribute(layout)
            filled = where(before, old, where(upto, wide, old))
            assign(old, filled)
            news.append(filled)
        k, v = news
        if h != kvh:
            rep = h // kvh
            k, v = (
                y.reshape(b, kvh, 1, length, e)
                .broadcast_to((b, kvh, rep, length, e))
                .reshape(b, h, length, e)
                for y in (k, v)
            )
        if k.layout != q.layout:
            k, v = k.redistribute(q.layout), v.redistribute(q.layout)
        scores = (q @ k.T) * e**-0.5  # [B, H, 1, length]
        keys = arange(length, DType.I32).reshape(1, 1, 1, length).broadcast_to(scores.shape)
        seen = keys <= pos.reshape(1, 1, 1, 1).broadcast_to(scores.shape)
        probs = _softmax_f32(where(seen.redistribute(scores.layout), scores, -1e9))
        o = probs @ v
        out: Tensor = self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, 1, h * e))
        return out


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    """The rotary inverse frequencies (float32, ``head_dim / 2``) as Hugging Face computes them:
    ``1 / theta ** (arange(0, head_dim, 2) / head_dim)`` in float32, with the ``llama3`` scaling
    (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``)
    where ``scaling`` asks for it; another ``rope_type`` is an error naming the supported ones."""
    f32 = np.float32
    with np.errstate(all="ignore"):
        inv = (
            f32(1.0) / (f32(theta) ** (np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)))
        ).astype(f32)
    kind = str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise UsageError(f"rope_type {kind!r} is not supported (supported: default, llama3)")
    assert scaling is not None
    try:
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise UsageError(f"the llama3 rope scaling needs {exc.args[0]!r}") from None
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = (f32(2 * math.pi) / inv).astype(f32)
    scaled = np.where(wavelen > f32(low_wavelen), inv / f32(factor), inv).astype(f32)
    smooth = ((f32(old) / wavelen - f32(low)) / f32(high - low)).astype(f32)
    smoothed = ((f32(1) - smooth) * scaled / f32(factor) + smooth * scaled).astype(f32)
    medium = ~(wavelen < f32(high_wavelen)) & ~(wavelen > f32(low_wavelen))
    return np.where(medium, smoothed, scaled).astype(f32)


# --- configs ------------------------------------------------------------------------------------


def _need(d: Mapping[str, Any], key: str, arch: str) -> Any:
    if key not in d:
        raise UsageError(f"a {arch} config needs {key!r}")
    return d[key]


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama ``config.json`` this model uses (``LlamaConfig.from_dict``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    dtype: str = "f32"
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The other fields of the file (kept for export)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        arch = "Llama"
        heads = int(_need(d, "num_attention_heads", arch))
        hidden = int(_need(d, "hidden_size", arch))
        act = str(d.get("hidden_act", "silu"))
        if act != "silu":
            raise UsageError(f"hidden_act {act!r} is not supported for Llama (supported: silu)")
        rope = d.get("rope_scaling") or d.get("rope_parameters")
        theta = d.get("rope_theta")
        if theta is None and isinstance(rope, Mapping):
            theta = rope.get("rope_theta")
        if (
            isinstance(rope, Mapping)
            and str(rope.get("rope_type", rope.get("type", "default"))) == "default"
        ):
            rope = None
        rope_inv_freq(2, float(theta or 10000.0), rope)  # refuses an unsupported rope type
        known = set(cls.__dataclass_fields__) | {"rope_parameters", "torch_dtype"}
        return cls(
            vocab_size=int(_need(d, "vocab_size", arch)),
            hidden_size=hidden,
            intermediate_size=int(_need(d, "intermediate_size", arch)),
            num_hidden_layers=int(_need(d, "num_hidden_layers", arch)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta or 10000.0),
            rope_scaling=dict(rope) if isinstance(rope, Mapping) else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=act,
            dtype=_config_dtype(d),
            extra={k: v for k, v in d.items() if k not in known},
        )


@dataclass(frozen=True)
class GPT2Config:
    """The fields of a GPT-2 ``config.json`` this model uses (``GPT2Config.from_dict``)."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    dtype: str = "f32"
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GPT2Config:
        arch = "GPT-2"
        act = str(d.get("activation_function", "gelu_new"))
        if act not in _GPT2_ACTIVATIONS:
            raise UsageError(
                f"activation_function {act!r} is not supported for GPT-2 (supported: {', '.join(sorted(_GPT2_ACTIVATIONS))})"
            )
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if d.get(flag):
                raise UsageError(f"GPT-2 with {flag}=true is not supported")
        known = set(cls.__dataclass_fields__) | {"torch_dtype"}
        return cls(
            vocab_size=int(_need(d, "vocab_size", arch)),
            n_positions=int(_need(d, "n_positions", arch)),
            n_embd=int(_need(d, "n_embd", arch)),
            n_layer=int(_need(d, "n_layer", arch)),
            n_head=int(_need(d, "n_head", arch)),
            n_inner=int(d["n_inner"]) if d.get("n_inner") else None,
            activation_function=act,
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(d.get("scale_attn_weights", True)),
            dtype=_config_dtype(d),
            extra={k: v for k, v in d.items() if k not in known},
        )


_GPT2_ACTIVATIONS = {"gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu"}
_TORCH_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


def _config_dtype(d: Mapping[str, Any]) -> str:
    name = d.get("torch_dtype") or d.get("dtype") or "float32"
    got = _TORCH_DTYPES.get(str(name))
    if got is None:
        raise UsageError(f"dtype {name!r} is not supported (supported: {', '.join(_TORCH_DTYPES)})")
    return got


# --- Llama ----------------------------------------------------------------------------------------


class LlamaDecoderLayer(Module):
    """``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, c: LlamaConfig, *, axis: str | None, kv_split: bool, dtype: DType) -> None:
        self.self_attn = GroupedQueryAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim=c.head_dim,
            bias=c.attention_bias,
            axis=axis,
            kv_split=kv_split,
            dtype=dtype,
        )
        self.mlp = SwiGLU(
            c.hidden_size, c.intermediate_size, bias=c.mlp_bias, axis=axis, dtype=dtype
        )
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, length: int, cache: str
    ) -> Tensor:
        x = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, pos, length, cache)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaModel(Module):
    """``embed_tokens``, the decoder ``layers`` and the final ``norm`` (HF's ``LlamaModel``)."""

    def __init__(self, c: LlamaConfig, *, axis: str | None, kv_split: bool, dtype: DType) -> None:
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, axis=axis, dtype=dtype)
        self.layers = [
            LlamaDecoderLayer(c, axis=axis, kv_split=kv_split, dtype=dtype)
            for _ in range(c.num_hidden_layers)
        ]
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self._inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed_tokens(ids)
        cos, sin = rotary_tables(ids.shape[-1], self._inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        out: Tensor = self.norm(x)
        return out

    def decode(self, ids: Tensor, pos: Tensor, length: int) -> Tensor:
        """The hidden state ``[B, 1, hidden]`` of one token per sequence at position ``pos``,
        through each layer's key/value cache (``cache.layers.{i}``)."""
        x = self.embed_tokens(ids)
        cos, sin = rotary_tables(pos, self._inv_freq, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.decode(x, cos, sin, pos, length, f"cache.layers.{i}")
        out: Tensor = self.norm(x)
        return out


class Llama(Module):
    """``LlamaForCausalLM``: ``ids`` ``[B, T]`` give logits ``[B, T, vocab]``, the vocabulary
    split over ``axis`` (what :func:`~dtm_mpi.frontend.functional.cross_entropy` takes). Tied
    embeddings (``tie_word_embeddings``) use ``model.embed_tokens.weight`` as the head; else
    ``lm_head.weight`` ``[vocab, hidden]``."""

    def __init__(
        self,
        config: LlamaConfig | Mapping[str, Any],
        *,
        axis: str | None = "tp",
        kv_split: bool = True,
        dtype: str | DType | None = None,
    ) -> None:
        c = config if isinstance(config, LlamaConfig) else LlamaConfig.from_dict(config)
        dt = _dtype(dtype or c.dtype)
        self.config = c
        self.model = LlamaModel(c, axis=axis, kv_split=kv_split, dtype=dt)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else TorchLinear(
                c.hidden_size, c.vocab_size, bias=False, parallel="column", axis=axis, dtype=dt
            )
        )

    @classmethod
    def for_mesh(
        cls,
        config: LlamaConfig | Mapping[str, Any],
        sizes: Mapping[str, int],
        *,
        axis: str | None = "tp",
        dtype: str | DType | None = None,
    ) -> Llama:
        """The model laid out for a mesh of these axis sizes: the kv heads split over ``axis``
        where its size divides them, else replicated (the module doc)."""
        c = config if isinstance(config, LlamaConfig) else LlamaConfig.from_dict(config)
        n = sizes.get(axis, 1) if axis is not None else 1
        if c.num_attention_heads % n:
            raise UsageError(
                f"num_attention_heads {c.num_attention_heads} does not split over {axis}={n}: "
                "the axis size must divide the query heads"
            )
        return cls(c, axis=axis, kv_split=c.num_key_value_heads % n == 0, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.model(ids)
        if self.lm_head is not None:
            out: Tensor = self.lm_head(x)
            return out
        return _tied_head(x, self.model.embed_tokens)

    def decode(self, ids: Tensor, pos: Tensor, length: int) -> Tensor:
        """The logits ``[B, 1, vocab]`` of the next token after ``ids`` ``[B, 1]`` at position
        ``pos`` (``i32[1]``), with a key/value cache of ``length`` positions per layer (the
        step's state: traced with :func:`~dtm_mpi.frontend.trace.forward_step`, each step
        one position, the cache kept between steps)."""
        if ids.ndim != 2 or ids.shape[1] != 1:
            raise trace_error(
                f"decode takes one token per sequence, ids [B, 1]; got {list(ids.shape)}"
            )
        x = self.model.decode(ids, pos, length)
        if self.lm_head is not None:
            out: Tensor = self.lm_head(x)
            return out
        return _tied_head(x, self.model.embed_tokens)


def _tied_head(x: Tensor, table: Embedding) -> Tensor:
    """Logits of ``x`` ``[B, T, D]`` against the embedding table ``[vocab, D]`` (tied)."""
    b, t, d = x.shape
    logits = x.reshape(b * t, d) @ table.param("weight").T
    return logits.reshape(b, t, logits.shape[-1])


# --- GPT-2 ----------------------------------------------------------------------------------------


def _gpt2_act(name: str, x: Tensor) -> Tensor:
    if name == "relu":
        return x.relu()
    if name == "silu":
        return x.silu()
    if name == "gelu":  # transformers' "gelu": the exact form, x Phi(x)
        return gelu(x, approximate="none")
    return gelu(x)  # gelu_new / gelu_pytorch_tanh / gelu_fast: the tanh form


class GPT2Attention(Module):
    """GPT-2's attention: the fused ``c_attn`` ``[dim, 3 dim]`` (Conv1D, ``[in, out]``) and
    ``c_proj`` ``[dim, dim]`` (row-parallel over ``axis``). ``c_attn`` is stored whole; each
    rank takes its heads' columns of each third (module doc)."""

    def __init__(self, dim: int, heads: int, *, axis: str | None, dtype: DType) -> None:
        if dim % heads:
            raise UsageError(f"n_embd {dim} is not a multiple of n_head {heads}")
        self.c_attn = Linear(dim, 3 * dim, dtype=dtype)
        self.c_proj = Linear(dim, dim, dtype=dtype, layout=(axis, None))
        self.heads, self.axis = heads, axis

    def forward(self, x: Tensor, scale: float) -> Tensor:
        b, t, d = x.shape
        h, e = self.heads, d // self.heads
        w, bias = self.c_attn.param("weight"), self.c_attn.param("bias")
        flat = x.reshape(b * t, d)

        def third(i: int) -> Tensor:  # this rank's heads of q, k or v: [B, H, T, E]
            wi, bi = w[:, i * d : (i + 1) * d], bias[i * d : (i + 1) * d]
            if self.axis is not None:
                wi, bi = wi.redistribute((None, self.axis)), bi.redistribute((self.axis,))
            return (flat @ wi + bi).reshape(b, t, h, e).transpose(0, 2, 1, 3)

        o = _attend(third(0), third(1), third(2), scale, upcast=False)
        out: Tensor = self.c_proj(o.transpose(0, 2, 1, 3).reshape(b, t, d))
        return out


class GPT2MLP(Module):
    def __init__(self, dim: int, hidden: int, act: str, *, axis: str | None, dtype: DType) -> None:
        self.c_fc = Linear(dim, hidden, dtype=dtype, layout=(None, axis), bias_layout=(axis,))
        self.c_proj = Linear(hidden, dim, dtype=dtype, layout=(axis, None))
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.c_proj(_gpt2_act(self.act, self.c_fc(x)))
        return out


class GPT2Block(Module):
    def __init__(self, c: GPT2Config, *, axis: str | None, dtype: DType) -> None:
        d = c.n_embd
        self.ln_1 = LayerNorm(d, eps=c.layer_norm_epsilon, dtype=dtype)
        self.attn = GPT2Attention(d, c.n_head, axis=axis, dtype=dtype)
        self.ln_2 = LayerNorm(d, eps=c.layer_norm_epsilon, dtype=dtype)
        self.mlp = GPT2MLP(d, c.n_inner or 4 * d, c.activation_function, axis=axis, dtype=dtype)
        self.scale = (d // c.n_head) ** -0.5 if c.scale_attn_weights else 1.0

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), self.scale)
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT2Model(Module):
    """``wte`` (vocab-parallel), ``wpe``, the blocks ``h`` and ``ln_f`` (HF's ``GPT2Model``)."""

    def __init__(self, c: GPT2Config, *, axis: str | None, dtype: DType) -> None:
        self.wte = Embedding(c.vocab_size, c.n_embd, axis=axis, dtype=dtype)
        self.wpe = Embedding(c.n_positions, c.n_embd, axis=None, dtype=dtype)
        self.h = [GPT2Block(c, axis=axis, dtype=dtype) for _ in range(c.n_layer)]
        self.ln_f = LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[-1]
        x = self.wte(ids) + self.wpe.param("weight")[:t]
        for block in self.h:
            x = block(x)
        out: Tensor = self.ln_f(x)
        return out


class GPT2(Module):
    """``GPT2LMHeadModel``: ``ids`` ``[B, T]`` (T <= ``n_positions``) give logits ``[B, T,
    vocab]``, the vocabulary split over ``axis``; the head is tied to ``transformer.wte``."""

    def __init__(
        self,
        config: GPT2Config | Mapping[str, Any],
        *,
        axis: str | None = "tp",
        dtype: str | DType | None = None,
    ) -> None:
        c = config if isinstance(config, GPT2Config) else GPT2Config.from_dict(config)
        self.config = c
        self.transformer = GPT2Model(c, axis=axis, dtype=_dtype(dtype or c.dtype))

    def forward(self, ids: Tensor) -> Tensor:
        if ids.shape[-1] > self.config.n_positions:
            raise trace_error(
                f"{ids.shape[-1]} positions, but the model has n_positions {self.config.n_positions}"
            )
        return _tied_head(self.transformer(ids), self.transformer.wte)
