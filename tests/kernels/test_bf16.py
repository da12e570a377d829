"""bf16 results are bfloat16 numbers (spec §4.2): every op with a bf16 result rounds it to
nearest, ties to even, in the reference and in the numpy kernels (held in float32 arrays
whose low 16 bits are zero)."""

from __future__ import annotations

import numpy as np
import pytest

from dtm_mpi.ir import load_module
from dtm_mpi.ir.dtypes import round_bf16
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated

SOURCE = """dtm 1.0
module b
mesh @m = [dp=2]
entry func @main(%x: f32[6,5]{dp,-}, %w: f32[5,4]) -> (bf16[6,5]{dp,-}, bf16[6,5]{dp,-}, bf16[6,4]{dp,-}, bf16[6]{dp}, bf16[6,5]{dp,-}) on @m {
  %b = cast %x : bf16[6,5]{dp,-}
  %e = exp %b : bf16[6,5]{dp,-}
  %s = add %e, %b : bf16[6,5]{dp,-}
  %wb = cast %w : bf16[5,4]
  %m = matmul %s, %wb : bf16[6,4]{dp,-}
  %r = mean %s dims [1] : bf16[6]{dp}
  %i = iota dim 1 : bf16[6,5]{dp,-}
  return %b, %s, %m, %r, %i
}
"""


def _bits_low(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF)


def test_round_bf16_ties_to_even_and_specials() -> None:
    x = np.array(
        [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, np.inf, -np.inf, 3.4e38, -0.0],
        dtype=np.float32,
    )
    want = [1.0, 1 + 2**-6, 1 + 2**-7, np.inf, -np.inf, np.inf, -0.0]
    np.testing.assert_array_equal(round_bf16(x), np.array(want, dtype=np.float32))
    assert np.isnan(round_bf16(np.array([np.nan], np.float32)))[0]
    assert round_bf16(np.float32(1.5)).shape == ()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_bf16_results_are_rounded_in_the_reference_and_the_numpy_kernels(ranks: int) -> None:
    module = load_module(SOURCE, "b.dtm")
    rng = np.random.default_rng(3)
    inputs = {
        "x": rng.standard_normal((6, 5)).astype(np.float32),
        "w": rng.standard_normal((5, 4)).astype(np.float32),
    }
    _, ref = run_reference(module, inputs)
    got = run_simulated(module, ranks, binding={"dp": ranks}, inputs=inputs)
    for k, (r, g) in enumerate(zip(ref[0], got.results[0], strict=True)):
        assert not _bits_low(r).any(), f"reference result {k} is not bf16"
        assert not _bits_low(g).any(), f"numpy-kernel result {k} is not bf16"
    b = round_bf16(inputs["x"])
    np.testing.assert_array_equal(ref[0][0], b)
    np.testing.assert_array_equal(ref[0][1], round_bf16(round_bf16(np.exp(b)) + b))
    np.testing.assert_array_equal(got.results[0][1], ref[0][1])  # elementwise: exact


SHARDED_CONTRACTION = """dtm 1.0
module c
mesh @m = [tp=2]
entry func @main(%x: f32[4,8]{-,tp} init normal(seed=5, std=1.0), %w: f32[8,4]{tp,-} init normal(seed=6, std=1.0)) -> (bf16[4,4], bf16[4]) on @m {
  %xb = cast %x : bf16[4,8]{-,tp}
  %wb = cast %w : bf16[8,4]{tp,-}
  %p = matmul %xb, %wb : bf16[4,4] partial(sum: tp)
  %y = allreduce sum %p on tp : bf16[4,4]
  %q = sum %xb dims [1] : bf16[4] partial(sum: tp)
  %z = allreduce sum %q on tp : bf16[4]
  return %y, %z
}
"""


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_bf16_sums_over_ranks_are_rounded(nranks: int) -> None:
    """A contraction or reduction over a sharded dim adds the ranks' bf16 blocks in binary32;
    the completed value is rounded again, so it is still a bfloat16 number."""
    module = load_module(SHARDED_CONTRACTION, "c.dtm")
    result = run_simulated(module, nranks)
    for value in result.results[0]:
        assert not _bits_low(value).any(), value
