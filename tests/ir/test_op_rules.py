"""Rules of single ops that the golden files do not pin down: the pending reductions
``dequantize``, ``sigmoid`` and ``abs`` accept (each entry's ``linear_in``), and the numpy
semantics of the new elementwise ops."""

from __future__ import annotations

import numpy as np
import pytest

from dtm_mpi.errors import VerifyError
from dtm_mpi.ir import load_module
from dtm_mpi.ir.registry import OPS, lookup_op
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated

DEQ_PARTIAL = """dtm 1.0
module deq
mesh @m = [tp=2]
entry func @main(%q: i8[4,64], %s: f32[4,4]) -> f32[4,64] on @m requires [CAP_QUANT] {
  %p = redistribute %q : i8[4,64] partial(sum: tp)
  %y = dequantize %p, %s block 16 : f32[4,64] partial(sum: tp)
  %z = allreduce sum %y on tp : f32[4,64]
  return %z
}
"""


def test_dequantize_of_a_pending_int8_sum_is_rejected() -> None:
    """i8 sums wrap: the global value (the wrapped sum, dequantized) and the distributed one
    (each rank's values dequantized, then summed in f32) differ, by the rank count."""
    with pytest.raises(VerifyError) as err:
        load_module(DEQ_PARTIAL, "deq.dtm")
    text = str(err.value)
    assert "deq.dtm:6:" in text and "partial(sum: tp)" in text and "wraps" in text


def test_dequantize_of_pending_scales_is_rejected() -> None:
    src = DEQ_PARTIAL.replace(
        "%p = redistribute %q : i8[4,64] partial(sum: tp)",
        "%p = redistribute %s : f32[4,4] partial(sum: tp)",
    ).replace("dequantize %p, %s", "dequantize %q, %p")
    with pytest.raises(VerifyError, match="dequantize needs complete scales"):
        load_module(src, "deq.dtm")


def _unary_module(op: str, dtype: str, partial: str, reduce: str) -> str:
    return f"""dtm 1.0
module u
mesh @m = [tp=2]
entry func @main(%x: {dtype}[4,3]{{-,tp}}) -> {dtype}[4] on @m {{
  %r = {reduce} %x dims [1] : {dtype}[4] partial({partial}: tp)
  %y = {op} %r : {dtype}[4] partial({partial}: tp)
  %z = allreduce {partial} %y on tp : {dtype}[4]
  return %z
}}
"""


@pytest.mark.parametrize(("reduce", "partial"), [("max", "max"), ("min", "min")])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_sigmoid_passes_pending_max_and_min(reduce: str, partial: str, ranks: int) -> None:
    """sigmoid is non-decreasing, so it commutes with max and min: the distributed value
    (sigmoid of each rank's partial, then the reduction) equals the reference at every rank
    count, empty blocks (-inf / +inf identities: 3 columns over 4 ranks) included."""
    module = load_module(_unary_module("sigmoid", "f32", partial, reduce), "u.dtm")
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32) * 4
    got = run_simulated(module, ranks, binding={"tp": ranks}, inputs={"x": x})
    _, want = run_reference(module, {"x": x})
    np.testing.assert_array_equal(got.results[0][0], want[0][0])
    fn = getattr(np, reduce)
    np.testing.assert_allclose(want[0][0], 1 / (1 + np.exp(-fn(x, axis=1))), rtol=1e-6)


@pytest.mark.parametrize(
    ("op", "reduce", "partial"),
    [
        ("sigmoid", "sum", "sum"),
        ("abs", "sum", "sum"),
        ("abs", "max", "max"),
        ("abs", "min", "min"),
    ],
)
def test_ops_not_linear_in_a_pending_reduction_are_rejected(
    op: str, reduce: str, partial: str
) -> None:
    with pytest.raises(VerifyError, match=rf"{op}: operand is partial\({partial}: tp\)"):
        load_module(_unary_module(op, "f32", partial, reduce), "u.dtm")


def test_linear_in_is_declared() -> None:
    assert lookup_op("sigmoid") is not None
    assert OPS["sigmoid"].linear_in == frozenset({ReduceOp.MAX, ReduceOp.MIN})
    assert OPS["abs"].linear_in == frozenset()
    assert OPS["neg"].linear_in == frozenset({ReduceOp.SUM})


def test_sigmoid_is_float_only_and_abs_takes_integers() -> None:
    src = """dtm 1.0
module t
entry func @main(%x: i32[3]) -> i32[3] {
  %y = OP %x : i32[3]
  return %y
}
"""
    with pytest.raises(VerifyError, match="sigmoid: operand must have a floating dtype"):
        load_module(src.replace("OP", "sigmoid"), "t.dtm")
    module = load_module(src.replace("OP", "abs"), "t.dtm")
    x = np.array([-5, 0, 7], dtype=np.int32)
    _, out = run_reference(module, {"x": x})
    np.testing.assert_array_equal(out[0][0], [5, 0, 7])
    assert out[0][0].dtype == np.int32


