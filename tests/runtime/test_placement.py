"""``dtm explain --backend cuda``: where each op runs on a GPU backend, decided without a GPU
and consistent with the kernel table (fused groups, RawKernels, cuBLAS, CuPy, uploads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from dtm_mpi.ir import load_module
from dtm_mpi.kernels.cuda_backend import placement
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.placement import placement_text

EXAMPLES = Path(__file__).parents[2] / "examples"
F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


def plan(name: str, ranks: int = 4):  # type: ignore[no-untyped-def]
    module = load_module((EXAMPLES / f"{name}.dtm").read_text(), f"{name}.dtm")
    return compile_plan(module, mesh_for(module, ranks, None))


def test_placement_rules() -> None:
    assert placement("gelu", [F32], {}, 2) == "generated kernel"
    assert placement("add", [I32, I32], {}, 2) == "CuPy"
    assert placement("softmax", [F32], {"dim": -1}, 3) == "RawKernel softmax.cu"
    assert (
        placement("softmax", [F32], {"dim": 0}, 3) == "RawKernel softmax.cu (moved to the last dim)"
    )
    assert placement("sum", [F32], {"dims": (1,)}, 2) == "RawKernel row_reduce.cu"
    assert placement("sum", [F32], {"dims": (0, 1)}, 2) == "CuPy"
    assert placement("max", [I32], {"dims": (-1,)}, 2) == "CuPy"
    assert placement("matmul", [F32, F32], {}, 2) == "cuBLAS/hipBLAS"
    assert placement("constant", [], {}, 0) == "host, uploaded once"
    assert placement("random", [], {}, 0) == "host, uploaded each step"
    assert placement("sigmoid", [F32], {}, 2) == "generated kernel"
    assert placement("abs", [I32], {}, 2) == "CuPy"
    assert placement("quantize", [F32], {"block": 16}, 2) == "RawKernel quant.cu"


def test_placement_is_what_each_kernel_registered() -> None:
    """``placement`` reads the rule registered with each GPU kernel (it mirrors no dispatch):
    every kernel of both GPU backends has one, and the two backends agree."""
    from dtm_mpi.kernels.dispatch import backend_kernels, placement_of

    for name in backend_kernels("cuda"):
        where = placement_of("cuda", name, [F32], {"dims": (1,), "dim": -1}, 2)
        assert where is not None, name
        assert where == placement_of("hip", name, [F32], {"dims": (1,), "dim": -1}, 2), name
        assert where == placement(name, [F32], {"dims": (1,), "dim": -1}, 2)


def test_tp_mlp_placement() -> None:
    text = placement_text(plan("tp_mlp"), "cuda")
    assert text.startswith("backend cuda: where each op runs")
    assert "generated kernel (fused 12 ops -> %gh)" in text
    assert "cuBLAS/hipBLAS: matmul x3" in text and "host, uploaded once: constant x8" in text
    assert "@forward:" in text and "generated kernel: gelu" in text


def test_attention_uses_the_softmax_kernel() -> None:
    assert "RawKernel softmax.cu" in placement_text(plan("attention"), "hip")


def test_cli_explain_with_a_gpu_backend_needs_no_gpu() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtm_mpi",
            "explain",
            str(EXAMPLES / "tp_mlp.dtm"),
            "-n",
            "4",
            "--backend",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "backend cuda: where each op runs" in proc.stdout and "peak memory" in proc.stdout
