"""Every layer covers every registered op: the registry is the one home of per-op facts, so
adding an op is its entry, its kernels and its tests, and this file fails when a layer lacks
it (a kernel, a device helper, the reference, the planner's kind, the GPU placement)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.ir import load_module
from dtm_mpi.ir.registry import OpKind, Trait, all_ops, ops_with
from dtm_mpi.kernels.dispatch import COMM_OPS, backend_kernels
from dtm_mpi.kernels.fused import Expr, FusedInput, fused_source
from dtm_mpi.kernels.sources import kernel_source
from dtm_mpi.plan import program
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated

ROOT = Path(__file__).parents[2]
OPS = all_ops()
LOCAL = sorted(n for n, d in OPS.items() if d.kind is OpKind.LOCAL)
FUSIBLE = sorted(ops_with(Trait.FUSIBLE))
F32 = np.dtype(np.float32)


def test_comm_ops_are_the_ops_that_are_not_local() -> None:
    assert frozenset(OPS) - frozenset(LOCAL) == COMM_OPS
    assert {"allreduce", "send", "recv", "call", "redistribute", "broadcast"} <= COMM_OPS


def test_the_plan_kind_is_the_registry_kind() -> None:
    """No second table of kinds: a plan op's kind is its registry entry's."""
    assert program.OpKind is OpKind


@pytest.mark.parametrize("backend", ["numpy", "cuda", "hip"])
def test_every_local_op_has_a_kernel_and_no_other_op_does(backend: str) -> None:
    table = backend_kernels(backend)
    assert [n for n in LOCAL if n not in table] == []
    assert not set(table) & COMM_OPS


def test_traits_are_consistent() -> None:
    for name, d in OPS.items():
        assert d.reference is not None and d.doc, name
        if d.c_expr is not None or d.has(Trait.FUSIBLE):
            assert d.c_expr is not None and d.has(Trait.FUSIBLE), name
            assert d.has(Trait.ELEMENTWISE) and d.array_fn is not None, name
            assert d.arity in (1, 2) and d.n_results == 1, name
            assert all(f"{{{i}}}" in d.c_expr for i in range(d.arity)), name
        if d.has(Trait.LINEAR_ONE_SIDE) or d.has(Trait.LINEAR_FIRST):
            assert d.arity == 2 and d.linear_in, name
        if d.kind is not OpKind.LOCAL:
            assert not d.traits and d.c_expr is None, name


def _helpers(c_expr: str) -> list[str]:
    return re.findall(r"\b(dtm_\w+)\(", c_expr)


def _c_text(name: str, form: dict[str, str]) -> str:
    n = OPS[name].arity
    return (OPS[name].c_expr or "").format(*(f"v{i}" for i in range(n)), **form)


@pytest.mark.parametrize("name", FUSIBLE)
def test_every_fusible_op_has_its_device_helper(name: str) -> None:
    """``kernels/dtm_common.cuh`` (compiled by nvcc, NVRTC, hipcc, hipRTC and the emulator)
    defines each helper the C expression names, for float and double."""
    header = (ROOT / "kernels" / "dtm_common.cuh").read_text()
    for form in OPS[name].forms():
        for helper in _helpers(_c_text(name, form)):
            for ctype in ("float", "double"):
                assert re.search(rf"\b{ctype} {helper}\({ctype} \w+", header), (helper, ctype)


@pytest.mark.parametrize("name", FUSIBLE)
def test_every_fusible_op_is_generated_and_placed_on_the_gpu(name: str) -> None:
    from dtm_mpi.kernels.cuda_backend import placement

    n = OPS[name].arity
    template = kernel_source("fused_elementwise.cu")
    for form in OPS[name].forms():
        expr = Expr(name, tuple(range(n)), tuple(form.items()))
        _, code = fused_source(expr, [FusedInput(F32)] * n, F32, template)
        assert _c_text(name, form) in code
    assert placement(name, [F32] * n, {}, 2) == "generated kernel"


def test_every_fusible_op_is_run_by_the_emulated_kernel_tests() -> None:
    """tests/kernels/test_cuda_kernels.py runs each generated kernel on the emulator (and on a
    GPU where there is one); its op list is the registry's, not a copy."""
    text = (ROOT / "tests" / "kernels" / "test_cuda_kernels.py").read_text()
    assert 'parametrize("op", sorted(ops_with(Trait.FUSIBLE)))' in text