def test_sigmoid_semantics() -> None:
    src = """dtm 1.0
module t
entry func @main(%x: f64[5]) -> (f64[5], f64[5]) {
  %y = sigmoid %x : f64[5]
  %a = abs %x : f64[5]
  return %y, %a
}
"""
    module = load_module(src, "t.dtm")
    x = np.array([-1000.0, -1.0, 0.0, 2.5, np.nan])
    _, out = run_reference(module, {"x": x})
    y, a = out[0]
    np.testing.assert_allclose(y[:4], [0.0, 1 / (1 + np.e), 0.5, 1 / (1 + np.exp(-2.5))])
    assert y[0] == 0.0 and np.isnan(y[4])
    np.testing.assert_array_equal(a[:4], [1000.0, 1.0, 0.0, 2.5])
    assert np.isnan(a[4])


EMPTY_MAX = """dtm 1.0
module e
entry func @main(%a: f32[3,0] init zeros, %b: i32[3,0] init zeros) -> (f32[3], i32[3], f32[3]) {
  %m = max %a dims [1] : f32[3]
  %n = min %b dims [1] : i32[3]
  %s = min %a dims [1] : f32[3]
  return %m, %n, %s
}
"""


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_max_min_over_an_empty_dim_are_the_identities(nranks: int) -> None:
    """The reference function of ``max``/``min`` over a dimension of size 0 gives the identities
    of spec §7.1 (numpy raises there without ``initial``), as the executor does."""
    module = load_module(EMPTY_MAX, "empty.dtm")
    _, history = run_reference(module)
    m, n, s = history[0]
    assert np.all(m == -np.inf) and np.all(s == np.inf)
    assert np.all(n == np.iinfo(np.int32).max)
    sim = run_simulated(module, nranks)
    for ref, got in zip(history[0], sim.results[0], strict=True):
        np.testing.assert_array_equal(ref, got)


def test_sigmoid_of_f16_is_computed_in_binary32() -> None:
    """As the GPU kernels do: exp(12) overflows f16, yet sigmoid(-12) ~ 6.1e-6 is an f16
    number, so the reference must not give 0 there."""
    src = """dtm 1.0
module s
entry func @main(%x: f16[3]) -> f16[3] {
  %y = sigmoid %x : f16[3]
  return %y
}
"""
    x = np.array([-12.0, 0.0, 12.0], dtype=np.float16)
    _, got = run_reference(load_module(src, "s.dtm"), {"x": x})
    want = (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float16)
    np.testing.assert_array_equal(got[0][0], want)
    assert got[0][0][0] > 0


RESHAPE = """dtm 1.0
module r
mesh @m = [dp=2, tp=2]
entry func @f(%x: f64[2,3,8]{dp,-,tp} init normal(seed=1)) -> (f64[2,3,4,2]{dp,-,tp,-}, f64[2,3,8]{dp,-,tp}, f64[6,8]{-,tp}) on @m {
  %h = reshape %x : f64[2,3,4,2]{dp,-,tp,-}
  %e = exp %h : f64[2,3,4,2]{dp,-,tp,-}
  %b = reshape %e : f64[2,3,8]{dp,-,tp}
  %c = allgather %b on dp : f64[2,3,8]{-,-,tp}
  %d = reshape %c : f64[6,8]{-,tp}
  return %h, %b, %d
}
"""


@pytest.mark.parametrize(
    ("nranks", "binding"),
    [
        (1, {"dp": 1, "tp": 1}),
        (2, {"dp": 1, "tp": 2}),
        (4, {"dp": 2, "tp": 2}),
        (8, {"dp": 2, "tp": 4}),
    ],
)
def test_reshape_moves_a_split_to_the_major_factor_and_back(
    nranks: int, binding: dict[str, int]
) -> None:
    m = load_module(RESHAPE)
    want = run_reference(m)[1][0]
    got = run_simulated(m, nranks, binding=binding).results[0]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_reshape_split_that_does_not_align_is_a_plan_error() -> None:
    from dtm_mpi.errors import PlanError

    with pytest.raises(PlanError, match="does not land on whole rows of result dim 2"):
        run_simulated(load_module(RESHAPE), 3, binding={"dp": 1, "tp": 3})
    bad = RESHAPE.replace(
        "%h = reshape %x : f64[2,3,4,2]{dp,-,tp,-}", "%h = reshape %x : f64[2,24]"
    )
    with pytest.raises(VerifyError, match="no counterpart in \\[2, 24\\]"):
        load_module(bad)
