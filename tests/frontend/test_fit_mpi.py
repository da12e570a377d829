"""The Python frontend under real ``mpirun`` (examples/digits.py): trained on 2, 3 and 4 ranks
with the runtime's checkpoints, resumed on another mesh (bitwise equal to the uninterrupted run
on yet another mesh: deterministic mode's sums are exact; the same mesh is then a special
case), held-out accuracy read through an evaluation step whose weights come from the store."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.mpi_env import mpirun_env
from tests.shared_runs import OUT, shared_run

pytestmark = [pytest.mark.slow]
DIGITS = str(Path(__file__).resolve().parents[2] / "examples" / "digits.py")


def digits_cmd(ranks: int, mesh: str, *args: str, quiet: bool = True) -> list[str]:
    """``examples/digits.py`` on ``ranks`` ranks of mpirun with these arguments."""
    run = [sys.executable, "-m", "mpi4py", DIGITS, *(["--quiet"] if quiet else []), "--mesh", mesh]
    return ["mpirun", "--timeout", "120", "--bind-to", "none", "-n", str(ranks), *run, *args]


def digits_job(
    ranks: int, mesh: str, *args: str, quiet: bool = True, **env_more: str
) -> subprocess.CompletedProcess[str]:
    """The finished job of :func:`digits_cmd` (deterministic mode, ``env_more`` added)."""
    env = mpirun_env(
        **{"PYTHONUNBUFFERED": "1", "DTM_TIMEOUT": "60", "DTM_DETERMINISTIC": "1", **env_more}
    )
    cmd = digits_cmd(ranks, mesh, *args, quiet=quiet)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, check=False)


def digits(ranks: int, mesh: str, *args: str, quiet: bool = True, **env_more: str) -> str:
    """The output of a :func:`digits_job` that must succeed."""
    proc = digits_job(ranks, mesh, *args, quiet=quiet, **env_more)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def straight_run(shared: Path, out: Path, steps: int) -> None:
    """The uninterrupted run on one simulated rank (deterministic mode), its outputs to ``out``
    (run once per session: :func:`~tests.shared_runs.shared_run`)."""
    cmd = [sys.executable, DIGITS, "--quiet", "--sim", "1", "--mesh", "dp=1,tp=1"]
    shared_run(shared, [*cmd, "--steps", str(steps), "-o", OUT], out, DTM_DETERMINISTIC="1")


def same_bits(got: Path, want: Path) -> None:
    a, b = np.load(got), np.load(want)
    assert sorted(a.files) == sorted(b.files)
    for k in b.files:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs bitwise"


def test_fit_under_mpirun_overlaps_its_allreduces_with_the_same_bits_and_shows_its_bar(
    tmp_path: Path,
    shared_tmp: Path,
) -> None:
    """DTM_OVERLAP=1 (buckets started when ready) in deterministic mode: 4 ranks give the
    1-rank run's bits; rank 0 shows the progress bar (no --quiet)."""
    out = digits(
        4,
        "dp=2,tp=2",
        "--steps",
        "6",
        "-o",
        str(tmp_path / "o.npz"),
        quiet=False,
        DTM_OVERLAP="1",
        DTM_BUCKET_BYTES="4096",
    )
    assert "6/6" in out and "loss=" in out, out
    straight_run(shared_tmp, tmp_path / "straight.npz", 6)
    same_bits(tmp_path / "o.npz", tmp_path / "straight.npz")


