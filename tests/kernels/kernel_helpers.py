"""Test helpers: a numpy evaluation of the generated kernels' expressions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dtm_mpi.ir.ops.elementwise import _BINARY, _UNARY
from dtm_mpi.kernels.fused import Expr


def evaluate(expr: Expr | int, values: Sequence[np.ndarray], dtype: Any) -> np.ndarray:
    """``expr`` over ``values`` (same shapes) with the registry's own numpy functions, each
    op's result in ``dtype`` (the arrays' dtype: equal to the op-by-op run bit for bit; the
    float compute type: what a generated kernel computes)."""
    if isinstance(expr, int):
        return values[expr]
    args = [evaluate(a, values, dtype) for a in expr.args]
    with np.errstate(all="ignore"):
        fn = _UNARY[expr.op][0] if len(args) == 1 else _BINARY[expr.op]
        return np.asarray(fn(*args)).astype(dtype, copy=False)
