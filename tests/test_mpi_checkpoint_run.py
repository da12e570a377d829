"""``dtm run --store DIR --checkpoint-every N --resume`` under real ``mpirun``: a run resumed on
another mesh gives the uninterrupted run's result; on the same mesh in deterministic mode,
bitwise; a rank killed during a save leaves ``latest`` loadable and verified and the partial
checkpoint directory reported as incomplete; a rank failing during a save is an error every
rank reports (one data file per rank) or ends the job at once (ranks sharing a data file); a
checkpoint of another program is refused on every rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.runtime.simulate import run_simulated
from tests.cli_entry import dtm
from tests.mpi_env import gone, mpirun_env
from tests.test_mpi_run import EXAMPLES, load, mpirun

pytestmark = [pytest.mark.slow]
MLP = str(EXAMPLES / "tp_mlp.dtm")


@pytest.mark.parametrize(
    ("first", "then"),
    [((4, "dp=2,tp=2"), (3, "dp=1,tp=3")), ((2, "dp=2,tp=1"), (4, "dp=2,tp=2"))],
    ids=["2x2->1x3", "2x1->2x2"],
)
def test_resume_on_another_mesh_equals_the_uninterrupted_run(
    first: tuple[int, str], then: tuple[int, str], tmp_path: Path
) -> None:
    store, out = str(tmp_path / "store"), tmp_path / "resumed.npz"
    code, text, _ = mpirun(
        first[0],
        MLP,
        "--mesh",
        first[1],
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--store",
        store,
        env={"DTM_TIMEOUT": "60"},
    )
    assert code == 0, text
    assert "checkpoint" in text and "after step 2" in text, text
    code, text, _ = mpirun(
        then[0],
        MLP,
        "--mesh",
        then[1],
        "--steps",
        "4",
        "--resume",
        "--store",
        store,
        "-o",
        str(out),
        env={"DTM_TIMEOUT": "60"},
    )
    assert code == 0, text
    assert "resumed from" in text and "after step 2" in text, text
    sizes = dict(kv.split("=") for kv in first[1].split(","))
    want = run_simulated(
        load("tp_mlp"), first[0], binding={k: int(v) for k, v in sizes.items()}, steps=4
    ).outputs()
    got = np.load(out)
    assert sorted(got.files) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_simulated_runs_checkpoint_resumes_under_mpirun_bit_for_bit(
    ranks: int, tmp_path: Path
) -> None:
    from dtm_mpi.runtime.policies import CheckpointPolicy

    store, out = str(tmp_path / "store"), tmp_path / "resumed.npz"
    run_simulated(
        load("tp_mlp"),
        4,
        binding={"dp": 2, "tp": 2},
        steps=2,
        deterministic=True,
        checkpoint=CheckpointPolicy(store, every=2),
    )
    env = {"DTM_TIMEOUT": "60", "DTM_DETERMINISTIC": "1"}
    code, text, _ = mpirun(
        ranks, MLP, "--steps", "4", "--resume", "--store", store, "-o", str(out), env=env
    )
    assert code == 0, text
    assert "resumed from" in text and "after step 2" in text, text
    want = run_simulated(load("tp_mlp"), 1, steps=4, deterministic=True).outputs()
    got = np.load(out)
    for key, value in want.items():
        assert got[key].tobytes() == value.tobytes(), key


def test_resume_on_the_same_mesh_is_bitwise(tmp_path: Path) -> None:
    store, out = str(tmp_path / "store"), tmp_path / "resumed.npz"
    env = {"DTM_TIMEOUT": "60", "DTM_DETERMINISTIC": "1"}
    code, text, _ = mpirun(
        2, MLP, "--steps", "3", "--checkpoint-every", "3", "--store", store, env=env
    )
    assert code == 0, text
    code, text, _ = mpirun(
        2, MLP, "--steps", "5", "--resume", "--store", store, "-o", str(out), env=env
    )
    assert code == 0, text
    want = run_simulated(load("tp_mlp"), 2, steps=5, deterministic=True).outputs()
    got = np.load(out)
    for key, value in want.items():
        assert got[key].tobytes() == value.tobytes(), f"{key} differs bitwise"


def test_rank_killed_during_a_save_leaves_latest_loadable(tmp_path: Path) -> None:
    store = tmp_path / "store"
    code, text, _ = mpirun(
        3,
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--store",
        str(store),
        env={"DTM_TIMEOUT": "60"},
    )
    assert code == 0, text
    marker = str(tmp_path / "killed.npz")
    code, text, elapsed = mpirun(
        3,
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--resume",
        "--store",
        str(store),
        "-o",
        marker,
        env={"DTM_TIMEOUT": "5", "DTM_FAULT": "1:ckpt_write:exit"},
    )
    assert code != 0, text
    assert elapsed < 40, f"took {elapsed:.1f} s"
    partial = [p for p in store.iterdir() if ".partial-" in p.name]
    assert partial and all(
        p.name.startswith("ckpt-00000004.partial-") and p.is_dir() for p in partial
    ), sorted(store.iterdir())
    assert (store / "latest").read_text() == "ckpt-00000002\n"
    assert (store / "ckpt-00000002").is_dir() and not (store / "ckpt-00000004").exists()
    listing = dtm("ckpt", "ls", str(store))
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"INCOMPLETE", listing.stdout) and "ckpt-00000004" in listing.stdout, (
        listing.stdout
    )
    verify = dtm("ckpt", "verify", str(store))
    assert verify.returncode == 0 and "ok" in verify.stdout, verify.stdout + verify.stderr
    assert gone(marker) == [], "processes survived the job"
    # the run resumes from step 2 as if nothing happened
    out = tmp_path / "out.npz"
    code, text, _ = mpirun(
        3,
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "4",
        "--resume",
        "--store",
        str(store),
        "-o",
        str(out),
        env={"DTM_TIMEOUT": "60"},
    )
    assert code == 0 and "after step 2" in text, text


def test_resume_refuses_another_programs_checkpoint(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    code, text, _ = mpirun(2, MLP, "--steps", "1", "--checkpoint-every", "1", "--store", store)
    assert code == 0, text
    other = tmp_path / "other.dtm"
    other.write_text(Path(MLP).read_text().replace("seed=1, std=0.02", "seed=9, std=0.02"))
    code, text, _ = mpirun(2, str(other), "--steps", "3", "--resume", "--store", store)
    assert code != 0
    lines = [ln for ln in text.splitlines() if "refusing to resume" in ln]
    assert sorted(ln.split("]")[0] for ln in lines) == ["[rank 0", "[rank 1"], text


def test_a_rank_failing_inside_a_save_is_an_error_on_every_rank(tmp_path: Path) -> None:
    """One data file per rank (the default): writing it involves no collective HDF5 call, so
    a rank that fails there reports to its peers at the next agreement, and every rank ends
    with the same error naming the failed rank, at once (not at the 60 s deadline). The
    partial checkpoint stays, listed as incomplete; nothing was committed."""
    store = tmp_path / "s"
    code, text, elapsed = mpirun(
        3,
        MLP,
        "--mesh",
        "dp=1,tp=3",
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--store",
        str(store),
        env={
            "DTM_TIMEOUT": "60",
            "DTM_FAULT": "1:ckpt_write:raise",
            "DTM_CKPT_RANKS_PER_FILE": "1",
        },
    )
    assert code != 0
    assert elapsed < 30, f"took {elapsed:.1f} s (the deadline is 60 s)\n{text}"
    pattern = r"\[rank (\d)\] dtm run: (checkpoint 1: writing ckpt-00000001\.partial-[0-9a-f]+ failed on rank 1: injected failure .*)"
    found = {int(m.group(1)): m.group(2) for m in re.finditer(pattern, text)}
    assert sorted(found) == [0, 1, 2] and len(set(found.values())) == 1, text
    assert "aborting the job" not in text, text
    partial = [p.name for p in store.iterdir() if ".partial-" in p.name]
    assert len(partial) == 1 and partial[0] in found[0], (partial, text)
    assert not (store / "latest").exists() and not (store / "ckpt-00000001").exists()
    listing = dtm("ckpt", "ls", str(store))
    assert listing.returncode == 0 and f"{partial[0]}: INCOMPLETE" in listing.stdout, listing.stdout


def test_a_rank_failing_inside_a_shared_data_file_ends_the_job_at_once(tmp_path: Path) -> None:
    """All ranks share one data file (``DTM_CKPT_RANKS_PER_FILE=all``): its peers wait inside
    collective HDF5 calls (holding the interpreter lock), so the failing rank ends the job
    with its own error instead of leaving them to the deadline."""
    code, text, elapsed = mpirun(
        2,
        MLP,
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--store",
        str(tmp_path / "s"),
        env={
            "DTM_TIMEOUT": "60",
            "DTM_FAULT": "1:ckpt_write:raise",
            "DTM_CKPT_RANKS_PER_FILE": "all",
        },
    )
    assert code != 0
    assert elapsed < 30, f"took {elapsed:.1f} s (the deadline is 60 s)\n{text}"
    assert re.search(
        r"\[rank 1\] dtm: error: rank 1 failed during checkpoint 1 \(writing data-000000\.h5\): .*injected failure",
        text,
    ), text
    assert "[rank 1] dtm: aborting the job (its peers are inside collective HDF5 calls)" in text, (
        text
    )


def test_resume_needs_no_inputs_for_parameters_without_init(tmp_path: Path) -> None:
    """Every entry parameter is in the checkpoint: one given with -i on the first run (it has
    no init) comes back from the store on --resume."""
    src = (EXAMPLES / "dp_step.dtm").read_text()
    prog = tmp_path / "noinit.dtm"
    prog.write_text(re.sub(r"(%w_true: f32\[32,8\]) init normal\([^)]*\)", r"\1", src))
    w_true = tmp_path / "w_true.npy"
    np.save(w_true, np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    store = str(tmp_path / "store")
    code, text, _ = mpirun(
        2, str(prog), "-i", str(w_true), "--steps", "2", "--checkpoint-every", "1", "--store", store
    )
    assert code == 0, text
    out = tmp_path / "out.npz"
    code, text, _ = mpirun(
        2, str(prog), "--steps", "3", "--resume", "--store", store, "-o", str(out)
    )
    assert code == 0 and "after step 2" in text, text
    assert np.array_equal(np.load(out)["w_true"], np.load(w_true))


ASYNC_FAULT = """
import sys
import numpy as np
from mpi4py import MPI
from dtm_mpi.io.checkpoint import CheckpointStore
from dtm_mpi.io.ckpt_plan import TensorSpec
from dtm_mpi.ir.types import DType, Layout, TensorType
from dtm_mpi.sharding.blocks import local_block
from dtm_mpi.sharding.mesh import MeshShape
comm = MPI.COMM_WORLD
mesh = MeshShape((("x", comm.Get_size()),))
t = TensorType(DType.F32, (50, 7), Layout((("x",), ())))
blk = np.arange(350, dtype=np.float32).reshape(50, 7)[local_block(t.shape, t.layout, mesh, comm.Get_rank())]
store = CheckpointStore(sys.argv[1], comm, timeout_s=30, ranks_per_file=1)
handle = store.save_async(1, mesh, [(TensorSpec(f"t{i}", t), blk + i) for i in range(3)])
try:
    handle.wait()
    sys.stdout.write(f"[rank {comm.Get_rank()}] saved\\n")  # one write: ranks interleave
    sys.stdout.flush()
