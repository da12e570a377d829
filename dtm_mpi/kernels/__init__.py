"""Kernels per backend: ``numpy`` (CPU, the reference); the GPU backends come with issue #7.

Sources of GPU kernels live in the checkout's top-level ``kernels/`` directory (``.cu``).
"""

from dtm_mpi.kernels.registry import (
    COMM_OPS,
    Kernel,
    KernelContext,
    backend_kernels,
    has_kernel,
    kernel_for,
    register_kernel,
)

__all__ = [
    "COMM_OPS",
    "Kernel",
    "KernelContext",
    "backend_kernels",
    "has_kernel",
    "kernel_for",
    "register_kernel",
]
