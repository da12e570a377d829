"""Kernels: what one rank computes for one op on its local blocks, per backend.

A kernel receives the op, its operands' local arrays and a :class:`KernelContext` (the global
and local result types, where the rank's result blocks start, the step), and returns the
result's local arrays. Every backend registers its kernels here with :func:`register_kernel`;
the op registry (``dtm_mpi.ir.registry``) holds each op's global numpy semantics, and a
backend's kernel must agree with it on every block (tests/kernels check this op by op).

Ops that move data between ranks (collectives, send/recv, redistribute) and ``call`` have no
kernel: the executor runs them through the communication interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dtm_mpi.errors import KernelError
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.types import TensorType

__all__ = [
    "COMM_OPS",
    "Kernel",
    "KernelContext",
    "backend_kernels",
    "has_kernel",
    "kernel_for",
    "register_kernel",
]

COMM_OPS = frozenset(
    {"allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv",
     "redistribute", "call"}
)  # fmt: skip
"""Ops the executor runs itself (communication and calls), never through a kernel."""


@dataclass(frozen=True, slots=True)
class KernelContext:
    """What a kernel knows beyond its operands' local arrays."""

    op: Op
    operand_types: tuple[TensorType, ...]  # global types of the operands
    result_types: tuple[TensorType, ...]  # global (declared) types of the results
    local_shapes: tuple[tuple[int, ...], ...]  # the shape of each result's local block
    offsets: tuple[tuple[int, ...], ...]  # the global index where each result block starts
    step: int = 0

    @property
    def local_types(self) -> tuple[TensorType, ...]:
        """The result types with the local shapes (what reference functions are given)."""
        return tuple(
            TensorType(t.dtype, s, t.layout)
            for t, s in zip(self.result_types, self.local_shapes, strict=True)
        )


Kernel = Callable[[KernelContext, Sequence[np.ndarray]], tuple[np.ndarray, ...]]

_KERNELS: dict[str, dict[str, Kernel]] = {}


def register_kernel(backend: str, *ops: str) -> Callable[[Kernel], Kernel]:
    """Decorator registering ``fn`` as ``backend``'s kernel for each of ``ops``."""

    def deco(fn: Kernel) -> Kernel:
        table = _KERNELS.setdefault(backend, {})
        for name in ops:
            assert name not in table, f"{backend} kernel for {name!r} registered twice"
            assert name not in COMM_OPS, f"{name!r} is run by the executor, not a kernel"
            table[name] = fn
        return fn

    return deco


def has_kernel(backend: str, op: str) -> bool:
    """Whether ``backend`` has registered a kernel for ``op`` (loads nothing)."""
    return op in _KERNELS.get(backend, {})


def backend_kernels(backend: str) -> dict[str, Kernel]:
    """Every kernel of ``backend`` (loading the backend's module on first use)."""
    if backend == "numpy":
        from dtm_mpi.kernels import numpy_backend  # noqa: F401  (registers the kernels)
    elif backend in ("cuda", "hip"):
        from dtm_mpi.kernels import cuda_backend  # noqa: F401  (registers; needs no GPU)
    if backend not in _KERNELS:
        raise KernelError(f"no kernels registered for backend {backend!r}")
    return _KERNELS[backend]


def kernel_for(backend: str, op: str) -> Kernel:
    """``backend``'s kernel for ``op``; :class:`KernelError` naming both if there is none."""
    table = backend_kernels(backend)
    try:
        return table[op]
    except KeyError:
        raise KernelError(f"backend {backend!r} has no kernel for op {op!r}") from None
