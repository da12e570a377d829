"""A stop signal in a simulated run (``dtm run --sim``, ``fit(sim=R)``): every simulated rank
stops after the same step (agreed through the communication interface), the state is saved to
the store and the process exits 75 ("saved, requeue me"); ``--resume`` continues it to the
bits an uninterrupted run gives (deterministic mode)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import EXIT_REQUEUE
from dtm_mpi.io.store import list_checkpoints
from dtm_mpi.io.tools import CheckStatus, verify_checkpoints
from tests.runtime.test_sim_examples import EXAMPLES

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DTM_DETERMINISTIC": "1",
        "PYTHONPATH": str(ROOT),
    }


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, check=False, capture_output=True, text=True, env=_env(), timeout=300
    )


def _stopped_by(
    sig: signal.Signals, argv: list[str]
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``argv``; once it printed its first progress line, send ``sig``. The finished
    process and what it printed before the signal."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    assert proc.stdout is not None
    before = ""
    for line in proc.stdout:  # the run is stepping
        before += line
        if line.startswith("step "):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, before + out, err), before


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["usr1", "term"])
def test_dtm_run_sim_stops_on_a_signal_saves_exits_75_and_resumes_bit_for_bit(
    sig: signal.Signals, tmp_path: Path
) -> None:
    store, resumed, straight = tmp_path / "s", tmp_path / "r.npz", tmp_path / "a.npz"
    mlp = str(EXAMPLES / "tp_mlp.dtm")
    run = [sys.executable, "-m", "dtm_mpi", "run", mlp, "--sim", "4", "--mesh", "dp=2,tp=2"]
    got, _ = _stopped_by(
        sig, [*run, "--steps", "1000000", "--log-every", "1", "--store", str(store)]
    )
    assert got.returncode == EXIT_REQUEUE, (got.returncode, got.stdout, got.stderr)
    assert f"stopped by {sig.name} after step" in got.stderr, got.stderr
    (ckpt,) = list_checkpoints(store)  # saved once: at the stop
    assert f"after step {ckpt.step}:" in got.stderr and ckpt.step >= 1
    assert all(c.status is CheckStatus.OK for c in verify_checkpoints(store))
    steps = str(ckpt.step + 2)
    again = _run(
        [
            *run[:5],
            "--sim",
            "3",
            "--mesh",
            "dp=1,tp=3",
            "--steps",
            steps,
            "--store",
            str(store),
            "--resume",
            "-o",
            str(resumed),
        ]
    )
    assert again.returncode == 0, again.stderr
    full = _run([*run[:5], "--sim", "1", "--steps", steps, "-o", str(straight)])
    assert full.returncode == 0, full.stderr
    got_bits, want_bits = np.load(resumed), np.load(straight)
    assert sorted(got_bits.files) == sorted(want_bits.files)
    for k in want_bits.files:
        assert got_bits[k].tobytes() == want_bits[k].tobytes(), k


def test_a_stop_without_a_store_ends_after_the_step_saying_nothing_was_saved(
    tmp_path: Path,
) -> None:
    mlp = str(EXAMPLES / "tp_mlp.dtm")
    got, _ = _stopped_by(
        signal.SIGUSR1,
        [
            sys.executable,
            "-m",
            "dtm_mpi",
            "run",
            mlp,
            "--sim",
            "2",
            "--steps",
            "1000000",
            "--log-every",
            "1",
        ],
    )
    assert got.returncode == 1, (got.stdout, got.stderr)
    assert (
        "stopped by SIGUSR1 after step" in got.stderr and "nothing saved (no --store)" in got.stderr
    )


FIT = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import dtm_mpi.frontend as dtm

    fn = dtm.functional
    store, steps, stop_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    net = dtm.nn.Sequential(dtm.nn.ColumnParallelLinear(8, 16), fn.gelu, dtm.nn.RowParallelLinear(16, 2))

    def loss(m, x, y):
        return fn.cross_entropy(m(x), y), {}

    step = dtm.train_step(
        net, loss, mesh=dtm.Mesh(dp=2, tp=2), optimizer=dtm.optim.AdamW(lr=1e-2),
        inputs={"x": dtm.Input((16, 8), "f32", ("dp", None)), "y": dtm.Input((16,), "i32", ("dp",))},
        name="tiny",
    )

    def on_step(i, metrics):
        if i == stop_at:  # a scheduler's preemption notice, in the middle of the run
            os.kill(os.getpid(), signal.SIGUSR1)

    got = dtm.fit(step, dtm.ArrayLoader({"x": x, "y": y}, 16, seed=3), steps=steps, sim=2,
                  mesh={"dp": 1, "tp": 2},
                  checkpoint=dtm.CheckpointPolicy(store, resume=os.path.isdir(store)) if store else None,
                  quiet=True, on_step=on_step)
    print("steps", [int(m["step"]) for m in got.metrics])
    print("loss", got.last("loss").hex())
    """
)


def test_fit_on_simulated_ranks_stops_on_a_signal_exits_75_and_resumes_bit_for_bit(
    tmp_path: Path,
) -> None:
    script, store = tmp_path / "train.py", tmp_path / "s"
    script.write_text(FIT)

    def fit(store: str, steps: int, stop_at: int) -> subprocess.CompletedProcess[str]:
        return _run([sys.executable, str(script), store, str(steps), str(stop_at)])

    stopped = fit(str(store), 8, 2)
    assert stopped.returncode == EXIT_REQUEUE, (stopped.stdout, stopped.stderr)
    (ckpt,) = list_checkpoints(store)
    assert 3 <= ckpt.step < 8 and f"stopped by SIGUSR1 after step {ckpt.step}" in stopped.stderr
    resumed = fit(str(store), 8, -1)
    assert resumed.returncode == 0, resumed.stderr
    assert f"steps {list(range(ckpt.step, 8))}" in resumed.stdout, resumed.stdout
    straight = fit("", 8, -1)
    assert straight.returncode == 0, straight.stderr
    loss = [line for line in straight.stdout.splitlines() if line.startswith("loss ")]
    assert loss and loss[0] in resumed.stdout.splitlines(), (straight.stdout, resumed.stdout)
