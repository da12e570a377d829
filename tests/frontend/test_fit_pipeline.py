"""Pipelined training through fit() and the one step loop, on simulated ranks: a train_step
with ``pipeline=dtm.Pipeline(...)`` trains as the unpipelined step does (every schedule, pp
alone and with dp or tp; float64, to rounding), keeps the same module and state names, and its
checkpoints move both ways between pipelined and unpipelined runs on other meshes; every
misuse is one error naming what."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.frontend.stage_split import even_splits
from tests.pipeline_case import T, gpt, lm_loss, token_batch

BATCH = 8
INPUTS = {k: dtm.Input((BATCH, T), "i32", ("dp", None)) for k in ("ids", "tgt")}
MESH = dtm.Mesh(pp=1, dp=1, tp=1)


def loader(step: int, regions: Mapping[str, tuple[slice, ...]]) -> dict[str, np.ndarray]:
    rows = regions["ids"][0].stop if "ids" in regions else BATCH
    data = token_batch(max(BATCH, rows), 100 + step)
    return {k: data[k][r] for k, r in regions.items()}


def _step(pipeline: dtm.Pipeline | None = None, batch: int = BATCH, **kw: object) -> dtm.TracedStep:
    return dtm.train_step(
        gpt(),
        lm_loss,
        mesh=MESH,
        inputs={k: dtm.Input((batch, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(lr=1e-2),
        clip_norm=0.5,
        pipeline=pipeline,
        **kw,  # type: ignore[arg-type]
    )


_REFERENCE: dict[int, dtm.FitResult] = {}


def _reference(steps: int) -> dtm.FitResult:
    """The unpipelined training on one simulated rank."""
    if steps not in _REFERENCE:
        _REFERENCE[steps] = dtm.fit(_step(), loader, steps=steps, sim=1, quiet=True)
    return _REFERENCE[steps]


def _same_training(got: dtm.FitResult, want: dtm.FitResult, first: int = 0) -> None:
    """``got`` trained as ``want`` did (from step ``first``): losses, final state."""
    np.testing.assert_allclose(
        [m["loss"] for m in got.metrics], [m["loss"] for m in want.metrics[first:]], rtol=1e-12
    )
    assert sorted(got.outputs) == sorted(want.outputs)
    for k, v in want.outputs.items():
        np.testing.assert_allclose(got.outputs[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


CASES = [
    ("pp2-1f1b", {"pp": 2}, "1f1b", 1, 4),
    ("pp4-gpipe", {"pp": 4}, "gpipe", 1, 4),
    ("dp2xpp2-zb-h1", {"pp": 2, "dp": 2}, "zb-h1", 1, 2),
    ("tp2xpp2-gpipe", {"pp": 2, "tp": 2}, "gpipe", 1, 2),
    ("pp2x2chunks-interleaved", {"pp": 2}, "interleaved", 2, 2),
    ("pp1-accumulation", {"pp": 1, "dp": 2}, "1f1b", 1, 2),
]


@pytest.mark.parametrize(
    ("mesh", "schedule", "chunks", "m"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_pipelined_fit_trains_as_the_unpipelined_one(
    mesh: dict[str, int], schedule: str, chunks: int, m: int
) -> None:
    step = _step(dtm.Pipeline(microbatches=m, schedule=schedule, chunks=chunks))
    assert step.hash == _step().hash  # the same program: its state moves between the two
    ranks = int(np.prod(list(mesh.values())))
    got = dtm.fit(step, loader, steps=3, sim=ranks, mesh=mesh, quiet=True)
    _same_training(got, _reference(3))


def test_checkpoints_move_between_pipelined_and_unpipelined_runs(tmp_path: Path) -> None:
    """pp=2 x tp=2 (zb-h1) checkpointed, resumed without a pipeline on dp=2; and an
    unpipelined checkpoint resumed on pp=2: both equal the uninterrupted training."""
    piped = _step(dtm.Pipeline(microbatches=2, schedule="zb-h1"))
    a = dtm.CheckpointPolicy(str(tmp_path / "a"), every=2)
    dtm.fit(piped, loader, steps=2, sim=4, mesh={"pp": 2, "tp": 2}, checkpoint=a, quiet=True)
    resumed = dtm.CheckpointPolicy(str(tmp_path / "a"), resume=True)
    got = dtm.fit(_step(), loader, steps=4, sim=2, mesh={"dp": 2}, checkpoint=resumed, quiet=True)
    _same_training(got, _reference(4), first=2)

    b = dtm.CheckpointPolicy(str(tmp_path / "b"), every=2)
    dtm.fit(_step(), loader, steps=2, sim=2, mesh={"tp": 2}, checkpoint=b, quiet=True)
    resumed = dtm.CheckpointPolicy(str(tmp_path / "b"), resume=True)
    got = dtm.fit(piped, loader, steps=4, sim=2, mesh={"pp": 2}, checkpoint=resumed, quiet=True)
    _same_training(got, _reference(4), first=2)


def test_even_splits_cut_the_longest_layer_list_evenly() -> None:
    model = dtm.nn.GPT(11, T, 16, 2, 6, dtype="f64")
    assert even_splits(model, 1) == []
    assert even_splits(model, 2) == ["blocks.3"]
    assert even_splits(model, 3) == ["blocks.2", "blocks.4"]
    assert even_splits(model, 4) == ["blocks.1", "blocks.3", "blocks.4"]
    with pytest.raises(UsageError, match="7 pipeline stages need at least 7 layers in 'blocks'"):
        even_splits(model, 7)


def test_a_mesh_without_the_pipeline_axis_is_refused_when_tracing() -> None:
    with pytest.raises(UsageError, match=r"Pipeline\(axis=.pp.\): the mesh Mesh\(dp=1, tp=1\)"):
        dtm.train_step(
            gpt(),
            lm_loss,
            mesh=dtm.Mesh(dp=1, tp=1),
            inputs=INPUTS,
            optimizer=dtm.optim.SGD(lr=0.1),
            pipeline=dtm.Pipeline(),
        )


def test_an_unknown_schedule_is_refused_when_tracing() -> None:
    with pytest.raises(UsageError, match="unknown pipeline schedule 'zigzag'"):
        _step(dtm.Pipeline(schedule="zigzag"))


def test_metrics_besides_the_loss_are_refused_for_a_pipelined_step() -> None:
    def with_metric(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> object:
        loss = lm_loss(m, ids, tgt)
        return loss, {"twice": loss * 2.0}

    with pytest.raises(UsageError, match=r"reports its loss only.*twice"):
        dtm.train_step(
            gpt(),
            with_metric,
            mesh=MESH,
            inputs=INPUTS,
            optimizer=dtm.optim.SGD(lr=0.1),
            pipeline=dtm.Pipeline(),
        )


@pytest.mark.parametrize(
    ("pipeline", "mesh", "message"),
    [
        (
            dtm.Pipeline(splits=("blocks.2",)),
            {"pp": 4},
            r"cuts the model into 2 stages; the run has 4",
        ),
        (
            dtm.Pipeline(microbatches=3),
            {"pp": 2},
            r"input 'ids': its first dimension \(8\) is not a multiple of 3 microbatches",
        ),
        (
            dtm.Pipeline(microbatches=8),
            {"pp": 1, "dp": 2},
            r"rank 0's block of 4 row\(s\) does not split into 8 microbatches",
        ),
        (dtm.Pipeline(chunks=2), {"pp": 2}, "need the interleaved schedule"),
        (
            dtm.Pipeline(schedule="interleaved", chunks=4),
            {"pp": 2},
            "8 pipeline stages need at least 8 layers",
        ),
    ],
)
def test_a_pipeline_that_does_not_fit_the_run_is_one_error_naming_why(
    pipeline: dtm.Pipeline, mesh: dict[str, int], message: str
) -> None:
    with pytest.raises(UsageError, match=message):  # (when tracing, or when planning the run)
        dtm.fit(
            _step(pipeline),
            loader,
            steps=1,
            sim=int(np.prod(list(mesh.values()))),
            mesh=mesh,
            quiet=True,
        )


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch) -> object:
    from dtm_mpi.config import get_config

    monkeypatch.setenv("DTM_DETERMINISTIC", "1")
    get_config.cache_clear()
    yield None
    monkeypatch.delenv("DTM_DETERMINISTIC")
    get_config.cache_clear()


DETERMINISTIC = [
    ("pp2-1f1b-m1", {"pp": 2}, "1f1b", 1, 1),
    ("pp2-1f1b-m4", {"pp": 2}, "1f1b", 1, 4),
    ("pp4-gpipe-m2", {"pp": 4}, "gpipe", 1, 2),
    ("pp4-zb-h1-m8", {"pp": 4}, "zb-h1", 1, 8),
    ("pp2-1f1b-m8", {"pp": 2}, "1f1b", 1, 8),
    ("dp2xpp2-zb-h1-m2", {"pp": 2, "dp": 2}, "zb-h1", 1, 2),
    ("tp2xpp2-1f1b-m4", {"pp": 2, "tp": 2}, "1f1b", 1, 4),
    ("pp2x2chunks-interleaved-m2", {"pp": 2}, "interleaved", 2, 2),
    ("pp1xdp2-accumulation-m2", {"pp": 1, "dp": 2}, "1f1b", 1, 2),
]


@pytest.mark.parametrize(
    ("mesh", "schedule", "chunks", "m"),
    [c[1:] for c in DETERMINISTIC],
    ids=[c[0] for c in DETERMINISTIC],
)
def test_in_deterministic_mode_a_pipelined_fit_has_the_unpipelined_bits(
    deterministic: object, mesh: dict[str, int], schedule: str, chunks: int, m: int
) -> None:
    """Deterministic mode: every loss and every bit of the final state equal the
    unpipelined training's on one rank (the batch's sums taken over the whole batch);
    microbatches of 2 rows (16 for m=8)."""
    batch = max(BATCH, 2 * m)
    want = dtm.fit(_step(batch=batch), loader, steps=2, sim=1, quiet=True)
    step = _step(dtm.Pipeline(microbatches=m, schedule=schedule, chunks=chunks), batch)
    ranks = int(np.prod(list(mesh.values())))
    got = dtm.fit(step, loader, steps=2, sim=ranks, mesh=mesh, quiet=True)
    assert [x["loss"] for x in got.metrics] == [x["loss"] for x in want.metrics]
    assert sorted(got.outputs) == sorted(want.outputs)
    differ = [k for k, v in want.outputs.items() if got.outputs[k].tobytes() != v.tobytes()]
    assert not differ, differ


def test_deterministic_mode_refuses_microbatches_that_trace_to_other_ops(
    deterministic: object,
) -> None:
    """A microbatch of one row lays its values out otherwise than the whole batch (a
    reshape of [1 x T] rows keeps the split on T): the whole-batch passes could not take its
    values, so planning refuses it, naming the pass and what to change."""
    step = _step(dtm.Pipeline(microbatches=8, schedule="1f1b"))  # 8 rows: 1 per microbatch
    with pytest.raises(
        UsageError, match=r"stage 0's stage0_weight_grad traces to other ops.*at least 2 rows"
    ):
        dtm.fit(step, loader, steps=1, sim=2, mesh={"pp": 2}, quiet=True)


def test_deterministic_mode_takes_a_power_of_two_of_microbatches(deterministic: object) -> None:
    inputs = {k: dtm.Input((6, T), "i32", ("dp", None)) for k in ("ids", "tgt")}
    three = dtm.train_step(
        gpt(),
        lm_loss,
        mesh=MESH,
        inputs=inputs,
        optimizer=dtm.optim.SGD(lr=0.1),
        pipeline=dtm.Pipeline(microbatches=3),
    )
    with pytest.raises(
        UsageError, match=r"take a power of two of microbatches.*got --microbatches 3"
    ):
        dtm.fit(three, loader, steps=1, sim=2, mesh={"pp": 2}, quiet=True)


def test_the_loss_function_sees_microbatches_when_pipelined() -> None:
    """The stages are traced on a microbatch of the fed inputs (a shape the loss function
    can see): a function that checks the batch it is given fails when it is not one."""
    seen: list[tuple[int, ...]] = []

    def looking(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
        seen.append(tuple(ids.shape))
        logits = m(ids)
        return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    step = dtm.train_step(
        gpt(),
        looking,
        mesh=MESH,
        inputs=INPUTS,
        optimizer=dtm.optim.SGD(lr=0.1),
        pipeline=dtm.Pipeline(microbatches=4),
    )
    dtm.fit(step, loader, steps=1, sim=2, mesh={"pp": 2}, quiet=True)
    assert seen == [(BATCH, T), (BATCH // 4, T)]


def test_a_sharded_optimizer_in_a_pipeline_trains_as_the_unpipelined_one() -> None:
    """AdamW(shard="dp") on pp=2 x dp=2: each stage's update and moments split over dp."""
    step = dtm.train_step(
        gpt(),
        lm_loss,
        mesh=MESH,
        inputs=INPUTS,
        optimizer=dtm.optim.AdamW(lr=1e-2, shard="dp"),
        clip_norm=0.5,
        pipeline=dtm.Pipeline(microbatches=2, schedule="1f1b"),
    )
    assert "state %opt.m.blocks.0.attn.wq: f64[12,12]{dp,tp} init zeros" in step.text
    got = dtm.fit(step, loader, steps=3, sim=4, mesh={"pp": 2, "dp": 2}, quiet=True)
    _same_training(got, _reference(3))


