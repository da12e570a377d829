"""``dequantize`` whose last dim is sharded: every shard must hold whole quantisation blocks on
the *bound* mesh. The rule depends on the mesh sizes (``--mesh`` may change them after ``dtm
check``), so the planner decides it: a located error on every rank before any communication,
never a numpy reshape error mid-run."""

from __future__ import annotations

import numpy as np
import pytest

from dtm_mpi.errors import PlanError
from dtm_mpi.ir import load_module
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated

# 48 values = 3 blocks of 16 along the last dim, split over tp: at tp=3 every shard holds one
# whole block (16 values, 1 scale); at tp=2 the values split 24/24 and the scales 2/1.
SOURCE = """dtm 1.0
module deq
mesh @m = [tp=3]
entry func @main(%q: i8[4,48]{-,tp}, %s: f32[4,3]{-,tp}) -> f32[4,48]{-,tp} on @m requires [CAP_QUANT] {
  %y = dequantize %q, %s block 16 : f32[4,48]{-,tp}
  return %y
}
"""


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(4, 48)).astype(np.int8)
    s = rng.random((4, 3)).astype(np.float32)
    return {"q": q, "s": s}


@pytest.mark.parametrize("tp", [2, 4, 5])
def test_blocks_straddling_shards_are_a_plan_error(tp: int) -> None:
    module = load_module(SOURCE, "deq.dtm")
    with pytest.raises(PlanError) as err:
        compile_plan(module, mesh_for(module, tp, {"tp": tp}))
    text = str(err.value)
    assert text.startswith("deq.dtm:5:")  # the op's location
    assert "dequantize" in text and "whole blocks of 16" in text and "\n" not in text


@pytest.mark.parametrize("tp", [2, 5])
def test_simulated_run_refuses_before_running(tp: int) -> None:
    module = load_module(SOURCE, "deq.dtm")
    with pytest.raises(PlanError, match=r"deq\.dtm:5:\d+: dequantize: every shard"):
        run_simulated(module, tp, binding={"tp": tp}, inputs=_inputs())


@pytest.mark.parametrize("tp", [1, 3])
def test_aligned_shards_run_and_match_the_reference(tp: int) -> None:
    module = load_module(SOURCE, "deq.dtm")
    compile_plan(module, mesh_for(module, tp, {"tp": tp}))
    got = run_simulated(module, tp, binding={"tp": tp}, inputs=_inputs())
    _, history = run_reference(module, _inputs())
    np.testing.assert_array_equal(got.results[0][0], history[0][0])
