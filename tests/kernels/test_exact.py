"""Deterministic mode's exact sums (dtm_mpi/kernels/exact.py) on 1-4 simulated ranks: the same
bits on every mesh, within a rounding of the exactly rounded sum, IEEE's infinities and NaNs,
no negative zeros; and the GPU backend (on the host emulator) gives the numpy path's bits."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import pytest

from dtm_mpi.config import get_config
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module
from dtm_mpi.kernels.exact import (
    NONFINITE_EXP,
    ZERO_EXP,
    _matmul_sum,
    _scale_back,
    exponents,
    group_exponent,
    slices,
)
from dtm_mpi.runtime.simulate import run_simulated

RANKS = (1, 2, 3, 4)


def module(body: str, params: str, result: str, version: str = "1.0") -> Module:
    text = f"""dtm {version}
module exact
mesh @m = [tp=4]
entry func @f({params}) -> ({result}) on @m {{
{body}
}}
"""
    m = parse_module(text, "exact.dtm")
    verify_module(m)
    return m


def matmul_module(t: str) -> Module:
    return module(
        f"  %p = matmul %a, %b : {t}[6,5] partial(sum: tp)\n"
        f"  %c = allreduce sum %p on tp : {t}[6,5]\n  return %c",
        f"%a: {t}[6,37]{{-,tp}}, %b: {t}[37,5]{{tp,-}}",
        f"{t}[6,5]",
    )


def on_every_mesh(m: Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The result on 1-4 ranks, asserted bitwise equal across them."""
    outs = [run_simulated(m, n, inputs=inputs, deterministic=True).results[0][0] for n in RANKS]
    for n, out in zip(RANKS, outs, strict=True):
        assert out.dtype == outs[0].dtype and out.tobytes() == outs[0].tobytes(), (
            f"{n} ranks differ"
        )
    return outs[0]


def wide(rng: np.random.Generator, shape: tuple[int, ...], spread: int = 12) -> np.ndarray:
    """Values over 2^-spread .. 2^spread of both signs: reassociation shows in their sums."""
    return (rng.normal(size=shape) * np.exp2(rng.integers(-spread, spread, size=shape))).astype(
        np.float32
    )


def exactly_rounded_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each output as math.fsum of the float64 products (exact for float32 operands)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return np.array(
        [[math.fsum(a64[i] * b64[:, j]) for j in range(b.shape[1])] for i in range(a.shape[0])]
    )


def test_matmul_over_a_split_k_has_the_same_bits_on_every_mesh_and_is_accurate() -> None:
    rng = np.random.default_rng(3)
    a, b = wide(rng, (6, 37)), wide(rng, (37, 5))
    got = on_every_mesh(matmul_module("f32"), {"a": a, "b": b})
    plain = [
        run_simulated(
            matmul_module("f32"), n, inputs={"a": a, "b": b}, deterministic=False
        ).results[0][0]
        for n in RANKS
    ]
    assert len({p.tobytes() for p in plain}) > 1  # without it, the meshes do differ
    ref = exactly_rounded_matmul(a, b)
    bound = 37 * 2.0**-38 * np.abs(a).max(axis=1)[:, None] * np.abs(b).max(axis=0)[None, :]
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - ref) <= ulp + bound)


def test_matmul_f64_keeps_float64_accuracy() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(6, 37)), rng.normal(size=(37, 5))
    got = on_every_mesh(matmul_module("f64"), {"a": a, "b": b})
    ref = a @ b
    np.testing.assert_allclose(got, ref, rtol=1e-13, atol=1e-13)


def test_cancellation_is_exact() -> None:
    """1e8 + 1 - 1e8, spread over the ranks: the float32 loop says 0 or 1 by its order."""
    a = np.zeros((6, 37), np.float32)
    a[:, 0], a[:, 20], a[:, 36] = 1e8, 1.0, -1e8
    b = np.ones((37, 5), np.float32)
    got = on_every_mesh(matmul_module("f32"), {"a": a, "b": b})
    assert np.all(got == 1.0)


