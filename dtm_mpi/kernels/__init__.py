"""Kernels per backend: ``numpy`` (CPU, the reference) and ``cuda``/``hip`` (CuPy: RawKernels
compiled from the checkout's top-level ``kernels/*.cu``, cuBLAS/hipBLAS for matmul).

Backend selection (:mod:`dtm_mpi.kernels.backends`) and device binding
(:mod:`dtm_mpi.kernels.devices`) fail loudly: a GPU backend without CuPy, runtime or device is
an error, never a CPU fall-through.
"""

from dtm_mpi.kernels.dispatch import (
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
