"""Functions of traced tensors beyond their methods: activations, normalisation, selection,
one-hot labels, the vocab-parallel cross-entropy, and the rotary position embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.frontend.tensor import Tensor, broadcast_pair, current_tracer, trace_error
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = [
    "accuracy",
    "arange",
    "causal_lm_loss",
    "causal_mask",
    "concat",
    "cross_entropy",
    "gelu",
    "layer_norm",
    "log_softmax",
    "one_hot",
    "relu",
    "rms_norm",
    "rotary",
    "rotary_tables",
    "scatter_add",
    "sigmoid",
    "silu",
    "softmax",
    "take",
    "tanh",
    "where",
]


def relu(x: Tensor) -> Tensor:
    return x.relu()


def gelu(x: Tensor, approximate: str = "tanh") -> Tensor:
    """GELU, tanh form by default; ``approximate="none"``: exact, ``x * Phi(x)`` (torch's)."""
    return x.gelu(approximate)


def silu(x: Tensor) -> Tensor:
    return x.silu()


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def sigmoid(x: Tensor) -> Tensor:
    return x.sigmoid()


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    return x.softmax(dim)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    return x.log_softmax(dim)


def where(cond: Tensor, a: Tensor | float, b: Tensor | float) -> Tensor:
    """``cond ? a : b`` elementwise (broadcasting; Python numbers take the other's dtype)."""
    like = a if isinstance(a, Tensor) else b
    if not isinstance(like, Tensor):
        raise trace_error("where needs a traced tensor as a or b")
    ta = a if isinstance(a, Tensor) else like._lift(a)
    tb = b if isinstance(b, Tensor) else like._lift(b)
    ta, tb = broadcast_pair(ta, tb)
    c, ta = broadcast_pair(cond, ta)
    c, tb = broadcast_pair(c, tb)
    return current_tracer().apply("where", [c, ta, tb])


def concat(xs: Sequence[Tensor], dim: int = 0) -> Tensor:
    if not xs:
        raise trace_error("concat needs at least one tensor")
    return current_tracer().apply("concat", list(xs), {"dim": xs[0]._dims(dim)[0]})


def take(x: Tensor, indices: Tensor, dim: int = 0) -> Tensor:
    """``x``'s rows along ``dim`` at integer ``indices`` (see :meth:`Tensor.take`)."""
    return x.take(indices, dim)


def scatter_add(
    updates: Tensor, indices: Tensor, size: int, dim: int = 0, axis: str | None = None
) -> Tensor:
    """Zeros of ``size`` rows along ``dim`` plus each row of ``updates`` added at its index
    (the transpose of :func:`take`; repeated indices add up), with that dim split over
    ``axis`` (None: not split)."""
    if not isinstance(indices, Tensor) or indices.dtype.is_float or indices.dtype is DType.BOOL:
        raise trace_error("scatter_add needs traced integer indices")
    d = updates._dims(dim)[0]
    k = indices.ndim
    shape = (*updates.shape[:d], size, *updates.shape[d + k :])
    dims = (*updates.layout.dims[:d], (axis,) if axis else (), *updates.layout.dims[d + k :])
    want = TensorType(updates.dtype, shape, Layout(dims))
    return current_tracer().apply("scatter_add", [updates, indices], {"dim": d}, [want])


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5) -> Tensor:
    return current_tracer().apply("layer_norm", [x, gamma, beta], {"eps": float(eps)})


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Hugging Face's ``LlamaRMSNorm`` over the last dim (the ``rms_norm`` op): ``x`` in
    binary32, ``x * rsqrt(mean(x^2) + eps)``, cast back to ``x``'s dtype, times ``weight``."""
    return current_tracer().apply("rms_norm", [x, weight], {"eps": float(eps)})


