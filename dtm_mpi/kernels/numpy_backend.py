"""The numpy backend: the CPU path, and the reference every other backend is checked against.

Most ops compute a rank's block from its operands' blocks with exactly the op's global
semantics (the reference function of the op registry, given the result types with their local
shapes): the sharding rules of the IR guarantee that, e.g. elementwise ops see aligned blocks,
a matmul whose contracted dim is split yields this rank's contribution to the pending sum, and
reshape/transpose/softmax never split across a sharded dim. The ops below are the exceptions,
where a block is not the op applied to blocks:

* ``mean`` divides the local sum by the *global* number of reduced elements;
* ``max``/``min`` of an empty block give the reduction's identity (spec §7.1);
* ``iota``, ``random`` and ``constant`` produce the rank's block of the global tensor from
  its global offsets (random values are a function of the global element index);
* ``slice`` keeps the full local extent of the sharded dims it does not change;
* ``take`` of a table split along the indexed dim looks up the indices in the rank's rows
  (zeros for the others: its part of the pending sum), and ``scatter_add`` adds only the
  updates whose indices fall in the rank's block of the result;
* ``step_index`` is the executor's step (and ``microbatch_index`` outside a pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dtm_mpi.config import get_config
from dtm_mpi.ir.dtypes import as_dtype, np_dtype
from dtm_mpi.ir.ops.create import random_values
from dtm_mpi.ir.ops.index import scatter_rows, take_rows
from dtm_mpi.ir.ops.update import adamw_blocks, update_attrs
from dtm_mpi.ir.registry import OPS, Trait, lookup_op
from dtm_mpi.ir.types import DType, Layout, ReduceOp, TensorType
from dtm_mpi.kernels.dispatch import (
    COMM_OPS,
    Kernel,
    KernelContext,
    PreparedKernel,
    has_kernel,
    register_kernel,
    register_preparer,
)
from dtm_mpi.kernels.gemm import Gemm, active_choice, gemm_for
from dtm_mpi.sharding.collectives import reduction_identity

__all__ = ["extremum_identity", "global_count", "reference_kernel", "slice_index"]

BACKEND = "numpy"
Arr = np.ndarray


def reference_kernel(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    """The op's global semantics applied to the local blocks."""
    opdef = OPS[ctx.op.name]
    return tuple(opdef.reference(ctx.op, xs, ctx.local_types))


def extremum_identity(name: str, dtype: np.dtype[Any]) -> Any:
    """What ``max``/``min`` of an empty block gives (spec §7.1): the reduction's identity."""
    return reduction_identity(ReduceOp.MAX if name == "max" else ReduceOp.MIN, dtype)


def global_count(ctx: KernelContext, dims: Sequence[int]) -> int:
    """How many elements a reduction over ``dims`` of the *global* operand reduces (what
    ``mean`` divides by on every backend, whatever the block)."""
    count = 1
    for d in dims:
        count *= ctx.operand_types[0].shape[d]
    return count


def _reduce_dims(ctx: KernelContext) -> tuple[tuple[int, ...], bool]:
    return tuple(ctx.op.attr("dims")), bool(ctx.op.attr("keepdims"))  # type: ignore[arg-type]


