"""``adamw`` (IR 1.3): one op per parameter with exactly the bits of the composed update, on
every mesh; its rule's errors at the operand; the version rule; the frontend's AdamW emits it
and trains to the bits of the ops one by one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import VerifyError
from dtm_mpi.frontend import optim as optim_module
from dtm_mpi.ir import load_module, print_module
from dtm_mpi.ir.ops.update import CHUNK
from dtm_mpi.ir.registry import OPS, all_ops
from dtm_mpi.runtime.simulate import run_simulated
from tests.frontend.test_optim import batch, digits_step

ATTRS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "decay": 0.01}


def composed(p: Any, g: Any, m: Any, v: Any, bc1: Any, bc2: Any, decay: float) -> tuple[Any, ...]:
    """The update written with the registry's elementwise ops one by one (each result rounded
    to the dtype), as the frontend wrote it before the op existed."""
    all_ops()
    f = {n: OPS[n].array_fn for n in ("add", "sub", "mul", "div", "sqrt")}
    dt = p.dtype

    def c(x: float) -> Any:
        return np.full(p.shape, x, dtype=dt)

    def call(name: str, *xs: Any) -> Any:
        return np.asarray(f[name](np, *xs), dtype=dt)  # type: ignore[misc]

    m2 = call("add", call("mul", m, c(0.9)), call("mul", g, c(1.0 - 0.9)))
    v2 = call("add", call("mul", v, c(0.999)), call("mul", call("mul", g, g), c(1.0 - 0.999)))
    mh = call("div", m2, np.broadcast_to(bc1, p.shape))
    vh = call("div", v2, np.broadcast_to(bc2, p.shape))
    step = call("div", mh, call("add", call("sqrt", vh), c(1e-8)))
    if decay:
        step = call("add", step, call("mul", p, c(decay)))
    return call("sub", p, call("mul", step, c(1e-3))), m2, v2


@pytest.mark.parametrize("dtype", ["f16", "f32", "f64"])
@pytest.mark.parametrize("decay", [0.0, 0.01])
@pytest.mark.parametrize("n", [2 * CHUNK + 37, 1000])  # three chunks, the last partial; one
def test_the_op_gives_the_bits_of_the_composed_update_across_chunks(
    dtype: str, decay: float, n: int
) -> None:
    np_dt = {"f16": np.float16, "f32": np.float32, "f64": np.float64}[dtype]
    rng = np.random.default_rng(5)
    p, g = (rng.standard_normal(n).astype(np_dt) for _ in range(2))
    m = (rng.standard_normal(n) * 0.1).astype(np_dt)
    v = np.abs(rng.standard_normal(n) * 0.01).astype(np_dt)
    bc1, bc2 = np.asarray(1 - 0.9**3, np_dt), np.asarray(1 - 0.999**3, np_dt)
    text = f"""dtm 1.3
module upd
entry func @main(%p: {dtype}[{n}], %g: {dtype}[{n}], %m: {dtype}[{n}], %v: {dtype}[{n}],
                 %a: {dtype}[], %b: {dtype}[]) -> ({dtype}[{n}], {dtype}[{n}], {dtype}[{n}]) {{
  %p2, %m2, %v2 = adamw %p, %g, %m, %v, %a, %b lr 0.001 beta1 0.9 beta2 0.999 eps 1e-08 decay {decay} : {dtype}[{n}], {dtype}[{n}], {dtype}[{n}]
  return %p2, %m2, %v2
}}
"""
    module = load_module(text, "upd.dtm")
    assert print_module(load_module(print_module(module))) == print_module(module)
    got = run_simulated(
        module, 1, inputs={"p": p, "g": g, "m": m, "v": v, "a": bc1, "b": bc2}
    ).results[0]
    want = composed(p, g, m, v, bc1, bc2, decay)
    for name, a, b in zip(("p2", "m2", "v2"), got, want, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name


def _module(p: str, g: str, bc: str, attrs: str = "beta1 0.9") -> str:
    return f"""dtm 1.3
module bad
mesh @m = [dp=2]
entry func @main(%p: {p}, %g: {g}, %a: {bc}) -> f32[8]{{dp}} on @m {{
  %p2, %m2, %v2 = adamw %p, %g, %p, %p, %a, %a lr 0.1 {attrs} beta2 0.99 eps 1e-08 decay 0.0 : f32[8]{{dp}}, f32[8]{{dp}}, f32[8]{{dp}}
  return %p2
}}
"""


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        (
            _module("f32[8]{dp}", "f32[8]", "f32[]"),
            "5:29",
            "the gradient must have the parameter's type f32[8]{dp}; got f32[8]",
        ),
        (
            _module("f32[8]{dp}", "f32[8]{dp}", "f32[2]"),
            "5:41",
            "bc1 must be a complete f32[] scalar; got f32[2]",
        ),
        (
            _module("f32[8]{dp}", "f32[8]{dp}", "f64[]"),
            "5:41",
            "bc1 must be a complete f32[] scalar; got f64[]",
        ),
        (
            _module("f32[8]{dp}", "f32[8]{dp}", "f32[]", "beta1 1.0"),
            "5:61",
            "beta1 must be in [0, 1); got 1.0",
        ),
    ],
)
def test_a_bad_update_is_named_at_its_operand(text: str, where: str, message: str) -> None:
    with pytest.raises(VerifyError) as info:
        load_module(text, "bad.dtm")
    assert message in str(info.value)
    assert f"{info.value.span.line}:{info.value.span.col}" == where, str(info.value)


def test_a_module_using_it_declares_1_3() -> None:
    text = _module("f32[8]{dp}", "f32[8]{dp}", "f32[]").replace("dtm 1.3", "dtm 1.2")
    with pytest.raises(
        VerifyError, match=r"adamw is new in IR dtm 1\.3; this module declares dtm 1\.2"
    ):
        load_module(text, "old.dtm")


@pytest.mark.parametrize("opt", [dtm.optim.AdamW(3e-3), dtm.optim.Adam(1e-3, weight_decay=0.1)])
def test_the_frontends_adam_emits_one_op_per_parameter_with_the_composed_bits(
    opt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = digits_step(opt)
    assert fused.text.startswith("dtm 1.3") and fused.text.count("= adamw ") == 4
    monkeypatch.setattr(optim_module, "ADAMW_DTYPES", frozenset())  # the ops one by one
    plain = digits_step(opt)
    assert "= adamw " not in plain.text
    n_fused, n_plain = (len(s.module.entry.body) for s in (fused, plain))
    assert n_fused < n_plain - 4 * 8  # a dozen ops a parameter become one
    data = batch()
    for ranks, binding in ((4, {"dp": 2, "tp": 2}), (3, {"dp": 3, "tp": 1})):
        a, b = (
            run_simulated(s.module, ranks, binding=binding, inputs=data, steps=3).params
            for s in (fused, plain)
        )
        for k in b:
            assert a[k].tobytes() == b[k].tobytes(), k
