"""Backend selection without a GPU: the pure decision (every missing piece named), device
binding, the GPU kernel table covering the op registry, and the errors a CPU-only machine
gives (never a fall-through to numpy)."""

from __future__ import annotations

import importlib.util

import pytest

from dtm_mpi.errors import BackendError, UsageError
from dtm_mpi.ir.registry import OPS
from dtm_mpi.kernels.backends import (
    BackendKind,
    DeviceProbe,
    backend_problem,
    choose_device,
    parse_backend,
    probe_devices,
)
from dtm_mpi.kernels.dispatch import COMM_OPS, backend_kernels

HAVE_CUPY = importlib.util.find_spec("cupy") is not None


def test_parse_backend() -> None:
    assert parse_backend("CUDA ") is BackendKind.CUDA
    assert parse_backend("hip") is BackendKind.HIP
    with pytest.raises(UsageError, match=r"unknown backend 'tpu'; choose one of numpy, cuda, hip"):
        parse_backend("tpu")


OK_CUDA = DeviceProbe(cupy_version="13.6.0", vendor="cuda", runtime_version=12080, devices=8)


@pytest.mark.parametrize(
    ("kind", "probe", "want"),
    [
        (BackendKind.NUMPY, DeviceProbe(cupy_error="ModuleNotFoundError: x"), None),
        (BackendKind.CUDA, OK_CUDA, None),
        (
            BackendKind.CUDA,
            DeviceProbe(cupy_error="ModuleNotFoundError: No module named 'cupy'"),
            r"backend 'cuda' needs CuPy, which cannot be imported \(ModuleNotFoundError: No module named 'cupy'\).*cupy-cuda12x",
        ),
        (
            BackendKind.HIP,
            DeviceProbe(cupy_error="ImportError: libamdhip64.so: cannot open shared object file"),
            r"backend 'hip' needs CuPy.*libamdhip64.*cupy-rocm",
        ),
        (
            BackendKind.HIP,
            OK_CUDA,
            r"backend 'hip' needs a CuPy built for ROCm/HIP; this CuPy 13.6.0 is built for CUDA \(use --backend cuda",
        ),
        (
            BackendKind.CUDA,
            DeviceProbe(cupy_version="13.6.0", vendor="hip", devices=2),
            r"needs a CuPy built for CUDA; .* built for ROCm/HIP \(use --backend hip",
        ),
        (
            BackendKind.CUDA,
            DeviceProbe(
                cupy_version="13.6.0",
                vendor="cuda",
                runtime_version=12080,
                device_error="CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected",
                visible="CUDA_VISIBLE_DEVICES=''",
            ),
            r"backend 'cuda': no usable CUDA device \(CUDARuntimeError: cudaErrorNoDevice.*; CUDA_VISIBLE_DEVICES=''\)",
        ),
        (
            BackendKind.CUDA,
            DeviceProbe(cupy_version="13.6.0", vendor="cuda", runtime_version=12080, devices=0),
            r"backend 'cuda': no CUDA device is visible to this process$",
        ),
    ],
)
def test_backend_problem_names_what_is_missing(
    kind: BackendKind, probe: DeviceProbe, want: str | None
) -> None:
    got = backend_problem(kind, probe)
    if want is None:
        assert got is None
    else:
        assert got is not None and __import__("re").search(want, got), got


def test_choose_device_by_node_local_rank() -> None:
    assert [choose_device(r, 8, 4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert choose_device(0, 1, 1) == 0
    with pytest.raises(BackendError, match="no GPU"):
        choose_device(0, 1, 0)
    with pytest.raises(BackendError, match=r"node-local rank 3 outside 0\.\.1"):
        choose_device(3, 2, 4)


def test_gpu_kernel_table_covers_every_op() -> None:
    """No op can reach the CPU unannounced: each one the executor does not run itself has a
    kernel in both GPU backends (importing them needs no GPU)."""
    for backend in ("cuda", "hip"):
        table = backend_kernels(backend)
        missing = sorted(o for o in OPS if o not in COMM_OPS and o not in table)
        assert missing == [], f"{backend} lacks kernels for {missing}"


@pytest.mark.skipif(HAVE_CUPY, reason="CuPy is installed: this checks the CPU-only machine")
def test_cpu_only_machine_refuses_gpu_backends_loudly() -> None:
    from dtm_mpi.kernels.devices import open_backend
    from dtm_mpi.runtime.executor import Executor

    probe = probe_devices()
    assert probe.cupy_version is None and "cupy" in probe.cupy_error
    for kind in (BackendKind.CUDA, BackendKind.HIP):
        with pytest.raises(BackendError, match=f"backend '{kind.value}' needs CuPy"):
            open_backend(kind)
    from pathlib import Path
    from types import SimpleNamespace

    from dtm_mpi.ir import parse_module, verify_module
    from dtm_mpi.plan.program import compile_plan, mesh_for

    path = Path(__file__).parents[2] / "examples" / "tp_mlp.dtm"
    module = parse_module(path.read_text(), str(path))
    verify_module(module)
    plan = compile_plan(module, mesh_for(module, 1, None))
    with pytest.raises(BackendError, match="backend 'cuda' needs CuPy"):
        Executor(plan, SimpleNamespace(rank=0), "cuda")  # type: ignore[arg-type]


def test_numpy_backend_moves_are_identity() -> None:
    import numpy as np

    from dtm_mpi.kernels.devices import numpy_backend

    b = numpy_backend()
    x = np.arange(6.0).reshape(2, 3)
    assert b.to_device(x) is x and b.to_host(x) is x
    assert b.zeros((2, 2), np.float32).dtype == np.float32 and b.name == "numpy"