def state(
    name: str,
    shape: Sequence[int],
    dtype: str | DType = DType.F32,
    layout: Sequence[str | Sequence[str] | None] | Layout | None = None,
    init: str = "zeros",
) -> Tensor:
    """A state parameter of the traced step (``zeros`` or ``ones`` at the first step), kept
    between steps: its value at this step; :func:`assign` gives its value at the next (a
    key/value cache of a decode step). Only :func:`~dtm_mpi.frontend.trace.forward_step`
    takes state."""
    from dtm_mpi.frontend.tensor import as_layout, parse_dtype
    from dtm_mpi.ir.nodes import Init, InitKind

    if init not in ("zeros", "ones"):
        raise trace_error(f"state {name!r}: init is 'zeros' or 'ones'; got {init!r}")
    tr = current_tracer()
    t = TensorType(parse_dtype(dtype), tuple(int(s) for s in shape), as_layout(layout, len(shape)))
    return Tensor(tr.b.add_param(name, t, state=True, init=Init(InitKind(init))), tr)


def assign(target: Tensor, value: Tensor) -> None:
    """``target`` (a :func:`state`) holds ``value`` from the next step on (taken to its
    layout; the same dtype and shape)."""
    tr = current_tracer()
    name = target.value.name
    param = next((p for p in tr.b.params if p.name == name and p.state), None)
    if param is None:
        raise trace_error(f"assign: {name} is not a state of this step (make it with state())")
    if any(n == name for n, _ in tr.updates):
        raise trace_error(f"assign: {name} is assigned twice in one step")
    if value.dtype is not target.dtype or value.shape != target.shape:
        raise trace_error(f"assign: {name} is {target.type}; the new value is {value.type}")
    tr.updates.append((name, value))


def arange(n: int, dtype: str | DType = DType.F32) -> Tensor:
    """``0, 1, .., n - 1`` (the ``iota`` op), replicated."""
    from dtm_mpi.frontend.tensor import parse_dtype

    t = TensorType(parse_dtype(dtype), (n,), Layout.replicated(1))
    return current_tracer().apply("iota", [], {"dim": 0}, [t])


