"""Learning-rate schedules (dtm_mpi/frontend/lr_schedule.py): computed inside the traced step
from ``step_index`` and logged as the ``lr`` metric, equal to the Python formula; SGD and AdamW
(the ``adamw`` op's ``scale`` operand, IR 1.5) update by the step's rate; a resumed run
continues the curve on another mesh; bad arguments are one clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError, VerifyError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.ir import load_module
from dtm_mpi.ir.types import DType

MESH = {"dp": 2, "tp": 2}
X = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 4, 8).astype(np.int32)
INPUTS = {"x": dtm.Input((8, 6), "f32", ("dp", None)), "y": dtm.Input((8,), "i32", ("dp",))}


def loader(step: int, rows: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"x": X[rows["x"]], "y": Y[rows["y"]]}


def mlp_step(optimizer: Any, dtype: str = "f32") -> Any:
    model = dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(6, 10, dtype=dtype),
        fn.gelu,
        dtm.nn.RowParallelLinear(10, 4, dtype=dtype),
    )
    inputs = {**INPUTS, "x": dtm.Input((8, 6), dtype, ("dp", None))}
    return dtm.train_step(
        model,
        lambda m, x, y: fn.cross_entropy(m(x), y),
        mesh=dtm.Mesh(**MESH),
        inputs=inputs,
        optimizer=optimizer,
    )


SCHEDULES = [
    dtm.optim.schedule("cosine", peak=0.1, warmup=3, total=10, floor=0.1),
    dtm.optim.schedule("linear", peak=0.05, warmup=2, total=9),
    dtm.optim.schedule("wsd", peak=0.02, warmup=1, total=12, floor=0.05, decay=4),
    dtm.optim.schedule("constant", peak=0.03, warmup=4, total=12),
    dtm.optim.schedule("cosine", peak=1.0, total=5),  # no warmup
]


@pytest.mark.parametrize("sch", SCHEDULES, ids=lambda s: f"{s.kind}-w{s.warmup}")
def test_the_traced_rate_is_the_formula_at_every_step(sch: dtm.optim.Schedule) -> None:
    """The factor the step computes from ``step_index`` (float32) is ``Schedule.factor``;
    a training step reports ``Schedule.lr`` as its ``lr`` metric each step."""
    traced = dtm.forward_step(
        dtm.nn.Sequential(),
        lambda m, x: x * 0.0 + sch.traced_factor(x.tracer, DType.F32),
        mesh=dtm.Mesh(dp=2),
        inputs={"x": dtm.Input((2,), "f32", ("dp",))},
    )
    zeros = np.zeros(2, np.float32)
    res = dtm.fit(
        traced, lambda s, r: {"x": zeros[r["x"]]}, steps=14, sim=2, mesh={"dp": 2}, quiet=True
    )
    got = [float(t["output"][0]) for t in res.tensors]
    np.testing.assert_allclose(got, [sch.factor(s) for s in range(14)], rtol=1e-6, atol=1e-9)
    step = mlp_step(dtm.optim.SGD(lr=sch))
    assert step.metrics == ("loss",) and step.schedule == sch  # the module has no lr result
    res = dtm.fit(step, loader, steps=5, sim=4, mesh=MESH, quiet=True)
    assert [m["lr"] for m in res.metrics] == [sch.lr(s) for s in range(5)]


def test_the_shapes_of_the_curves() -> None:
    cos = dtm.optim.schedule("cosine", peak=1.0, warmup=4, total=104, floor=0.1)
    assert [cos.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.factor(54) == pytest.approx(0.55)  # half way: the mean of peak and floor
    assert cos.factor(104) == cos.factor(500) == pytest.approx(0.1)
    wsd = dtm.optim.schedule("wsd", peak=1.0, total=100, decay=20)
    assert wsd.factor(0) == wsd.factor(80) == 1.0 and wsd.factor(90) == 0.5
    assert wsd.factor(100) == 0.0
    lin = dtm.optim.schedule("linear", peak=2.0, total=10)
    assert lin.lr(5) == 1.0


def test_sgd_updates_by_each_steps_rate() -> None:
    """A linear loss (gradient constant): after k steps w = w0 - sum of the step rates * g."""
    sch = dtm.optim.schedule("cosine", peak=0.5, warmup=2, total=6, floor=0.2)
    model = dtm.nn.Linear(6, 1, bias=False, dtype="f64")
    inputs = {"x": dtm.Input((8, 6), "f64", ("dp", None))}
    step = dtm.train_step(
        model,
        lambda m, x: m(x).sum(),
        mesh=dtm.Mesh(dp=2),
        inputs=inputs,
        optimizer=dtm.optim.SGD(lr=sch),
    )
    x = X.astype(np.float64)
    w0 = np.random.default_rng(4).standard_normal((6, 1))
    res = dtm.fit(
        step,
        lambda s, r: {"x": x[r["x"]]},
        steps=8,
        sim=2,
        mesh={"dp": 2},
        values={"weight": w0},
        quiet=True,
    )
    g = x.sum(0).reshape(6, 1)
    want = w0 - sum(sch.lr(s) for s in range(8)) * g
    np.testing.assert_allclose(res.outputs["weight"], want, rtol=1e-12)


def test_adamw_with_a_constant_schedule_gives_the_bits_of_the_plain_rate() -> None:
    """``scale`` of 1: ``lr * 1`` rounds to ``lr``, so the op gives the bits without it; in
    float32 (one adamw op) and bf16 (the composed ops)."""
    for dtype in ("f32", "bf16"):
        plain = mlp_step(dtm.optim.AdamW(0.01), dtype)
        sch = mlp_step(dtm.optim.AdamW(dtm.optim.schedule("constant", peak=0.01, total=3)), dtype)
        if dtype == "f32":
            assert " scale %" in sch.text and sch.text.startswith("dtm 1.5")
            assert " scale %" not in plain.text
        a = dtm.fit(plain, loader, steps=3, sim=4, mesh=MESH, quiet=True)
        b = dtm.fit(sch, loader, steps=3, sim=4, mesh=MESH, quiet=True)
        for name in plain.params:
            assert a.outputs[name].tobytes() == b.outputs[name].tobytes(), (dtype, name)


def test_adamw_follows_the_schedule() -> None:
    """A warmup schedule's first step equals a plain AdamW step at the first step's rate."""
    sch = dtm.optim.schedule("linear", peak=0.04, warmup=4, total=8)
    step = mlp_step(dtm.optim.AdamW(sch))
    a = dtm.fit(step, loader, steps=1, sim=4, mesh=MESH, quiet=True)
    b = dtm.fit(mlp_step(dtm.optim.AdamW(0.01)), loader, steps=1, sim=4, mesh=MESH, quiet=True)
    for name in step.params:
        np.testing.assert_allclose(a.outputs[name], b.outputs[name], rtol=1e-6, atol=1e-8)


def test_a_resumed_run_continues_the_curve_on_another_mesh(tmp_path: Path) -> None:
    sch = dtm.optim.schedule("cosine", peak=0.1, warmup=2, total=8)
    step = mlp_step(dtm.optim.AdamW(sch))
    full = dtm.fit(step, loader, steps=8, sim=4, mesh=MESH, quiet=True)
    save = dtm.CheckpointPolicy(str(tmp_path / "s"), every=4)
    dtm.fit(step, loader, steps=4, sim=4, mesh=MESH, checkpoint=save, quiet=True)
    again = dtm.CheckpointPolicy(str(tmp_path / "s"), resume=True)
    rest = dtm.fit(
        step, loader, steps=8, sim=2, mesh={"dp": 1, "tp": 2}, checkpoint=again, quiet=True
    )
    assert [m["step"] for m in rest.metrics] == [4.0, 5.0, 6.0, 7.0]
    assert [m["lr"] for m in rest.metrics] == [m["lr"] for m in full.metrics[4:]]
    for name in step.params:
        np.testing.assert_allclose(rest.outputs[name], full.outputs[name], rtol=1e-5, atol=1e-7)


def test_the_scale_operand_is_new_in_ir_1_5() -> None:
    text = mlp_step(dtm.optim.AdamW(dtm.optim.schedule("cosine", peak=0.1, total=4))).text
    load_module(text)
    with pytest.raises(VerifyError, match=r"adamw's operand scale is new in IR dtm 1\.5"):
        load_module(text.replace("dtm 1.5", "dtm 1.4", 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "cosin", "peak": 0.1, "total": 5}, "schedule kind 'cosin' is not one of"),
        ({"kind": "cosine", "peak": -1.0, "total": 5}, "peak must be a finite"),
        ({"kind": "cosine", "peak": 0.1, "total": 0}, "total must be at least 1"),
        ({"kind": "cosine", "peak": 0.1, "total": 5, "warmup": 6}, "warmup (6 steps) is longer"),
        ({"kind": "cosine", "peak": 0.1, "total": 5, "warmup": 1.5}, "whole number of steps"),
        ({"kind": "linear", "peak": 0.1, "total": 5, "floor": 1.5}, "floor is a fraction"),
        ({"kind": "linear", "peak": 0.1, "total": 5, "decay": 2}, "decay is the final decay"),
        (
            {"kind": "wsd", "peak": 0.1, "total": 5, "warmup": 2, "decay": 4},
            "wsd decay must be 1 to 3",
        ),
    ],
)
def test_bad_arguments_are_one_error(kwargs: dict[str, Any], message: str) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(UsageError) as info:
        dtm.optim.schedule(kind, **kwargs)
    assert message in str(info.value)


def test_a_scheduled_step_is_the_same_program_pipelined_or_not() -> None:
    """The rate is not a result of the module: a checkpoint moves between the two."""
    from tests.pipeline_case import gpt, lm_loss, token_inputs

    def traced(pipeline: dtm.Pipeline | None) -> Any:
        return dtm.train_step(
            gpt(),
            lm_loss,
            mesh=dtm.Mesh(pp=1, dp=1, tp=1),
            inputs=token_inputs(4),
            optimizer=dtm.optim.AdamW(dtm.optim.schedule("cosine", peak=0.01, total=6)),
            pipeline=pipeline,
        )

    assert traced(dtm.Pipeline(microbatches=2)).hash == traced(None).hash


def test_a_metric_named_lr_and_a_bad_lr_are_refused() -> None:
    with pytest.raises(UsageError, match="a metric named 'lr'"):
        dtm.train_step(
            dtm.nn.Linear(6, 4),
            lambda m, x, y: (m(x).sum(), {"lr": m(x).mean()}),
            mesh=dtm.Mesh(**MESH),
            inputs=INPUTS,
            optimizer=dtm.optim.SGD(dtm.optim.schedule("linear", peak=0.1, total=3)),
        )
    with pytest.raises(UsageError, match="lr must be a number or a schedule"):
        dtm.optim.AdamW(lr="0.1")  # type: ignore[arg-type]