def test_infinities_nans_and_zeros_are_ieee_and_zero_is_positive() -> None:
    rng = np.random.default_rng(5)
    a, b = wide(rng, (6, 37), 4), wide(rng, (37, 5), 4)
    a[0, 3] = np.inf  # row 0: +-inf (or NaN where b is 0 there)
    a[1, 30] = np.nan  # row 1: NaN everywhere
    b[7, 2] = -np.inf  # column 2: -+inf
    a[2] = 0.0
    a[2, 5] = -0.0  # row 2 of zeros and a negative zero
    b[5, :] = 3.0
    got = on_every_mesh(matmul_module("f32"), {"a": a, "b": b})
    want = exactly_rounded_matmul(np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0))
    with np.errstate(all="ignore"):
        ieee = a.astype(np.float64) @ b.astype(np.float64)
    special = ~np.isfinite(ieee)
    assert np.array_equal(np.isnan(got), np.isnan(ieee)) and np.array_equal(
        np.isinf(got), np.isinf(ieee)
    )
    assert np.array_equal(
        np.sign(got[special & ~np.isnan(ieee)]), np.sign(ieee[special & ~np.isnan(ieee)])
    )
    finite = ~special
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-30)
    row2 = got[2, [0, 1, 3, 4]]
    assert np.all(row2 == 0) and not np.any(np.signbit(row2))


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_sum_and_mean_over_a_split_dim(op: str) -> None:
    rng = np.random.default_rng(6)
    x = wide(rng, (5, 41), 20)
    m = module(
        f"  %p = {op} %x dims [1] : f32[5] partial(sum: tp)\n"
        "  %s = allreduce sum %p on tp : f32[5]\n  return %s",
        "%x: f32[5,41]{-,tp}",
        "f32[5]",
    )
    got = on_every_mesh(m, {"x": x})
    ref = np.array([math.fsum(r) for r in x.astype(np.float64)]) / (41 if op == "mean" else 1)
    assert np.array_equal(got, ref.astype(np.float32))  # 64 bits kept, then one rounding


def test_sum_to_a_scalar_keeps_its_shape() -> None:
    rng = np.random.default_rng(7)
    x = wide(rng, (5, 41))
    m = module(
        "  %p = sum %x dims [0, 1] : f32[] partial(sum: tp)\n"
        "  %s = allreduce sum %p on tp : f32[]\n  return %s",
        "%x: f32[5,41]{-,tp}",
        "f32[]",
    )
    got = on_every_mesh(m, {"x": x})
    assert got.shape == () and got == np.float32(math.fsum(x.astype(np.float64).ravel()))


def test_scatter_add_with_repeated_indices_split_over_ranks() -> None:
    rng = np.random.default_rng(8)
    u = wide(rng, (12, 3), 16)
    idx = np.array([0, 2, 2, 5, 0, 2, 1, 1, 5, 0, 2, 4], dtype=np.int64)
    m = module(
        "  %s = scatter_add %u, %i dim 0 : f32[6,3] partial(sum: tp)\n"
        "  %g = allreduce sum %s on tp : f32[6,3]\n  return %g",
        "%u: f32[12,3]{tp,-}, %i: i64[12]{tp}",
        "f32[6,3]",
        version="1.1",
    )
    got = on_every_mesh(m, {"u": u, "i": idx})
    ref = np.zeros((6, 3))
    for r in range(6):
        for c in range(3):
            ref[r, c] = math.fsum(u[idx == r, c].astype(np.float64))
    assert np.array_equal(got, ref.astype(np.float32))


def test_slices_recompose_the_value() -> None:
    rng = np.random.default_rng(9)
    x = wide(rng, (50,), 30).astype(np.float64)
    x[3] = 0.0
    e = np.full(x.shape, int(exponents(x).max()))
    parts = slices(x, e, 26, 4)  # 104 bits: every float64 here is whole
    assert all(np.all(p == np.trunc(p)) and np.all(np.abs(p) < 2.0**26) for p in parts)
    back = sum(np.ldexp(p, e - (i + 1) * 26) for i, p in enumerate(parts))
    assert np.array_equal(back, x)
    assert exponents(np.array([0.0, 1.0, 0.75, np.inf]))[0] == ZERO_EXP
    assert list(exponents(np.array([1.0, 0.75]))) == [1, 0]


def test_the_gpu_backend_on_the_host_emulator_gives_the_numpy_bits() -> None:
    from dtm_mpi.kernels.devices import BackendKind
    from tests.kernels.test_cuda_backend_on_host import HostCuda

    rng = np.random.default_rng(10)
    a, b = wide(rng, (6, 37)), wide(rng, (37, 5))
    want = on_every_mesh(matmul_module("f32"), {"a": a, "b": b})
    got = run_simulated(
        matmul_module("f32"),
        3,
        inputs={"a": a, "b": b},
        deterministic=True,
        backend=HostCuda(BackendKind.CUDA),
    ).results[0][0]
    assert np.asarray(got).tobytes() == want.tobytes()


PENDING = "%a: f32[2,4]{-,tp}, %b: f32[4,2]{tp,-}, %w: f32[2,2]"