def test_trained_on_4_ranks_resumed_on_3_equals_the_uninterrupted_run(
    tmp_path: Path, shared_tmp: Path
) -> None:
    store = str(tmp_path / "store")
    first = digits(4, "dp=2,tp=2", "--steps", "30", "--store", store, "--checkpoint-every", "30")
    assert "checkpoint" in first and "after step 30" in first
    out = digits(
        3,
        "dp=1,tp=3",
        "--steps",
        "60",
        "--store",
        store,
        "--checkpoint-every",
        "30",
        "--resume",
        "-o",
        str(tmp_path / "resumed.npz"),
        "--plot",
        str(tmp_path / "p.png"),
    )
    assert "resumed from" in out and "after step 30" in out, out
    acc = float(re.search(r"held-out accuracy ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert acc > 0.8, out  # 60 steps of 64 images: well past chance (0.1)
    assert (tmp_path / "p.png").stat().st_size > 1000
    # the uninterrupted run on one simulated rank (deterministic mode: the same bits on any mesh)
    straight_run(shared_tmp, tmp_path / "straight.npz", 60)
    same_bits(tmp_path / "resumed.npz", tmp_path / "straight.npz")  # 4 ranks then 3 equal 1


def test_a_bad_mesh_is_one_line_on_every_rank(tmp_path: Path) -> None:
    proc = digits_job(3, "dp=2,tp=2", "--steps", "2", DTM_TIMEOUT="30")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("digits:")]
    assert len(lines) == 3 and len(set(lines)) == 1, proc.stderr
    assert "has 4 rank(s), but the job has 3" in lines[0] and "Traceback" not in proc.stderr


GPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")


def test_the_gpt_example_trains_checkpoints_and_resumes_on_another_mesh(tmp_path: Path) -> None:
    """The plumbing of examples/gpt.py under mpirun (its quality run is in the note and
    docs/PERFORMANCE.md): heads and vocabulary over tp=2, then 2 heads on tp=3 ranks."""
    env = mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="60")
    store = str(tmp_path / "store")

    def gpt(ranks: int, mesh: str, *args: str, store: str = store) -> str:
        cmd = [
            "mpirun",
            "--timeout",
            "150",
            "--bind-to",
            "none",
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "mpi4py",
            GPT,
            "--quiet",
            "--mesh",
            mesh,
            "--store",
            store,
            "--val-batches",
            "1",
            *args,
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=180, env=env, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    first = gpt(2, "dp=1,tp=2", "--steps", "6", "--checkpoint-every", "6")
    assert "validation loss" in first and "bigram baseline" in first, first
    out = gpt(3, "dp=1,tp=3", "--steps", "12", "--checkpoint-every", "6", "--resume")
    assert "resumed from" in out and "after step 6" in out, out
    loss = float(re.search(r"validation loss ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert 0 < loss < math.log(96) + 0.5, (
        out
    )  # below a uniform guess over the 96 characters (plus noise)
    # pipelined: two stages per rank need --layers >= 2 x pp
    args = ["--steps", "4", "--schedule", "interleaved", "--microbatches", "2", "--layers", "4"]
    out = gpt(2, "pp=2,dp=1,tp=1", *args, store=str(tmp_path / "pp"))
    assert "validation loss" in out, out


@pytest.mark.parametrize(
    ("ranks", "meshes"),
    [(3, ("dp=1,tp=3", "dp=2,tp=2", "dp=1,tp=3")), (4, ("dp=2,tp=2", "dp=1,tp=2", "dp=2,tp=2"))],
    ids=["grow-spawns", "shrink-parks-with-async-checkpoints"],
)
def test_fit_resizes_live_and_equals_the_uninterrupted_run(
    ranks: int, meshes: tuple[str, str, str], tmp_path: Path, shared_tmp: Path
) -> None:
    """fit(resize_at=...) under mpirun: growing past the launched ranks spawns the script
    again (its fit() call joins the run: the handshake checks the traced module), shrinking
    parks the ranks that leave inside fit() until the run ends (that run also writes its
    checkpoints in the background, keeping the last two, on every mesh); the result is the
    uninterrupted run's, bit for bit (deterministic mode)."""
    from dtm_mpi.io.store import list_checkpoints

    a, b, c = meshes
    store = tmp_path / "store"
    saves = [
        "--store",
        str(store),
        "--checkpoint-every",
        "1",
        "--checkpoint-async",
        "--keep-last",
        "2",
    ]
    out = digits(
        ranks,
        a,
        "--steps",
        "9",
        "--resize-at",
        f"3:{b}",
        "--resize-at",
        f"6:{c}",
        "-o",
        str(tmp_path / "live.npz"),
        *(saves if ranks == 4 else []),
    )
    if ranks == 4:
        assert [c.step for c in list_checkpoints(store)] == [8, 9], out
        assert "written in the background" in out, out
    n = [math.prod(int(kv.split("=")[1]) for kv in m.split(",")) for m in meshes]
    assert f"resized after step 3: {n[0]} -> {n[1]} rank(s)" in out, out
    assert f"resized after step 6: {n[1]} -> {n[2]} rank(s)" in out, out
    straight_run(shared_tmp, tmp_path / "straight.npz", 9)
    same_bits(tmp_path / "live.npz", tmp_path / "straight.npz")


MESHES = {2: "dp=1,tp=2", 3: "dp=1,tp=3", 4: "dp=2,tp=2"}
# The three launched-failure tests below run at two sizes each, every size in two of them:
# what they assert is the same code at every size (the in-process MPI suite runs at 2, 3 and
# 4 ranks); CI time keeps the launches few.


@pytest.mark.parametrize("ranks", [2, 3])
def test_fit_under_mpirun_stops_on_a_signal_saves_and_exits_75(ranks: int, tmp_path: Path) -> None:
    """SIGUSR1 to mpirun (forwarded to every rank) while fit() trains: every rank stops after
    the same step, the state is saved, and the job exits 75 ("saved, requeue me")."""
    import os
    import signal

    from dtm_mpi.errors import EXIT_REQUEUE
    from dtm_mpi.io.store import list_checkpoints

    store = tmp_path / "store"
    env = mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="60")
    cmd = digits_cmd(ranks, MESHES[ranks], "--steps", "1000000", "--store", str(store))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # rank 0's progress: the run is stepping
        lines.append(line)
        if line.startswith("step 50/"):
            os.kill(proc.pid, signal.SIGUSR1)
            break
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == EXIT_REQUEUE, text
    m = re.search(r"stopped by SIGUSR1 after step (\d+): checkpoint", text)
    assert m is not None, text
    assert [c.step for c in list_checkpoints(store)] == [int(m.group(1))]


@pytest.mark.parametrize("ranks", [3, 4])
def test_an_injected_fault_in_fit_under_mpirun_is_named_on_every_rank(ranks: int) -> None:
    """DTM_FAULT in fit() under mpirun: rank 1 fails at its first step; every rank ends with
    one line naming the injected failure, its rank and the step, and no traceback."""
    proc = digits_job(
        ranks, MESHES[ranks], "--steps", "4", DTM_TIMEOUT="30", DTM_FAULT="1:step:raise"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    want = "step 0 failed on rank(s) 1: rank 1 (step 0): injected failure (DTM_FAULT=1:step:raise)"
    named = sorted(ln.split("]")[0] for ln in out.splitlines() if want in ln)
    assert named == [f"[rank {r}" for r in range(ranks)] and "Traceback" not in out, out


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_quota_too_small_for_fits_checkpoint_is_one_error_on_every_rank(
    ranks: int, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    args = ["--store", str(store), "--checkpoint-every", "1", "--quota", "1000"]
    proc = digits_job(ranks, MESHES[ranks], "--steps", "2", *args, DTM_TIMEOUT="30")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    refused = [ln for ln in out.splitlines() if "the quota's 1000" in ln and str(store) in ln]
    assert len(refused) == ranks and "Traceback" not in out, out


@pytest.fixture(scope="module")
def straight_20(tmp_path_factory: pytest.TempPathFactory, shared_tmp: Path) -> Path:
    out = tmp_path_factory.mktemp("straight") / "straight.npz"
    straight_run(shared_tmp, out, 20)
    return out


# (ranks, the sharded leg's mesh and how it shards, the unsharded leg's mesh)
SHARDED = [
    (2, "dp=2,tp=1", "--shard-optimizer", "dp=1,tp=2"),
    (3, "dp=3,tp=1", "--shard-params", "dp=1,tp=3"),
    (4, "dp=2,tp=2", "--shard-optimizer", "dp=4,tp=1"),
]


@pytest.mark.parametrize(
    ("ranks", "mesh", "how", "other"), SHARDED, ids=[f"{r}{h}" for r, _, h, _ in SHARDED]
)
def test_a_sharded_run_resumes_unsharded_on_another_mesh_with_the_same_bits(
    ranks: int, mesh: str, how: str, other: str, straight_20: Path, tmp_path: Path
) -> None:
    """ZeRO under mpirun: AdamW's update and state split over dp (reduce-scatter, then
    allgather), or the weights stored split too (gathered where used), checkpointed, resumed
    without sharding on another mesh: the bits of the unsharded uninterrupted run on one rank
    (deterministic mode)."""
    store = str(tmp_path / "store")
    first = digits(ranks, mesh, "--steps", "10", "--store", store, "--checkpoint-every", "10", how)
    assert "after step 10" in first, first
    out = tmp_path / "resumed.npz"
    second = digits(
        ranks,
        other,
        "--steps",
        "20",
        "--store",
        store,
        "--checkpoint-every",
        "10",
        "--resume",
        "-o",
        str(out),
    )
    assert "resumed from" in second and "after step 10" in second, second
    same_bits(out, straight_20)


@pytest.mark.parametrize(
    ("ranks", "mesh", "integrity"), [(2, "dp=2,tp=1", "0"), (4, "dp=2,tp=2", "1")]
)
def test_prefetched_gathers_under_mpirun_keep_the_bits(
    ranks: int, mesh: str, integrity: str, straight_20: Path, tmp_path: Path
) -> None:
    """ZeRO-3 (`--shard-params`) with DTM_OVERLAP=1: every gather of a stored parameter but
    the first runs on the side thread, started one ahead (in integrity mode compared when
    waited for); 20 steps give the bits of the unsharded run on one rank."""
    out = tmp_path / "o.npz"
    digits(
        ranks,
        mesh,
        "--steps",
        "20",
        "--shard-params",
        "-o",
        str(out),
        DTM_OVERLAP="1",
        DTM_INTEGRITY=integrity,
    )
    same_bits(out, straight_20)


@pytest.mark.parametrize(
    ("op", "waited_in"), [("matmul", "overlap communicator"), ("gelu", "allgather")]
)
def test_a_rank_hung_while_a_prefetched_gather_waits_for_it_is_named_on_every_rank(
    op: str, waited_in: str
) -> None:
    """ZeRO-3 with DTM_OVERLAP=1 at dp=4: rank 1 hangs before its first ``op``, where the
    others go on to start the next parameter's gather on their side threads (``matmul``: the
    first, which creates the side thread's communicator; ``gelu``: a later one, a gather rank
    1 never joins). Each of them waits within the deadline and the job ends with one line on
    every rank naming rank 1 and where it waited, nothing left hanging."""
    start = time.monotonic()
    proc = digits_job(
        4,
        "dp=4,tp=1",
        "--steps",
        "3",
        "--shard-params",
        DTM_OVERLAP="1",
        DTM_FAULT=f"1:{op}:hang",
        DTM_TIMEOUT="3",
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "failed on rank(s) 1" in ln]
    ranks = sorted({int(re.match(r"\[rank (\d+)\]", ln).group(1)) for ln in lines})  # type: ignore[union-attr]
    assert ranks == [0, 1, 2, 3], proc.stderr
    assert all(f"waited 3 s in {waited_in} on axes dp" in ln for ln in lines), proc.stderr
    assert "Traceback" not in proc.stderr and elapsed < 60, (elapsed, proc.stderr)
