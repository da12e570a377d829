"""Elementwise fusion groups (pure) and the executor's fused path: grouping rules, the bias
broadcast absorbed, returned or shared intermediates never fused, and every example run with
fusion on (a host backend evaluating each group's tree with numpy) bit-identical to the
op-by-op reference at several rank counts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.ir import load_module
from dtm_mpi.kernels.backends import BackendKind
from dtm_mpi.kernels.devices import ArrayBackend
from dtm_mpi.plan.fusion import FusionNode, fusion_groups
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.simulate import run_simulated
from tests.kernels.kernel_helpers import evaluate

MLP = """dtm 1.0
module fuse

mesh @m = [dp=2]

entry func @main(%x: f32[6,5], %b: f32[5], %z: f32[6,5]) -> (f32[6,5], f32[6,5]) on @m {
  %bb = broadcast_to %b : f32[6,5]
  %h = add %x, %bb : f32[6,5]
  %g = gelu %h : f32[6,5]
  %y = mul %g, %z : f32[6,5]
  %e = exp %x : f32[6,5]
  %n = neg %e : f32[6,5]
  %r = relu %n : f32[6,5]
  %s = add %r, %e : f32[6,5]
  return %y, %s
}
"""


def plan_of(text: str, ranks: int = 2):  # type: ignore[no-untyped-def]
    module = load_module(text, "fuse.dtm")
    return compile_plan(module, mesh_for(module, ranks, None))


def test_bias_gelu_chain_is_one_group_with_a_broadcast_input() -> None:
    plan = plan_of(MLP)
    fp = plan.entry_plan
    groups = fusion_groups(fp)
    names = [[fp.ops[m].op.results[0] for m in g.members] for g in groups]
    assert names[0] == ["%bb", "%h", "%g", "%y"]
    g = groups[0]
    assert g.inputs == ("%x", "%b", "%z") and g.lastdim == (False, True, False)
    assert g.tree == FusionNode(
        "mul", (FusionNode("gelu", (FusionNode("add", (0, 1)),), (("approximate", "tanh"),)), 2)
    )
    assert g.result == "%y" and fp.ops[g.root].op.results[0] == "%y"


def test_shared_intermediates_are_inputs_not_members() -> None:
    """%e is used twice (by neg and by add): it is computed once, as its own op, and read
    by the group; it is not recomputed inside it."""
    fp = plan_of(MLP).entry_plan
    groups = fusion_groups(fp)
    second = [fp.ops[m].op.results[0] for m in groups[1].members]
    assert second == ["%n", "%r", "%s"]
    assert groups[1].inputs == ("%e",)
    assert groups[1].tree == FusionNode("add", (FusionNode("relu", (FusionNode("neg", (0,)),)), 0))


def test_returned_values_and_non_float_ops_end_a_group() -> None:
    text = MLP.replace("return %y, %s", "return %y, %s, %g").replace(
        "-> (f32[6,5], f32[6,5])", "-> (f32[6,5], f32[6,5], f32[6,5])"
    )
    fp = plan_of(text).entry_plan
    groups = [[fp.ops[m].op.results[0] for m in g.members] for g in fusion_groups(fp)]
    # %g is returned, so it ends its group (as the root) and %y = %g * %z stays alone
    assert groups == [["%bb", "%h", "%g"], ["%n", "%r", "%s"]]
    ints = """dtm 1.0
module ints

entry func @main(%a: i32[4], %b: i32[4]) -> (i32[4]) {
  %c = add %a, %b : i32[4]
  %d = mul %c, %c : i32[4]
  return %d
}
"""
    assert fusion_groups(plan_of(ints, 1).entry_plan) == ()


class HostFusing(ArrayBackend):
    """The numpy backend with fusion on: each group's tree evaluated with the registry's own
    numpy functions, in the arrays' dtype (so results equal the op-by-op run bit for bit)."""

    calls: list[int]

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
        self.calls.append(1)
        cols = shape[-1] if shape else 1
        vals = [np.broadcast_to(x, shape) if b else x for x, b in zip(xs, lastdim, strict=True)]
        assert all(np.shape(v) == tuple(shape) for v in vals) and cols >= 0
        return np.ascontiguousarray(evaluate(expr, vals, dtype))


EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("name", ["tp_mlp", "dp_step", "attention"])
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_examples_with_fusion_equal_the_reference(name: str, ranks: int) -> None:
    module = load_module((EXAMPLES / f"{name}.dtm").read_text(), f"{name}.dtm")
    want = run_simulated(module, ranks, steps=2)
    backend = HostFusing(BackendKind.NUMPY)
    backend.calls = []
    got = run_simulated(module, ranks, steps=2, backend=backend)
    assert bool(backend.calls) == (name != "attention"), "fused groups ran where planned"
    assert got.outputs().keys() == want.outputs().keys()
    for k, v in want.outputs().items():
        assert np.array_equal(got.outputs()[k], v, equal_nan=True), k


def test_tp_mlp_backward_chain_is_fused() -> None:
    module = load_module((EXAMPLES / "tp_mlp.dtm").read_text(), "tp_mlp.dtm")
    plan = compile_plan(module, mesh_for(module, 4, None))
    sizes = [g.size for g in fusion_groups(plan.entry_plan)]
    assert sizes and max(sizes) >= 4, sizes  # the written-out gelu' is one kernel


def test_an_input_freed_by_an_op_between_member_and_root_is_kept() -> None:
    """%x's last other user (the matmul) sits between the group's first member (exp) and
    its root (add): the matmul must not free %x before the group reads it."""
    text = """dtm 1.0
module between

entry func @main(%x: f32[4,4] init normal(seed=1, std=1.0), %y: f32[4,4] init normal(seed=2, std=1.0)) -> (f32[4,4], f32[4,4]) {
  %a = exp %x : f32[4,4]
  %m = matmul %x, %y : f32[4,4]
  %c = add %a, %y : f32[4,4]
  return %c, %m
}
"""
    module = load_module(text, "between.dtm")
    fp = plan_of(text, 1).entry_plan
    (g,) = fusion_groups(fp)
    assert [fp.ops[m].op.results[0] for m in g.members] == ["%a", "%c"]
    want = run_simulated(module, 1)
    backend = HostFusing(BackendKind.NUMPY)
    backend.calls = []
    got = run_simulated(module, 1, backend=backend)
    assert backend.calls
    for k, v in want.outputs().items():
        assert np.array_equal(got.outputs()[k], v), k
