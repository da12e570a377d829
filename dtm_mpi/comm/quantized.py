"""Quantized allreduce and allgather (CAP_QUANT communication; ``DTM_QUANT_ALLREDUCE=B``,
``dtm run --quantize-allreduce B``, ``fit(quantize_allreduce=B)``): float sums and gathers
move as int8 blocks of ``B`` elements with one float32 scale each, about a quarter of the
bytes. (A floating allgather of at least :data:`MIN_COUNT` elements in all sends each member's
block quantized once: every element within half a step of its block.)

:class:`QuantizedComm` wraps the run's communicator; every other call passes through. A sum
allreduce of a floating array of at least :data:`MIN_COUNT` elements runs in two phases over
the same group (smaller ones, e.g. the loss, stay exact):

1. each member adds its error-feedback residual, pads the flat array to ``p`` pieces of whole
   blocks, quantizes it (spec §8.10.1) and sends piece ``j`` to member ``j`` (all-to-all);
   member ``j`` dequantizes the ``p`` pieces it got and adds them in group order (binary64);
2. member ``j`` quantizes its summed piece and all members allgather the quantized pieces and
   dequantize them.

**Error bound** (io/WIRE.md §6, tested): for an element in block ``b``, the result differs
from the exact sum of the members' inputs (residuals included) by at most
``(sum_r s_r[b] + s'[b]) / 2`` plus float32 rounding, where ``s_r[b] = amax_r[b] / 127`` is
member r's phase-1 scale of the block and ``s'[b] = amax'[b] / 127`` the phase-2 scale of the
summed block: each rounding to the nearest step is at most half a step.

**Error feedback**: what a member's quantizations dropped this step (its phase-1 error, and
the phase-2 error of the piece it owns) is added to its input of the same allreduce next step
(the n-th quantized allreduce of a shape in a step, counted from :meth:`begin_step`), so the
errors do not accumulate over training.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dtm_mpi.comm.interface import Comm, Completed, Pending
from dtm_mpi.ir.ops.quant import dequantize_values, quantize_values
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding.steps import AllgatherSpec, AllreduceSpec, ExchangeSpec, Transfer

__all__ = ["MIN_COUNT", "QuantizedComm", "error_bound", "quantized_bytes"]

MIN_COUNT = 1024
"""Allreduces of fewer elements (losses, metrics, norms) are not quantized."""


def error_bound(inputs: list[np.ndarray], block: int) -> np.ndarray:
    """The stated bound of each element of the result of a quantized sum of ``inputs`` (one
    flat array per member): ``sum_r amax_r[b] / 127`` for the element's block ``b``, plus the
    rounding of the result to its dtype (relative ``2**-22`` of the exact sum)."""
    n = inputs[0].size
    nb = -(-n // block)
    amax = np.zeros(nb)
    for x in inputs:
        padded = np.zeros(nb * block)
        padded[:n] = np.abs(np.asarray(x, dtype=np.float64).reshape(-1))
        amax += padded.reshape(nb, block).max(axis=1)
    exact = np.sum([np.asarray(x, dtype=np.float64).reshape(-1) for x in inputs], axis=0)
    eps = 2.0 ** -(np.finfo(inputs[0].dtype).nmant - 1)
    bound: np.ndarray = np.repeat(amax / 127, block)[:n] * (1 + 1e-6) + np.abs(exact) * eps
    return bound


def quantized_bytes(count: int, members: int, block: int) -> int:
    """The bytes one member sends in a quantized allreduce of ``count`` elements (both phases:
    int8 values and float32 scales of the ``members - 1`` pieces it sends each time)."""
    chunk = -(-count // (members * block)) * block
    row = chunk + 4 * (chunk // block)
    return 2 * (members - 1) * row


class QuantizedComm:
    """``inner`` with its large float sum allreduces quantized in blocks of ``block``."""

    def __init__(self, inner: Comm, block: int, min_count: int = MIN_COUNT) -> None:
        if block < 1:
            raise ValueError(f"quantized allreduce block must be >= 1; got {block}")
        self.inner = inner
        self.block = block
        self.min_count = min_count
        self._residuals: dict[tuple[Any, ...], np.ndarray] = {}
        self._seen: dict[tuple[Any, ...], int] = {}

    def __getattr__(self, name: str) -> Any:  # every other call: the inner communicator's
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def mesh(self) -> Any:
        return self.inner.mesh

    @property
    def stats(self) -> Any:
        return self.inner.stats

    def begin_step(self) -> None:
        """A new step: the quantized allreduces are counted from the first again (the n-th of
        a shape takes the residual the n-th left last step)."""
        self._seen.clear()

    def quantizes(self, x: np.ndarray, spec: AllreduceSpec) -> bool:
        return (
            spec.op is ReduceOp.SUM
            and x.dtype.kind == "f"
            and x.size >= self.min_count
            and len(spec.group) > 1
        )

    def allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> np.ndarray:
        if not self.quantizes(x, spec):
            return self.inner.allreduce(x, axes, spec)
        return self._quantized(x, axes, spec)

    def start_allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> Pending:
        if not self.quantizes(x, spec):
            return self.inner.start_allreduce(x, axes, spec)
        return Completed(self._quantized(x, axes, spec))

    def allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> np.ndarray:
        """A floating allgather of at least :data:`MIN_COUNT` elements in all moves as each
        member's block quantized (int8 blocks of the flat block, float32 scales): every
        element within half its block's step of the sent value (io/WIRE.md §6)."""
        if x.dtype.kind != "f" or sum(spec.counts) < self.min_count or len(spec.group) < 2:
            return self.inner.allgather(x, axes, spec)
        b = self.block
        sizes = [-(-c // b) * b for c in spec.counts]  # each member's padded element count
        widths = [_row_bytes(n, b) for n in sizes]
        flat = np.zeros(sizes[spec.position])
        flat[: x.size] = np.asarray(x, dtype=np.float64).reshape(-1)
        q, scale = quantize_values(flat[None, :], b)
        row = _pack(q, scale.astype(np.float32))[0]
        rows = self.inner.allgather(
            row, axes, AllgatherSpec(spec.group, spec.position, 0, tuple(widths), tuple(widths))
        )
        parts, at = [], 0
        for i, (n, w) in enumerate(zip(sizes, widths, strict=True)):
            qi, si = _unpack(rows[at : at + w], n, b)
            at += w
            shape = list(x.shape)
            shape[spec.dim] = spec.extents[i]
            values = dequantize_values(qi, si, b)[: spec.counts[i]]
            parts.append(values.astype(x.dtype).reshape(shape))
        return np.concatenate(parts, axis=spec.dim)

    def _quantized(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> np.ndarray:
        p, me, b = len(spec.group), spec.position, self.block
        key = (axes, x.size, x.dtype.str)
        nth = self._seen.get(key, 0)
        self._seen[key] = nth + 1
        flat = np.asarray(x, dtype=np.float64).reshape(-1)
        residual = self._residuals.get((*key, nth))
        if residual is not None:
            flat = flat + residual
        n = flat.size
        chunk = -(-n // (p * b)) * b
        padded = np.zeros(p * chunk)
        padded[:n] = flat
        q, scale = quantize_values(padded.reshape(p, chunk), b)
        s32 = scale.astype(np.float32)
        dropped = padded - dequantize_values(q, s32, b).reshape(-1)
        got = self.inner.exchange(_pack(q, s32), axes, _to_each(spec, chunk, b), "all_to_all")
        piece = np.zeros(chunk)
        for i in range(p):  # in group order
            qi, si = _unpack(got[i], chunk, b)
            piece += dequantize_values(qi, si, b)
        q2, scale2 = quantize_values(piece[None, :], b)
        s2 = scale2.astype(np.float32)
        dropped[me * chunk : (me + 1) * chunk] += piece - dequantize_values(q2, s2, b)[0]
        rows = self.inner.allgather(_pack(q2, s2), axes, _gather(spec, chunk, b))
        out = np.empty(p * chunk)
        for i in range(p):
            qi, si = _unpack(rows[i], chunk, b)
            out[i * chunk : (i + 1) * chunk] = dequantize_values(qi, si, b)
        self._residuals[(*key, nth)] = dropped[:n]
        return out[:n].astype(x.dtype).reshape(x.shape)


def _row_bytes(chunk: int, block: int) -> int:
    return chunk + 4 * (chunk // block)


def _pack(q: np.ndarray, s32: np.ndarray) -> np.ndarray:
    """Rows of int8 values followed by their float32 scales' bytes, as uint8."""
    rows = q.shape[0]
    return np.concatenate(
        [q.view(np.uint8).reshape(rows, -1), s32.view(np.uint8).reshape(rows, -1)], axis=1
    )


def _unpack(row: np.ndarray, chunk: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    q = np.ascontiguousarray(row[:chunk]).view(np.int8)
    s = np.ascontiguousarray(row[chunk : _row_bytes(chunk, block)]).view(np.float32)
    return q, s


def _to_each(spec: AllreduceSpec, chunk: int, block: int) -> ExchangeSpec:
    """Row ``j`` of this member's packed array to member ``j``; member ``i``'s row to row
    ``i`` of the result."""
    w = _row_bytes(chunk, block)
    rows = tuple(  # (the same rows both ways: row j goes to and comes from member j)
        Transfer(peer, (slice(j, j + 1), slice(0, w)), w) for j, peer in enumerate(spec.group)
    )
    return ExchangeSpec(spec.group, spec.position, rows, rows, (len(spec.group), w), w)


def _gather(spec: AllreduceSpec, chunk: int, block: int) -> AllgatherSpec:
    w = _row_bytes(chunk, block)
    p = len(spec.group)
    return AllgatherSpec(spec.group, spec.position, 0, (1,) * p, (w,) * p)
