"""``dtm bench kernels`` end to end without a GPU: the benchmark's cases, timing loop, table and
CSV run with CuPy replaced by the kernel emulator (tests/kernels/gpu_emu.py: the real launchers
and kernel sources; host-clock events). The figures mean nothing here; what is checked is that
every case runs, computes what its composed CuPy twin computes (compared flat: the twins of
the block-wise cases keep a [blocks, 32] shape), and is reported."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dtm_mpi.bench import kernels as bench
from dtm_mpi.errors import BackendError
from dtm_mpi.kernels import devices
from tests.kernels.gpu_emu import EmuCupy, install

CASES = [
    "softmax",
    "log_softmax",
    "layer_norm",
    "row_sum",
    "row_max",
    "bias_gelu",
    "fused gelu(x+b)*z",
    "quantize b32",
    "dequantize b32",
]


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> EmuCupy:
    cp = install(monkeypatch, EmuCupy(32, strict=False))  # cp.random gives numpy arrays
    dev = SimpleNamespace(ops=SimpleNamespace(cp=cp), description="CPU emulator (warp 32)")
    monkeypatch.setattr(devices, "open_backend", lambda kind: dev)
    return cp


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_case_computes_what_its_composed_twin_does(emu: EmuCupy, dtype: Any) -> None:
    cases = bench._cases(emu, 6, 96, dtype)
    assert [c[0] for c in cases] == CASES
    for name, nbytes, kernel, composed in cases:
        assert nbytes > 0, name
        got, want = kernel(), composed()
        if name.startswith("quantize"):
            assert np.array_equal(np.asarray(got[0]).reshape(-1), want[0].reshape(-1)), name
            assert np.array_equal(np.asarray(got[1]).reshape(-1), want[1]), name
            continue
        tol = 2e-2 if dtype == np.float16 else 1e-4
        np.testing.assert_allclose(
            np.asarray(got, np.float64).reshape(-1),
            np.asarray(want, np.float64).reshape(-1),
            rtol=tol,
            atol=tol,
            err_msg=name,
        )


def test_table_and_csv(emu: EmuCupy, tmp_path: Path) -> None:
    out = tmp_path / "kernels.csv"
    table = bench.run_kernel_bench(
        "cuda", rows=4, cols=64, dtypes=("f32", "f16"), repeat=1, csv_path=str(out)
    )
    lines = table.splitlines()
    assert lines[0].startswith("dtm bench kernels: CPU emulator (warp 32); [4, 64] per case")
    assert len(lines) == 2 + 2 * len(CASES)
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["metric", "value", "baseline", "ratio"]
    assert len(rows) == 1 + 4 * len(CASES)
    for metric, value, baseline, ratio in rows[1:]:
        assert metric.endswith(("GBps", "s_vs_cupy")), metric
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in (value, baseline, ratio)), (
            metric
        )
    assert {r[0] for r in rows[1:]} >= {"softmax f32 GBps", "layer_norm f16 GBps"}


def test_without_a_gpu_it_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match=r"backend 'cuda' needs CuPy"):
        bench.run_kernel_bench("cuda", rows=4, cols=64)
