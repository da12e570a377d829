"""Against a real Slurm (a private single-node cluster started by the fixture, never a system
one): ``srun --mpi=pmix`` launches dtm runs; the job script ``jobs/slurm_train.sbatch``,
submitted with ``sbatch``, preempted with ``scancel --signal=USR1``, saves, requeues itself and
resumes, and its final weights equal those of the same job run without interruption, bit for
bit (deterministic mode). Skipped with the reason where Slurm cannot run here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.runtime.simulate import run_simulated
from tests.slurm_cluster import SlurmCluster, start_cluster, why_not
from tests.test_mpi_run import EXAMPLES, load

ROOT = Path(__file__).parent.parent
JOB = ROOT / "jobs" / "slurm_train.sbatch"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(why_not() is not None, reason=why_not() or ""),
    pytest.mark.xdist_group("slurm"),  # one private cluster (module fixture), on one worker
]


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def test_srun_over_pmix_runs_a_dtm_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    plugins = slurm.run("srun", "--mpi=list", check=False)
    if "pmix" not in plugins.stdout + plugins.stderr:
        pytest.skip(
            "this Slurm has no PMIx plugin (the job script then uses mpirun inside the allocation)"
        )
    out = tmp_path / "out.npz"
    got = slurm.run(
        "srun",
        "--mpi=pmix",
        "-n",
        "3",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "run",
        str(EXAMPLES / "tp_mlp.dtm"),
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "2",
        "-o",
        str(out),
        timeout=240,
        check=False,
        DTM_DETERMINISTIC="1",
    )
    assert got.returncode == 0, got.stdout + got.stderr
    want = run_simulated(
        load("tp_mlp"), 3, binding={"dp": 1, "tp": 3}, steps=2, deterministic=True
    ).outputs()
    saved = np.load(out)
    assert all(saved[k].tobytes() == v.tobytes() for k, v in want.items())


def test_srun_runs_a_task_graph_and_a_second_run_skips_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    plugins = slurm.run("srun", "--mpi=list", check=False)
    if "pmix" not in plugins.stdout + plugins.stderr:
        pytest.skip("this Slurm has no PMIx plugin")
    graph = tmp_path / "g"
    shutil.copytree(EXAMPLES / "tasks", graph)
    store = graph / "store"
    store.mkdir()
    rng = np.random.default_rng(0)
    for name, value in (("raw", rng.standard_normal((64, 16))), ("w_init", np.zeros((16, 4)))):
        np.save(tmp_path / f"{name}.npy", value.astype(np.float32))
        put = [sys.executable, "-m", "dtm_mpi", "store", "put", str(store), name]
        subprocess.run([*put, str(tmp_path / f"{name}.npy")], check=True, capture_output=True)
    task = ["srun", "--mpi=pmix", "-n", "3", sys.executable, "-m", "mpi4py", "-m", "dtm_mpi"]
    task += ["task", "run", str(graph / "graph.toml")]
    first = slurm.run(*task, timeout=240, check=False)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count(": running on") == 3, first.stdout
    again = slurm.run(*task, timeout=240, check=False)
    assert again.returncode == 0 and again.stdout.count(": skipped:") == 3, again.stdout


def _submit(slurm: SlurmCluster, tmp_path: Path, name: str, steps: int) -> tuple[int, Path, Path]:
    out, log = tmp_path / f"{name}.npz", tmp_path / f"{name}-%j.out"
    job = slurm.sbatch(
        JOB,
        "--ntasks=4",
        f"--output={log}",
        cwd=ROOT,
        PY=sys.executable,
        STORE=str(tmp_path / f"{name}-store"),
        STEPS=str(steps),
        MESH="dp=2,tp=2",
        CKPT_EVERY="1000",
        LOG_EVERY="2",
        OUT=str(out),
        DTM_DETERMINISTIC="1",
        DTM_TIMEOUT="120",
    )
    return job, out, Path(str(log).replace("%j", str(job)))


@pytest.mark.timeout(700)  # (its own waits: 240 s for a step, 400 s for the requeued job)
def test_a_preempted_job_saves_requeues_resumes_and_equals_an_uninterrupted_one(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    steps = 100  # (long enough that the signal lands before the end on a busy machine)
    job, out, log = _submit(slurm, tmp_path, "preempted", steps)
    deadline = time.monotonic() + 240
    while not (log.exists() and re.search(rf"^step \d+/{steps}: ", log.read_text(), re.M)):
        assert time.monotonic() < deadline, f"job {job} showed no step ({slurm.state(job)})"
        assert slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), (
            log.read_text() if log.exists() else ""
        )
        time.sleep(0.3)
    slurm.run("scancel", "--signal=USR1", str(job))  # to the job's steps: every task
    slurm.wait_gone(job, 400)
    text = log.read_text()
    m = re.search(
        r"^dtm run: stopped by SIGUSR1 after step (\d+): checkpoint (\S+) saved", text, re.M
    )
    assert m is not None, text
    done = int(m.group(1))
    assert done < steps and f"requeueing job {job}" in text, text
    assert "restart 1" in text and f"resumed from {m.group(2)} (after step {done})" in text, text
    assert out.exists(), text

    # deterministic mode gives the same bits on every mesh: the uninterrupted run is the
    # simulator's (a second Slurm job of the same 40 steps adds nothing but time)
    want = run_simulated(load("tp_mlp"), 1, steps=steps, deterministic=True).outputs()
    got = np.load(out)
    assert sorted(got.files) == sorted(want)
    for key, value in want.items():
        assert got[key].tobytes() == value.tobytes(), (
            f"{key}: the preempted job differs from the uninterrupted one"
        )
