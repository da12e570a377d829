"""A run's options as policy objects (dtm_mpi.runtime.policies): each option's check in one
place, raised as an agreed error (the same on every rank), and built alike by ``dtm run`` and
by ``fit()``."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.runtime.policies import (
    CheckpointPolicy,
    DevicePolicy,
    ProgressPolicy,
    ResizePolicy,
    checkpoint_policy,
    progress_policy,
)
from dtm_mpi.runtime.request import RunRequest
from dtm_mpi.runtime.step_loop import Progress

BAD: dict[str, tuple[Callable[[], object], str]] = {
    "backend": (lambda: DevicePolicy("tpu"), "--backend must be one of numpy"),
    "gpu-aware-value": (lambda: DevicePolicy("cuda", "maybe"), "--gpu-aware-mpi must be auto"),
    "gpu-aware-numpy": (lambda: DevicePolicy(gpu_aware="yes"), "need --backend cuda or hip"),
    "require-numpy": (
        lambda: DevicePolicy(require_gpu_aware=True),
        "need --backend cuda or hip",
    ),
    "max-bytes": (lambda: DevicePolicy(max_bytes_per_rank=0), "--max-bytes-per-rank must be"),
    "log-every": (lambda: ProgressPolicy(0), "--log-every must be >= 1; got 0"),
    "every": (lambda: CheckpointPolicy("s", every=0), "--checkpoint-every must be >= 1"),
    "keep-last": (lambda: CheckpointPolicy("s", keep_last=0), "--keep-last must be >= 1"),
    "quota": (lambda: CheckpointPolicy("s", quota=0), "--quota must be >= 1 byte"),
    "no-store": (lambda: checkpoint_policy(None, keep_last=2), "need --store DIR"),
    "sim-gpu": (
        lambda: RunRequest("m.dtm", sim=2, device=DevicePolicy("cuda")),
        "the simulator (--sim) runs the numpy backend only",
    ),
    "sim-resize": (
        lambda: RunRequest(
            "m.dtm", {"dp": 2}, steps=4, sim=2, resize=ResizePolicy(((2, {"dp": 1}),))
        ),
        "need the MPI runtime",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_option_is_one_agreed_error_naming_it(case: str) -> None:
    make, message = BAD[case]
    with pytest.raises(UsageError, match=re.escape(message)) as info:
        make()
    assert info.value.agreed  # decided from the options alone: the same on every rank


def test_no_progress_policy_without_log_every_and_the_default_device_is_numpy() -> None:
    assert progress_policy(None) is None
    assert progress_policy(5, 32) == ProgressPolicy(5, 32)
    assert RunRequest("m.dtm").device == DevicePolicy("numpy")


def test_the_progress_line_shows_the_metrics_step_time_and_throughput(
    capsys: pytest.CaptureFixture[str],
) -> None:
    progress = Progress(ProgressPolicy(2, samples=64), steps=3)
    progress.step_done(0, {"loss": 1.5})
    assert capsys.readouterr().out == ""  # not due yet
    progress.step_done(1, {"loss": 1.25, "acc": 0.5})
    progress.step_done(2)  # the last step is always shown
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"step 2/3: loss 1\.25 acc 0\.5, [0-9.]+ ms/step, [0-9.]+ steps/s, \d+ samples/s", lines[0]
    ), lines
    assert re.fullmatch(r"step 3/3: [0-9.]+ ms/step, [0-9.]+ steps/s, \d+ samples/s", lines[1])


def _step() -> dtm.TracedStep:
    net = dtm.nn.Sequential(dtm.nn.ColumnParallelLinear(8, 16), dtm.nn.RowParallelLinear(16, 4))

    def loss(
        m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor
    ) -> tuple[dtm.Tensor, dict[str, dtm.Tensor]]:
        return fn.cross_entropy(m(x), y), {}

    return dtm.train_step(
        net,
        loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        optimizer=dtm.optim.SGD(lr=0.1),
        inputs={
            "x": dtm.Input((16, 8), "f32", ("dp", None)),
            "y": dtm.Input((16,), "i32", ("dp",)),
        },
        name="tiny",
    )


def test_fit_refuses_a_policy_it_cannot_run_before_any_step(tmp_path: Path) -> None:
    """fit() builds the same request as dtm run: a GPU device or a live resize on simulated
    ranks is the CLI's agreed error, raised before the loader is called once."""
    calls: list[int] = []

    def loader(step: int, regions: object) -> dict[str, np.ndarray]:
        calls.append(step)
        raise AssertionError("no step may run")

    for kw, message in (
        ({"device": DevicePolicy("cuda")}, "runs the numpy backend only"),
        ({"resize": ResizePolicy(((1, {"dp": 1, "tp": 2}),))}, "need the MPI runtime"),
    ):
        with pytest.raises(UsageError, match=message):
            dtm.fit(_step(), loader, steps=2, sim=2, mesh={"dp": 1, "tp": 2}, quiet=True, **kw)  # type: ignore[arg-type]
    assert calls == []


