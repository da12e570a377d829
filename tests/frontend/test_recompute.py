"""Activation recomputation (dtm_mpi/frontend/recompute.py): ``train_step(recompute=...)``
rewrites the traced step so each block's reverse pass recomputes the activations it does not
keep; the same bits as without it (in deterministic mode and out of it), on one rank and over
dp, pipelined, with ZeRO-3 and with mixed precision; the planned peak per rank falls from
none to selective to full (``dtm explain`` lists the three); checkpoints move between the
choices; a bad choice is one error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.frontend.fit import explain_fit
from tests.frontend.test_fit_pipeline import deterministic  # noqa: F401 (a fixture)

B, T = 8, 16
CFG = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}


def _loss(m: Any, ids: dtm.Tensor) -> dtm.Tensor:
    return fn.causal_lm_loss(m(ids), ids)


def _feed(step: int, regions: Any) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(step).integers(0, 64, (B, T)).astype(np.int32)
    return {"ids": ids[regions["ids"]]}


def _step(recompute: Any, mesh: dtm.Mesh | None = None, dtype: str = "f64", **kw: Any) -> Any:
    return dtm.train_step(
        dtm.nn.Llama(CFG, axis="tp", dtype=dtype),
        _loss,
        mesh=mesh or dtm.Mesh(dp=1, tp=1),
        inputs={"ids": dtm.Input((B, T), "i32", ("dp", None))},
        optimizer=dtm.optim.AdamW(1e-2),
        clip_norm=1.0,
        recompute=recompute,
        **kw,
    )


def _same_bits(got: dtm.FitResult, want: dtm.FitResult) -> None:
    assert [m["loss"] for m in got.metrics] == [m["loss"] for m in want.metrics]
    differ = [k for k, v in want.outputs.items() if got.outputs[k].tobytes() != v.tobytes()]
    assert not differ, differ


def _keep_matmuls_and_softmax(op: str) -> bool:
    return op in ("matmul", "softmax")


@pytest.mark.parametrize(
    ("choice", "sizes"),
    [
        ("selective", {"dp": 1, "tp": 1}),
        ("full", {"dp": 2, "tp": 2}),
        (_keep_matmuls_and_softmax, {"dp": 2, "tp": 1}),
    ],
    ids=["selective-1rank", "full-dp2xtp2", "keep-dp2"],
)
def test_recomputed_steps_have_the_same_bits(choice: Any, sizes: dict[str, int]) -> None:
    mesh = dtm.Mesh(**sizes)
    ranks = sizes["dp"] * sizes["tp"]
    want = dtm.fit(_step("none", mesh), _feed, steps=2, sim=ranks, quiet=True)
    step = _step(choice, mesh)
    plain = _step("none", mesh)
    assert len(step.module.entry.body) > len(plain.module.entry.body)  # the recomputed ops
    assert step.identity is not None and step.identity.entry == plain.module.entry
    _same_bits(dtm.fit(step, _feed, steps=2, sim=ranks, quiet=True), want)


def test_in_deterministic_mode_too(deterministic: object) -> None:  # noqa: F811
    mesh = dtm.Mesh(dp=2, tp=1)
    want = dtm.fit(_step("none", mesh, dtype="f32"), _feed, steps=2, sim=1, quiet=True)
    got = dtm.fit(_step("full", mesh, dtype="f32"), _feed, steps=2, sim=2, quiet=True)
    _same_bits(got, want)


def test_the_peak_per_rank_falls_from_none_to_selective_to_full() -> None:
    from dtm_mpi.plan.cost import function_cost
    from dtm_mpi.plan.program import compile_plan, mesh_for

    peaks = {}
    for choice in ("none", "selective", "full"):
        s = _step(choice, dtype="f32")
        plan = compile_plan(s.module, mesh_for(s.module, 1, None))
        peaks[choice] = max(function_cost(plan, plan.entry_plan).peak)
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
    text = explain_fit(_step("selective", dtype="f32"), None, 1)
    tail = text[text.index("activation recomputation") :].splitlines()
    assert [line.split()[0] for line in tail[1:]] == ["none", "selective", "full"]
    assert "(this step)" in tail[2]


def test_pipelined_zero3_and_mixed_precision_steps_recompute_too() -> None:
    mesh = dtm.Mesh(pp=1, dp=1, tp=1)
    want = dtm.fit(_step("none", mesh), _feed, steps=2, sim=1, quiet=True)
    piped = _step("full", mesh, pipeline=dtm.Pipeline(microbatches=2))
    got = dtm.fit(piped, _feed, steps=2, sim=2, mesh={"pp": 2}, quiet=True)
    np.testing.assert_allclose(
        [m["loss"] for m in got.metrics], [m["loss"] for m in want.metrics], rtol=1e-12
    )
    dp2 = dtm.Mesh(dp=2, tp=1)
    zero3 = dtm.fit(_step("none", dp2, shard_params="dp"), _feed, steps=2, sim=2, quiet=True)
    _same_bits(
        dtm.fit(_step("full", dp2, shard_params="dp"), _feed, steps=2, sim=2, quiet=True), zero3
    )
    bf16 = dtm.MixedPrecision()
    mixed = dtm.fit(_step("none", dp2, "f32", precision=bf16), _feed, steps=2, sim=2, quiet=True)
    again = _step("selective", dp2, "f32", precision=bf16)
    _same_bits(dtm.fit(again, _feed, steps=2, sim=2, quiet=True), mixed)


def test_checkpoints_move_between_the_choices(tmp_path: Path) -> None:
    want = dtm.fit(_step("none"), _feed, steps=4, sim=1, quiet=True)
    a = dtm.CheckpointPolicy(str(tmp_path / "a"), every=2)
    dtm.fit(_step("full"), _feed, steps=2, sim=1, checkpoint=a, quiet=True)
    again = dtm.CheckpointPolicy(str(tmp_path / "a"), resume=True)
    got = dtm.fit(_step("selective"), _feed, steps=4, sim=1, checkpoint=again, quiet=True)
    assert [m["loss"] for m in got.metrics] == [m["loss"] for m in want.metrics[2:]]


def test_a_bad_choice_is_one_error() -> None:
    with pytest.raises(UsageError, match=r"recompute='some': one of 'none', 'selective', 'full'"):
        _step("some")
    with pytest.raises(UsageError, match="the model has no list of layers"):
        dtm.train_step(
            dtm.nn.Linear(4, 4, dtype="f64"),
            lambda m, x: m(x).sum(),
            mesh=dtm.Mesh(dp=1),
            inputs={"x": dtm.Input((2, 4), "f64")},
            optimizer=dtm.optim.SGD(0.1),
            recompute="full",
        )
