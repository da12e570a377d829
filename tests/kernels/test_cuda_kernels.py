"""Every RawKernel against a float64 numpy reference, run three ways: on a GPU (parameter
``gpu``, marker ``gpu``; skipped with the reason where no device exists), and on the CPU
emulator (``tests/kernels/gpu_emu.py``: the same kernel sources and the same launcher code,
threads as fibers with strict barriers) with the CUDA branch at warp size 32 (``emu-cuda-w32``,
as NVIDIA GPUs) and the HIP branch at 64 (``emu-hip-w64-reverse``, as CDNA AMD GPUs, blocks and threads
run in descending order), which also checks
argument types against each kernel's C signature and writes outside the arrays. Inputs are
random and never all zero; outputs are poisoned (NaN, or 99 for int8) before the launch, so a
kernel that skips an element fails;
sizes include ones that are not multiples of the block size (1, 31, 257 columns...).

Tolerances (kernels/README.md): f64 rtol 1e-12; f32 rtol 1e-5, atol 1e-6; f16 rtol 2e-3,
atol 1e-3; for softmax, log_softmax, layer_norm and row sums both times max(1, sqrt(cols))
(and 4 more for log_softmax and f16 layer_norm). Quantisation computes in double: bit-exact.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dtm_mpi.errors import BackendError
from dtm_mpi.ir.registry import OPS, Trait, ops_with
from dtm_mpi.kernels.backends import BackendKind
from tests.mpi_env import mpirun_env

DTYPES = [np.float16, np.float32, np.float64]
SHAPES = [(1, 1), (3, 31), (257, 33), (5, 1000), (2, 4099)]
RTOL = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}
ATOL = {np.float16: 1e-3, np.float32: 1e-6, np.float64: 1e-12}


def _open_gpu() -> Any:
    from dtm_mpi.kernels.devices import open_backend

    why = []
    for kind in (BackendKind.CUDA, BackendKind.HIP):
        try:
            return open_backend(kind)
        except BackendError as exc:
            why.append(str(exc))
    pytest.skip("no GPU here: " + "; ".join(why))


@pytest.fixture(scope="module")
def gpu() -> Any:
    return _open_gpu()


@pytest.fixture(
    scope="module",
    params=[pytest.param("gpu", marks=pytest.mark.gpu), "emu-cuda-w32", "emu-hip-w64-reverse"],
)
def dev(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A GPU backend, or the CPU emulator standing in for CuPy under the same launcher code."""
    if request.param == "gpu":
        yield _open_gpu()
        return
    from tests.kernels.gpu_emu import EmuCupy, install

    with pytest.MonkeyPatch.context() as mp:
        cp = install(mp, EmuCupy.named(request.param))
        yield SimpleNamespace(name=request.param, ops=SimpleNamespace(cp=cp))