def test_fit_logs_its_metrics_through_the_run_progress_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=32).astype(np.int32)
    dtm.fit(
        _step(),
        dtm.ArrayLoader({"x": x, "y": y}, 16, seed=1),
        steps=4,
        sim=2,
        mesh={"dp": 1, "tp": 2},
        quiet=True,
        log_every=2,
    )
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2, lines
    for n, line in zip((2, 4), lines, strict=True):
        assert re.fullmatch(
            rf"step {n}/4: loss [0-9.e+-]+ tok/s [0-9.e+-]+ mfu% [0-9.e+-]+, [0-9.]+ ms/step, "
            rf"[0-9.]+ steps/s, \d+ samples/s",
            line,
        ), line


@pytest.mark.parametrize(
    ("every", "final", "due"),
    [
        (None, False, []),
        (None, True, [5]),
        (2, False, [2, 4]),
        (2, True, [2, 4, 5]),
        (5, True, [5]),
    ],
)
def test_a_checkpoint_is_due_every_n_steps_and_after_the_last_with_save_final(
    every: int | None, final: bool, due: list[int]
) -> None:
    policy = CheckpointPolicy("s", every=every, save_final=final)
    assert [d for d in range(1, 6) if policy.due(d, 5)] == due
    assert policy.saves == bool(due)


def test_fit_with_a_store_and_no_checkpoint_interval_saves_after_its_last_step(
    tmp_path: Path,
) -> None:
    """fit() saves its final state (what an evaluation step's weights are read from) also
    when no interval is given."""
    from dtm_mpi.io.store import list_checkpoints

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=32).astype(np.int32)
    store = tmp_path / "store"
    dtm.fit(
        _step(),
        dtm.ArrayLoader({"x": x, "y": y}, 16, seed=1),
        steps=3,
        sim=2,
        mesh={"dp": 1, "tp": 2},
        quiet=True,
        checkpoint=CheckpointPolicy(str(store)),
    )
    assert [c.step for c in list_checkpoints(store)] == [3]
    # an evaluation step reading its weights from the store saves nothing into it
    net = dtm.nn.Sequential(dtm.nn.ColumnParallelLinear(8, 16), dtm.nn.RowParallelLinear(16, 4))
    ev = dtm.eval_step(
        net,
        lambda m, x, y: fn.cross_entropy(m(x), y),
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs={
            "x": dtm.Input((16, 8), "f32", ("dp", None)),
            "y": dtm.Input((16,), "i32", ("dp",)),
        },
        name="tiny_eval",
        weights_from_store=True,
    )
    dtm.fit(
        ev,
        dtm.ArrayLoader({"x": x, "y": y}, 16, seed=2),
        steps=2,
        sim=2,
        mesh={"dp": 1, "tp": 2},
        quiet=True,
        checkpoint=CheckpointPolicy(str(store)),
    )
    assert [c.step for c in list_checkpoints(store)] == [3]