except Exception as exc:
    sys.stdout.write(f"[rank {comm.Get_rank()}] {type(exc).__name__}: {exc}\\n")
    sys.stdout.flush()
"""


def test_a_rank_failing_in_an_async_save_is_the_error_every_rank_reports(tmp_path: Path) -> None:
    """The other ranks stop at the next vote without checking their unfinished files: the
    error every rank raises is the failing rank's own, not a secondary "dataset is missing"."""

    script = tmp_path / "async_fault.py"
    script.write_text(ASYNC_FAULT)
    env = mpirun_env(DTM_FAULT="1:ckpt_write:raise")
    cmd = [
        "mpirun",
        "--timeout",
        "60",
        "--bind-to",
        "none",
        "-n",
        "2",
        sys.executable,
        str(script),
        str(tmp_path / "s"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, check=False)
    lines = sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("[rank "))
    assert len(lines) == 2, proc.stdout + proc.stderr
    for rank, line in enumerate(lines):
        assert line.startswith(
            f"[rank {rank}] StorageError: checkpoint 1: writing ckpt-00000001.partial-"
        ), line
        assert "failed on rank 1: injected failure" in line and "more rank" not in line, line


def _mount_tmpfs(where: Path, size_bytes: int) -> None:
    """Mount a tmpfs of ``size_bytes`` at ``where`` (root only), else skip the test."""
    import os

    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024 + 1}k", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_full_disk_during_a_save_fails_cleanly_naming_enospc(ranks: int, tmp_path: Path) -> None:
    """A save that fills its file system fails on every rank with one error line naming
    ``No space left on device``; the job exits with dtm's failure code (1), not a crash in
    HDF5's file close at interpreter exit (139), with no traceback; the previous checkpoint
    stays latest and verifies."""
    from dtm_mpi.io.store import tree_bytes

    probe = tmp_path / "probe"
    code, text, _ = mpirun(
        ranks, MLP, "--steps", "1", "--checkpoint-every", "1", "--store", str(probe)
    )
    assert code == 0, text
    one = tree_bytes(probe)  # one checkpoint: the second does not fit in 1.5 of them
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, one * 3 // 2)
    try:
        store = disk / "store"
        code, text, _ = mpirun(
            ranks,
            MLP,
            "--steps",
            "2",
            "--checkpoint-every",
            "1",
            "--store",
            str(store),
            env={"DTM_TIMEOUT": "60"},
        )
        assert code == 1, f"exit code {code}\n{text}"
        assert "Traceback" not in text and "Exception ignored" not in text, text
        assert "Segmentation fault" not in text, text
        for rank in range(ranks):
            lines = [ln for ln in text.splitlines() if ln.startswith(f"[rank {rank}] ")]
            assert len(lines) == 1, (rank, text)
            assert "checkpoint 2: " in lines[0] and "No space left on device" in lines[0], (
                rank,
                text,
            )
        assert (store / "latest").read_text().strip().endswith("1"), text
        check = dtm("ckpt", "verify", str(store))
        assert check.returncode == 0 and check.stdout.startswith(
            f"ok {store / 'ckpt-00000001'}: "
        ), check.stdout + check.stderr
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=60, check=False)