@register_kernel(BACKEND, "transpose")
def _transpose(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    """A view, not a copy: values are never written in place on this backend, numpy's
    matmul reads a transposed operand directly (the backward pass's ``a^T @ g`` copied its
    operand before: 0.2 s of a 1.6 s MLP step), and communication and storage copy
    non-contiguous blocks where they need contiguous ones."""
    perm: tuple[int, ...] = ctx.op.attr("perm")  # type: ignore[assignment]
    return (np.transpose(xs[0], perm),)


@register_kernel(BACKEND, "broadcast_to")
def _broadcast_to(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    """A read-only view, not a copy (as ``transpose``): its consumers read the operand's
    values where they repeat (a GPT step copied 63 broadcasts, 2 ms of 57); communication
    and storage copy blocks that are not contiguous, and a write into it would fail loudly."""
    return (np.broadcast_to(xs[0], ctx.local_shapes[0]),)


@register_kernel(BACKEND, "mean")
def _mean(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    dims, keep = _reduce_dims(ctx)
    count = global_count(ctx, dims)
    total = np.sum(xs[0], axis=dims, keepdims=keep)
    with np.errstate(all="ignore"):
        return (as_dtype(total / count if count else total * np.nan, ctx.result_types[0]),)


def _extremum(name: str) -> None:
    fn = np.max if name == "max" else np.min

    @register_kernel(BACKEND, name)
    def kernel(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
        dims, keep = _reduce_dims(ctx)
        x = xs[0]
        out = fn(x, axis=dims, keepdims=keep, initial=extremum_identity(name, x.dtype))
        return (as_dtype(out, ctx.result_types[0]),)


_extremum("max")
_extremum("min")


@register_kernel(BACKEND, "iota")
def _iota(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    t, shape, offsets = ctx.result_types[0], ctx.local_shapes[0], ctx.offsets[0]
    dim = int(ctx.op.attr("dim"))  # type: ignore[arg-type]
    line = np.arange(offsets[dim], offsets[dim] + shape[dim])
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return (as_dtype(np.broadcast_to(line.reshape(view), shape), t),)


def global_flat_index(
    global_shape: Sequence[int], offsets: Sequence[int], local_shape: Sequence[int]
) -> Arr:
    """The row-major global flat index of every element of a block (uint64, block-shaped)."""
    index = np.zeros(tuple(local_shape), dtype=np.uint64)
    stride = 1
    for d in range(len(global_shape) - 1, -1, -1):
        view = [1] * len(local_shape)
        view[d] = local_shape[d]
        coords = np.arange(offsets[d], offsets[d] + local_shape[d], dtype=np.uint64)
        index += coords.reshape(view) * np.uint64(stride)
        stride *= global_shape[d]
    return index


@register_kernel(BACKEND, "random")
def _random(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    t = ctx.result_types[0]
    op = ctx.op
    offset = int(xs[0]) if xs else 0
    params = {k: float(v) for k, v in op.attrs if k in ("mean", "std", "low", "high")}  # type: ignore[arg-type]
    index = global_flat_index(t.shape, ctx.offsets[0], ctx.local_shapes[0])
    values = random_values(str(op.attr("dist")), int(op.attr("seed")), offset, index, params)  # type: ignore[arg-type]
    return (as_dtype(values, t),)


@register_kernel(BACKEND, "constant")
def _constant(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    opdef = OPS["constant"]
    t = ctx.result_types[0]
    if not isinstance(ctx.op.attr("value"), tuple):
        # a splat: one element repeated (a read-only view; values are never written in
        # place on this backend), not a filled block: the optimizer's and the reverse pass's
        # scalars cost no memory traffic
        (one,) = opdef.reference(ctx.op, xs, [TensorType(t.dtype, (), Layout(()))])
        return (np.broadcast_to(one, tuple(ctx.local_shapes[0])),)
    (full,) = opdef.reference(ctx.op, xs, ctx.result_types)
    block = tuple(slice(o, o + n) for o, n in zip(ctx.offsets[0], ctx.local_shapes[0], strict=True))
    return (np.array(full[block], order="C"),)


def slice_index(ctx: KernelContext, shape: Sequence[int]) -> tuple[slice, ...]:
    """The local index of a ``slice`` op on a block of ``shape``: the box on unsharded dims,
    the whole local extent on sharded ones (every backend's slice kernel uses it)."""
    start: tuple[int, ...] = ctx.op.attr("start")  # type: ignore[assignment]
    limit: tuple[int, ...] = ctx.op.attr("limit")  # type: ignore[assignment]
    layout = ctx.operand_types[0].layout
    return tuple(
        slice(0, shape[d]) if layout.dims[d] else slice(a, b)
        for d, (a, b) in enumerate(zip(start, limit, strict=True))
    )


@register_kernel(BACKEND, "slice")
def _slice(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    x = xs[0]
    return (np.array(x[slice_index(ctx, x.shape)], order="C"),)


@register_kernel(BACKEND, "take")
def _take(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    d = int(ctx.op.attr("dim"))  # type: ignore[arg-type]
    size = ctx.operand_types[0].shape[d]
    y = take_rows(xs[0], xs[1], d, ctx.operand_offsets[0][d], size, ctx.operand_offsets[1])
    return (np.asarray(y, order="C"),)  # (ascontiguousarray would make a 0-d result 1-d)


@register_kernel(BACKEND, "scatter_add")
def _scatter_add(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    d = int(ctx.op.attr("dim"))  # type: ignore[arg-type]
    lo, n, size = ctx.offsets[0][d], ctx.local_shapes[0][d], ctx.result_types[0].shape[d]
    return (scatter_rows(xs[0], xs[1], d, lo, n, size, ctx.operand_offsets[1]),)


@register_kernel(BACKEND, "step_index", "microbatch_index")
def _step_counter(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[Arr, ...]:
    # (a step not split into microbatches is one microbatch, numbered as the step; a
    # pipeline's passes take the microbatch's number as an input: dtm_mpi.ir.stages)
    return (np.array(ctx.step, dtype=np.int64),)


def _prepared_matmul(ctx: KernelContext) -> PreparedKernel:
    """A matmul through the GEMM provider chosen for its shape class (``DTM_GEMM``,
    :mod:`dtm_mpi.kernels.gemm`: 2-D float32/float64 products; numpy's for the others),
    looked up on the first call of each operand shape."""
    t = ctx.result_types[0]
    chosen: dict[tuple[tuple[int, ...], tuple[int, ...], str], Gemm | None] = {}

    def call(xs: Sequence[Arr]) -> tuple[Arr, ...]:
        a, b = xs
        key = (a.shape, b.shape, a.dtype.str)
        g = chosen.get(key, _UNSET)
        if g is _UNSET:
            g = chosen[key] = (
                gemm_for(
                    active_choice(get_config().gemm), a.dtype, a.shape[0], a.shape[1], b.shape[1]
                )
                if a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype
                else None
            )
        out = np.matmul(a, b) if g is None else g(a, b)
        return (as_dtype(out, t),)

    return call


_UNSET: Any = object()


def _prepared_adamw(ctx: KernelContext) -> PreparedKernel:
    """``adamw`` with its attributes read once (the reference reads them every call)."""
    attrs = update_attrs(ctx.op)
    return lambda xs: adamw_blocks(xs, attrs)


@register_preparer(BACKEND)
def _prepare(kernel: Kernel, ctx: KernelContext) -> PreparedKernel | None:
    """Faster calls with the same results (a 1,000-op chain of 8-element ops: the
    executor's cost per op from 13 us to about 2):

    * an op without operands (``constant``, ``iota``; not ``step_index``: the executor prepares
      no op that reads the step) gives the same block every step: computed on the first call
      and kept, read-only (values are never written in place on this backend);
    * an elementwise op run by the reference kernel: its array function called directly
      (``as_dtype`` of it, as the reference gives);
    * another op run by the reference kernel: the reference with the local types computed
      once."""
    op = ctx.op
    opdef = OPS[op.name]
    if op.name == "matmul" and kernel is reference_kernel:
        return _prepared_matmul(ctx)
    if op.name == "adamw" and kernel is reference_kernel:
        return _prepared_adamw(ctx)
    if not op.operands:
        kept: list[tuple[Arr, ...]] = []

        def once(xs: Sequence[Arr]) -> tuple[Arr, ...]:
            if not kept:
                outs = kernel(ctx, xs)
                for out in outs:
                    out.flags.writeable = False
                kept.append(outs)
            return kept[0]

        return once
    if kernel is not reference_kernel:
        return None
    fn = opdef.array_fn
    if fn is None or not opdef.has(Trait.ELEMENTWISE):
        reference, types = opdef.reference, ctx.local_types

        def call_reference(xs: Sequence[Arr]) -> tuple[Arr, ...]:
            return tuple(reference(op, xs, types))

        return call_reference
    t = ctx.result_types[0]
    want, exact = np_dtype(t.dtype), t.dtype is not DType.BF16
    form = opdef.form(op)

    def call(xs: Sequence[Arr]) -> tuple[Arr, ...]:
        out = fn(np, *xs, **form)
        if type(out) is not np.ndarray:  # numpy gives a scalar for 0-d operands
            out = np.asarray(out)
        if exact and out.dtype == want:
            return (out,)
        return (as_dtype(out, t),)

    return call


def _register_defaults() -> None:
    lookup_op("add")  # load the op registry
    for name in OPS:
        if name not in COMM_OPS and not has_kernel(BACKEND, name):
            register_kernel(BACKEND, name)(reference_kernel)


_register_defaults()
