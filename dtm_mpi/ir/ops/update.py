"""Optimizer updates (new in IR 1.3): ``adamw``, Adam with decoupled weight decay as one op per
parameter (spec §8.15).

``%p2, %m2, %v2 = adamw %p, %g, %m, %v, %bc1, %bc2 lr L beta1 B1 beta2 B2 eps E decay W``: with
every operation in the parameter's dtype, rounded after each as the composed ops would be::

    m2 = m * B1 + g * (1 - B1)
    v2 = v * B2 + (g * g) * (1 - B2)
    step = (m2 / bc1) / (sqrt(v2 / bc2) + E)  [+ p * W when W > 0]
    p2 = p - step * L

(each constant a value of the dtype: ``1 - B1`` computed in binary64, then rounded). With the
optional operand ``scale %s`` (new in IR 1.5; a learning-rate schedule's factor for this step,
a complete scalar of the dtype) the last line is ``p2 = p - step * (L * s)``, ``L * s`` rounded
to the dtype. So the op
gives exactly the bits of those ops written one by one (the frontend wrote them so before),
in one pass over the parameter's memory: the numpy backend runs it in chunks that stay in a
core's cache, a GPU backend as one RawKernel (``kernels/adamw.cu``, the same bits). ``bc1``/``bc2`` are the bias corrections
(``1 - B1^t`` for step ``t``), scalars shared by every parameter. ``p``, ``g``, ``m``, ``v``
have one type (dtype f16, f32 or f64, shape, layout; not pending), the scalars that dtype
and no layout; the three results that type. No gradient flows through an update.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import no_partial
from dtm_mpi.ir.registry import OpContext, register_op
from dtm_mpi.ir.types import DType, TensorType

__all__ = [
    "ADAMW_DTYPES",
    "CHUNK",
    "adamw_blocks",
    "adamw_reference",
    "adamw_values",
    "update_attrs",
]

ADAMW_DTYPES = frozenset({DType.F16, DType.F32, DType.F64})
"""The dtypes ``adamw`` takes (bf16 parameters are updated by the composed ops)."""

CHUNK = 16384
"""Elements per chunk of the numpy kernel (64 KiB of float32 per array: the seven arrays of a
chunk stay in a core's L2 cache)."""


def adamw_values(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    bc1: np.ndarray,
    bc2: np.ndarray,
    attrs: dict[str, float],
    scale: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The op on numpy arrays of one dtype (module doc): the operations one by one."""
    dt = p.dtype

    def c(x: float) -> np.ndarray:
        return np.asarray(x, dtype=dt)

    b1, b2 = attrs["beta1"], attrs["beta2"]
    m2 = m * c(b1) + g * c(1.0 - b1)
    v2 = v * c(b2) + (g * g) * c(1.0 - b2)
    step = (m2 / bc1) / (np.sqrt(v2 / bc2) + c(attrs["eps"]))
    if attrs["decay"] > 0:
        step = step + p * c(attrs["decay"])
    lr = c(attrs["lr"]) if scale is None else c(attrs["lr"]) * scale
    return p - step * lr, m2, v2


ATTRS = ("lr", "beta1", "beta2", "eps", "decay")


def update_attrs(op: Op) -> dict[str, float]:
    return {k: float(op.attr(k)) for k in ATTRS}  # type: ignore[arg-type]


def adamw_reference(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    return adamw_blocks(xs, update_attrs(op))


def adamw_blocks(xs: Sequence[np.ndarray], attrs: dict[str, float]) -> tuple[np.ndarray, ...]:
    """The op on its operands' blocks, its attributes read (:func:`update_attrs`): a block of
    at most :data:`CHUNK` elements in one call of the formula, a larger one in chunks of
    :data:`CHUNK` (elementwise: the same bits either way; a small model's step spent 40 us a
    parameter on the chunk loop and its copies)."""
    p, g, m, v, bc1, bc2 = xs[:6]
    s1, s2 = np.asarray(bc1, dtype=p.dtype), np.asarray(bc2, dtype=p.dtype)
    sc = np.asarray(xs[6], dtype=p.dtype) if len(xs) > 6 else None
    if p.size <= CHUNK:
        with np.errstate(all="ignore"):  # IEEE results, as the ops one by one
            got = adamw_values(p, g, m, v, s1, s2, attrs, sc)
        return tuple(np.asarray(o) for o in got)  # (numpy gives scalars for 0-d operands)
    outs = [np.empty(p.shape, dtype=p.dtype) for _ in range(3)]
    flat = [np.ascontiguousarray(a).reshape(-1) for a in (p, g, m, v)]
    views = [o.reshape(-1) for o in outs]
    with np.errstate(all="ignore"):  # IEEE results, as the ops one by one
        for lo in range(0, flat[0].size, CHUNK):
            hi = lo + CHUNK
            p_, g_, m_, v_ = (a[lo:hi] for a in flat)
            got = adamw_values(p_, g_, m_, v_, s1, s2, attrs, sc)
            for view, part in zip(views, got, strict=True):
                view[lo:hi] = part
    return tuple(outs)


@register_op(
    "adamw",
    "$p:operand , $g:operand , $m:operand , $v:operand , $bc1:operand , $bc2:operand "
    "?( scale $scale:operand ) lr $lr:float beta1 $beta1:float beta2 $beta2:float eps $eps:float decay $decay:float",
    results=3,
    reference=adamw_reference,
    doc="AdamW's update of a parameter and its moments in one op",
    since=(1, 3),
    attr_since=(("scale", (1, 5)),),
)
def _adamw(ctx: OpContext) -> tuple[TensorType, ...]:
    p = ctx.operand_types[0]
    if p.dtype not in ADAMW_DTYPES:
        raise ctx.operand_error(0, f"adamw takes f16, f32 or f64 parameters; got {p.dtype}")
    no_partial(ctx, 0)
    for i, what in ((1, "gradient"), (2, "first moment"), (3, "second moment")):
        t = ctx.operand_types[i]
        if t != p:
            raise ctx.operand_error(i, f"the {what} must have the parameter's type {p}; got {t}")
    for i, what in ((4, "bc1"), (5, "bc2"), (6, "scale"))[: len(ctx.operand_types) - 4]:
        t = ctx.operand_types[i]
        if t.rank != 0 or t.dtype is not p.dtype or not t.layout.is_replicated:
            raise ctx.operand_error(
                i, f"{what} must be a complete {p.dtype.value}[] scalar; got {t}"
            )
    for key in ATTRS:
        value = float(ctx.attr(key))
        high = 1.0 if key in ("beta1", "beta2") else None
        if not (value >= 0 and (high is None or value < high)):
            rng = "in [0, 1)" if high is not None else ">= 0"
            raise ctx.attr_error(key, f"{key} must be {rng}; got {value}")
    return (p, p, p)
