"""Tracing Python into IR: verified canonical modules with stable hashes, sharding propagation
that reproduces the hand-written types of the examples, errors at the user's line, layer
gradients against finite differences at 1-4 simulated ranks, and the hand-written
tensor-parallel MLP rebuilt from the frontend with autodiff."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import GradientError, PlanError, PropagationWarning, TraceError, UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.ir import load_module, print_module
from dtm_mpi.ir.autodiff import backward
from dtm_mpi.ir.build import FunctionBuilder
from dtm_mpi.ir.nodes import Module
from dtm_mpi.ir.parser import parse_module
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.reference import evaluate_function, run_reference
from dtm_mpi.runtime.simulate import run_simulated
from dtm_mpi.runtime.values import init_global
from tests.ir.gradcheck import central_difference, numeric_gradient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MESH = dtm.Mesh(dp=2, tp=2)
BINDINGS = [
    (1, {"dp": 1, "tp": 1}),
    (2, {"dp": 1, "tp": 2}),
    (3, {"dp": 1, "tp": 3}),
    (4, {"dp": 2, "tp": 2}),
]


def mlp(dtype: str = "f32") -> dtm.nn.Module:
    return dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(6, 10, dtype=dtype),
        fn.gelu,
        dtm.nn.RowParallelLinear(10, 4, dtype=dtype),
    )


def ce_loss(
    m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor
) -> tuple[dtm.Tensor, dict[str, dtm.Tensor]]:
    logits = m(x)
    return fn.cross_entropy(logits, y), {"acc": fn.accuracy(logits, y)}


INPUTS = {"x": dtm.Input((8, 6), "f32", ("dp", None)), "y": dtm.Input((8,), "i32", ("dp",))}


def test_a_traced_step_is_verified_canonical_and_hashes_the_same_every_time() -> None:
    a = dtm.train_step(mlp(), ce_loss, mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.AdamW())
    b = dtm.train_step(mlp(), ce_loss, mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.AdamW())
    text = a.text
    assert print_module(load_module(text)) == text  # dtm fmt fixed point
    assert parse_module(text, "<traced>") == a.module  # the text is the whole module
    assert a.hash == b.hash and a.text == b.text
    c = dtm.train_step(
        mlp(), ce_loss, mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.AdamW(), seed=1
    )
    assert c.hash != a.hash  # another init seed is another program
    entry = a.module.entry
    assert entry is not None and entry.name == "train_step"
    assert a.inputs == ("x", "y") and a.metrics == ("loss", "acc")
    assert a.params == ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")
    assert len(a.state) == 8 and all(s.startswith(("opt.m.", "opt.v.")) for s in a.state)
    types = {p.name: str(p.type) for p in entry.params}
    assert (
        types["%layers.0.weight"] == "f32[6,10]{-,tp}"
        and types["%layers.1.weight"] == "f32[10,4]{tp,-}"
    )
    # the data-parallel gradient reduction comes out of the reverse pass
    assert any(op.name == "allreduce" and op.attr("axes") == ("dp",) for op in entry.body)


def test_propagation_reproduces_the_hand_written_types_of_tp_mlp() -> None:
    """Tracing @forward of examples/tp_mlp.dtm from its parameter layouts gives its types."""
    hand = load_module((EXAMPLES / "tp_mlp.dtm").read_text())
    fwd = hand.function("forward")
    assert fwd is not None
    want = {op.results[0]: str(op.result_types[0]) for op in fwd.body}

    class Fwd(dtm.nn.Module):
        def __init__(self) -> None:
            self.w1 = dtm.nn.Parameter((256, 1024), DType.F32, (None, "tp"))
            self.w2 = dtm.nn.Parameter((1024, 256), DType.F32, ("tp", None))

    seen: dict[str, str] = {}

    def run(m: Fwd, x: dtm.Tensor) -> dict[str, dtm.Tensor]:
        h = x @ m.param("w1")
        a = h.gelu()
        p = a @ m.param("w2")
        y = p.complete()
        seen.update({"%h": str(h.type), "%a": str(a.type), "%p": str(p.type), "%y": str(y.type)})
        return {"s": y.sum()}

    dtm.eval_step(
        Fwd(),
        run,
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs={"x": dtm.Input((64, 256), "f32", ("dp", None))},
    )
    assert seen == want


def test_a_shape_error_names_the_users_line() -> None:
    def bad(m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
        return (m(x) @ m(x)).sum()  # [8,4] @ [8,4]: contracted dims differ

    line = inspect.getsourcelines(bad)[1] + 1
    with pytest.raises(TraceError) as info:
        dtm.train_step(mlp(), bad, mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.SGD(0.1))
    text = str(info.value)
    assert f"{__file__}:{line}:" in text and "contracted dims differ" in text
    assert "(m(x) @ m(x)).sum()" in text  # the source line is shown


def test_a_loss_that_is_not_a_scalar_is_named() -> None:
    with pytest.raises(TraceError, match="loss must be a float scalar; it is f32\\[8,4\\]"):
        dtm.train_step(
            mlp(), lambda m, x, y: m(x), mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.SGD(0.1)
        )


def test_a_gradient_through_an_op_without_a_rule_names_the_op_and_line() -> None:
    # every op the frontend emits has a rule; an op without one is refused at its line
    from dtm_mpi.ir.autodiff import backward
    from dtm_mpi.ir.build import FunctionBuilder
    from dtm_mpi.ir.types import Layout, TensorType

    b = FunctionBuilder(None)
    x = b.add_param("x", TensorType(DType.F32, (4, 8), Layout.replicated(2)))
    q, s = b.emit(
        "quantize",
        [x],
        {"block": 8},
        [
            TensorType(DType.I8, (4, 8), Layout.replicated(2)),
            TensorType(DType.F32, (4, 1), Layout.replicated(2)),
        ],
    )
    y = b.emit1("dequantize", [q, s], {"block": 8}, [x.type])
    loss = b.emit1("sum", [y], {"dims": (0, 1)})
    with pytest.raises(GradientError, match="dequantize has no gradient rule"):
        backward(b, list(b.ops), loss, [x])


def _layer_models() -> list[tuple[str, dtm.nn.Module, dict[str, dtm.Input]]]:
    x = {"x": dtm.Input((5, 6), "f64", ("dp", None))}
    return [
        ("linear", dtm.nn.Linear(6, 3, dtype="f64"), x),
        ("column", dtm.nn.ColumnParallelLinear(6, 7, dtype="f64"), x),
        (
            "row",
            dtm.nn.Sequential(
                dtm.nn.ColumnParallelLinear(6, 7, dtype="f64"),
                fn.tanh,
                dtm.nn.RowParallelLinear(7, 3, dtype="f64"),
            ),
            x,
        ),
        (
            "layernorm",
            dtm.nn.Sequential(dtm.nn.Linear(6, 6, dtype="f64"), dtm.nn.LayerNorm(6, dtype="f64")),
            x,
        ),
        ("mlp", dtm.nn.MLP(6, 9, dtype="f64"), x),
    ]


@pytest.mark.parametrize(
    ("name", "model", "inputs"), _layer_models(), ids=[m[0] for m in _layer_models()]
)
def test_layer_gradients_match_finite_differences_on_1_to_4_ranks(
    name: str, model: dtm.nn.Module, inputs: dict[str, dtm.Input]
) -> None:
    """One SGD step with lr 1 gives w - dL/dw: compared with central differences of the
    traced loss (an eval step), at every binding."""

    def loss(m: dtm.nn.Module, x: dtm.Tensor) -> dtm.Tensor:
        out = m(x)
        return ((out - 0.3) ** 2).mean() + (out * 0.1).sum()

    step = dtm.train_step(model, loss, mesh=MESH, inputs=inputs, optimizer=dtm.optim.SGD(1.0))
    ev = dtm.eval_step(model, loss, mesh=MESH, inputs=inputs)
    x = np.random.default_rng(1).normal(size=(5, 6))
    entry = step.module.entry
    assert entry is not None
    w0 = {
        p.name.lstrip("%"): init_global(p)
        for p in entry.params
        if p.name.lstrip("%") in step.params
    }
    ref = ev.module

    def L(w: dict[str, np.ndarray]) -> float:
        return float(run_reference(ref, {"x": x, **w})[1][0][0])

    grads = {k: numeric_gradient(L, w0, k) for k in w0}
    for nranks, binding in BINDINGS:
        res = run_simulated(step.module, nranks, binding=binding, inputs={"x": x})
        for k in step.params:
            got = w0[k] - res.params[k]
            np.testing.assert_allclose(
                got, grads[k], rtol=1e-6, atol=1e-7, err_msg=f"{name}: d/d{k} at {binding}"
            )


def test_tp_mlp_rebuilt_from_the_frontend_matches_the_hand_written_module() -> None:
    """examples/tp_mlp.dtm derives its backward pass by hand; the frontend's autodiff gives
    weights equal within 1e-6 after 5 SGD steps (4 simulated ranks, 2x2)."""
    hand = load_module((EXAMPLES / "tp_mlp.dtm").read_text())
    entry = hand.entry
    assert entry is not None
    params = {p.name.lstrip("%"): p for p in entry.params}

    class TpMlp(dtm.nn.Module):
        def __init__(self) -> None:
            self.w1 = dtm.nn.Parameter(
                (256, 1024), DType.F32, (None, "tp"), "normal", (("std", 0.02),), seed=1
            )
            self.w2 = dtm.nn.Parameter(
                (1024, 256), DType.F32, ("tp", None), "normal", (("std", 0.02),), seed=2
            )

        def forward(self, x: dtm.Tensor) -> dtm.Tensor:
            return (x @ self.param("w1")).gelu() @ self.param("w2")

    def loss(m: TpMlp, x: dtm.Tensor, target: dtm.Tensor) -> dtm.Tensor:
        d = m(x) - target
        return (d * d).mean()

    inputs = {
        "x": dtm.Input((64, 256), "f32", ("dp", None)),
        "target": dtm.Input((64, 256), "f32", ("dp", None)),
    }
    step = dtm.train_step(TpMlp(), loss, mesh=MESH, inputs=inputs, optimizer=dtm.optim.SGD(0.1))
    data = {k: init_global(params[k]) for k in ("x", "target")}
    want = run_simulated(hand, 4, binding={"dp": 2, "tp": 2}, steps=5)
    got = run_simulated(step.module, 4, binding={"dp": 2, "tp": 2}, inputs=data, steps=5)
    for k in ("w1", "w2"):
        np.testing.assert_allclose(got.params[k], want.params[k], rtol=0, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(got.results[-1][0]), float(want.results[-1][0]), rtol=1e-5)


def test_fit_on_simulated_ranks_learns_and_reports_every_step() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32) + 2 * (x[:, 2] > 0).astype(np.int32)
    step = dtm.train_step(
        mlp(), ce_loss, mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.AdamW(lr=3e-2)
    )
    seen: list[int] = []
    res = dtm.fit(
        step,
        dtm.ArrayLoader({"x": x, "y": y}, 8, seed=1),
        steps=60,
        sim=4,
        mesh={"dp": 2, "tp": 2},
        quiet=True,
        on_step=lambda i, m: seen.append(i),
    )
    assert seen == list(range(60)) and len(res.metrics) == 60
    first = np.mean([m["loss"] for m in res.metrics[:5]])
    last = np.mean([m["loss"] for m in res.metrics[-5:]])
    assert last < 0.6 * first, (first, last)
    assert set(step.params) <= set(res.outputs)
    # the same batches on another mesh: the same run up to float32 reassociation
    res3 = dtm.fit(
        step,
        dtm.ArrayLoader({"x": x, "y": y}, 8, seed=1),
        steps=60,
        sim=3,
        mesh={"dp": 1, "tp": 3},
        quiet=True,
    )
    np.testing.assert_allclose(
        [m["loss"] for m in res3.metrics], [m["loss"] for m in res.metrics], rtol=1e-4
    )


def test_the_loader_gives_each_rank_only_its_rows() -> None:
    x = np.arange(40 * 3).reshape(40, 3)
    loader = dtm.ArrayLoader({"x": x}, 8, seed=3)
    rows = loader.rows(6)
    whole = loader(6, {"x": (slice(0, 8), slice(0, 3))})["x"]
    half = loader(6, {"x": (slice(4, 8), slice(1, 3))})["x"]
    np.testing.assert_array_equal(whole, x[rows])
    np.testing.assert_array_equal(half, x[rows[4:8], 1:3])
    assert sorted(np.concatenate([loader.rows(s) for s in range(5)]).tolist()) == list(
        range(40)
    )  # one epoch: every row once
    with pytest.raises(UsageError, match="different lengths"):
        dtm.ArrayLoader({"x": x, "y": x[:5]}, 4)


def lm_loss(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
    logits = m(ids)
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def test_gpt_gradients_match_finite_differences_on_1_to_4_ranks() -> None:
    """Embedding (vocab over tp), attention (whole heads over tp: one GEMM per projection),
    MLP, layer norms and the vocab-parallel cross-entropy: one SGD step with lr 1 against
    central differences of the traced loss, at every binding."""
    b, t, v = 4, 6, 11
    inputs = {
        "ids": dtm.Input((b, t), "i32", ("dp", None)),
        "tgt": dtm.Input((b, t), "i32", ("dp", None)),
    }
    model = dtm.nn.GPT(v, t, 12, 6, 2, dtype="f64")
    step = dtm.train_step(model, lm_loss, mesh=MESH, inputs=inputs, optimizer=dtm.optim.SGD(1.0))
    ev = dtm.eval_step(model, lm_loss, mesh=MESH, inputs=inputs)
    rng = np.random.default_rng(0)
    data = {
        "ids": rng.integers(0, v, (b, t)).astype(np.int32),
        "tgt": rng.integers(0, v, (b, t)).astype(np.int32),
    }
    entry = step.module.entry
    assert entry is not None
    # the embedding is a lookup and its gradient a scatter-add (IR 1.1), not a one-hot product
    assert {"take", "scatter_add"} <= {op.name for op in entry.body}
    assert step.module.version == (1, 1)
    w0 = {
        p.name.lstrip("%"): init_global(p)
        for p in entry.params
        if p.name.lstrip("%") in step.params
    }

    def loss(w: dict[str, np.ndarray]) -> float:
        return float(run_reference(ev.module, {**data, **w})[1][0][0])

    got = {}
    for nranks, binding in BINDINGS:
        res = run_simulated(step.module, nranks, binding=binding, inputs=data)
        got[nranks] = {k: w0[k] - res.params[k] for k in step.params}
    checked = [
        "tok.weight",
        "pos",
        "blocks.0.attn.wq",
        "blocks.0.attn.wo",
        "blocks.1.attn.wv",
        "blocks.1.mlp.down.weight",
        "blocks.0.ln1.weight",
        "ln.bias",
        "head.weight",
    ]
    for k in checked:
        v0 = w0[k]
        for i in list(np.ndindex(v0.shape))[:: max(1, v0.size // 5)][:5]:
            fd = central_difference(loss, w0, k, i)
            for nranks, grads in got.items():
                assert abs(grads[k][i] - fd) <= 1e-6 * max(1.0, abs(fd)), (
                    k,
                    i,
                    nranks,
                    grads[k][i],
                    fd,
                )


def test_heads_that_do_not_divide_over_tp_are_a_plan_error_at_the_attention() -> None:
    """Each rank computes whole heads: 2 heads on 3 ranks is refused when the mesh is bound,
    naming the line of the user's code that called the model."""
    inputs = {
        "ids": dtm.Input((2, 4), "i32", ("dp", None)),
        "tgt": dtm.Input((2, 4), "i32", ("dp", None)),
    }
    model = dtm.nn.GPT(5, 4, 8, 2, 1, dtype="f64")
    step = dtm.train_step(model, lm_loss, mesh=MESH, inputs=inputs, optimizer=dtm.optim.SGD(1.0))
    compile_plan(step.module, mesh_for(step.module, 2, {"dp": 1, "tp": 2}))  # 1 head per rank
    with pytest.raises(PlanError, match=r"test_trace\.py:\d+:\d+: reshape: dim 1 \(size 8\) split"):
        compile_plan(step.module, mesh_for(step.module, 3, {"dp": 1, "tp": 3}))


