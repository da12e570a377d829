"""The GPU backends' kernel table run on the CPU: CuPy replaced by numpy (CuPy mirrors numpy's
API) and each RawKernel launcher either by a numpy twin of what its ``.cu`` source computes or
by the real launcher running the real kernels on the CPU emulator (``gpu_emu.py``). This
checks the glue a GPU run depends on — which launcher each op calls and with what, result
shapes and dtypes (0-d and empty blocks included), keepdims, the global count of ``mean``,
softmax along any dim, quantisation scales' shape, fused groups — against the numpy backend
on every example at several rank counts, without a GPU. The kernels themselves are checked
on a GPU by tests/kernels/test_cuda_kernels.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.errors import KernelError
from dtm_mpi.ir import load_module
from dtm_mpi.kernels import cuda_backend, launch
from dtm_mpi.kernels.backends import BackendKind
from dtm_mpi.kernels.devices import ArrayBackend
from dtm_mpi.kernels.fused import Expr, FusedInput
from dtm_mpi.runtime.simulate import run_simulated
from tests.kernels.gpu_emu import EmuCupy, install
from tests.kernels.kernel_helpers import evaluate

EXAMPLES = Path(__file__).parents[2] / "examples"


def _softmax(x: Any, *, log: bool = False, out: Any = None) -> Any:
    xf = x.astype(np.float32 if x.dtype == np.float16 else x.dtype)
    s = xf - xf.max(axis=-1, keepdims=True)
    y = (
        s - np.log(np.exp(s).sum(axis=-1, keepdims=True))
        if log
        else np.exp(s) / np.exp(s).sum(axis=-1, keepdims=True)
    )
    return y.astype(x.dtype)


def _layer_norm(x: Any, g: Any, b: Any, eps: float, *, out: Any = None) -> Any:
    xf = x.astype(np.float64)
    m = xf.mean(axis=-1, keepdims=True)
    v = ((xf - m) ** 2).mean(axis=-1, keepdims=True)
    return ((xf - m) / np.sqrt(v + eps) * g + b).astype(x.dtype)


def _row_reduce(op: str, x: Any, scale: float = 1.0, *, out: Any = None) -> Any:
    assert op in ("sum", "max", "min")
    if op == "sum":
        return (x.astype(np.float64).sum(axis=-1) * scale).astype(x.dtype)
    ident = -np.inf if op == "max" else np.inf
    return getattr(np, op)(x, axis=-1, initial=ident).astype(x.dtype)


def _quantize(x: Any, block: int, *, out: Any = None) -> tuple[Any, Any]:
    xb = x.astype(np.float64).reshape(-1, block)
    amax = np.abs(xb).max(axis=-1)
    s = np.where(amax > 0, amax / 127.0, 1.0)
    q = np.clip(np.rint(xb / s[:, None]), -127, 127).astype(np.int8).reshape(x.shape)
    return q, s.astype(np.float32)


def _dequantize(q: Any, scales: Any, block: int, dtype: Any, *, out: Any = None) -> Any:
    y = q.astype(np.float64).reshape(-1, block) * scales.astype(np.float64).reshape(-1)[:, None]
    return y.reshape(q.shape).astype(dtype)


def _fused(
    expr: Expr,
    inputs: Sequence[FusedInput],
    xs: Sequence[Any],
    dtype: Any,
    shape: Sequence[int],
    *,
    out: Any = None,
) -> Any:
    assert len(inputs) == len(xs)
    for i, x in zip(inputs, xs, strict=True):
        assert np.dtype(x.dtype) == i.dtype
        assert (x.shape == (shape[-1],)) if i.lastdim else (tuple(x.shape) == tuple(shape))
    acc = (
        np.float64
        if any(i.dtype == np.float64 for i in inputs) or np.dtype(dtype) == np.float64
        else np.float32
    )
    vals = [np.broadcast_to(x, shape).astype(acc) for x in xs]
    # (np.ascontiguousarray gives a 0-d value 1 dim: the launcher's output keeps the shape)
    return np.ascontiguousarray(evaluate(expr, vals, acc)).astype(dtype).reshape(tuple(shape))


def _take_rows(x: Any, idx: Any, lo: int, *, out: Any = None) -> Any:
    n = x.shape[1]
    inside = (idx >= lo) & (idx < lo + n)
    y = np.zeros((x.shape[0], idx.size, x.shape[2]), x.dtype)
    y[:, inside] = x[:, idx[inside] - lo]
    return y


def _scatter_rows(u: Any, perm: Any, starts: Any, n: int, *, out: Any = None) -> Any:
    assert starts.size == n + 1 and np.all(np.diff(starts) >= 0)
    y = np.zeros((u.shape[0], n, u.shape[2]), u.dtype)
    for r in range(n):
        for g in perm[starts[r] : starts[r + 1]]:
            y[:, r] += u[:, g]
    return y


def _adamw(p: Any, g: Any, m: Any, v: Any, bc1: Any, bc2: Any, attrs: Any) -> Any:
    from dtm_mpi.ir.ops.update import adamw_values

    return adamw_values(p, g, m, v, bc1, bc2, attrs)


TWINS = {
    "adamw": _adamw,
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "row_reduce": _row_reduce,
    "quantize": _quantize,
    "dequantize": _dequantize,
    "fused": _fused,
    "take_rows": _take_rows,
    "scatter_rows": _scatter_rows,
}


@pytest.fixture(params=["twins", "emu-cuda-w32", "emu-hip-w64"])
def on_host(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """CuPy -> numpy for the backend's array code, and every launcher either -> its numpy twin
    (``twins``) or the real launcher running the real kernel sources on the CPU emulator (the
    CUDA branch at warp size 32, ``emu-cuda-w32``; the HIP branch at 64, ``emu-hip-w64``);
    returns the launchers called."""
    impls = TWINS
    if request.param != "twins":
        install(monkeypatch, EmuCupy.named(request.param, strict=False))
        impls = {name: getattr(launch, name) for name in TWINS}
    return launchers_on_host(monkeypatch, impls)


def launchers_on_host(monkeypatch: pytest.MonkeyPatch, impls: dict[str, Any] = TWINS) -> list[str]:
    """CuPy -> numpy for the backend's array code and every launcher -> ``impls`` (default:
    its numpy twin), each call recorded; returns the launchers called."""
    called: list[str] = []

    def spy(name: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            called.append(name)
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(cuda_backend, "_cp", lambda: np)
    for name, fn in impls.items():
        monkeypatch.setattr(launch, name, spy(name, fn))
    return called


class HostCuda(ArrayBackend):
    """The cuda kernel table on host arrays, fusion on (run through the patched launcher)."""

    @property
    def fuses(self) -> bool:
        return True

    def run_fused(
        self,
        expr: Any,
        lastdim: Sequence[bool],
        xs: Sequence[Any],
        dtype: Any,
        shape: tuple[int, ...],
    ) -> Any:
        ins = [FusedInput(np.dtype(x.dtype), bool(b)) for x, b in zip(xs, lastdim, strict=True)]
        return launch.fused(expr, ins, xs, dtype, shape)


def _compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        g = got[k]
        assert g.shape == v.shape and g.dtype == v.dtype, (k, g.shape, v.shape, g.dtype, v.dtype)
        if v.dtype.kind == "f":  # f16: the GPU computes in float, numpy in f16
            tol = (2e-3, 1e-3) if v.dtype == np.float16 else (2e-5, 1e-6)
            np.testing.assert_allclose(g, v, rtol=tol[0], atol=tol[1], err_msg=k)
        else:
            assert np.array_equal(g, v), k


@pytest.mark.parametrize("name", ["tp_mlp", "dp_step", "attention", "collectives", "pipeline"])
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_examples_with_the_gpu_table_equal_numpy(on_host: list[str], name: str, ranks: int) -> None:
    module = load_module((EXAMPLES / f"{name}.dtm").read_text(), f"{name}.dtm")
    if name == "pipeline" and ranks == 1:
        pytest.skip("the pipeline needs at least 2 stages")
    want = run_simulated(module, ranks, steps=2).outputs()
    got = run_simulated(module, ranks, steps=2, backend=HostCuda(BackendKind.CUDA)).outputs()
    _compare(got, want)
    if name in ("tp_mlp", "attention"):
        assert "fused" in on_host  # elementwise ops went through generated kernels
    if name == "attention":
        assert "softmax" in on_host


OPS_MODULE = """dtm 1.0
module gpu_table

