"""Reverse-mode autodiff of IR functions: every differentiable op's gradient against central
finite differences in float64 (on the reference), and the generated backward pass run on 1-4
simulated ranks over several meshes (uneven splits included) against the reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import GradientError, UsageError
from dtm_mpi.ir import load_module, print_module
from dtm_mpi.ir.autodiff import backward, grad_module
from dtm_mpi.ir.build import FunctionBuilder, Value
from dtm_mpi.ir.nodes import MeshDecl, Module
from dtm_mpi.ir.registry import all_ops, required_version
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.ir.verify import verify_module
from dtm_mpi.runtime.reference import evaluate_function
from dtm_mpi.runtime.simulate import run_simulated
from tests.ir.gradcheck import central_difference, numeric_gradient

MESH = MeshDecl("m", (("dp", 2), ("tp", 2)))
BINDINGS = [
    (1, {"dp": 1, "tp": 1}),
    (2, {"dp": 1, "tp": 2}),
    (2, {"dp": 2, "tp": 1}),
    (3, {"dp": 1, "tp": 3}),
    (4, {"dp": 2, "tp": 2}),
]


def layout(text: str) -> Layout:
    return Layout(tuple(() if d == "-" else (d,) for d in text.split(",")) if text else ())


@dataclass(frozen=True)
class Case:
    name: str
    params: tuple[tuple[str, tuple[int, ...], str], ...]  # name, shape, layout ("dp,-")
    body: Callable[[FunctionBuilder, list[Value]], Value]
    positive: bool = False  # inputs drawn > 0 (log, sqrt, rsqrt)


def op(name: str, **attrs: object) -> Callable[[FunctionBuilder, list[Value]], Value]:
    return lambda b, xs: b.apply1(name, xs, attrs)  # type: ignore[arg-type]


def with_decl(
    name: str, shape: tuple[int, ...], **attrs: object
) -> Callable[[FunctionBuilder, list[Value]], Value]:
    return lambda b, xs: b.apply1(
        name, xs, attrs, [TensorType(DType.F64, shape, Layout.replicated(len(shape)))]
    )  # type: ignore[arg-type]


def ids(b: FunctionBuilder, lay: str = "dp,-") -> Value:
    """Integer indices [4, 3] into a dim of 7, with repeats (their gradients add up)."""
    t = TensorType(DType.I64, (4, 3), layout(lay))
    return b.emit1("constant", [], {"value": ((0, 6, 3), (3, 3, 5), (6, 1, 2), (4, 4, 4))}, [t])


X = ("x", (5, 6), "dp,tp")
Y = ("y", (5, 6), "dp,-")
UNARY = ["neg", "exp", "tanh", "relu", "gelu", "sigmoid", "abs", "silu", "sin", "cos", "erf"]
# fmt: off
CASES = [
    *(Case(n, (X,), op(n)) for n in UNARY),
    Case("gelu-exact", (X,), op("gelu", approximate="none")),
    *(Case(n, (X,), op(n), positive=True) for n in ("log", "sqrt", "rsqrt")),
    *(Case(n, (X, Y), op(n)) for n in ("add", "sub", "mul", "maximum", "minimum")),
    Case("div", (X, Y), op("div"), positive=True),
    Case("matmul", (("a", (5, 7), "dp,-"), ("w", (7, 6), "-,tp")), op("matmul")),
    Case("matmul-k-sharded", (("a", (5, 7), "-,tp"), ("w", (7, 6), "tp,-")), op("matmul")),
    Case("batched-matmul", (("a", (3, 4, 5), "dp,-,-"), ("w", (3, 5, 2), "dp,-,-")), op("matmul")),
    Case("transpose", (X,), op("transpose", perm=(1, 0))),
    Case("reshape", (("x", (6, 4), "dp,-"),), with_decl("reshape", (6, 2, 2))),
    Case("broadcast_to", (("v", (1, 6), "-,tp"),), with_decl("broadcast_to", (4, 5, 6))),
    Case("slice", (("x", (7, 6), "-,tp"),), op("slice", start=(1, 0), limit=(5, 6))),
    Case("concat", (("a", (3, 6), "-,tp"), ("c", (2, 6), "-,tp")), op("concat", dim=0)),
    Case("take-vocab-split", (("w", (7, 5), "tp,-"),), lambda b, xs: b.apply1("take", [xs[0], ids(b)], {"dim": 0})),
    Case("take-inner-dim", (("t", (2, 7, 5), "-,-,tp"),), lambda b, xs: b.apply1("take", [xs[0], ids(b, "-,dp")], {"dim": 1})),
    Case("scatter_add", (("u", (4, 3, 5), "dp,-,tp"),), lambda b, xs: b.apply1("scatter_add", [xs[0], ids(b)], {"dim": 0}, [TensorType(DType.F64, (7, 5), layout("-,tp"))])),
    *(Case(f"{n}-dims", (X,), op(n, dims=(0,))) for n in ("sum", "mean", "max", "min")),
    Case("sum-keepdims", (X,), op("sum", dims=(1,), keepdims=True)),
    Case("mean-all", (X,), op("mean", dims=(0, 1))),
    Case("softmax", (X,), op("softmax", dim=1)),
    Case("log_softmax", (X,), op("log_softmax", dim=1)),
    Case("layer_norm", (("x", (5, 6), "dp,-"), ("g", (6,), "-"), ("b", (6,), "-")), op("layer_norm", eps=1e-5)),
    Case("rms_norm", (("x", (5, 6), "dp,-"), ("g", (6,), "-")), op("rms_norm", eps=1e-5)),
    Case("where", (X, Y), lambda b, xs: b.apply1("where", [b.apply1("compare", xs, {"pred": "gt"}), *xs])),
    Case("cast-f32", (X,), lambda b, xs: b.apply1("cast", [b.apply1("cast", xs, {}, [xs[0].type.with_dtype(DType.F32)])], {}, [xs[0].type])),
    Case("allgather", (X,), lambda b, xs: b.emit1("allgather", xs, {"axes": ("tp",)})),
    Case("all_to_all", (("x", (4, 6), "tp,-"),), lambda b, xs: b.emit1("all_to_all", xs, {"axes": ("tp",), "src": 0, "dst": 1})),
    Case("redistribute", (X,), lambda b, xs: b.to_layout(xs[0], layout("tp,dp"))),
    Case("reduce_scatter", (("a", (5, 6), "-,tp"), ("w", (6, 4), "tp,-")), lambda b, xs: b.emit1("reduce_scatter", [b.apply1("matmul", xs)], {"op": "sum", "axes": ("tp",), "dim": 1})),
    Case("broadcast", (Y,), lambda b, xs: b.emit1("broadcast", xs, {"axes": ("tp",), "root": 0})),
    Case("chain", (("x", (5, 6), "dp,-"), ("w", (6, 8), "-,tp"), ("v", (8, 6), "tp,-")), lambda b, xs: b.apply1("log_softmax", [b.apply1("matmul", [b.apply1("gelu", [b.apply1("matmul", xs[:2])]), xs[2]])], {"dim": 1})),
]
# fmt: on


def build(case: Case) -> tuple[Module, list[str]]:
    """An entry function of ``case``'s parameters returning the loss sum(op(...) * r) (r a
    fixed random tensor, so every element's gradient differs) and its gradients."""
    b = FunctionBuilder(MESH, module_name=case.name.replace("-", "_"))
    xs = [b.add_param(n, TensorType(DType.F64, s, layout(lay))) for n, s, lay in case.params]
    out = case.body(b, xs)
    r = b.add_param("r", out.type.with_layout(Layout(out.type.layout.dims)))
    total = (
        b.apply1("sum", [b.apply1("mul", [out, r])], {"dims": tuple(range(out.type.rank))})
        if out.type.rank
        else b.apply1("mul", [out, r])
    )
    loss = b.complete(total)
    grads = backward(b, list(b.ops), loss, xs)
    f = b.function("step", [loss, *grads], entry=True)
    module = Module(required_version(f.body), b.module.name, (MESH,), (f,))
    verify_module(module)
    return load_module(print_module(module)), [n for n, _, _ in case.params]


