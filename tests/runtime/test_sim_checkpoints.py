"""Checkpoints of simulated runs (``dtm run --sim``, ``fit(sim=R)``): the same checkpoint
policy as under MPI (every N steps, in the background, keep-last, quota, resume from the
newest checkpoint that verifies), the ranks' blocks gathered to one process that writes them;
a checkpoint resumes on any mesh, bit for bit in deterministic mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dtm_mpi.frontend as dtm
from dtm_mpi.errors import DtmError, UsageError
from dtm_mpi.io.store import list_checkpoints
from dtm_mpi.io.tools import CheckStatus, verify_checkpoints
from dtm_mpi.runtime.policies import CheckpointPolicy
from dtm_mpi.runtime.simulate import RunResult, run_simulated
from tests.cli_entry import dtm as dtm_cli
from tests.runtime.test_sim_examples import EXAMPLES, load


def _bits(got: RunResult, want: RunResult) -> None:
    a, b = got.outputs(), want.outputs()
    for k, v in b.items():
        assert a[k].tobytes() == v.tobytes(), f"{k} differs"


def _steps(store: Path) -> list[int]:
    return [c.step for c in list_checkpoints(store)]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_simulated_run_saved_on_4_ranks_resumes_on_3_bit_for_bit(
    tmp_path: Path, background: bool
) -> None:
    module = load("tp_mlp")
    store = tmp_path / "s"
    policy = CheckpointPolicy(str(store), every=2, background=background, keep_last=2)
    run_simulated(
        module, 4, binding={"dp": 2, "tp": 2}, steps=6, deterministic=True, checkpoint=policy
    )
    assert _steps(store) == [4, 6]  # keep-last 2 of 2, 4, 6
    report = verify_checkpoints(store)
    assert report and all(c.status is CheckStatus.OK for c in report), report
    straight = run_simulated(module, 1, steps=9, deterministic=True)
    resumed = run_simulated(
        module,
        3,
        binding={"dp": 1, "tp": 3},
        steps=9,
        deterministic=True,
        checkpoint=CheckpointPolicy(str(store), resume=True),
    )
    _bits(resumed, straight)


def test_dtm_run_sim_checkpoints_and_resumes_from_the_command_line(tmp_path: Path) -> None:
    store, out1, out2 = tmp_path / "s", tmp_path / "a.npz", tmp_path / "b.npz"
    mlp = str(EXAMPLES / "tp_mlp.dtm")
    first = dtm_cli(
        "run",
        mlp,
        "--sim",
        "2",
        "--steps",
        "3",
        "--store",
        str(store),
        "--checkpoint-every",
        "1",
        "--checkpoint-async",
        "--quota",
        "10M",
        "-o",
        str(out1),
    )
    assert first.returncode == 0, first.stderr
    assert "written in the background" in first.stdout
    logged = dtm_cli("run", mlp, "--sim", "2", "--steps", "4", "--log-every", "2")
    assert (
        logged.returncode == 0 and "step 2/4:" in logged.stdout and "step 4/4:" in logged.stdout
    ), logged.stdout
    assert _steps(store) == [1, 2, 3]
    again = dtm_cli(
        "run",
        mlp,
        "--sim",
        "3",
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "5",
        "--store",
        str(store),
        "--resume",
        "-o",
        str(out2),
    )
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "after step 3" in again.stdout
    full = dtm_cli("run", mlp, "--sim", "1", "--steps", "5", "-o", str(tmp_path / "c.npz"))
    assert full.returncode == 0, full.stderr
    got, want = np.load(out2), np.load(tmp_path / "c.npz")
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_quota_too_small_for_one_checkpoint_is_refused_naming_the_store(tmp_path: Path) -> None:
    store = tmp_path / "s"
    policy = CheckpointPolicy(str(store), every=1, quota=1000)
    with pytest.raises(
        DtmError,
        match=r"rank 0 .*store .*: checkpoint 1 needs about \d+ bytes; 0 of the quota's 1000 are in use",
    ) as got:
        run_simulated(load("tp_mlp"), 2, steps=2, checkpoint=policy)
    assert str(store) in str(got.value)
    assert _steps(store) == []


def test_resume_refuses_another_programs_checkpoint_in_the_simulator(tmp_path: Path) -> None:
    store = tmp_path / "s"
    run_simulated(load("tp_mlp"), 2, steps=2, checkpoint=CheckpointPolicy(str(store), every=1))
    from dtm_mpi.ir import parse_module, verify_module

    text = (EXAMPLES / "tp_mlp.dtm").read_text().replace("seed=1, std=0.02", "seed=9, std=0.02")
    other = parse_module(text, "other.dtm")
    verify_module(other)
    with pytest.raises(UsageError, match="refusing to resume another program's state"):
        run_simulated(other, 2, steps=4, checkpoint=CheckpointPolicy(str(store), resume=True))
    with pytest.raises(UsageError, match="leaves nothing to run"):
        run_simulated(
            load("tp_mlp"), 2, steps=2, checkpoint=CheckpointPolicy(str(store), resume=True)
        )


def _tiny_fit(**kw: object) -> dtm.FitResult:
    """A small tensor-parallel classifier trained by fit() with ``kw``."""
    fn = dtm.functional
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    net = dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(8, 16), fn.gelu, dtm.nn.RowParallelLinear(16, 2)
    )

    def loss(
        m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor
    ) -> tuple[dtm.Tensor, dict[str, dtm.Tensor]]:
        return fn.cross_entropy(m(x), y), {}

    step = dtm.train_step(
        net,
        loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        optimizer=dtm.optim.AdamW(lr=1e-2),
        inputs={
            "x": dtm.Input((16, 8), "f32", ("dp", None)),
            "y": dtm.Input((16,), "i32", ("dp",)),
        },
        name="tiny",
    )
    kw.setdefault("quiet", True)
    return dtm.fit(step, dtm.ArrayLoader({"x": x, "y": y}, 16, seed=3), **kw)  # type: ignore[arg-type]


def test_fit_on_simulated_ranks_writes_in_the_background_keeps_the_last_within_a_quota_and_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "s"
    _tiny_fit(
        steps=5,
        sim=2,
        mesh={"dp": 1, "tp": 2},
        checkpoint=dtm.CheckpointPolicy(
            str(store), every=1, background=True, keep_last=2, quota=10_000_000
        ),
        log_every=2,
    )
    out = capsys.readouterr().out
    assert "written in the background" in out, out
    assert "step 2/5: loss " in out and "step 4/5: loss " in out and "step 3/5" not in out, out
    assert _steps(store) == [4, 5]  # every step saved, the last two kept
    assert all(c.status is CheckStatus.OK for c in verify_checkpoints(store))
    with pytest.raises(
        DtmError, match=r"checkpoint 1 needs about \d+ bytes; 0 of the quota's 1000"
    ):
        _tiny_fit(
            steps=2,
            sim=2,
            mesh={"dp": 1, "tp": 2},
            checkpoint=dtm.CheckpointPolicy(str(tmp_path / "q"), every=1, quota=1000),
        )


def test_fit_on_simulated_ranks_checkpoints_and_resumes_on_another_mesh(tmp_path: Path) -> None:
    run = _tiny_fit
    store = str(tmp_path / "s")
    straight = run(steps=6, sim=2, mesh={"dp": 1, "tp": 2})
    run(steps=4, sim=4, mesh={"dp": 2, "tp": 2}, checkpoint=dtm.CheckpointPolicy(store, every=2))
    assert _steps(Path(store)) == [2, 4]
    resumed = run(
        steps=6, sim=2, mesh={"dp": 1, "tp": 2}, checkpoint=dtm.CheckpointPolicy(store, resume=True)
    )
    assert [m["step"] for m in resumed.metrics] == [4.0, 5.0]
    np.testing.assert_allclose(resumed.last("loss"), straight.last("loss"), rtol=1e-5)
    for k, v in straight.outputs.items():
        np.testing.assert_allclose(resumed.outputs[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