def test_propagation_reproduces_the_hand_written_types_of_attention() -> None:
    """examples/attention.dtm (heads over tp, batch over dp) traced from its parameter layouts
    with the per-head formulation: q, k, v, the scores, softmax, per-head output, the
    pending sum over heads, its completion and the residual have the hand-written types."""
    hand = load_module((EXAMPLES / "attention.dtm").read_text())
    entry = hand.entry
    assert entry is not None
    want = {op.results[0]: str(op.result_types[0]) for op in entry.body}
    seen: dict[str, str] = {}

    class Attn(dtm.nn.Module):
        def __init__(self) -> None:
            for n in ("wq", "wk", "wv"):
                setattr(self, n, dtm.nn.Parameter((4, 64, 16), "f32", ("tp", None, None)))
            self.wo = dtm.nn.Parameter((4, 16, 64), "f32", ("tp", None, None))
            self.gamma = dtm.nn.Parameter((64,), "f32", None, "ones", ())
            self.beta = dtm.nn.Parameter((64,), "f32", None, "zeros", ())

    def run(m: Attn, x: dtm.Tensor) -> dict[str, dtm.Tensor]:
        lay = ("dp", "tp", None, None)
        xs = x.reshape(4, 1, 16, 64).broadcast_to((4, 4, 16, 64)).redistribute(lay)

        def per_head(name: str) -> dtm.Tensor:
            w = m.param(name)
            return w.reshape((1, *w.shape)).broadcast_to((4, *w.shape)).redistribute(lay)

        q, k, v = (xs @ per_head(n) for n in ("wq", "wk", "wv"))
        s = (q @ k.T) * 0.25
        p = s.softmax(3)
        o = p @ v
        ob = o @ per_head("wo")
        yp = ob.sum(1)
        y = yp.complete()
        r = x + y
        out = fn.layer_norm(r, m.param("gamma"), m.param("beta"))
        for key, t in (
            ("%q", q),
            ("%k", k),
            ("%v", v),
            ("%s", s),
            ("%p", p),
            ("%o", o),
            ("%ob", ob),
            ("%yp", yp),
            ("%y", y),
            ("%r", r),
            ("%out", out),
        ):
            seen[key] = str(t.type)
        return {"s": out.sum()}

    dtm.eval_step(
        Attn(), run, mesh=MESH, inputs={"x": dtm.Input((4, 16, 64), "f32", ("dp", None, None))}
    )
    assert seen == {k: want[k] for k in seen}


