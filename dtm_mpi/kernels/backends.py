"""Backend selection: ``numpy`` (CPU), ``cuda`` or ``hip`` (CuPy on NVIDIA or AMD GPUs).

Selection is explicit and never falls through: asking for ``cuda`` where CuPy, the CUDA
runtime or a device is missing is a :class:`~dtm_mpi.errors.BackendError` naming what is
missing (and a CuPy built for ROCm does not serve ``cuda``, nor one built for CUDA ``hip``).
The decision is split so that it can be tested without a GPU:

* :func:`probe_devices` looks at this process (imports CuPy, asks its runtime) and returns a
  :class:`DeviceProbe` — the only function here that touches a device;
* :func:`backend_problem` (pure) says why a backend cannot run given a probe, or None;
* :func:`choose_device` (pure) binds a rank to a GPU from its node-local rank.

Under MPI the caller agrees on the outcome, so a rank without a GPU ends every rank with the
same error (``dtm run`` does this in its ``backend`` phase).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

from dtm_mpi.errors import BackendError, UsageError

__all__ = [
    "BACKEND_NAMES",
    "BackendKind",
    "DeviceProbe",
    "backend_problem",
    "choose_device",
    "parse_backend",
    "probe_devices",
]


class BackendKind(enum.Enum):
    NUMPY = "numpy"
    CUDA = "cuda"
    HIP = "hip"

    @property
    def is_gpu(self) -> bool:
        return self is not BackendKind.NUMPY

    @property
    def vendor(self) -> str:
        return {"numpy": "CPU", "cuda": "CUDA", "hip": "ROCm/HIP"}[self.value]


BACKEND_NAMES = tuple(k.value for k in BackendKind)
"""Every backend's name, for ``--backend`` choices (the one list: :class:`BackendKind`)."""


def parse_backend(text: str) -> BackendKind:
    """``numpy``, ``cuda`` or ``hip``; :class:`UsageError` otherwise."""
    try:
        return BackendKind(text.strip().lower())
    except ValueError:
        choices = ", ".join(k.value for k in BackendKind)
        raise UsageError(f"unknown backend {text!r}; choose one of {choices}") from None


@dataclass(frozen=True, slots=True)
class DeviceProbe:
    """What this process found: CuPy (version, or why it did not import), which vendor its
    build targets, the runtime version and the visible devices (or why they are unknown)."""

    cupy_version: str | None = None
    cupy_error: str = ""
    vendor: str | None = None  # "cuda" | "hip": what CuPy was built for
    runtime_version: int | None = None
    devices: int = 0
    device_error: str = ""
    visible: str | None = None  # CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES


def _visible_devices_env() -> str | None:
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        if name in os.environ:
            return f"{name}={os.environ[name]!r}"
    return None


def probe_devices() -> DeviceProbe:
    """Look for CuPy and GPUs in this process (never raises: failures are recorded)."""
    visible = _visible_devices_env()
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy whose shared libraries fail to load
        return DeviceProbe(cupy_error=f"{type(exc).__name__}: {exc}", visible=visible)
    runtime: Any = cupy.cuda.runtime
    vendor = "hip" if bool(getattr(runtime, "is_hip", False)) else "cuda"
    version: int | None = None
    try:
        version = int(runtime.runtimeGetVersion())
    except Exception as exc:
        return DeviceProbe(
            cupy_version=str(cupy.__version__),
            vendor=vendor,
            device_error=f"the {vendor.upper()} runtime is unusable: {type(exc).__name__}: {exc}",
            visible=visible,
        )
    try:
        count = int(runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device, or a driver too old for the runtime
        return DeviceProbe(
            cupy_version=str(cupy.__version__),
            vendor=vendor,
            runtime_version=version,
            device_error=f"{type(exc).__name__}: {exc}",
            visible=visible,
        )
    return DeviceProbe(
        cupy_version=str(cupy.__version__),
        vendor=vendor,
        runtime_version=version,
        devices=count,
        visible=visible,
    )


def backend_problem(kind: BackendKind, probe: DeviceProbe) -> str | None:
    """Why ``kind`` cannot run in a process that found ``probe`` (a message naming what is
    missing), or None when it can (pure)."""
    if not kind.is_gpu:
        return None
    want = f"backend {kind.value!r}"
    if probe.cupy_version is None:
        extra = "cupy-cuda12x or cupy-cuda13x" if kind is BackendKind.CUDA else "cupy-rocm-6-0"
        return (
            f"{want} needs CuPy, which cannot be imported ({probe.cupy_error or 'not installed'});"
            f" install the 'gpu' extra with the CuPy build for your {kind.vendor} version"
            f" ({extra})"
        )
    if probe.vendor != kind.value:
        other = BackendKind(probe.vendor or "cuda")
        return (
            f"{want} needs a CuPy built for {kind.vendor}; this CuPy {probe.cupy_version} is "
            f"built for {other.vendor} (use --backend {other.value}, or install the other build)"
        )
    where = f"; {probe.visible}" if probe.visible else ""
    if probe.device_error:
        return f"{want}: no usable {kind.vendor} device ({probe.device_error}{where})"
    if probe.devices < 1:
        return f"{want}: no {kind.vendor} device is visible to this process{where}"
    return None


def choose_device(local_rank: int, local_size: int, devices: int) -> int:
    """The device a rank binds: its node-local rank, wrapping when ranks outnumber devices
    (pure). :class:`BackendError` when there is no device."""
    if devices < 1:
        raise BackendError("no GPU to bind")
    if local_rank < 0 or local_rank >= max(local_size, 1):
        raise BackendError(f"node-local rank {local_rank} outside 0..{local_size - 1}")
    return local_rank % devices