mesh @m = [x=3]

entry func @main(%a: f32[7,6]{x,-} init normal(seed=1, std=2.0),
                 %b: f32[6] init normal(seed=2, std=1.0),
                 %fi: f32[7,6]{x,-} init uniform(seed=3, low=-50.0, high=50.0),
                 %h: f16[5,8] init normal(seed=4, std=1.0),
                 %r: f32[7,6] init normal(seed=5, std=1.0)) -> (
    f32[7,6], f32[7,6]{x,-}, f32[7]{x}, f32[6] partial(sum: x),
    f32[7,1]{x,-}, f32[6] partial(max: x), i32[7,6]{x,-}, f32[7,6], f32[7,6],
    f16[5,8], f16[5,8], i8[5,8], f32[5,2], f16[5,8], f32[6,7]{-,x}, f32[] partial(sum: x)) on @m requires [CAP_QUANT] {
  %s0 = softmax %r dim 0 : f32[7,6]
  %s1 = log_softmax %a dim 1 : f32[7,6]{x,-}
  %m1 = mean %a dims [1] : f32[7]{x}
  %m0 = mean %a dims [0] : f32[6] partial(sum: x)
  %k = max %a dims [1] keepdims : f32[7,1]{x,-}
  %k0 = max %a dims [0] : f32[6] partial(max: x)
  %i = cast %fi : i32[7,6]{x,-}
  %ii = mul %i, %i : i32[7,6]{x,-}
  %bb = broadcast_to %b : f32[7,6]
  %g = add %r, %bb : f32[7,6]
  %gg = gelu %g : f32[7,6]
  %c = compare gt %r, %gg : bool[7,6]
  %w = where %c, %r, %gg : f32[7,6]
  %hs = softmax %h dim 1 : f16[5,8]
  %gamma = constant 1.5 : f16[8]
  %beta = constant 0.25 : f16[8]
  %ln = layer_norm %h, %gamma, %beta eps 0.00001 : f16[5,8]
  %q, %qs = quantize %h block 4 : i8[5,8], f32[5,2]
  %dq = dequantize %q, %qs block 4 : f16[5,8]
  %t = transpose %a perm [1, 0] : f32[6,7]{-,x}
  %z = sum %a dims [0, 1] : f32[] partial(sum: x)
  return %s0, %s1, %m1, %m0, %k, %k0, %ii, %gg, %w, %hs, %ln, %q, %qs, %dq, %t, %z
}
"""


@pytest.mark.parametrize("ranks", [1, 3])
def test_every_op_family_with_the_gpu_table(on_host: list[str], ranks: int) -> None:
    try:
        module = load_module(OPS_MODULE, "gpu_table.dtm")
    except Exception as exc:  # a typo in the module above is a test bug: show it
        pytest.fail(f"the test module does not verify: {exc}")
    want = run_simulated(module, ranks).outputs()
    got = run_simulated(module, ranks, backend=HostCuda(BackendKind.CUDA)).outputs()
    _compare(got, want)
    for launcher in ("softmax", "layer_norm", "row_reduce", "quantize", "dequantize", "fused"):
        assert launcher in on_host, launcher


INDEX_MODULE = """dtm 1.1
module gpu_index