def rotary_tables(
    positions: int | Tensor, inv_freq: Sequence[float] | np.ndarray, dtype: str | DType = DType.F32
) -> tuple[Tensor, Tensor]:
    """The rotary ``cos`` and ``sin`` tables ``[T, 2 len(inv_freq)]`` as Hugging Face builds
    them, inside the step: in binary32, ``freqs = positions x inv_freq`` (``positions``: T, for
    ``0 .. T-1``, or a float32 tensor of T positions), ``emb = concat(freqs, freqs)``, then
    ``cos(emb)``, ``sin(emb)`` cast to ``dtype``."""
    tr = current_tracer()
    pos = arange(positions, DType.F32) if isinstance(positions, int) else positions.cast(DType.F32)
    n = len(inv_freq)
    freq_t = TensorType(DType.F32, (1, n), Layout.replicated(2))
    freq = tr.apply("constant", [], {"value": (tuple(float(f) for f in inv_freq),)}, [freq_t])
    t = pos.shape[0]
    freqs = pos.reshape(t, 1) * freq
    emb = concat([freqs, freqs], dim=1)
    return emb.cos().cast(dtype), emb.sin().cast(dtype)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` ``[..., T, E]`` with tables ``[T, E]``, in Hugging
    Face's half-split convention: ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) =
    concat(-x[..., E/2:], x[..., :E/2])``."""
    e = x.shape[-1]
    if e % 2 or cos.shape != x.shape[-2:] or sin.shape != x.shape[-2:]:
        raise trace_error(
            f"rotary needs an even last dim and [T, E] tables; got x {list(x.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}"
        )
    lead = (slice(None),) * (x.ndim - 1)
    half = e // 2
    rotated = concat([-x[(*lead, slice(half, e))], x[(*lead, slice(0, half))]], dim=x.ndim - 1)
    return x * cos + rotated * sin


def one_hot(
    labels: Tensor,
    classes: int,
    dtype: str | DType = DType.F32,
    like: Tensor | None = None,
    class_axis: str | None = None,
) -> Tensor:
    """``labels`` (integers, any shape S) as a ``[*S, classes]`` tensor of 0/1 in ``dtype``,
    laid out like ``like`` where given (e.g. the logits, vocab split over ``tp``), else like
    the labels with the class dim split over ``class_axis`` (None: not split)."""
    tr = current_tracer()
    if labels.dtype.is_float or labels.dtype is DType.BOOL:
        raise trace_error(f"labels must be integers; got {labels.dtype}")
    shape = (*labels.shape, classes)
    if like is not None and like.shape == shape:
        layout = like.layout.with_partial(None)
    else:
        layout = Layout((*labels.layout.dims, (class_axis,) if class_axis else ()))
    ids = tr.apply("iota", [], {"dim": len(shape) - 1}, [TensorType(labels.dtype, shape, layout)])
    lab = labels.reshape((*labels.shape, 1)).broadcast_to(shape)
    hot = lab.eq(ids)
    return hot.cast(dtype)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits`` ``[..., C]`` against integer ``labels`` ``[...]``.
    Vocab-parallel as Megatron computes it: with the class dim split (over ``tp``), each
    rank's max, sum of exponentials and target logit are completed by allreduces of a
    scalar per row, never by gathering the logits. Under a mixed-precision policy
    (:class:`~dtm_mpi.frontend.precision.MixedPrecision`) ``bf16``/``f16`` logits are cast to
    float32 first, as Hugging Face's causal-LM loss upcasts them."""
    if current_tracer().compute is not None and logits.dtype in (DType.BF16, DType.F16):
        logits = logits.cast(DType.F32)
    last = logits.ndim - 1
    m = logits.max(last, keepdims=True).detach()  # the shift only steadies exp
    shifted = logits - m
    sumexp = shifted.exp().sum(last, keepdims=True)
    target = (shifted * one_hot(labels, logits.shape[-1], logits.dtype, like=logits)).sum(
        last, keepdims=True
    )
    return (sumexp.log() - target).mean()


def causal_lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """The next-token loss of a causal LM as Hugging Face's ``labels=ids`` computes it: the
    mean cross-entropy (in binary32) of the logits ``[B, T, V]`` at positions ``0 .. T-2``
    against the ids ``[B, T]`` at ``1 .. T-1``."""
    b, t, _ = logits.shape
    if ids.shape != (b, t):
        raise trace_error(
            f"ids must be [{b}, {t}] for logits {list(logits.shape)}; got {list(ids.shape)}"
        )
    shifted = logits[:, : t - 1, :]
    if shifted.dtype not in (DType.F32, DType.F64):
        shifted = shifted.cast(DType.F32)
    return cross_entropy(shifted, ids[:, 1:])


def causal_mask(scores: Tensor, fill: float = -1e9) -> Tensor:
    """``scores`` ``[..., T, T]`` with every entry above the diagonal (a query's later keys)
    replaced by ``fill``: position i attends to positions 0..i."""
    tr = current_tracer()
    t = scores.shape[-1]
    if scores.ndim < 2 or scores.shape[-2] != t:
        raise trace_error(f"causal_mask needs [..., T, T] scores; got {list(scores.shape)}")
    pair = TensorType(DType.I32, (t, t), Layout.replicated(2))
    row = tr.apply("iota", [], {"dim": 0}, [pair])
    col = tr.apply("iota", [], {"dim": 1}, [pair])
    return where(row >= col, scores, fill)


def accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """The fraction of rows whose largest logit is the label's (a float scalar; a tie
    counts as a hit)."""
    last = logits.ndim - 1
    m = logits.max(last, keepdims=True)
    hot = one_hot(labels, logits.shape[-1], logits.dtype, like=logits)
    hit = (logits * hot).sum(last, keepdims=True) >= m
    return hit.cast(logits.dtype).mean()
