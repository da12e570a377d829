"""Public type helpers: how a DTM dtype is held in numpy arrays (spec §4.2). ``bf16`` is held
in float32 arrays whose values are bfloat16 numbers (every result rounded to nearest, ties to
even), so the top 16 bits of each float32 are the bfloat16's raw bits."""

from __future__ import annotations

import numpy as np

from dtm_mpi.ir.types import DType, TensorType

__all__ = ["as_dtype", "np_dtype", "round_bf16"]


def np_dtype(dtype: DType) -> np.dtype[np.generic]:
    if dtype is DType.BF16:
        return np.dtype(np.float32)  # reference semantics compute bf16 in float32
    return np.dtype(dtype.numpy_name)


def held_itemsize(dtype: DType) -> int:
    """Bytes per element as the runtime holds, sends and stores it: ``bf16`` is held in
    binary32 (spec Q12), so 4; else the dtype's own size. What memory and traffic figures
    count."""
    return _HELD[dtype]


def as_dtype(a: np.ndarray, t: TensorType) -> np.ndarray:
    """``a`` as values of ``t``'s dtype: bf16 values are float32 arrays holding numbers that
    bfloat16 represents (each result rounded to nearest, ties to even, spec §4.2)."""
    out = np.asarray(a).astype(np_dtype(t.dtype), copy=False)
    return round_bf16(out) if t.dtype is DType.BF16 else out


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still float32: the top
    16 bits of the result are the bfloat16's raw bits, the low 16 are zero. Infinities stay,
    NaN stays NaN (quiet), finite values beyond bfloat16's range become infinities."""
    f = np.array(x, dtype=np.float32, order="C")  # a copy
    bits = f.reshape(-1).view(np.uint32)  # 1-d: array arithmetic wraps without warnings
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)).view(np.float32)
    nan = np.isnan(rounded) | np.isnan(f.reshape(-1))
    if nan.any():
        rounded[nan] = np.float32(np.nan)
    return rounded.reshape(f.shape)


_HELD = {d: np_dtype(d).itemsize for d in DType}
