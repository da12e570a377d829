"""The array backend a run computes on: where its arrays live and how they move.

:class:`ArrayBackend` is what the executor and ``dtm run`` hold: the kernel table of the
backend, and the moves between host (numpy) and the backend's arrays. For ``numpy`` the moves
are the identity. For ``cuda``/``hip``, :func:`open_backend` checks the process
(:mod:`dtm_mpi.kernels.backends`), binds the rank's GPU and returns a backend whose arrays are
CuPy arrays on that device; :class:`CupyDeviceOps` is what the communication layer uses to
synchronise, stage and copy device buffers (``dtm_mpi.comm.device.DeviceOps``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from dtm_mpi.errors import BackendError
from dtm_mpi.kernels.backends import BackendKind, backend_problem, choose_device, probe_devices
from dtm_mpi.kernels.dispatch import Kernel, backend_kernels

__all__ = ["DeviceArray", "ArrayBackend", "CupyDeviceOps", "numpy_backend", "open_backend"]


class CupyDeviceOps:
    """Device buffers through CuPy on the current device (``DeviceOps`` of the comm layer).

    Every copy is synchronous on the current stream; :meth:`synchronize` waits for all work
    queued on it — called before a device buffer is handed to MPI, so MPI never reads memory
    a kernel is still writing."""

    def __init__(self, name: str) -> None:
        import cupy

        self.cp: Any = cupy
        self.name = name

    def is_device(self, x: object) -> bool:
        return isinstance(x, self.cp.ndarray)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.cp.empty(shape, dtype=dtype)

    def to_host(self, x: Any, out: np.ndarray) -> np.ndarray:
        if not x.flags.c_contiguous:  # (ascontiguousarray would turn a 0-d array into 1-d)
            x = self.cp.ascontiguousarray(x)
        if not out.flags.c_contiguous:
            raise ValueError("to_host: out must be C-contiguous")
        view = out.reshape(-1).view(np.uint8)[: x.nbytes].view(x.dtype).reshape(x.shape)
        x.get(out=view)  # synchronous on the current stream
        result: np.ndarray = view
        return result

    def to_device(self, host: np.ndarray, out: Any | None = None) -> Any:
        host = np.require(host, requirements="C")  # keeps 0-d arrays 0-d
        if out is None:
            out = self.cp.empty(host.shape, dtype=host.dtype)
        out.set(host.reshape(-1).view(np.uint8)[: out.nbytes].view(out.dtype).reshape(out.shape))
        self.synchronize()
        return out

    def pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(max(1, nbytes))
        return np.frombuffer(mem, dtype=np.uint8, count=max(1, nbytes))  # holds mem alive


DeviceArray: TypeAlias = Any
"""An array on a backend's device: a numpy array (the CPU backend) or a CuPy array (CuPy ships
no type information)."""


@dataclass(slots=True)
class ArrayBackend:
    """A run's backend: its kernels and where its arrays live."""

    kind: BackendKind
    device: int | None = None
    ops: Any = None  # CupyDeviceOps for GPU backends, None for numpy
    description: str = "numpy (CPU)"
    _kernels: dict[str, Kernel] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def kernels(self) -> dict[str, Kernel]:
        if self._kernels is None:
            self._kernels = backend_kernels(self.name)
        return self._kernels

    def to_device(self, x: np.ndarray) -> Any:
        """A host array moved to the backend (the array itself for numpy)."""
        return x if self.ops is None else self.ops.to_device(np.asarray(x))

    def to_host(self, x: Any) -> np.ndarray:
        """A backend array as a host numpy array (the array itself for numpy)."""
        if self.ops is None or isinstance(x, np.ndarray):
            return np.asarray(x)
        return np.asarray(x.get())

    @property
    def fuses(self) -> bool:
        """Whether this backend runs planned elementwise groups as one kernel (GPU backends;
        numpy, the reference, runs op by op). ``DTM_FUSE=0`` (or ``false``, ``no``, ``off``)
        turns fusion off (:mod:`dtm_mpi.config`)."""
        from dtm_mpi.config import get_config

        return self.ops is not None and get_config().fuse

    def run_fused(
        self,
        expr: Any,
        lastdim: Sequence[bool],
        xs: Sequence[Any],
        dtype: Any,
        shape: tuple[int, ...],
    ) -> Any:
        """One generated kernel computing ``expr`` over ``xs`` (inputs flagged ``lastdim`` are
        vectors broadcast along the last dim)."""
        from dtm_mpi.kernels import launch
        from dtm_mpi.kernels.fused import FusedInput

        ins = [FusedInput(np.dtype(x.dtype), bool(b)) for x, b in zip(xs, lastdim, strict=True)]
        return launch.fused(expr, ins, xs, dtype, shape)

    def full(self, shape: Any, value: Any, dtype: Any) -> Any:
        """A new backend array of ``shape`` filled with ``value``."""
        if self.ops is None:
            return np.full(shape, value, dtype=dtype)
        return self.ops.cp.full(shape, value, dtype=dtype)

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.full(shape, 0, dtype)


_BLAS_LIMITS: list[Any] = []  # the limit set (threadpoolctl keeps it while referenced)


def limit_blas_threads(threads: int) -> None:
    """Limit the BLAS libraries loaded in this process (OpenBLAS, MKL, BLIS: the one numpy
    uses) to ``threads`` threads each, for the rest of the process."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    _BLAS_LIMITS[:] = [threadpool_limits(limits=threads, user_api="blas")]


def limit_blas_to_share(local_size: int) -> None:
    """Limit this process's BLAS to its share of the node's CPUs, ``local_size`` processes
    sharing the node (:func:`~dtm_mpi.config.blas_threads_share`; nothing where the user set a
    thread count or the process is alone)."""
    from dtm_mpi.config import blas_threads_share

    share = blas_threads_share(local_size)
    if share is not None:
        limit_blas_threads(share)


def numpy_backend() -> ArrayBackend:
    return ArrayBackend(BackendKind.NUMPY)


def open_backend(kind: BackendKind, local_rank: int = 0, local_size: int = 1) -> ArrayBackend:
    """The backend ``kind`` with this rank's GPU bound (node-local rank modulo the visible
    devices), or on the CPU with the BLAS limited to this rank's share of the node's CPUs
    (``local_size`` ranks on the node; :func:`~dtm_mpi.config.blas_threads_share`).
    :class:`BackendError` naming what is missing when it cannot run: never a CPU
    fall-through."""
    if not kind.is_gpu:
        limit_blas_to_share(local_size)
        return numpy_backend()
    probe = probe_devices()
    problem = backend_problem(kind, probe)
    if problem is not None:
        raise BackendError(problem)
    device = choose_device(local_rank, local_size, probe.devices)
    ops = CupyDeviceOps(kind.value)
    try:
        ops.cp.cuda.Device(device).use()
        props = ops.cp.cuda.runtime.getDeviceProperties(device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as exc:
        raise BackendError(f"backend {kind.value!r}: cannot bind device {device}: {exc}") from None
    from dtm_mpi.kernels import cuda_backend  # noqa: F401  (registers the GPU kernels)

    return ArrayBackend(
        kind, device, ops, f"{kind.value} (device {device}: {name}, CuPy {probe.cupy_version})"
    )