def _elementwise_module(name: str, dtype: str, form: dict[str, str] | None = None) -> str:
    args = ", ".join(["%x", "%w"][: OPS[name].arity])
    attrs = "".join(f" {k} {v}" for k, v in (form or {}).items())
    major, minor = max([OPS[name].since, *(v for _, v in OPS[name].attr_since)])
    return f"""dtm {major}.{minor}
module e
mesh @m = [dp=2]
entry func @main(%x: {dtype}[5,3]{{dp,-}}, %w: {dtype}[5,3]{{dp,-}}) -> {dtype}[5,3]{{dp,-}} on @m {{
  %y = {name} {args}{attrs} : {dtype}[5,3]{{dp,-}}
  return %y
}}
"""


@pytest.mark.parametrize("name", FUSIBLE)
def test_every_fusible_op_runs_in_the_reference_and_the_executor(name: str) -> None:
    """The reference interpreter and the executor (numpy backend, 3 ranks: uneven blocks)
    compute the op's array function."""
    d = OPS[name]
    for form in d.forms():
        module = load_module(_elementwise_module(name, "f64", form), "e.dtm")
        rng = np.random.default_rng(2)
        x, w = rng.random((5, 3)) + 0.5, rng.random((5, 3)) + 0.5
        _, ref = run_reference(module, {"x": x, "w": w})
        assert d.array_fn is not None
        want = d.array_fn(np, *(x, w)[: d.arity], **form)
        np.testing.assert_array_equal(ref[0][0], want)
        got = run_simulated(module, 3, binding={"dp": 3}, inputs={"x": x, "w": w})
        np.testing.assert_array_equal(got.results[0][0], want)


def _imports(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


@pytest.mark.parametrize("layer", ["plan", "sharding", "ir"])
def test_no_upward_imports(layer: str) -> None:
    """``ir``, ``sharding`` and ``plan`` import neither ``kernels`` nor ``comm`` (nor the
    runtime): the op facts they need are in the registry."""
    bad = {}
    for path in sorted((ROOT / "dtm_mpi" / layer).rglob("*.py")):
        up = sorted(
            m
            for m in _imports(path)
            if m.startswith(("dtm_mpi.kernels", "dtm_mpi.comm", "dtm_mpi.runtime"))
        )
        if up:
            bad[path.name] = up
    assert bad == {}


def test_no_second_table_of_op_names() -> None:
    """The tables that used to repeat op names are gone (derived from the registry)."""
    import dtm_mpi.kernels.cuda_backend as cuda
    import dtm_mpi.kernels.fused as fused
    import dtm_mpi.plan.fusion as fusion
    import dtm_mpi.runtime.reference as reference

    assert not hasattr(fused, "UNARY_C") and not hasattr(fused, "BINARY_C")
    assert not hasattr(fusion, "FUSIBLE") and not hasattr(program, "_REDIST_OPS")
    assert not hasattr(reference, "_IDENTITY_OPS") and not hasattr(cuda, "_int_elementwise")


def test_every_op_that_sums_floats_has_its_exact_rule_and_no_other_op_does() -> None:
    """Whether an op sums floats is its registry entry's (``Trait.SUMS``), and so is its exact
    rule (deterministic mode), attached by the kernels: neither without the other."""
    import dtm_mpi.kernels.exact as exact

    ops = all_ops()
    summing = sorted(n for n, d in ops.items() if d.has(Trait.SUMS))
    assert {"matmul", "sum", "mean", "scatter_add"} <= set(summing)
    assert [n for n in summing if not isinstance(ops[n].exact, exact.ExactRule)] == []
    assert sorted(n for n, d in ops.items() if d.exact is not None) == summing
    assert not hasattr(exact, "EXACT_RULES")


def test_an_op_adding_a_pending_sum_without_saying_it_sums_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pending sum across ranks that an op adds is a float sum in the mesh's order: an op
    whose entry does not say it sums (so deterministic mode has no exact rule) is refused
    where its rule adds one."""
    from dataclasses import replace

    from dtm_mpi.ir import registry

    monkeypatch.setitem(registry.OPS, "matmul", replace(OPS["matmul"], traits=frozenset()))
    text = (ROOT / "examples" / "tp_mlp.dtm").read_text(encoding="utf-8")
    with pytest.raises(AssertionError, match="matmul sums floats across ranks"):
        load_module(text, "tp_mlp.dtm")


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_the_gpu_reduction_kernels_are_the_registry_reductions(backend: str) -> None:
    reductions = ops_with(Trait.REDUCTION)
    assert reductions == {"sum", "mean", "max", "min"}
    assert reductions <= set(backend_kernels(backend))