@pytest.mark.parametrize("then", ["mul %p, %w", "div %p, %w", "matmul %p, %w"])
def test_an_infinity_applied_to_a_pending_exact_result_is_the_same_on_every_mesh(then: str) -> None:
    """The pending result is whole on every rank until the plan reduces it, so a later
    ``* inf`` or ``/ 0`` meets the value, not another rank's zeros (which would give NaN)."""
    m = module(
        f"  %p = matmul %a, %b : f32[2,2] partial(sum: tp)\n  %q = {then} : f32[2,2] partial(sum: tp)\n"
        "  %c = allreduce sum %q on tp : f32[2,2]\n  return %c",
        PENDING,
        "f32[2,2]",
    )
    w = np.full((2, 2), 0.0 if then.startswith("div") else np.inf, np.float32)
    if then.startswith("matmul"):
        w = np.array([[np.inf, 1], [1, 1]], np.float32)
    got = on_every_mesh(
        m, {"a": np.ones((2, 4), np.float32), "b": np.ones((4, 2), np.float32), "w": w}
    )
    want = (
        np.array([[np.inf, 8], [np.inf, 8]], np.float32)
        if then.startswith("matmul")
        else np.full((2, 2), np.inf, np.float32)
    )
    assert np.array_equal(got, want)


def test_underflow_to_zero_is_positive_and_nans_are_canonical() -> None:
    a = np.zeros((6, 37), np.float32)
    a[:, 0] = 1e-30
    b = np.zeros((37, 5), np.float32)
    b[0, :] = -1e-30  # the product underflows: -0.0 in float32 arithmetic
    got = on_every_mesh(matmul_module("f32"), {"a": a, "b": b})
    assert np.all(got == 0) and not np.any(np.signbit(got))
    m = module(
        "  %p = sum %x dims [1] : f32[2] partial(sum: tp)\n  %s = allreduce sum %p on tp : f32[2]\n  return %s",
        "%x: f32[2,4]{-,tp}",
        "f32[2]",
    )
    x = np.array([[np.inf, 1, -np.inf, np.nan], [np.nan, -np.inf, np.inf, 1]], np.float32)
    got = on_every_mesh(m, {"x": x})
    assert list(got.view(np.uint32)) == [0x7FC00000, 0x7FC00000]


def test_an_infinity_decides_whatever_the_finite_terms_overflow_to() -> None:
    m = module(
        "  %p = sum %x dims [0] : f64[] partial(sum: tp)\n  %s = allreduce sum %p on tp : f64[]\n  return %s",
        "%x: f64[4]{tp}",
        "f64[]",
    )
    got = on_every_mesh(m, {"x": np.array([np.inf, 1e308, -1.7e308, -1.7e308])})
    assert got == np.inf


@pytest.mark.parametrize(
    ("dtype", "values", "want"),
    [
        ("f32", [1.0, 2.0**-24, 2.0**-80], 1 + 2.0**-23),  # a tie broken by the third term
        ("bf16", [1.0, 2.0**-8, 2.0**-30], 1 + 2.0**-7),
    ],
)
def test_the_exact_sum_is_rounded_once(dtype: str, values: list[float], want: float) -> None:
    m = module(
        f"  %p = sum %x dims [0] : {dtype}[] partial(sum: tp)\n  %s = allreduce sum %p on tp : {dtype}[]\n  return %s",
        f"%x: {dtype}[3]{{tp}}",
        f"{dtype}[]",
    )
    got = on_every_mesh(m, {"x": np.array(values, np.float32)})
    assert float(got) == want


def test_overflow_to_infinity_warns_nothing() -> None:
    import warnings

    m = module(
        "  %p = sum %x dims [0] : f32[] partial(sum: tp)\n  %s = allreduce sum %p on tp : f32[]\n  return %s",
        "%x: f32[2]{tp}",
        "f32[]",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = on_every_mesh(m, {"x": np.array([3e38, 3e38], np.float32)})
    assert got == np.inf


# --- the fast matmul (DTM_DETERMINISTIC_MATMUL=fast) and the same-bits shortcuts -------------


@contextlib.contextmanager
def matmul_precision(value: str) -> Iterator[None]:
    """``DTM_DETERMINISTIC_MATMUL=value`` inside (the configuration read again both ways)."""
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DTM_DETERMINISTIC_MATMUL", value)
            get_config.cache_clear()
            yield
    finally:
        get_config.cache_clear()


@pytest.fixture
def fast_matmul() -> Iterator[None]:
    with matmul_precision("fast"):
        yield


def test_the_fast_matmul_has_the_same_bits_on_every_mesh_within_its_bound(
    fast_matmul: None,
) -> None:
    """One slice of w = 23 bits (K = 37) rounded to nearest: every output within
    K 2^(e_row + e_col - w) of the exact product, plus its own rounding."""
    rng = np.random.default_rng(3)
    a, b = wide(rng, (6, 37)), wide(rng, (37, 5))
    got = on_every_mesh(matmul_module("f32"), {"a": a, "b": b})
    ref = exactly_rounded_matmul(a, b)
    er, ec = exponents(np.abs(a).max(axis=1)), exponents(np.abs(b).max(axis=0))
    bound = 37 * np.exp2(er[:, None] + ec[None, :] - 23)
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - ref) <= ulp + bound)
    with matmul_precision("full"):
        full = run_simulated(matmul_module("f32"), 1, inputs={"a": a, "b": b}, deterministic=True)
    assert full.results[0][0].tobytes() != got.tobytes()  # the setting is what ran


