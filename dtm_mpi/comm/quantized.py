"""Quantized allreduce and allgather (CAP_QUANT communication; ``DTM_QUANT_ALLREDUCE=B``,
``dtm run --quantize-allreduce B``, ``fit(quantize_allreduce=B)``): float sums and gathers
move as int8 blocks of ``B`` elements with one float32 scale each, about a quarter of the
bytes. (A floating allgather of at least :data:`MIN_COUNT` elements in all sends each member's
block quantized once: every element within half a step of its block.)

:class:`QuantizedComm` wraps the run's communicator; every other call passes through. A sum
allreduce of a floating array of at least :data:`MIN_COUNT` elements runs in two phases over
the same group (smaller ones, e.g. the loss, stay exact):

1. each member adds its error-feedback residual, pads the flat array to ``p`` pieces of whole
   blocks, quantizes it (io/WIRE.md §6: spec §8.10.1 with the scale in binary32) and sends
   piece ``j`` to member ``j`` (all-to-all); member ``j`` dequantizes the ``p`` pieces it got
   and adds them in group order, in the working precision (:func:`_work_dtype`);
2. member ``j`` quantizes its summed piece and all members allgather the quantized pieces and
   dequantize them.

**Error bound** (io/WIRE.md §6, tested): for an element in block ``b``, the result differs
from the exact sum of the members' inputs (residuals included) by at most
``(sum_r s_r[b] + s'[b]) / 2``, where ``s_r[b]`` (about ``amax_r[b] / 127``) is member r's
phase-1 scale of the block and ``s'[b]`` the phase-2 scale of the summed block (each rounding
to the nearest step is at most half a step), plus the working precision's roundings
(:func:`error_bound`) and the result's rounding to its dtype. A block holding a NaN or an
infinity, or too large for a binary32 scale, comes out NaN and leaves no residual.

**Error feedback**: what a member's quantizations dropped this step (its phase-1 error, and
the phase-2 error of the piece it owns) is added to its input of the same allreduce next step
(the n-th quantized allreduce of a shape in a step, counted from :meth:`begin_step`), so the
errors do not accumulate over training.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dtm_mpi.comm.interface import Comm, Completed, Pending
from dtm_mpi.cpu_cache import CHUNK_ELEMS
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding.steps import AllgatherSpec, AllreduceSpec, ExchangeSpec, Transfer

__all__ = ["MIN_COUNT", "QuantizedComm", "error_bound", "quantized_bytes"]

MIN_COUNT = 1024
"""Allreduces of fewer elements (losses, metrics, norms) are not quantized."""


def error_bound(inputs: list[np.ndarray], block: int) -> np.ndarray:
    """The stated bound of each element of the result of a quantized sum of ``inputs`` (one
    flat array per member): ``sum_r amax_r[b] / 127`` for the element's block ``b``, plus the
    roundings of the dequantizations and the sum in the working precision (at most ``2 p u
    sum_r amax_r[b]``, ``u`` its unit roundoff) and of the result to its dtype (relative
    ``2**-22`` of the exact sum)."""
    n = inputs[0].size
    nb = -(-n // block)
    amax = np.zeros(nb)
    for x in inputs:
        padded = np.zeros(nb * block)
        padded[:n] = np.abs(np.asarray(x, dtype=np.float64).reshape(-1))
        amax += padded.reshape(nb, block).max(axis=1)
    exact = np.sum([np.asarray(x, dtype=np.float64).reshape(-1) for x in inputs], axis=0)
    eps = 2.0 ** -(np.finfo(inputs[0].dtype).nmant - 1)
    u = 2.0 ** -(np.finfo(_work_dtype(inputs[0].dtype)).nmant + 1)
    per_block = amax / 127 * (1 + 1e-6) + 2 * len(inputs) * u * amax
    bound: np.ndarray = np.repeat(per_block, block)[:n] + np.abs(exact) * eps
    return bound


def quantized_bytes(count: int, members: int, block: int) -> int:
    """The bytes one member sends in a quantized allreduce of ``count`` elements (both phases:
    int8 values and float32 scales of the ``members - 1`` pieces it sends each time)."""
    return 2 * (members - 1) * _row_bytes(_piece(count, members, block), block)


class QuantizedComm:
    """``inner`` with its large float sum allreduces quantized in blocks of ``block``."""

    def __init__(self, inner: Comm, block: int, min_count: int = MIN_COUNT) -> None:
        if block < 1:
            raise ValueError(f"quantized allreduce block must be >= 1; got {block}")
        self.inner = inner
        self.block = block
        self.min_count = min_count
        # per allreduce (axes, size, dtype, n-th in the step): [its residual, a spare array]
        self._residuals: dict[tuple[Any, ...], list[np.ndarray]] = {}
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

    def quantizes_gather(self, x: np.ndarray, spec: AllgatherSpec) -> bool:
        return x.dtype.kind == "f" and sum(spec.counts) >= self.min_count and len(spec.group) > 1

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
        if not self.quantizes_gather(x, spec):
            return self.inner.allgather(x, axes, spec)
        b = self.block
        sizes = [-(-c // b) * b for c in spec.counts]  # each member's padded element count
        widths = [_row_bytes(n, b) for n in sizes]
        work = _work_dtype(x.dtype)
        flat = np.zeros(sizes[spec.position], dtype=work)
        flat[: x.size] = x.reshape(-1)
        row = np.empty((1, widths[spec.position]), np.uint8)
        _quantize_rows(flat[None, :], b, row, None)
        rows = self.inner.allgather(
            row[0], axes, AllgatherSpec(spec.group, spec.position, 0, tuple(widths), tuple(widths))
        )
        parts, at = [], 0
        for i, (n, w) in enumerate(zip(sizes, widths, strict=True)):
            values = np.empty(n, dtype=work)
            _dequantize_row(rows[at : at + w], n, b, values)
            at += w
            shape = list(x.shape)
            shape[spec.dim] = spec.extents[i]
            parts.append(values[: spec.counts[i]].astype(x.dtype, copy=False).reshape(shape))
        return np.concatenate(parts, axis=spec.dim)

    def start_allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> Pending:
        """The quantized allgather runs now (its packing is this thread's work); others are
        the inner communicator's."""
        if not self.quantizes_gather(x, spec):
            return self.inner.start_allgather(x, axes, spec)
        return Completed(self.allgather(x, axes, spec))

    def _quantized(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> np.ndarray:
        p, me, b = len(spec.group), spec.position, self.block
        key = (axes, x.size, x.dtype.str)
        nth = self._seen.get(key, 0)
        self._seen[key] = nth + 1
        n = x.size
        chunk = _piece(n, p, b)
        work = _work_dtype(x.dtype)
        # the input plus last step's residual (zeros at first), padded to p pieces of whole
        # blocks; after the quantization it holds what the quantization dropped, the next
        # residual. Two such arrays per allreduce, swapped after each call.
        pair = self._residuals.get((*key, nth))
        if pair is None:
            shape = (p, chunk)
            pair = self._residuals[(*key, nth)] = [np.zeros(shape, work), np.empty(shape, work)]
        residual, padded = pair
        flat = padded.reshape(-1)
        flat[n:] = 0
        np.add(x.reshape(-1), residual.reshape(-1)[:n], out=flat[:n])
        w = _row_bytes(chunk, b)
        rows = np.empty((p, w), np.uint8)
        _quantize_rows(padded, b, rows, padded)
        got = self.inner.exchange(rows, axes, _to_each(spec, chunk, b), "all_to_all")
        piece = np.empty(chunk, dtype=work)  # the pieces added in group order (io/WIRE.md §6)
        _dequantize_row(got[0], chunk, b, piece)
        values = np.empty(chunk, dtype=work) if p > 1 else piece
        for i in range(1, p):
            _dequantize_row(got[i], chunk, b, values)
            piece += values
        mine = np.empty((1, w), np.uint8)
        summed = piece[None, :]
        _quantize_rows(summed, b, mine, summed)  # summed: the phase-2 rounding dropped
        padded[me] += summed[0]
        gathered = self.inner.allgather(mine, axes, _gather(spec, chunk, b))
        out = np.empty(p * chunk, dtype=work)
        for i in range(p):
            _dequantize_row(gathered[i], chunk, b, out[i * chunk : (i + 1) * chunk])
        pair.reverse()  # this call's dropped values are the next call's residual
        return out[:n].astype(x.dtype, copy=False).reshape(x.shape)


def _work_dtype(dtype: np.dtype[Any]) -> type[np.floating[Any]]:
    """The precision the quantization computes in: binary64 for arrays of 64 bits or more,
    binary32 for narrower ones (float32 scales and int8 values carry no more)."""
    return np.float64 if dtype.itemsize >= 8 else np.float32


def _quantize_rows(x: np.ndarray, block: int, rows: np.ndarray, dropped: np.ndarray | None) -> None:
    """Quantize each row of ``x`` (``[r, c]``, ``c`` whole blocks) into ``rows`` (``[r, c + 4c /
    block]`` bytes: the int8 values, then the float32 scales, io/WIRE.md §6): per block
    ``scale = float32(amax / 127)``, one float32 step up where ``127 * scale < amax`` (a
    scale rounded down, coarsely where it is subnormal), 1 for an all-zero block or one too
    small for a float32 scale, and ``q = round-half-even(x / scale)``, within ±127 since
    ``|x| <= amax <= 127 * scale``. A block whose scale is not finite (a NaN or an infinity
    in it, or beyond float32's range) gets a NaN scale and zeros: it dequantizes to NaN. With
    ``dropped`` (``x`` itself allowed), writes ``x - q * scale`` there, what the rounding
    dropped (0 in a non-finite block: nothing carried to the next step). In chunks of about
    :data:`~dtm_mpi.cpu_cache.CHUNK_ELEMS` elements (cache-sized); a block's ``amax``
    is the largest of its magnitudes' bit patterns (sign bit cleared: the same order as the
    magnitudes)."""
    r, c = x.shape
    bits = np.dtype(f"i{x.itemsize}")
    mask = bits.type(np.iinfo(bits).max)  # all but the sign bit
    step = max(1, CHUNK_ELEMS // block) * block
    starts = np.arange(0, step, block)
    mag = np.empty(step, bits)
    t = np.empty(step, x.dtype)
    each = np.empty(step, x.dtype)  # each element's scale
    up = np.float32(np.inf)
    for i in range(r):
        q = rows[i, :c].view(np.int8)
        scales = rows[i, c:].view(np.float32)
        for lo in range(0, c, step):
            hi = min(c, lo + step)
            k, nb = hi - lo, (hi - lo) // block
            xs = x[i, lo:hi]
            np.bitwise_and(xs.view(bits), mask, out=mag[:k])
            amax = np.maximum.reduceat(mag[:k], starts[:nb]).view(x.dtype)
            s = (amax / 127).astype(np.float32)
            short = s.astype(x.dtype) * 127 < amax
            if short.any():
                s[short] = np.nextafter(s[short], up)
            s[s == 0] = 1
            bad = ~np.isfinite(s)
            nonfinite = bool(bad.any())
            if nonfinite:
                s[bad] = np.nan
            scales[lo // block : hi // block] = s
            each[:k].reshape(nb, block)[...] = s[:, None]
            np.divide(xs, each[:k], out=t[:k])
            np.rint(t[:k], out=t[:k])
            if nonfinite:
                t[:k].reshape(nb, block)[bad] = 0
            q[lo:hi] = t[:k]  # (exact: whole numbers within ±127)
            if dropped is not None:
                np.multiply(t[:k], each[:k], out=t[:k])
                np.subtract(xs, t[:k], out=dropped[i, lo:hi])
                if nonfinite:
                    dropped[i, lo:hi].reshape(nb, block)[bad] = 0


def _dequantize_row(row: np.ndarray, c: int, block: int, out: np.ndarray) -> None:
    """``out`` (``c`` elements) = each int8 value of the packed ``row`` times its block's
    float32 scale, in ``out``'s precision."""
    np.copyto(out, row[:c].view(np.int8))
    scales = row[c : _row_bytes(c, block)].view(np.float32)
    blocks = out.reshape(-1, block)
    np.multiply(blocks, scales[:, None].astype(out.dtype, copy=False), out=blocks)


def _piece(count: int, members: int, block: int) -> int:
    """Elements of each member's piece of a ``count``-element allreduce: whole blocks."""
    return -(-count // (members * block)) * block


def _row_bytes(chunk: int, block: int) -> int:
    """Bytes of a packed row of ``chunk`` elements: its int8 values, then its float32 scales."""
    return chunk + 4 * (chunk // block)


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
