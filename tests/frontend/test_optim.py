"""The sharded optimizer (``shard="dp"``: ZeRO stages 1 and 2) on simulated ranks: the traced
step reduce-scatters the gradients and all-gathers the new parameters, keeps 1/dp of the
optimizer state per rank, and trains to the same bits as the unsharded optimizer on any mesh
(deterministic mode; the simulator's sums have a fixed order, so also without it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.plan.cost import local_bytes
from dtm_mpi.runtime.simulate import RunResult, run_simulated
from dtm_mpi.sharding.mesh import bind_mesh


def digits_step(optimizer: Any, clip: float | None = None, shard_params: str | None = None) -> Any:
    model = dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(64, 96), fn.gelu, dtm.nn.RowParallelLinear(96, 10)
    )

    def loss(m: Any, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
        return fn.cross_entropy(m(x), y)

    return dtm.train_step(
        model,
        loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs={
            "x": dtm.Input((24, 64), "f32", ("dp", None)),
            "y": dtm.Input((24,), "i32", ("dp",)),
        },
        optimizer=optimizer,
        clip_norm=clip,
        name="digits",
        shard_params=shard_params,
    )


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "x": rng.random((24, 64), dtype=np.float32),
        "y": rng.integers(0, 10, 24).astype(np.int32),
    }


def test_the_sharded_step_reduce_scatters_gradients_and_allgathers_parameters() -> None:
    plain = digits_step(dtm.optim.AdamW(3e-3)).text
    sharded = digits_step(dtm.optim.AdamW(3e-3, shard="dp")).text
    ops = lambda text, name: [ln for ln in text.splitlines() if f"= {name} " in ln]  # noqa: E731
    # unsharded: every weight's gradient completed over dp by an allreduce
    assert len([ln for ln in ops(plain, "allreduce") if " on dp " in ln]) >= 4
    assert not ops(plain, "reduce_scatter") and not ops(plain, "allgather")
    # sharded: the four weights' gradients reduce-scattered, the new weights all-gathered
    assert len(ops(sharded, "reduce_scatter")) == 4, sharded
    assert len(ops(sharded, "allgather")) == 4, sharded
    assert not [ln for ln in ops(sharded, "allreduce") if "f32[64,96]" in ln or "f32[96,10]" in ln]
    # the moments are stored split over dp, the weights as before
    assert "state %opt.m.layers.0.weight: f32[64,96]{dp,tp}" in sharded
    assert "state %opt.v.layers.1.weight: f32[96,10]{(tp,dp),-}" in sharded
    assert "state %layers.0.weight: f32[64,96]{-,tp}" in sharded


def trained(module: Any, ranks: int, binding: dict[str, int]) -> RunResult:
    """Three steps of ``module`` on :func:`batch` on ``ranks`` simulated ranks in
    deterministic mode (runs that must agree bit for bit)."""
    return run_simulated(
        module, ranks, binding=binding, inputs=batch(), steps=3, deterministic=True
    )


def same_params(got: RunResult, want: RunResult) -> None:
    """Every parameter of ``want`` in ``got``, bit for bit."""
    for name, value in want.params.items():
        assert got.params[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize(
    "make",
    [
        lambda s: dtm.optim.AdamW(3e-3, weight_decay=0.01, shard=s),
        lambda s: dtm.optim.Adam(1e-3, weight_decay=0.1, shard=s),
        lambda s: dtm.optim.SGD(0.1, momentum=0.9, weight_decay=1e-3, shard=s),
    ],
    ids=["adamw", "adam", "sgd-momentum"],
)
@pytest.mark.parametrize(
    ("ranks", "binding"),
    [(4, {"dp": 2, "tp": 2}), (3, {"dp": 3, "tp": 1}), (4, {"dp": 4, "tp": 1})],
)
def test_the_sharded_optimizer_trains_to_the_unsharded_bits(
    make: Any, ranks: int, binding: dict[str, int]
) -> None:
    plain, sharded = digits_step(make(None), clip=1.0), digits_step(make("dp"), clip=1.0)
    runs = [trained(s.module, ranks, binding) for s in (plain, sharded)]
    assert sorted(runs[0].params) == sorted(runs[1].params)
    same_params(runs[1], runs[0])
    losses = [float(r[0]) for r in runs[1].results]
    assert losses[-1] < losses[0]  # it trains


def test_each_rank_keeps_one_dp_th_of_the_optimizer_state() -> None:
    def state_bytes(step: Any, binding: dict[str, int], rank: int) -> int:
        mesh = bind_mesh(step.module.meshes[0], binding["dp"] * binding["tp"], binding)
        params = step.module.entry.params
        return sum(local_bytes(p.type, mesh, rank) for p in params if p.name.startswith("%opt."))

    for dp in (2, 4):
        binding = {"dp": dp, "tp": 1}
        plain = state_bytes(digits_step(dtm.optim.AdamW()), binding, 0)
        sharded = [
            state_bytes(digits_step(dtm.optim.AdamW(shard="dp")), binding, r) for r in range(dp)
        ]
        assert sum(sharded) == plain  # every element kept once over dp
        assert max(sharded) <= plain // dp + 2 * 4 * 2  # 1/dp, up to the uneven 10-wide bias


def test_a_shard_axis_the_mesh_lacks_is_named() -> None:
    with pytest.raises(
        UsageError, match=r"AdamW\(shard='pp'\): the mesh has no axis 'pp' \(axes: dp, tp\)"
    ):
        digits_step(dtm.optim.AdamW(shard="pp"))
    with pytest.raises(UsageError, match="shard must be a mesh axis name"):
        dtm.optim.SGD(0.1, shard="d p")


def resumed_across(
    tmp_path: Path, plain: Any, legs: list[tuple[Any, int, dict[str, int], int]]
) -> None:
    """Run ``legs`` (step, ranks, mesh, until step) one after another through one checkpoint
    store, each resuming the last (deterministic mode): the end equals the ``plain`` step's
    uninterrupted run on one rank bit for bit."""
    from dtm_mpi.runtime.policies import CheckpointPolicy

    store = str(tmp_path / "store")
    for k, (step, ranks, binding, until) in enumerate(legs):
        got = run_simulated(
            step.module,
            ranks,
            binding=binding,
            inputs=batch(),
            steps=until,
            deterministic=True,
            checkpoint=CheckpointPolicy(store, every=2, resume=k > 0),
        )
    straight = run_simulated(
        plain.module,
        1,
        binding={"dp": 1, "tp": 1},
        inputs=batch(),
        steps=legs[-1][3],
        deterministic=True,
    )
    same_params(got, straight)


def test_a_sharded_runs_checkpoint_resumes_unsharded_on_another_mesh_and_back(
    tmp_path: Path,
) -> None:
    plain = digits_step(dtm.optim.AdamW(3e-3))
    sharded = digits_step(dtm.optim.AdamW(3e-3, shard="dp"))
    legs = [
        (sharded, 4, {"dp": 2, "tp": 2}, 2),
        (plain, 3, {"dp": 1, "tp": 3}, 4),
        (sharded, 3, {"dp": 3, "tp": 1}, 6),
    ]
    resumed_across(tmp_path, plain, legs)


def digits_params_sharded(shard: str | None) -> Any:
    """The digits step with AdamW, clipped, its parameters stored sharded over ``shard``."""
    return digits_step(dtm.optim.AdamW(3e-3), clip=1.0, shard_params=shard)


def test_sharded_parameters_are_gathered_at_their_use_and_their_gradients_reduce_scattered() -> (
    None
):
    text = digits_params_sharded("dp").text
    ops = lambda name: [ln for ln in text.splitlines() if f"= {name} " in ln]  # noqa: E731
    assert "state %layers.0.weight: f32[64,96]{dp,tp}" in text  # stored split over dp
    assert "state %layers.1.weight: f32[96,10]{(tp,dp),-}" in text
    assert "state %opt.m.layers.0.weight: f32[64,96]{dp,tp}" in text  # the state follows
    assert len(ops("reduce_scatter")) == 4, text
    # each gathered where a layer uses it, and the second layer's weight once more where the
    # reverse pass needs it (for the first layer's activations' gradient): FSDP's re-gather
    gathers = [ln.split("=")[0].strip() for ln in ops("allgather")]
    assert gathers == [
        "%layers.0.weight.1",
        "%layers.0.bias.2",
        "%layers.1.weight.4",
        "%layers.1.bias.6",
        "%layers.1.weight.4.again",
    ], text
    lines = text.splitlines()
    again = next(i for i, ln in enumerate(lines) if "%layers.1.weight.4.again =" in ln)
    forward_copy = re.compile(r"%layers\.1\.weight\.4(?![.\w])")
    assert any(forward_copy.search(ln) for ln in lines[:again])
    assert not any(forward_copy.search(ln) for ln in lines[again:]), "used again after"
    # the update keeps the stored layout: the new weights are not gathered
    assert "f32[64,96]{dp,tp} updates %layers.0.weight" in text


@pytest.mark.parametrize(
    ("ranks", "binding"),
    [(4, {"dp": 2, "tp": 2}), (3, {"dp": 3, "tp": 1}), (2, {"dp": 1, "tp": 2})],
)
def test_sharded_parameters_train_to_the_unsharded_bits(
    ranks: int, binding: dict[str, int]
) -> None:
    runs = [trained(digits_params_sharded(s).module, ranks, binding) for s in (None, "dp")]
    same_params(runs[1], runs[0])


def test_a_sharded_parameter_runs_checkpoint_resumes_unsharded(tmp_path: Path) -> None:
    plain, sharded = digits_params_sharded(None), digits_params_sharded("dp")
    resumed_across(
        tmp_path, plain, [(sharded, 4, {"dp": 2, "tp": 2}, 2), (plain, 3, {"dp": 3, "tp": 1}, 4)]
    )


def test_shard_params_errors_name_the_axis() -> None:
    with pytest.raises(
        UsageError, match=r"shard_params='pp': the mesh has no axis 'pp' \(axes: dp, tp\)"
    ):
        digits_params_sharded("pp")