def test_the_fast_matmul_errs_like_a_float32_gemm(fast_matmul: None) -> None:
    """At K = 1024 (w = 21) the fast matmul's rms error is within 4x a float32 GEMM's own
    (measured 3x)."""
    rng = np.random.default_rng(11)
    a = rng.normal(size=(32, 1024)).astype(np.float32)
    b = (rng.normal(size=(1024, 48)) * 0.02).astype(np.float32)
    m = module(
        "  %c = matmul %a, %b : f32[32,48]\n  return %c",
        "%a: f32[32,1024], %b: f32[1024,48]",
        "f32[32,48]",
    )
    got = run_simulated(m, 1, inputs={"a": a, "b": b}, deterministic=True).results[0][0]
    ref = a.astype(np.float64) @ b.astype(np.float64)

    def rms(x: np.ndarray) -> float:
        return float(np.sqrt(np.mean((x.astype(np.float64) - ref) ** 2)))

    assert 0 < rms(got) <= 4 * rms(a @ b)


def test_the_f64_fast_matmul_keeps_two_slices() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(6, 37)), rng.normal(size=(37, 5))
    with matmul_precision("fast"):
        got = on_every_mesh(matmul_module("f64"), {"a": a, "b": b})
    np.testing.assert_allclose(got, a @ b, rtol=1e-10, atol=1e-10)  # 2 x 22 bits kept


@pytest.mark.parametrize("seed", range(20))
def test_the_shortcuts_give_the_bits_of_the_plain_forms(seed: int) -> None:
    """A group's largest exponent from its largest magnitude, and the levels scaled back by a
    row's and a column's power of two, are bit for bit the elementwise forms (exponents of
    every element; one ldexp per output), zeros, infinities, NaNs and wide ranges included."""
    rng = np.random.default_rng(seed)
    dtype = (np.float32, np.float64)[seed % 2]
    x = rng.normal(size=(7, 9)) * np.exp2(rng.integers(-60, 60, size=(7, 9)))
    x[rng.random(x.shape) < 0.2] = 0.0
    if seed % 3 == 0:
        x[rng.integers(0, 7), rng.integers(0, 9)] = (np.inf, -np.inf, np.nan)[seed % 9 // 3]
    x[2] = 0.0
    x = x.astype(dtype)
    for axis in ((0,), (1,), (0, 1)):
        plain = np.max(exponents(x), axis=axis, keepdims=True, initial=ZERO_EXP)
        assert np.array_equal(group_exponent(x, axis), plain)
    count, w = 2, 20
    levels = rng.integers(-(2**52), 2**52, size=(count, 7, 9))
    rows = np.where(rng.random(7) < 0.2, ZERO_EXP, rng.integers(-300, 300, 7))
    cols = np.where(rng.random(9) < 0.2, NONFINITE_EXP, rng.integers(-300, 300, 9))
    rows[0] = ZERO_EXP
    levels[:, 0, :] = 0  # an all-zero row has zero levels
    hi, lo = _matmul_sum(levels, rows, cols, w)
    keep = cols < NONFINITE_EXP  # outputs with an infinity or NaN are replaced later
    r = np.where(rows <= ZERO_EXP, 0, rows)
    want_hi, want_lo = _scale_back(levels, r[:, None] + np.where(keep, cols, 0)[None, :], w, 2)
    assert lo is not None and want_lo is not None
    assert np.array_equal(hi[:, keep], want_hi[:, keep])
    assert np.array_equal(lo[:, keep], want_lo[:, keep])


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ([1.7e308, 1.7e308, 0.0, 0.0, 0.0], np.inf),  # past the largest float64: IEEE's inf
        ([-1.7e308, -1.7e308, 0.0, 1.0, 0.0], -np.inf),
        ([1e308, 1e308, -1e308, 5.0, 0.0], 1e308),  # exact: no overflow in any order
    ],
)
def test_a_float64_sum_past_the_largest_is_an_infinity_not_nan(
    values: list[float], want: float
) -> None:
    m = module(
        "  %p = sum %x dims [0] : f64[] partial(sum: tp)\n"
        "  %s = allreduce sum %p on tp : f64[]\n  return %s",
        "%x: f64[5]{tp}",
        "f64[]",
    )
    got = on_every_mesh(m, {"x": np.array(values)})
    assert got == want
