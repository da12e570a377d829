"""int8 quantisation with per-block scales along the last dim (capability ``CAP_QUANT``).

``quantize``: for each block of ``block`` consecutive elements of the last dim,
``scale = max(|x|) / 127`` (1 where the block is all zeros) and ``q = round_half_even(x /
scale)`` clipped to [-127, 127]. ``dequantize``: ``x = q * scale``. The last dim must be
divisible by ``block``; other dims keep their sharding in both results. ``quantize`` needs the
last dim unsharded. ``dequantize`` takes values and scales that are not pending (a pending sum
of i8 values would wrap, so its result would depend on the rank count) and, where the last dim
is sharded, every shard must hold whole blocks: on the bound mesh, each shard of the values'
last dim is ``block`` times the matching shard of the scales' (checked when planning, since
``--mesh`` may change the sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.ir.dtypes import as_dtype
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops._common import no_partial, require_float, unsharded_dim
from dtm_mpi.ir.registry import OpContext, ShardExtents, register_op
from dtm_mpi.ir.types import DType, Layout, TensorType


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def quantize_values(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Spec §8.10.1 on values: int8 ``q`` of ``x``'s shape and the binary64 scale of each block
    of ``block`` elements of the last dim (``amax / 127``, 1 for an all-zero block)."""
    xb = _blocks(x.astype(np.float64), block)
    amax = np.max(np.abs(xb), axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0)
    q = np.clip(np.rint(xb / scale[..., None]), -127, 127).astype(np.int8).reshape(x.shape)
    return q, scale


def dequantize_values(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """Spec §8.10.2 on values, in binary64: each int8 value times its block's scale."""
    return (_blocks(q.astype(np.float64), block) * scale.astype(np.float64)[..., None]).reshape(
        q.shape
    )


def _quantize_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    q, scale = quantize_values(xs[0], int(op.attr("block")))  # type: ignore[arg-type]
    return (q, as_dtype(scale, rt[1]))


def _check_block(ctx: OpContext, x: TensorType) -> int:
    block = int(ctx.attr("block"))
    if block < 1:
        raise ctx.attr_error("block", f"block must be >= 1; got {block}")
    if x.rank < 1 or x.shape[-1] % block:
        raise ctx.attr_error(
            "block",
            f"the last dim ({x.shape[-1] if x.rank else 'none'}) must be a multiple of block {block}",
        )
    return block


@register_op(
    "quantize",
    "$x:operand block $block:int",
    results=2,
    reference=_quantize_ref,
    capability="CAP_QUANT",
    doc="int8 values and f32 per-block scales",
)
def _quantize(ctx: OpContext) -> tuple[TensorType, ...]:
    x = ctx.operand_types[0]
    require_float(ctx, 0)
    no_partial(ctx, 0)
    block = _check_block(ctx, x)
    unsharded_dim(ctx, 0, x.rank - 1, "the quantised (last)")
    scale_shape = (*x.shape[:-1], x.shape[-1] // block)
    return (
        TensorType(DType.I8, x.shape, x.layout),
        TensorType(DType.F32, scale_shape, Layout(x.layout.dims, None)),
    )


def _dequantize_ref(
    op: Op, xs: Sequence[np.ndarray], rt: Sequence[TensorType]
) -> tuple[np.ndarray, ...]:
    q, scale = xs
    return (as_dtype(dequantize_values(q, scale, int(op.attr("block"))), rt[0]),)  # type: ignore[arg-type]


def _dequantize_blocks(op: Op, types: Sequence[TensorType], extents: ShardExtents) -> str | None:
    """Every shard of the values' last dim holds whole blocks: ``block`` times the matching
    shard of the scales' last dim (they share its axes)."""
    q, s = types[0], types[1]
    axes = q.layout.dims[-1] if q.rank else ()
    if not axes:
        return None
    block = int(op.attr("block"))  # type: ignore[arg-type]
    shards = zip(extents(q.shape[-1], axes), extents(s.shape[-1], axes), strict=True)
    for i, ((q0, qn), (s0, sn)) in enumerate(shards):
        if (q0, qn) != (s0 * block, sn * block):
            return (
                f"every shard of the last dim must hold whole blocks of {block}; split over "
                f"{','.join(axes)}, shard {i} holds values {q0}..{q0 + qn - 1} but the scales of "
                f"values {s0 * block}..{(s0 + sn) * block - 1} (make the last dim unsharded, "
                "or a size whose shards are multiples of the block)"
            )
    return None


@register_op(
    "dequantize",
    "$q:operand , $scales:operand block $block:int",
    reference=_dequantize_ref,
    capability="CAP_QUANT",
    doc="q * scale per block",
    plan_check=_dequantize_blocks,
)
def _dequantize(ctx: OpContext) -> tuple[TensorType, ...]:
    q, s = ctx.operand_types
    d = ctx.declared[0]
    if q.dtype is not DType.I8:
        raise ctx.operand_error(0, f"quantised values must be i8; got {q.dtype}")
    if s.dtype is not DType.F32:
        raise ctx.operand_error(1, f"scales must be f32; got {s.dtype}")
    no_partial(
        ctx,
        0,
        "a pending sum of i8 values wraps, so its result would depend on the "
        "rank count; dequantize each rank's values first, or allreduce them",
    )
    no_partial(ctx, 1, "dequantize needs complete scales; allreduce them first")
    block = _check_block(ctx, q)
    want = (*q.shape[:-1], q.shape[-1] // block)
    if s.shape != want or s.layout.dims != q.layout.dims:
        raise ctx.operand_error(
            1, f"scales must be f32{list(want)} laid out like the values; got {s}"
        )
    if not d.dtype.is_float:
        raise ctx.result_error(0, f"dequantize needs a floating result dtype; got {d.dtype}")
    return (TensorType(d.dtype, q.shape, q.layout),)