def _x(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3 + 0.5
    assert x.size == 0 or np.any(x != 0)
    return x.astype(dtype)


def _poisoned(cp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    return cp.full(shape, np.nan if np.dtype(dtype).kind == "f" else 99, dtype=dtype)


def _close(got: Any, want: np.ndarray, dtype: Any, scale: float = 1.0) -> None:
    g = got.get().astype(np.float64)
    assert not np.isnan(g).any(), "an output element was never written (still poisoned)"
    np.testing.assert_allclose(g, want, rtol=RTOL[dtype] * scale, atol=ATOL[dtype] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("log", [False, True])
def test_softmax(dev: Any, shape: tuple[int, int], dtype: Any, log: bool) -> None:
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    x = _x(shape, dtype)
    xf = x.astype(np.float64)
    s = xf - xf.max(axis=-1, keepdims=True)
    want = (
        s - np.log(np.exp(s).sum(axis=-1, keepdims=True))
        if log
        else np.exp(s) / np.exp(s).sum(axis=-1, keepdims=True)
    )
    out = _poisoned(cp, shape, dtype)
    got = launch.softmax(cp.asarray(x), log=log, out=out)
    assert got is out
    _close(got, want, dtype, max(1.0, math.sqrt(shape[1])) * (4.0 if log else 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(dev: Any, shape: tuple[int, int], dtype: Any) -> None:
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    x, g, b = _x(shape, dtype), _x(shape[-1:], dtype, 1), _x(shape[-1:], dtype, 2)
    xf = x.astype(np.float64)
    m = xf.mean(axis=-1, keepdims=True)
    v = ((xf - m) ** 2).mean(axis=-1, keepdims=True)
    want = (xf - m) / np.sqrt(v + 1e-5) * g.astype(np.float64) + b.astype(np.float64)
    got = launch.layer_norm(
        cp.asarray(x), cp.asarray(g), cp.asarray(b), 1e-5, out=_poisoned(cp, shape, dtype)
    )
    _close(got, want, dtype, max(1.0, math.sqrt(shape[1])) * (4.0 if dtype is np.float16 else 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dev: Any, shape: tuple[int, int], dtype: Any) -> None:
    """Against the registry's reference (the normalised value rounded to the storage type
    before the weight), within the tolerance of the other row kernels."""
    from dtm_mpi.ir import load_module
    from dtm_mpi.ir.ops.reduce import _rms_norm_ref
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    x, w = _x(shape, dtype), _x(shape[-1:], dtype, 1)
    t = {np.float16: "f16", np.float32: "f32", np.float64: "f64"}[dtype]
    rows, cols = shape
    module = load_module(
        f"""dtm 1.4
module r
entry func @f(%x: {t}[{rows},{cols}], %w: {t}[{cols}]) -> {t}[{rows},{cols}] {{
  %y = rms_norm %x, %w eps 0.00001 : {t}[{rows},{cols}]
  return %y
}}
""",
        "r.dtm",
    )
    assert module.entry is not None
    op = module.entry.body[0]
    (want,) = _rms_norm_ref(op, [x, w], op.result_types)
    got = launch.rms_norm(cp.asarray(x), cp.asarray(w), 1e-5, out=_poisoned(cp, shape, dtype))
    _close(
        got,
        want.astype(np.float64),
        dtype,
        max(1.0, math.sqrt(shape[1])) * (4.0 if dtype is np.float16 else 1.0),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [*SHAPES, (4, 0)])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_row_reduce(dev: Any, shape: tuple[int, int], dtype: Any, op: str) -> None:
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    x = _x(shape, dtype)
    xf = x.astype(np.float64)
    ident = {"sum": 0.0, "max": -np.inf, "min": np.inf}[op]
    want = getattr(np, op)(xf, axis=-1, initial=ident) * (0.5 if op == "sum" else 1.0)
    got = launch.row_reduce(op, cp.asarray(x), 0.5, out=_poisoned(cp, shape[:1], dtype))
    if shape[1] == 0:
        assert np.array_equal(got.get().astype(np.float64), want)
        return
    _close(got, want, dtype, math.sqrt(shape[1]) if op == "sum" else 1.0)


def test_row_max_propagates_nan(dev: Any) -> None:
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    x = _x((3, 300), np.float32)
    x[1, 177] = np.nan
    got = launch.row_reduce("max", cp.asarray(x)).get()
    assert np.isnan(got[1]) and not np.isnan(got[[0, 2]]).any()
    y = launch.softmax(cp.asarray(x)).get()
    assert np.isnan(y[1]).all() and not np.isnan(y[[0, 2]]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "block"), [((3, 32), 32), ((5, 96), 32), ((7, 33), 11), ((1, 1), 1), ((4, 1024), 256)]
)
def test_quantize_and_dequantize_bit_exact(
    dev: Any, shape: tuple[int, int], block: int, dtype: Any
) -> None:
    from dtm_mpi.ir.ops.quant import _dequantize_ref, _quantize_ref
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    x = _x(shape, dtype)
    x[0, :block] = 0  # an all-zero block: scale 1
    ops = _FakeOp(block)
    want_q, want_s = _quantize_ref(ops, [x], [None, _type(np.float32)])  # type: ignore[list-item]
    q, s = launch.quantize(
        cp.asarray(x),
        block,
        out=(_poisoned(cp, shape, np.int8), _poisoned(cp, (x.size // block,), np.float32)),
    )
    assert np.array_equal(q.get(), want_q)
    assert np.array_equal(s.get(), want_s.reshape(-1))
    (want_y,) = _dequantize_ref(ops, [want_q, want_s], [_type(dtype)])  # type: ignore[list-item]
    y = launch.dequantize(q, s, block, dtype, out=_poisoned(cp, shape, dtype))
    assert np.array_equal(y.get(), want_y)


class _FakeOp:
    def __init__(self, block: int) -> None:
        self.block = block

    def attr(self, name: str) -> int:
        assert name == "block"
        return self.block


def _type(dtype: Any) -> Any:
    from dtm_mpi.ir.types import DType, Layout, TensorType

    d = {np.float16: DType.F16, np.float32: DType.F32, np.float64: DType.F64}[dtype]
    return TensorType(d, (1,), Layout(((),)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_and_fused_chain(dev: Any, shape: tuple[int, int], dtype: Any) -> None:
    from dtm_mpi.kernels import launch
    from dtm_mpi.kernels.fused import Expr, FusedInput

    cp = dev.ops.cp
    x, b, z = _x(shape, dtype), _x(shape[-1:], dtype, 1), _x(shape, dtype, 2)
    v = x.astype(np.float64) + b.astype(np.float64)
    gelu = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    got = launch.bias_gelu(cp.asarray(x), cp.asarray(b), out=_poisoned(cp, shape, dtype))
    _close(got, gelu, dtype, 4.0)
    chain = Expr("mul", (Expr("gelu", (Expr("add", (0, 1)),)), 2))
    ins = [
        FusedInput(np.dtype(dtype)),
        FusedInput(np.dtype(dtype), True),
        FusedInput(np.dtype(dtype)),
    ]
    got = launch.fused(
        chain,
        ins,
        [cp.asarray(x), cp.asarray(b), cp.asarray(z)],
        dtype,
        shape,
        out=_poisoned(cp, shape, dtype),
    )
    _close(got, gelu * z.astype(np.float64), dtype, 8.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_adamw_kernel_gives_the_reference_bits(dev: Any, dtype: Any) -> None:
    """kernels/adamw.cu: every value of the op's numpy reference, bit for bit (each operation
    rounded once, no contracted multiply-add; f16 rounded after each operation)."""
    from dtm_mpi.ir.nodes import Op
    from dtm_mpi.ir.ops.update import adamw_reference
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    rng = np.random.default_rng(7)
    n = 4099
    p, g = _x((n,), dtype), _x((n,), dtype, 1)
    m = (rng.standard_normal(n) * 0.1).astype(dtype)
    v = np.abs(rng.standard_normal(n) * 0.01).astype(dtype)
    bc1, bc2 = np.asarray(1 - 0.9**5, dtype), np.asarray(1 - 0.999**5, dtype)
    for decay in (0.0, 0.01):
        attrs = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "decay": decay}
        op = Op("adamw", ("a", "b", "c"), (), (), tuple(attrs.items()))
        want = adamw_reference(op, [p, g, m, v, bc1, bc2], ())
        got = launch.adamw(*(cp.asarray(a) for a in (p, g, m, v, bc1, bc2)), attrs)
        for name, a, b in zip(("p2", "m2", "v2"), got, want, strict=True):
            host = a.get() if hasattr(a, "get") else np.asarray(a)
            assert host.tobytes() == b.tobytes(), (name, decay)


@pytest.mark.parametrize("op", sorted(ops_with(Trait.FUSIBLE)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_elementwise_kernel_matches_numpy(dev: Any, op: str, dtype: Any) -> None:
    from dtm_mpi.kernels import launch
    from dtm_mpi.kernels.fused import Expr, FusedInput

    cp = dev.ops.cp
    shape = (37, 129)
    a, b = _x(shape, dtype), _x(shape, dtype, 1)
    if op in ("log", "sqrt", "rsqrt"):
        a = np.abs(a) + np.asarray(0.1, dtype)
    a[0, 0] = np.nan  # NaN propagates through every op (numpy's maximum/minimum included)
    opdef = OPS[op]
    assert opdef.array_fn is not None
    args = (a, b)[: opdef.arity]
    for form in opdef.forms():  # gelu: tanh and the exact erf form
        with np.errstate(all="ignore"):
            want = np.asarray(opdef.array_fn(np, *(x.astype(np.float64) for x in args), **form))
        expr = Expr(op, tuple(range(len(args))), tuple(form.items()))
        got = launch.fused(
            expr,
            [FusedInput(np.dtype(dtype))] * len(args),
            [cp.asarray(x) for x in args],
            dtype,
            shape,
            out=_poisoned(cp, shape, dtype),
        )
        g = got.get().astype(np.float64)
        assert np.isnan(g[0, 0]) and np.isnan(want[0, 0])
        np.testing.assert_allclose(
            g.reshape(-1)[1:],
            want.reshape(-1)[1:],
            rtol=RTOL[dtype] * 4,
            atol=ATOL[dtype],
            err_msg=f"{op} {form}",
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("pre", "n", "k", "post", "lo"),
    [(1, 11, 9, 6, 0), (3, 4, 37, 5, 4), (1, 0, 5, 3, 2), (2, 7, 0, 33, 0), (1, 300, 513, 1, 100)],
)
def test_take_and_scatter_rows(
    dev: Any, pre: int, n: int, k: int, post: int, lo: int, dtype: Any
) -> None:
    """Rows at indices (some outside the block: zeros) bit exact, and their scatter-add in the
    updates' order: bit-equal to numpy.add.at in f32/f64 (repeated indices included)."""
    from dtm_mpi.kernels import launch

    cp = dev.ops.cp
    rng = np.random.default_rng(n + k)
    size = lo + n + 3
    idx = rng.integers(0, size, k).astype(np.int64)
    idx[: k // 2] = idx[0] if k else 0  # many repeats of one row
    x = _x((pre, n, post), dtype)
    got = launch.take_rows(
        cp.asarray(x), cp.asarray(idx), lo, out=_poisoned(cp, (pre, k, post), dtype)
    ).get()
    inside = (idx >= lo) & (idx < lo + n)
    want = np.zeros((pre, k, post), dtype)
    want[:, inside] = x[:, idx[inside] - lo]
    assert np.array_equal(got, want)
    u = _x((pre, k, post), dtype, 1)
    rows = np.nonzero(inside)[0]
    keys = idx[rows] - lo
    order = np.argsort(keys, kind="stable")
    starts = np.searchsorted(keys[order], np.arange(n + 1))
    got = launch.scatter_rows(
        cp.asarray(u),
        cp.asarray(rows[order]),
        cp.asarray(starts),
        n,
        out=_poisoned(cp, (pre, n, post), dtype),
    ).get()
    ref = np.zeros((pre, n, post), dtype)
    np.add.at(np.moveaxis(ref, 1, 0), keys, np.moveaxis(u[:, rows], 1, 0))
    if dtype == np.float16:  # the kernel sums in float, numpy in half
        np.testing.assert_allclose(
            got.astype(np.float64), ref, rtol=RTOL[dtype] * math.sqrt(k + 1), atol=ATOL[dtype] * k
        )
    else:
        assert np.array_equal(got, ref)


EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["tp_mlp", "dp_step", "attention", "collectives"])
def test_examples_on_the_gpu_match_numpy(gpu: Any, name: str, tmp_path: Path) -> None:
    """Whole programs at 2 ranks on the GPU (both ranks may share one device) against the
    numpy backend: the same outputs within the f32 tolerance."""

    env = mpirun_env()
    outs = {}
    for backend in ("numpy", gpu.name):
        out = tmp_path / f"{backend}.npz"
        cmd = [
            "mpirun",
            "--timeout",
            "120",
            "--bind-to",
            "none",
            "-n",
            "2",
            sys.executable,
            "-m",
            "mpi4py",
            "-m",
            "dtm_mpi",
            "run",
            str(EXAMPLES / f"{name}.dtm"),
            "--backend",
            backend,
            "-o",
            str(out),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=180, env=env, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs[backend] = dict(np.load(out))
    assert outs["numpy"].keys() == outs[gpu.name].keys()
    for k, want in outs["numpy"].items():
        got = outs[gpu.name][k]
        assert got.shape == want.shape and got.dtype == want.dtype, k
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=k)
        else:
            assert np.array_equal(got, want), k
