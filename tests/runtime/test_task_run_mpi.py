"""``dtm task run`` under real ``mpirun`` at 2, 3 and 4 ranks (examples/tasks/graph.toml:
preprocess, train, quantize for serving): the outputs equal a numpy reference; a second run
skips every task; a changed input recomputes exactly its descendants; after a SIGKILL in the
middle of a task the next run recomputes only that task and the ones after it; a missing input,
a failing task and a task that fits nowhere are named, and nothing hangs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.io.store import list_checkpoints
from tests.mpi_env import dtm_job, kill_leftovers, mpirun_env

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def _put(store: Path, name: str, value: np.ndarray, tmp: Path) -> None:
    store.mkdir(exist_ok=True)
    npy = tmp / f"{name}.npy"
    np.save(npy, value)
    got = subprocess.run(
        [sys.executable, "-m", "dtm_mpi", "store", "put", str(store), name, str(npy)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert got.returncode == 0, got.stderr


def _get(store: Path, name: str, tmp: Path) -> np.ndarray:
    out = tmp / f"got-{name}.npy"
    got = subprocess.run(
        [sys.executable, "-m", "dtm_mpi", "store", "get", str(store), name, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert got.returncode == 0, got.stderr
    return np.asarray(np.load(out))


@pytest.fixture
def graph(tmp_path: Path) -> Path:
    """The example graph in ``tmp_path/g`` with a store holding raw and w_init."""
    g = tmp_path / "g"
    shutil.copytree(EXAMPLES, g)
    rng = np.random.default_rng(3)
    _put(g / "store", "raw", (2 * rng.standard_normal((64, 16))).astype(np.float32), tmp_path)
    _put(g / "store", "w_init", np.zeros((16, 4), np.float32), tmp_path)
    return g / "graph.toml"


def _states(out: str) -> dict[str, str]:
    return dict(re.findall(r"^task (\w+): (running|skipped)", out, re.M))


def _sgd(x: np.ndarray, y: np.ndarray, w: np.ndarray, steps: int) -> tuple[np.ndarray, float]:
    w, loss = w.astype(np.float64), 0.0
    for _ in range(steps):
        d = x @ w - y
        loss = float(np.mean(d * d))
        w = w - 0.5 * (x.T @ (d * (2.0 / d.size)))
    return w, loss


def _quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    b = w.astype(np.float64).reshape(w.shape[0], -1, block)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127, 1.0)
    q = np.clip(np.rint(b / scale), -127, 127).astype(np.int8)
    return q.reshape(w.shape), scale.reshape(w.shape[0], -1).astype(np.float32)


@pytest.mark.parametrize("ranks", [2, 4])  # (3 ranks: the same code; CI time)
def test_runs_skips_and_recomputes_exactly_the_descendants_of_a_changed_input(
    ranks: int, graph: Path, tmp_path: Path
) -> None:
    store = graph.parent / "store"
    first = dtm_job(ranks, "task", "run", str(graph))
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    assert _states(out) == {"preprocess": "running", "train": "running", "quantize": "running"}
    raw = _get(store, "raw", tmp_path)
    x = _get(store, "features", tmp_path)
    np.testing.assert_allclose(x, np.tanh(raw.astype(np.float64)), rtol=1e-6, atol=1e-6)
    y = _get(store, "targets", tmp_path)
    w_want, loss_want = _sgd(x.astype(np.float64), y.astype(np.float64), np.zeros((16, 4)), 20)
    w = _get(store, "w_trained", tmp_path)
    np.testing.assert_allclose(w, w_want, rtol=1e-4, atol=1e-5)
    assert float(_get(store, "train_loss", tmp_path)) == pytest.approx(loss_want, rel=1e-4)
    q, s = _quantize(w, 4)
    np.testing.assert_array_equal(_get(store, "w_int8", tmp_path), q)
    np.testing.assert_allclose(_get(store, "w_scales", tmp_path), s, rtol=1e-7)
    assert sorted(p.name for p in (store / "tasks").iterdir()) == [
        "preprocess.json",
        "quantize.json",
        "train.json",
    ]

    again = dtm_job(ranks, "task", "run", str(graph))
    assert again.returncode == 0 and _states(again.stdout) == dict.fromkeys(
        ("preprocess", "train", "quantize"), "skipped"
    ), again.stdout + again.stderr
    steps = [c.step for c in list_checkpoints(store)]

    _put(store, "w_init", np.full((16, 4), 0.1, np.float32), tmp_path)
    changed = dtm_job(ranks, "task", "run", str(graph))
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert _states(changed.stdout) == {
        "preprocess": "skipped",
        "train": "running",
        "quantize": "running",
    }
    assert "task train: running on ranks 0-1 (input 'w_init' changed)" in changed.stdout
    assert "task quantize: running on rank 0 (input 'w_trained' changed)" in changed.stdout
    w2_want, _ = _sgd(x.astype(np.float64), y.astype(np.float64), np.full((16, 4), 0.1), 20)
    np.testing.assert_allclose(_get(store, "w_trained", tmp_path), w2_want, rtol=1e-4, atol=1e-5)
    assert len(list_checkpoints(store)) == len(steps) + 3  # the put, then one per wave run

    forced = dtm_job(ranks, "task", "run", str(graph), "--rerun")
    assert _states(forced.stdout) == dict.fromkeys(("preprocess", "train", "quantize"), "running")


def test_a_sigkill_in_a_task_costs_only_that_task_and_the_ones_after(
    graph: Path, tmp_path: Path
) -> None:
    store = graph.parent / "store"
    assert dtm_job(2, "task", "run", str(graph)).returncode == 0
    _put(store, "w_init", np.full((16, 4), -0.2, np.float32), tmp_path)
    before = [c.step for c in list_checkpoints(store)]
    cmd = ["mpirun", "--timeout", "120", "--bind-to", "none", "-n", "2"]
    cmd += [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", "task", "run", str(graph)]
    # rank 0 stops in the train task, its steps done, before its outputs leave the task
    env = mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="60", DTM_FAULT="0:output:hang")
    job = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert job.stdout is not None
    seen = []
    try:
        for line in job.stdout:
            seen.append(line)
            if line.startswith("task train: running"):
                break
        import time

        time.sleep(2.0)  # the steps run; rank 0 waits in the output phase
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    finally:
        kill_leftovers(str(graph))
    assert "task preprocess: skipped" in "".join(seen), "".join(seen)
    assert [c.step for c in list_checkpoints(store)] == before  # nothing of the task committed
    ls = _ls(store)  # the lifecycle the runtime drove: STALE (w_init changed), then RECOVERING
    assert "w_trained is recovering: task 'train' is rebuilding it" in ls, ls
    assert "w_int8 is stale: its input 'w_trained' is stale" in ls, ls
    after = dtm_job(2, "task", "run", str(graph))
    assert after.returncode == 0, after.stdout + after.stderr
    assert _states(after.stdout) == {
        "preprocess": "skipped",
        "train": "running",
        "quantize": "running",
    }
    ls = _ls(store)
    assert " recovering " not in ls and " stale " not in ls and "is stale" not in ls, ls


def _ls(store: Path) -> str:
    got = subprocess.run(
        [sys.executable, "-m", "dtm_mpi", "store", "ls", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_a_missing_input_is_located_and_named_on_every_rank(graph: Path) -> None:
    text = graph.read_text().replace('w = "w_init"', 'w = "w_missing"')
    graph.write_text(text)
    got = dtm_job(3, "task", "run", str(graph))
    out = got.stdout + got.stderr
    assert got.returncode != 0, out
    lines = [ln for ln in out.splitlines() if "input tensor 'w_missing' is not in store" in ln]
    assert lines and all(f"{graph}:20:" in ln for ln in lines), out
    assert "task preprocess: wrote" in out  # the wave before ran; the error is at the train wave
    assert "Traceback" not in out


def test_a_failing_task_is_named_and_its_wave_commits_nothing(graph: Path) -> None:
    store = graph.parent / "store"
    before = [c.step for c in list_checkpoints(store)]
    got = dtm_job(2, "task", "run", str(graph), DTM_FAULT="1:step:raise")
    out = got.stdout + got.stderr
    assert got.returncode != 0, out
    assert "dtm task preprocess: step 0 failed on rank(s) 1" in out, out
    assert "Traceback" not in out
    assert [c.step for c in list_checkpoints(store)] == before
    assert dtm_job(2, "task", "run", str(graph)).returncode == 0


def test_a_task_that_fits_nowhere_is_refused_before_anything_runs(graph: Path) -> None:
    store = graph.parent / "store"
    before = [c.step for c in list_checkpoints(store)]
    got = dtm_job(2, "task", "run", str(graph), "--capacity", "1K")
    out = got.stdout + got.stderr
    assert got.returncode != 0
    assert f"{graph}:11:1: task 'preprocess' needs" in out and "over the capacity of 1024" in out
    assert "running" not in out and [c.step for c in list_checkpoints(store)] == before
