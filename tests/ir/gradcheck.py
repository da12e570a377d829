"""Central finite differences for the gradient checks (one definition for every test)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def central_difference(
    loss: Callable[[Any], float],
    args: Sequence[np.ndarray] | Mapping[str, np.ndarray],
    key: int | str,
    index: tuple[int, ...],
    eps: float = 1e-6,
) -> float:
    """``(loss(args with args[key][index] + eps) - loss(... - eps)) / 2 eps``; ``args`` (a
    tuple or a dict of arrays, as ``loss`` takes them) is left as it was."""

    def shifted(delta: float) -> Any:
        moved = args[key].copy()  # type: ignore[index]
        moved[index] += delta
        if isinstance(args, Mapping):
            return {**args, key: moved}
        return tuple(moved if i == key else a for i, a in enumerate(args))

    return (loss(shifted(eps)) - loss(shifted(-eps))) / (2 * eps)


def numeric_gradient(
    loss: Callable[[Any], float],
    args: Sequence[np.ndarray] | Mapping[str, np.ndarray],
    key: int | str,
    eps: float = 1e-6,
) -> np.ndarray:
    """The central differences of ``loss`` for every element of ``args[key]``."""
    value: np.ndarray = args[key]  # type: ignore[index]
    out = np.zeros_like(value)
    for i in np.ndindex(value.shape):
        out[i] = central_difference(loss, args, key, i, eps)
    return out