def test_parameters_sharded_over_dp_inside_a_pipeline_train_as_the_unpipelined_step(
    tmp_path: Path,
) -> None:
    """ZeRO-3 inside pipelines (dp sharded x pp, as the large recipes run it): each stage's
    parameters, gradients and optimizer state stored split over dp, gathered at each use;
    the training equals the unpipelined, unsharded one's, and its checkpoint resumes there."""
    step = _step(dtm.Pipeline(microbatches=2, schedule="1f1b"), shard_params="dp")
    assert "state %blocks.0.attn.wq: f64[12,12]{dp,tp}" in step.text  # stored split over dp
    piped = step.pipeline
    assert piped is not None
    stages = piped.stages(2, False)
    w = next(p for p in stages.params if p.name == "%blocks.0.attn.wq")
    assert w.type.layout.dims[0] == ("dp",)
    save = dtm.CheckpointPolicy(str(tmp_path / "s"), every=2)
    got = dtm.fit(
        step, loader, steps=2, sim=4, mesh={"pp": 2, "dp": 2}, checkpoint=save, quiet=True
    )
    _same_training(got, _reference(2))
    again = dtm.CheckpointPolicy(str(tmp_path / "s"), resume=True)
    rest = dtm.fit(_step(), loader, steps=4, sim=1, checkpoint=again, quiet=True)
    np.testing.assert_allclose(
        [m["loss"] for m in rest.metrics],
        [m["loss"] for m in _reference(4).metrics[2:]],
        rtol=1e-12,
    )


def test_in_deterministic_mode_zero3_inside_a_pipeline_has_the_unpipelined_bits(
    deterministic: object,
) -> None:
    want = dtm.fit(_step(), loader, steps=2, sim=1, quiet=True)
    step = _step(dtm.Pipeline(microbatches=2, schedule="1f1b"), shard_params="dp")
    got = dtm.fit(step, loader, steps=2, sim=4, mesh={"pp": 2, "dp": 2}, quiet=True)
    assert [x["loss"] for x in got.metrics] == [x["loss"] for x in want.metrics]
    differ = [k for k, v in want.outputs.items() if got.outputs[k].tobytes() != v.tobytes()]
    assert not differ, differ
