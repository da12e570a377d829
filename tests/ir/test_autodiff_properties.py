"""Hypothesis-generated chains of ops with random layouts, differentiated: the gradients of
the generated backward pass equal central finite differences (float64, on the reference), and
the module runs on the simulated ranks of its mesh (uneven splits included) with the
reference's loss and gradients."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtm_mpi.ir import load_module, print_module
from dtm_mpi.ir.autodiff import backward
from dtm_mpi.ir.build import FunctionBuilder, Value
from dtm_mpi.ir.nodes import MeshDecl, Module
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.runtime.reference import evaluate_function
from dtm_mpi.runtime.simulate import run_simulated
from tests.depth import examples
from tests.ir.gradcheck import numeric_gradient

LAYOUTS = [
    ((), ()),
    (("dp",), ()),
    ((), ("tp",)),
    (("dp",), ("tp",)),
    (("tp",), ("dp",)),
    (("dp", "tp"), ()),
]
UNARY = ["tanh", "sigmoid", "gelu", "neg", "abs", "relu"]
BINARY = ["add", "sub", "mul", "maximum", "minimum"]


@st.composite
def programs(draw: st.DrawFn) -> tuple[Module, int]:
    dp, tp = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1)]))
    mesh = MeshDecl("m", (("dp", dp), ("tp", tp)))
    b = FunctionBuilder(mesh, module_name="chain")
    rows, cols = draw(st.integers(2, 5)), draw(st.integers(2, 5))

    def param(name: str, shape: tuple[int, int]) -> Value:
        return b.add_param(
            name, TensorType(DType.F64, shape, Layout(draw(st.sampled_from(LAYOUTS))))
        )

    x = param("x", (rows, cols))
    y = param("y", (rows, cols))
    w = param("w", (cols, cols))
    cur = x
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(
            st.sampled_from(
                ["unary", "binary", "matmul", "reduce", "softmax", "layout", "transpose"]
            )
        )
        if kind == "unary":
            cur = b.apply1(draw(st.sampled_from(UNARY)), [cur])
        elif kind == "binary" and cur.type.shape == y.type.shape:
            cur = b.apply1(draw(st.sampled_from(BINARY)), [cur, y])
        elif kind == "matmul" and cur.type.shape[-1] == cols:
            cur = b.apply1("matmul", [cur, w])
        elif kind == "reduce":
            dim = draw(st.integers(0, 1))
            s = b.apply1(
                draw(st.sampled_from(["sum", "mean", "max"])),
                [cur],
                {"dims": (dim,), "keepdims": True},
            )
            cur = b.apply1(
                "sub",
                [
                    cur,
                    b.apply1(
                        "broadcast_to",
                        [s],
                        {},
                        [TensorType(DType.F64, cur.type.shape, Layout.replicated(2))],
                    ),
                ],
            )
        elif kind == "softmax":
            cur = b.apply1(
                draw(st.sampled_from(["softmax", "log_softmax"])),
                [cur],
                {"dim": draw(st.integers(0, 1))},
            )
        elif kind == "layout":
            cur = b.to_layout(cur, Layout(draw(st.sampled_from(LAYOUTS))))
        elif kind == "transpose" and cur.type.shape[0] == cur.type.shape[1]:
            cur = b.apply1("transpose", [cur], {"perm": (1, 0)})
    r = b.add_param("r", TensorType(DType.F64, cur.type.shape, Layout(cur.type.layout.dims)))
    loss = b.complete(b.apply1("sum", [b.apply1("mul", [cur, r])], {"dims": (0, 1)}))
    grads = backward(b, list(b.ops), loss, [x, y, w])
    f = b.function("f", [loss, *grads], entry=True)
    return load_module(print_module(Module((1, 0), "chain", (mesh,), (f,)))), dp * tp


@settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=programs(), seed=st.integers(0, 2**16))
def test_random_chains_differentiate_correctly_on_their_mesh(
    case: tuple[Module, int], seed: int
) -> None:
    module, nranks = case
    entry = module.entry
    assert entry is not None
    rng = np.random.default_rng(seed)
    values = {p.name.lstrip("%"): rng.normal(size=p.type.shape) for p in entry.params}
    args = tuple(values[p.name.lstrip("%")] for p in entry.params)
    want = evaluate_function(module, entry, args, 0)

    def loss(a: tuple[np.ndarray, ...]) -> float:
        return float(evaluate_function(module, entry, a, 0)[0])

    for k in range(3):  # x, y, w
        num = numeric_gradient(loss, args, k)
        # a kink of relu/abs/max within the step makes one difference meaningless: allow it
        bad = ~np.isclose(
            want[1 + k], num, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(num).max()))
        )
        assert bad.sum() <= max(1, bad.size // 10), (k, want[1 + k], num)
    sizes = dict(module.meshes[0].axes)
    got = run_simulated(module, nranks, binding=sizes, inputs=values).results[0]
    for g, wv in zip(got, want, strict=True):
        np.testing.assert_allclose(g, wv, rtol=1e-9, atol=1e-9)
