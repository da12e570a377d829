"""Pipelined training through fit() under real ``mpirun`` (tests/pipeline_fit_job.py: a
float64 GPT, AdamW, clipped by the global norm) at 2, 3 and 4 ranks: every schedule, pp alone
and with dp or tp, trains as the unpipelined step on one simulated rank does (to float64
rounding), the loss the same bits on every rank; its parallel-HDF5 checkpoint resumes without
a pipeline on another mesh; a stage failing mid-schedule is named on every rank; a stop signal
saves the state and exits 75."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.mpi_env import mpirun_env, named_on_every_rank
from tests.shared_runs import OUT, shared_run

pytestmark = [pytest.mark.slow]
JOB = str(Path(__file__).resolve().parents[1] / "pipeline_fit_job.py")

# ranks -> (pipelined mesh, schedule, microbatches, unpipelined mesh it resumes on)
CASES = {
    "2-1f1b": (2, "pp=2", "1f1b", 4, "dp=2"),
    "3-gpipe": (3, "pp=3", "gpipe", 2, "tp=3"),
    "4-interleaved-dp": (4, "pp=2,dp=2", "interleaved", 2, "dp=4"),
}


def job_cmd(ranks: int, *args: str) -> list[str]:
    run = [sys.executable, "-m", "mpi4py", JOB, *args]
    return ["mpirun", "--timeout", "120", "--bind-to", "none", "-n", str(ranks), *run]


def job(ranks: int, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        job_cmd(ranks, *args),
        capture_output=True,
        text=True,
        timeout=150,
        env=mpirun_env(**{"PYTHONUNBUFFERED": "1", "DTM_TIMEOUT": "60", **env}),
        check=False,
    )


def ok(ranks: int, *args: str, **env: str) -> str:
    proc = job(ranks, *args, **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def reference(shared: Path, path: Path, steps: int, **env: str) -> np.ndarray:
    """The unpipelined training on one simulated rank: its losses; its state to ``path``
    (run once per session: :func:`~tests.shared_runs.shared_run`)."""
    cmd = [sys.executable, JOB, "--sim", "1", "--steps", str(steps), "-o", OUT]
    return losses_of(shared_run(shared, cmd, path, **env), 1)[0]


def losses_of(out: str, ranks: int) -> list[np.ndarray]:
    """Every rank's losses (hex floats) from the job's lines, rank by rank."""
    lines = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("losses ")]
    assert len(lines) == ranks, out
    return [np.array([float.fromhex(x) for x in ln]) for ln in lines]


def close(got: Path, want: Path) -> None:
    a, b = np.load(got), np.load(want)
    assert sorted(a.files) == sorted(b.files)
    for k in b.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipelined_fit_under_mpirun_trains_as_unpipelined_and_resumes_without_a_pipeline(
    case: str, tmp_path: Path, shared_tmp: Path
) -> None:
    ranks, mesh, schedule, m, plain = CASES[case]
    store = str(tmp_path / "store")
    out = ok(
        ranks,
        *("--mesh", mesh, "--schedule", schedule, "--microbatches", str(m)),
        *("--steps", "3", "--store", store, "--every", "2", "-o", str(tmp_path / "piped.npz")),
    )
    every = losses_of(out, ranks)
    assert all(x.tobytes() == every[0].tobytes() for x in every), every  # the same bits
    want = reference(shared_tmp, tmp_path / "ref3.npz", 3)
    np.testing.assert_allclose(every[0], want, rtol=1e-12)
    close(tmp_path / "piped.npz", tmp_path / "ref3.npz")
    # the pipelined run's checkpoint (its stages' ranks wrote their state) without a pipeline
    ok(
        ranks,
        "--mesh",
        plain,
        "--steps",
        "5",
        "--store",
        store,
        "--resume",
        "-o",
        str(tmp_path / "r.npz"),
    )
    reference(shared_tmp, tmp_path / "ref5.npz", 5)
    close(tmp_path / "r.npz", tmp_path / "ref5.npz")


DETERMINISTIC = {
    "2-1f1b": (2, "pp=2", "1f1b", 4),
    "4-gpipe-tp": (4, "pp=2,tp=2", "gpipe", 2),
    "4-interleaved-dp": (4, "pp=2,dp=2", "interleaved", 2),
}


@pytest.mark.parametrize("case", sorted(DETERMINISTIC))
def test_in_deterministic_mode_pipelined_fit_under_mpirun_has_the_unpipelined_bits(
    case: str, tmp_path: Path, shared_tmp: Path
) -> None:
    """DTM_DETERMINISTIC=1: every rank's losses and the final state are bit for bit those of
    the unpipelined training on one simulated rank."""
    ranks, mesh, schedule, m = DETERMINISTIC[case]
    out = ok(
        ranks,
        *("--mesh", mesh, "--schedule", schedule, "--microbatches", str(m)),
        *("--steps", "2", "-o", str(tmp_path / "piped.npz")),
        DTM_DETERMINISTIC="1",
    )
    want = reference(shared_tmp, tmp_path / "ref.npz", 2, DTM_DETERMINISTIC="1")
    assert all(x.tobytes() == want.tobytes() for x in losses_of(out, ranks)), out
    a, b = np.load(tmp_path / "piped.npz"), np.load(tmp_path / "ref.npz")
    assert sorted(a.files) == sorted(b.files)
    differ = [k for k in b.files if a[k].tobytes() != b[k].tobytes()]
    assert not differ, differ


def test_a_pipelined_fit_resizes_live_across_pp_with_the_uninterrupted_bits(
    tmp_path: Path, shared_tmp: Path
) -> None:
    """Deterministic mode, 4 ranks: pp=2 x tp=2, after step 2 onto pp=1 x dp=2 (two ranks
    leave, the state of both stages moves to the two left), after step 4 back onto pp=2 x
    dp=2 (the parked ranks called back, each stage's state moved to its ranks): the final
    state has the bits of the uninterrupted unpipelined training."""
    out = ok(
        4,
        *("--mesh", "pp=2,dp=1,tp=2", "--schedule", "zb-h1", "--microbatches", "2"),
        *("--steps", "6", "--resize-at", "2:pp=1,dp=2,tp=1", "--resize-at", "4:pp=2,dp=2,tp=1"),
        *("-o", str(tmp_path / "resized.npz")),
        DTM_DETERMINISTIC="1",
    )
    assert "resized after step 2: 4 -> 2 rank(s), mesh [pp=1, dp=2, tp=1]" in out, out
    assert "resized after step 4: 2 -> 4 rank(s), mesh [pp=2, dp=2, tp=1]" in out, out
    reference(shared_tmp, tmp_path / "ref.npz", 6, DTM_DETERMINISTIC="1")
    a, b = np.load(tmp_path / "resized.npz"), np.load(tmp_path / "ref.npz")
    differ = [k for k in b.files if a[k].tobytes() != b[k].tobytes()]
    assert sorted(a.files) == sorted(b.files) and not differ, differ


FAULTS = {2: "pp=2", 3: "pp=3", 4: "pp=2,tp=2"}

# schedule -> (the splits, rank 1's other splits)
MISCUT = {
    "gpipe": ("blocks.2", "blocks.1"),
    "1f1b": ("blocks.2", "blocks.3"),
    "zb-h1": ("blocks.2", "blocks.1"),
    "interleaved": ("blocks.1,blocks.2,blocks.3", "blocks.1,blocks.2,ln"),
}


# each schedule at one size, the sizes alternating (the check is the same code at every size)
@pytest.mark.parametrize(
    ("schedule", "ranks"), [(s, (2, 4)[i % 2]) for i, s in enumerate(sorted(MISCUT))]
)
def test_a_boundary_mismatch_on_one_rank_is_a_located_error_before_any_send(
    schedule: str, ranks: int
) -> None:
    """Rank 1 cuts the model elsewhere (its own splits): the ranks' boundary values differ,
    and every rank ends with one error naming the first differing boundary value, its type
    and the user's line that made it, before any step (no hang, no wrong block)."""
    ours, theirs = MISCUT[schedule]
    proc = job(
        ranks,
        *("--mesh", FAULTS[ranks], "--schedule", schedule, "--microbatches", "2"),
        *("--splits", ours, "--rank1-splits", theirs, "--steps", "2"),
        DTM_TIMEOUT="30",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    errors = [ln for ln in out.splitlines() if "the pipeline plans differ" in ln]
    assert len(errors) == ranks and "Traceback" not in out, out
    assert re.search(r"stage \d -> \d (act|grad): %\S+ f64\[", errors[0]), errors[0]
    assert "pipeline_case.py:" in errors[0] and "losses" not in out, errors[0]


@pytest.mark.parametrize("ranks", sorted(FAULTS))
def test_a_stage_failing_mid_schedule_is_named_on_every_rank(ranks: int) -> None:
    """Rank 1 fails at its first receive of a boundary value (after rank 0's first forward):
    every rank ends with one line naming it and the step, no traceback, no hang."""
    proc = job(
        ranks,
        *("--mesh", FAULTS[ranks], "--schedule", "1f1b", "--microbatches", "2", "--steps", "2"),
        DTM_TIMEOUT="30",
        DTM_FAULT="1:recv:raise",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    want = "step 0 failed on rank(s) 1: rank 1 (step 0): injected failure (DTM_FAULT=1:recv:raise)"
    assert named_on_every_rank(out, want, ranks), out


@pytest.mark.parametrize("ranks", [4])  # (2 ranks: the same code; the unpipelined test has 3)
def test_a_pipelined_fit_stops_on_a_signal_saves_and_exits_75(ranks: int, tmp_path: Path) -> None:
    from dtm_mpi.errors import EXIT_REQUEUE
    from dtm_mpi.io.store import list_checkpoints

    store = tmp_path / "store"
    cmd = job_cmd(
        ranks,
        *("--mesh", FAULTS[ranks], "--schedule", "zb-h1", "--microbatches", "2"),
        *("--steps", "1000000", "--store", str(store), "--log-every", "5"),
    )
    env = mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="60")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # rank 0's progress: the run is stepping
        lines.append(line)
        if line.startswith("step 10/"):
            os.kill(proc.pid, signal.SIGUSR1)
            break
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == EXIT_REQUEUE, text
    m = re.search(r"stopped by SIGUSR1 after step (\d+): checkpoint", text)
    assert m is not None, text
    assert [c.step for c in list_checkpoints(store)] == [int(m.group(1))]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_in_integrity_mode_a_payload_corrupted_in_flight_is_named_on_every_rank(
    ranks: int,
) -> None:
    """DTM_INTEGRITY=1: a boundary value's bytes carry their sender's CRC32C; one bit flipped
    in flight on rank 1 (after the CRC) is one line on every rank naming the route and the
    step, never a wrong result reported as success. Without integrity mode the same flip goes
    unnoticed (the run succeeds), which is what the mode is for."""
    args = ("--mesh", FAULTS[ranks], "--schedule", "1f1b", "--microbatches", "2", "--steps", "2")
    proc = job(ranks, *args, DTM_TIMEOUT="30", DTM_FAULT="1:send:corrupt", DTM_INTEGRITY="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    lines = [ln for ln in out.splitlines() if "arrived with CRC32C" in ln]
    assert sorted({ln.split("]")[0] for ln in lines}) == [f"[rank {r}" for r in range(ranks)], out
    assert all("step 0 failed" in ln and "send/recv from rank 1 to rank" in ln for ln in lines)
    assert all(re.search(r"of microbatch \d from stage \d+ over pp\)", ln) for ln in lines), out
    assert "Traceback" not in out
    silent = job(ranks, *args, DTM_TIMEOUT="30", DTM_FAULT="1:send:corrupt")
    assert silent.returncode == 0, silent.stdout + silent.stderr
