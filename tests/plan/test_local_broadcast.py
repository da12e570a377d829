"""Broadcasts planned in the layout their uses cut them to (``dtm_mpi.plan.local_broadcast``):
each rank makes only its block of the repeat, the values are those of the module as written,
and the builder reduces a pending value before it repeats it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.build import FunctionBuilder
from dtm_mpi.ir.nodes import MeshDecl, Module
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.plan.cost import function_cost
from dtm_mpi.plan.program import OpKind, compile_plan, mesh_for
from dtm_mpi.runtime.simulate import run_simulated

REPEAT = """dtm 1.0
module repeat
mesh @m = [dp=2, tp=2]
entry func @f(%v: f32[1,1,64]{-,-,tp} init normal(seed=3, std=1.0),
              %x: f32[6,5,64]{dp,-,tp} init normal(seed=4, std=1.0)) -> (f32[6,5,64]{dp,-,tp}) on @m {
  %b = broadcast_to %v : f32[6,5,64]{-,-,tp}
  %bs = redistribute %b : f32[6,5,64]{dp,-,tp}
  %y = mul %bs, %x : f32[6,5,64]{dp,-,tp}
  return %y
}
"""


def _module(text: str) -> Module:
    module = parse_module(text, "repeat.dtm")
    verify_module(module)
    return module


WHOLE = REPEAT.replace("%v: f32[1,1,64]{-,-,tp}", "%v: f32[1,1,64]").replace(
    "%b = broadcast_to %v : f32[6,5,64]{-,-,tp}", "%b = broadcast_to %v : f32[6,5,64]"
)


@pytest.mark.parametrize(("ranks", "binding"), [(4, {"dp": 2, "tp": 2}), (3, {"dp": 3, "tp": 1})])
@pytest.mark.parametrize("text", [REPEAT, WHOLE], ids=["operand-split", "operand-whole"])
def test_a_broadcast_its_use_cuts_is_made_as_each_ranks_block(
    ranks: int, binding: dict[str, int], text: str
) -> None:
    module = _module(text)
    plan = compile_plan(module, mesh_for(module, ranks, binding))
    fp = plan.entry_plan
    if text == WHOLE:  # the uses split the dim v has whole: v is cut to its block first
        first = fp.ops[0]
        assert first.kind is OpKind.REDIST and first.op.operands == ("%v",)
        assert first.op.result_types[0].layout.dims == ((), (), ("tp",))
        assert first.redist is not None
        assert all(not s.kind.is_collective for s in first.redist.steps)
        fp = replace(fp, ops=fp.ops[1:])
    b, cut = fp.ops[0], fp.ops[1]
    assert b.op.result_types[0].layout.dims[0] == ("dp",)  # the use's layout (the IR's is -)
    assert module.entry is not None and module.entry.body[0].result_types[0].layout.dims[0] == ()
    assert cut.kind is OpKind.REDIST and cut.redist is not None and cut.redist.steps == ()
    cost = function_cost(plan, plan.entry_plan)
    at = 1 if text == WHOLE else 0
    # dp=3 cuts the 6 rows into 2 a rank; each rank holds only its block of the repeat
    rows = -(-6 // binding["dp"])
    cols = 64 // binding["tp"]
    assert cost.ops[at].local_shapes[0] == ((rows, 5, cols),)
    # the values are the module's: v repeated, times x (the reference: one rank, all of it)
    got = run_simulated(module, ranks, binding=binding).outputs()
    want = run_simulated(module, 1, binding={"dp": 1, "tp": 1}).outputs()
    for k, v in want.items():
        assert np.array_equal(got[k], v), k


def test_a_broadcast_with_another_use_is_made_whole() -> None:
    text = REPEAT.replace("  return %y", "  %z = add %b, %b : f32[6,5,64]{-,-,tp}\n  return %y")
    module = _module(text)
    plan = compile_plan(module, mesh_for(module, 4, {"dp": 2, "tp": 2}))
    b, cut = plan.entry_plan.ops[0], plan.entry_plan.ops[1]
    assert b.op.result_types[0].layout.dims[0] == ()
    assert cut.redist is not None and cut.redist.steps != ()


def test_a_pending_value_is_reduced_before_it_is_repeated() -> None:
    mesh = MeshDecl("m", (("dp", 2), ("tp", 2)))
    b = FunctionBuilder(mesh)
    t = TensorType(DType.F32, (4, 1), Layout((("dp",), ()), Partial(ReduceOp.MAX, ("tp",))))
    v = b.add_param("v", t)
    wide = b.emit1(
        "broadcast_to", [v], declared=[TensorType(DType.F32, (4, 1000), Layout.replicated(2))]
    )
    done = b.complete(wide)
    assert done.type.layout.partial is None and done.type.shape == (4, 1000)
    reduced = [op for op in b.ops if op.name == "allreduce"]
    assert len(reduced) == 1 and reduced[0].result_types[0].shape == (4, 1)  # not [4,1000]
    assert b.ops[-1].name == "broadcast_to" and b.ops[-1].results == (done.name,)