mesh @m = [dp=2, tp=2]

entry func @main(%w: f32[11,6]{tp,-} init normal(seed=1, std=1.0),
                 %u: f32[4,3,6]{dp,-,-} init normal(seed=2, std=1.0),
                 %t: f64[2,11,5]{-,-,tp} init normal(seed=3, std=1.0)) -> (
    f32[4,3,6]{dp,-,-} partial(sum: tp), f32[11,6]{tp,-} partial(sum: dp), f64[2,4,3,5]{-,dp,-,tp}, i64[4,3]{dp,-}) on @m {
  %ids = constant [[0, 10, 3], [3, 3, 7], [10, 1, 2], [5, 5, 5]] : i64[4,3]{dp,-}
  %r = take %w, %ids dim 0 : f32[4,3,6]{dp,-,-} partial(sum: tp)
  %s = scatter_add %u, %ids dim 0 : f32[11,6]{tp,-} partial(sum: dp)
  %x = take %t, %ids dim 1 : f64[2,4,3,5]{-,dp,-,tp}
  %tab = constant [[9, 8], [7, 6], [5, 4], [3, 2], [1, 0], [2, 2], [4, 4], [6, 6], [8, 8], [1, 1], [0, 0]] : i64[11,2]
  %it = take %tab, %ids dim 0 : i64[4,3,2]{dp,-,-}
  %i = sum %it dims [2] : i64[4,3]{dp,-}
  return %r, %s, %x, %i
}
"""


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_take_and_scatter_add_with_the_gpu_table(on_host: list[str], ranks: int) -> None:
    module = load_module(INDEX_MODULE, "gpu_index.dtm")
    binding = {1: {"dp": 1, "tp": 1}, 3: {"dp": 1, "tp": 3}, 4: {"dp": 2, "tp": 2}}[ranks]
    want = run_simulated(module, ranks, binding=binding).results
    got = run_simulated(module, ranks, binding=binding, backend=HostCuda(BackendKind.CUDA)).results
    for g, w in zip(got, want, strict=True):  # each step
        _compare(
            {str(i): np.asarray(a) for i, a in enumerate(g)}, {str(i): a for i, a in enumerate(w)}
        )
    assert "take_rows" in on_host and "scatter_rows" in on_host


def test_a_host_array_reaching_a_launcher_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real CuPy refuses numpy arrays with a bare TypeError; the launchers name the input."""
    cp = install(monkeypatch, EmuCupy(32))  # strict: numpy arrays are host arrays
    host = np.ones((2, 8), np.float32)
    dev = cp.asarray(host)
    with pytest.raises(KernelError, match=r"^softmax: got a host \(numpy\) array"):
        launch.softmax(host)
    with pytest.raises(KernelError, match=r"^layer_norm gamma: got a host \(numpy\) array"):
        launch.layer_norm(dev, host[0], cp.asarray(host[0]), 1e-5)
    expr = Expr("add", (0, 1))
    ins = [FusedInput(np.dtype(np.float32)), FusedInput(np.dtype(np.float32), lastdim=True)]
    with pytest.raises(KernelError, match=r"^fused kernel input 1: got a host \(numpy\) array"):
        launch.fused(expr, ins, [dev, host[0]], np.float32, (2, 8))
    got = launch.fused(expr, ins, [dev, cp.asarray(host[0])], np.float32, (2, 8))
    assert np.array_equal(got.get(), host + host[0])


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_adamw_update_with_the_gpu_table(on_host: list[str], ranks: int) -> None:
    """The optimizer update (IR 1.3 golden vector) through the GPU kernel table: its CuPy array
    operations (numpy here) against the numpy backend's chunks (the bias corrections come from
    generated kernels, whose exp may differ from numpy's in the last bit)."""
    path = Path(__file__).parents[2] / "io" / "vectors" / "ir" / "valid" / "update.dtm"
    module = load_module(path.read_text(), "update.dtm")
    binding = {"dp": ranks}
    g = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    want = run_simulated(module, ranks, binding=binding, inputs={"g": g}, steps=3).params
    got = run_simulated(
        module, ranks, binding=binding, inputs={"g": g}, steps=3, backend=HostCuda(BackendKind.CUDA)
    ).params
    _compare(got, want)
    assert "fused" in on_host  # the scalar chain went through generated kernels
    assert "adamw" in on_host  # the update through its launcher (kernels/adamw.cu)
