"""Kernels: what one rank computes for one op on its local blocks, per backend.

A kernel receives the op, its operands' local arrays and a :class:`KernelContext` (the global
and local result types, where the rank's result blocks start, the step), and returns the
result's local arrays. Every backend registers its kernels here with :func:`register_kernel`;
the op registry (``dtm_mpi.ir.registry``) holds each op's global numpy semantics, and a
backend's kernel must agree with it on every block (tests/kernels check this op by op).

Ops that move data between ranks (collectives, send/recv, redistribute) and ``call`` have no
kernel: the executor runs them through the communication interface (:data:`COMM_OPS`: the ops
whose registry kind is not ``LOCAL``).

A kernel may come with a placement rule (``dtm explain --backend``: where it runs, decided
without running it); :func:`placement_of` reads what each kernel registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtm_mpi.errors import KernelError
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.registry import OpKind, all_ops
from dtm_mpi.ir.types import TensorType

__all__ = [
    "COMM_OPS",
    "PreparedKernel",
    "Kernel",
    "KernelContext",
    "Placement",
    "backend_kernels",
    "prepare_kernel",
    "has_kernel",
    "kernel_for",
    "placement_of",
    "register_preparer",
    "register_kernel",
]

COMM_OPS = frozenset(n for n, d in all_ops().items() if d.kind is not OpKind.LOCAL)
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
    operand_offsets: tuple[tuple[int, ...], ...] = ()  # where each operand's block starts

    @property
    def local_types(self) -> tuple[TensorType, ...]:
        """The result types with the local shapes (what reference functions are given)."""
        return tuple(
            TensorType(t.dtype, s, t.layout)
            for t, s in zip(self.result_types, self.local_shapes, strict=True)
        )


Kernel = Callable[[KernelContext, Sequence[np.ndarray]], tuple[np.ndarray, ...]]

PreparedKernel = Callable[[Sequence[np.ndarray]], tuple[np.ndarray, ...]]
"""A kernel prepared for its context once (the executor's per-op call on every step): operands'
local arrays in, results out. The executor calls it with floating-point errors ignored (IEEE
results are the ops' semantics)."""

Preparer = Callable[[Kernel, KernelContext], PreparedKernel | None]

Placement = Callable[[str, Sequence[np.dtype[Any]], dict[str, Any], int], str]
"""Where a kernel runs: ``rule(op, operand dtypes, attributes, operand rank)`` -> a short text
(``RawKernel softmax.cu``, ``generated kernel``, ``CuPy``, ...). Pure: no device needed."""

_KERNELS: dict[str, dict[str, Kernel]] = {}
_PLACEMENTS: dict[str, dict[str, Placement]] = {}
_PREPARERS: dict[str, Preparer] = {}


def register_preparer(backend: str) -> Callable[[Preparer], Preparer]:
    """Decorator registering ``backend``'s preparer: given a kernel and its context, a faster
    call computing the same results (or None: the kernel is called with its context)."""

    def deco(fn: Preparer) -> Preparer:
        assert backend not in _PREPARERS, f"{backend} preparer registered twice"
        _PREPARERS[backend] = fn
        return fn

    return deco


def prepare_kernel(backend: str, kernel: Kernel, ctx: KernelContext) -> PreparedKernel | None:
    """A faster call of ``kernel`` with ``ctx`` from the backend's preparer, or None where it
    has none (the kernel is then called with ``ctx``). The context's step is fixed: bind
    only ops without the ``NEEDS_STEP`` trait."""
    preparer = _PREPARERS.get(backend)
    return preparer(kernel, ctx) if preparer is not None else None


def register_kernel(
    backend: str, *ops: str, placement: Placement | str | None = None
) -> Callable[[Kernel], Kernel]:
    """Decorator registering ``fn`` as ``backend``'s kernel for each of ``ops``, with its
    placement rule (a fixed text, or a :data:`Placement` function) if given."""
    rule = _fixed(placement) if isinstance(placement, str) else placement

    def deco(fn: Kernel) -> Kernel:
        table = _KERNELS.setdefault(backend, {})
        for name in ops:
            assert name not in table, f"{backend} kernel for {name!r} registered twice"
            assert name not in COMM_OPS, f"{name!r} is run by the executor, not a kernel"
            table[name] = fn
            if rule is not None:
                _PLACEMENTS.setdefault(backend, {})[name] = rule
        return fn

    return deco


def _fixed(text: str) -> Placement:
    def rule(op: str, dtypes: Sequence[np.dtype[Any]], attrs: dict[str, Any], rank: int) -> str:
        return text

    return rule


def placement_of(
    backend: str, op: str, dtypes: Sequence[np.dtype[Any]], attrs: dict[str, Any], rank: int
) -> str | None:
    """Where ``backend``'s kernel for ``op`` runs (its registered rule), None without one."""
    rule = _PLACEMENTS.get(backend, {}).get(op)
    return None if rule is None else rule(op, dtypes, attrs, rank)


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