def draw(module: Module, positive: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for p in module.entry.params:  # type: ignore[union-attr]
        v = rng.normal(size=p.type.shape)
        out[p.name.lstrip("%")] = np.abs(v) + 0.5 if positive and p.name != "%r" else v
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gradient_matches_finite_differences(case: Case) -> None:
    module, names = build(case)
    entry = module.entry
    assert entry is not None
    values = draw(module, case.positive)
    args = tuple(values[p.name.lstrip("%")] for p in entry.params)
    outs = evaluate_function(module, entry, args, 0)

    def loss(a: tuple[np.ndarray, ...]) -> float:
        return float(evaluate_function(module, entry, a, 0)[0])

    eps = 1e-3 if case.name == "cast-f32" else 1e-6  # f32 rounding: a coarser step
    for k, name in enumerate(names):
        num = numeric_gradient(loss, args, k, eps)
        tol = 1e-2 if case.name == "cast-f32" else 1e-6
        np.testing.assert_allclose(
            outs[1 + k],
            num,
            rtol=tol,
            atol=tol * max(1.0, float(np.abs(num).max())),
            err_msg=f"{case.name}: d/d{name}",
        )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_backward_pass_runs_distributed(case: Case) -> None:
    """The generated module on 1-4 simulated ranks gives the reference's loss and gradients."""
    module, _ = build(case)
    entry = module.entry
    assert entry is not None
    values = draw(module, case.positive, seed=1)
    want = evaluate_function(
        module, entry, tuple(values[p.name.lstrip("%")] for p in entry.params), 0
    )
    for nranks, binding in BINDINGS:
        got = run_simulated(module, nranks, binding=binding, inputs=values).results[0]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(
                g, w, rtol=1e-10, atol=1e-10, err_msg=f"{case.name} result {i} at {binding}"
            )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_backward_pass_has_the_same_bits_on_every_mesh_in_deterministic_mode(case: Case) -> None:
    """Deterministic mode's exact sums: the loss and gradients on 1-4 ranks and every mesh
    shape are bit for bit those of one rank (and still the reference's values)."""
    module, _ = build(case)
    entry = module.entry
    assert entry is not None
    values = draw(module, case.positive, seed=2)
    want = evaluate_function(
        module, entry, tuple(values[p.name.lstrip("%")] for p in entry.params), 0
    )
    first: tuple[np.ndarray, ...] | None = None
    for nranks, binding in BINDINGS:
        got = run_simulated(
            module, nranks, binding=binding, inputs=values, deterministic=True
        ).results[0]
        if first is None:
            first = got
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(
                    g, w, rtol=1e-10, atol=1e-10, err_msg=f"{case.name} result {i}"
                )
        for i, (g, f) in enumerate(zip(got, first, strict=True)):
            assert g.tobytes() == f.tobytes(), (
                f"{case.name} result {i} at {binding} differs from 1 rank"
            )


def test_every_local_float_op_with_operands_has_a_rule_or_is_listed() -> None:
    """A new op must state its gradient (or be listed here as having none, with the reason)."""
    none = {
        "compare": "bool result",
        "iota": "no operands",
        "constant": "no operands",
        "random": "integer offset only",
        "step_index": "no operands",
        "microbatch_index": "no operands",
        "quantize": "integer codes",
        "dequantize": "integer codes in",
        "call": "inlined before differentiation",
        "adamw": "an optimizer update, after the reverse pass",
    }
    missing = sorted(n for n, d in all_ops().items() if d.grad is None and n not in none)
    assert missing == []
    assert all(all_ops()[n].grad is None for n in none)


MLP = """dtm 1.0
module mlp
mesh @m = [dp=2, tp=2]

entry func @loss(%x: f64[8,6]{dp,-}, %t: f64[8,4]{dp,-}, %w1: f64[6,10]{-,tp}, %w2: f64[10,4]{tp,-}) -> f64[] on @m {
  %h = matmul %x, %w1 : f64[8,10]{dp,tp}
  %a = call @act(%h) : f64[8,10]{dp,tp}
  %p = matmul %a, %w2 : f64[8,4]{dp,-} partial(sum: tp)
  %y = allreduce sum %p on tp : f64[8,4]{dp,-}
  %d = sub %y, %t : f64[8,4]{dp,-}
  %d2 = mul %d, %d : f64[8,4]{dp,-}
  %lp = mean %d2 dims [0, 1] : f64[] partial(sum: dp)
  %l = allreduce sum %lp on dp : f64[]
  return %l
}

func @act(%h: f64[8,10]{dp,tp}) -> f64[8,10]{dp,tp} on @m {
  %a = gelu %h : f64[8,10]{dp,tp}
  return %a
}
"""


def test_grad_module_inlines_calls_and_reduces_weight_gradients_over_dp() -> None:
    m = load_module(MLP, "mlp.dtm")
    g = grad_module(m, "loss", ["w1", "%w2"])
    text = print_module(g)
    assert load_module(text) == g and print_module(load_module(text)) == text  # canonical
    f = g.function("loss_grad")
    assert f is not None and [str(r.type) for r in f.results] == [
        "f64[]",
        "f64[6,10]{-,tp}",
        "f64[10,4]{tp,-}",
    ]
    assert not any(op.name == "call" for op in f.body)
    reduces = [op for op in f.body if op.name == "allreduce" and op.attr("axes") == ("dp",)]
    assert len(reduces) == 3  # the loss's and one per weight gradient
    rng = np.random.default_rng(3)
    args = tuple(rng.normal(size=p.type.shape) for p in f.params)
    outs = evaluate_function(g, f, args, 0)
    x, t, w1, w2 = args
    h = x @ w1
    a = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    gy = 2 * (a @ w2 - t) / t.size
    np.testing.assert_allclose(outs[2], a.T @ gy, rtol=1e-12)


def test_errors_name_the_op_and_place() -> None:
    m = load_module(MLP, "mlp.dtm")
    with pytest.raises(UsageError, match="no parameter %w3"):
        grad_module(m, "loss", ["w3"])
    with pytest.raises(UsageError, match="no function @nope"):
        grad_module(m, "nope", ["w1"])
    quant = """dtm 1.0
module q
entry func @f(%x: f32[4,8]) -> f32[] requires [CAP_QUANT] {
  %q, %s = quantize %x block 8 : i8[4,8], f32[4,1]
  %y = dequantize %q, %s block 8 : f32[4,8]
  %l = sum %y dims [0, 1] : f32[]
  return %l
}
"""
    with pytest.raises(GradientError) as info:
        grad_module(load_module(quant, "q.dtm"), "f", ["x"])
    assert "q.dtm:5:8" in str(info.value) and "dequantize has no gradient rule" in str(info.value)
    vector = MLP.replace("-> f64[] on @m", "-> f64[8,4]{dp,-} on @m").replace(
        "return %l", "return %y"
    )
    with pytest.raises(GradientError, match="must be a float scalar"):
        grad_module(load_module(vector), "loss", ["w1"])


def test_dtm_grad_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dtm_mpi.cli import run

    src = tmp_path / "mlp.dtm"
    src.write_text(MLP)
    out = tmp_path / "grad.dtm"
    assert run(["grad", str(src), "--wrt", "w1,w2", "-o", str(out)]) == 0
    g = load_module(out.read_text())
    assert g.function("loss_grad") is not None and g.entry is not None and g.entry.name == "loss"
    assert run(["grad", str(src), "--wrt", "w1"]) == 0
    assert capsys.readouterr().out == print_module(grad_module(load_module(MLP), "loss", ["w1"]))
    assert run(["grad", str(src), "--wrt", "h", "--function", "act"]) == 1
    err = capsys.readouterr().err
    assert f"{src}:18:8: error: the differentiated value %a must be a float scalar" in err
    assert run(["grad", str(src), "--wrt", "nope"]) == 2
    assert "@loss has no parameter %nope" in capsys.readouterr().err


PIPELINE = """dtm 1.0
module pipeline
mesh @m = [pp=2, dp=1]

entry func @main(%x: f64[8,16]{dp,-}, %w: f64[16,16]) -> f64[] on @m {
  %h = matmul %x, %w : f64[8,16]{dp,-}
  %a = gelu %h : f64[8,16]{dp,-}
  send %a on pp from 0 to 1 tag 1
  %r = recv on pp from 0 to 1 tag 1 : f64[8,16]{dp,-} partial(sum: pp)
  %s = allreduce sum %r on pp : f64[8,16]{dp,-}
  %o = matmul %s, %w : f64[8,16]{dp,-}
  %q = mul %o, %o : f64[8,16]{dp,-}
  %l = sum %q dims [0, 1] : f64[] partial(sum: dp)
  %lf = allreduce sum %l on dp : f64[]
  return %lf
}
"""


def test_a_pipeline_hand_off_is_differentiated_by_sending_the_cotangent_back() -> None:
    """The adjoint of send/recv is the reverse transfer (a new tag), paired in order."""
    g = grad_module(load_module(PIPELINE), "main", ["w", "x"])
    f = g.function("main_grad")
    assert f is not None
    back = [op for op in f.body if op.name in ("send", "recv")][2:]
    assert [(op.name, op.attr("src"), op.attr("dst")) for op in back] == [
        ("send", 1, 0),
        ("recv", 1, 0),
    ]
    assert back[0].attr("tag") == back[1].attr("tag") != 1
    entry_g = Module(g.version, g.name, g.meshes, (replace(f, entry=True),))
    rng = np.random.default_rng(2)
    values = {"x": rng.normal(size=(8, 16)), "w": 0.3 * rng.normal(size=(16, 16))}
    want = evaluate_function(g, f, (values["x"], values["w"]), 0)
    m = load_module(PIPELINE)
    assert m.entry is not None

    def loss(v: dict[str, np.ndarray]) -> float:
        return float(evaluate_function(m, m.entry, (v["x"], v["w"]), 0)[0])  # type: ignore[arg-type]

    for k, name in ((1, "w"), (2, "x")):
        for i in list(np.ndindex(values[name].shape))[::17]:
            num = central_difference(loss, values, name, i)
            assert abs(want[k][i] - num) <= 1e-6 * max(1.0, abs(num)), (name, i)
    for nranks, binding in ((2, {"pp": 2, "dp": 1}), (4, {"pp": 2, "dp": 2})):
        got = run_simulated(entry_g, nranks, binding=binding, inputs=values).results[0]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