def test_user_mistakes_are_one_error_at_the_users_line() -> None:
    def traced(body: object) -> str:
        def fn_(m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
            return body(m(x), y)  # type: ignore[operator,no-any-return]

        with pytest.raises((TraceError, UsageError)) as info:
            dtm.train_step(mlp(), fn_, mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.SGD(0.1))
        return str(info.value)

    assert "cast the tensor first" in traced(lambda h, y: (y * 0.5).cast("f32").sum() + h.sum())
    assert "at most one -1" in traced(lambda h, y: h.reshape(-2, -16).sum())
    assert "no size for -1" in traced(lambda h, y: h.reshape(0, -1).sum())
    assert "not a permutation" in traced(lambda h, y: h.transpose(0, 3).sum())
    assert "names axis 'zz'" in traced(lambda h, y: h.redistribute(("zz", None)).sum())
    assert "use ints and slices" in traced(lambda h, y: h[True].sum())
    assert "must be 'tanh' or 'none'" in traced(lambda h, y: fn.gelu(h, approximate="erf").sum())
    with pytest.raises(UsageError, match=r"input 'x': .*names axis 'zz'"):
        dtm.train_step(
            mlp(),
            ce_loss,
            mesh=MESH,
            inputs={**INPUTS, "x": dtm.Input((8, 6), "f32", ("zz", None))},
            optimizer=dtm.optim.SGD(0.1),
        )
    with pytest.raises(UsageError, match="init 'xavier'"):
        bad = dtm.nn.Linear(6, 4)
        bad.weight = dtm.nn.Parameter((6, 4), "f32", None, "xavier")
        dtm.train_step(
            bad, lambda m, x, y: m(x).sum(), mesh=MESH, inputs=INPUTS, optimizer=dtm.optim.SGD(0.1)
        )


def test_a_plan_error_of_a_traced_step_names_the_users_line() -> None:
    """The traced module keeps the user's lines as spans: an op refused on the bound mesh
    (a head split that does not land on whole rows at tp=3) is reported there."""

    def loss(m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
        return m(x).reshape(8, 2, 2).sum()  # the [8,4] output split over tp... (replicated here)

    def split(m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
        return x.redistribute((None, "tp")).reshape(8, 2, 3).sum()

    line = inspect.getsourcelines(split)[1] + 1
    step = dtm.train_step(
        mlp(),
        lambda m, x, y: loss(m, x, y) + split(m, x, y),
        mesh=MESH,
        inputs=INPUTS,
        optimizer=dtm.optim.SGD(0.1),
    )
    from dtm_mpi.errors import PlanError

    with pytest.raises(PlanError) as info:
        run_simulated(
            step.module,
            3,
            binding={"dp": 1, "tp": 3},
            inputs={"x": np.zeros((8, 6), np.float32), "y": np.zeros(8, np.int32)},
        )
    assert f"{__file__}:{line}:" in str(info.value)


def test_tied_layers_share_one_parameter_and_ties_share_the_max_gradient() -> None:
    lin = dtm.nn.Linear(6, 6)
    step = dtm.train_step(
        dtm.nn.Sequential(lin, fn.tanh, lin),
        lambda m, x, y: m(x).sum(),
        mesh=MESH,
        inputs=INPUTS,
        optimizer=dtm.optim.SGD(0.1),
    )
    assert step.params == ("layers.0.weight", "layers.0.bias")

    b = FunctionBuilder(None)
    x = b.add_param("x", TensorType(DType.F64, (4,), Layout.replicated(1)))
    loss = b.emit1("max", [x], {"dims": (0,)})
    (g,) = backward(b, list(b.ops), loss, [x])
    f = b.function("f", [loss, g], entry=True)
    m = Module((1, 0), "t", (), (f,))
    out = evaluate_function(m, f, (np.array([1.0, 3.0, 3.0, 2.0]),), 0)
    np.testing.assert_array_equal(out[1], [0.0, 0.5, 0.5, 0.0])  # a subgradient: sums to 1


def test_slicing_a_sharded_tensor_gathers_only_the_cut_dim() -> None:
    seen: list[str] = []

    def run(m: dtm.nn.Module, x: dtm.Tensor) -> dict[str, dtm.Tensor]:
        part = x[:, :4]
        seen.append(part.tracer.b.ops[-2].name + " " + str(part.tracer.b.ops[-2].result_types[0]))
        return {"s": part.sum()}

    dtm.eval_step(
        dtm.nn.Linear(2, 2), run, mesh=MESH, inputs={"x": dtm.Input((8, 6), "f32", ("dp", "tp"))}
    )
    assert seen == ["allgather f32[8,6]{dp,-}"]


def test_propagation_that_gives_up_is_warned_at_the_users_line() -> None:
    def run(m: dtm.nn.Module, x: dtm.Tensor) -> dict[str, dtm.Tensor]:
        flat = x.reshape((48,))  # the split inner dim cannot land on the merged one
        return {"s": flat.sum()}

    line = inspect.getsourcelines(run)[1] + 1
    with pytest.warns(PropagationWarning) as caught:
        step = dtm.eval_step(
            dtm.nn.Linear(2, 2),
            run,
            mesh=MESH,
            inputs={"x": dtm.Input((8, 6), "f32", (None, "tp"))},
        )
    (note,) = step.fallbacks
    assert note.startswith(f"{__file__}:{line}: reshape ran replicated: no sharding rule takes ")
    assert "f32[8,6]{-,tp}" in note, note
    assert caught[0].filename == __file__ and caught[0].lineno == line
    from dtm_mpi.frontend.fit import explain_fit

    text = explain_fit(step, {"dp": 2, "tp": 2}, None)
    assert (
        f"where sharding propagation gave up (the op ran on replicated values):\n  {note}" in text
    )
    # a rule that takes the split value as it is: nothing to say
    ok = dtm.eval_step(
        dtm.nn.Linear(2, 2),
        lambda m, x: {"s": x.reshape((48,)).sum()},
        mesh=MESH,
        inputs={"x": dtm.Input((8, 6), "f32", ("tp", None))},
    )
    assert ok.fallbacks == ()


def test_exact_gelu_is_an_attribute_and_declares_ir_1_5() -> None:
    """``gelu(x, approximate="none")`` traces as ``gelu ... approximate none`` in a module
    that declares dtm 1.5; the default (tanh) form prints as every IR version reads it; the
    step's values are torch's gelu in both forms."""
    torch = pytest.importorskip("torch")

    x = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32) * 3
    for form, version in (("none", "dtm 1.5"), ("tanh", "dtm 1.")):
        step = dtm.forward_step(
            dtm.nn.Sequential(),
            lambda m, x, f=form: fn.gelu(x, approximate=f),
            mesh=MESH,
            inputs={"x": INPUTS["x"]},
        )
        assert step.text.startswith(version)
        assert ("approximate none" in step.text) == (form == "none")
        res = dtm.fit(
            step, lambda s, r: {"x": x[r["x"]]}, steps=1, sim=4, mesh={"dp": 2, "tp": 2}, quiet=True
        )
        want = torch.nn.functional.gelu(torch.from_numpy(x), approximate=form).numpy()
        np.testing.assert_allclose(res.tensors[0]["output"], want, rtol=1e-6, atol=1e-6)
