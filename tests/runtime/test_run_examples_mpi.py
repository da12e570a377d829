"""``dtm run`` of every example on the ranks of the MPI suite (2, 3 and 4), through the command's
entry point in the suite's own processes: the outputs equal the simulator's bit for bit
(deterministic mode). tests/test_mpi_run.py launches the command itself under ``mpirun`` (the
process, its start-up and its failures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.cli import run
from dtm_mpi.config import get_config
from dtm_mpi.runtime.simulate import run_simulated
from tests.test_mpi_run import EXAMPLES, load

pytestmark = pytest.mark.mpi


def run_two_steps(name: str, out: Path, comm: Any, all_ranks: Any, capsys: Any) -> Any:
    """``dtm run`` of example ``name`` for two steps in the suite's processes, its outputs
    (asserted to have exited 0 on every rank)."""
    code = run(["run", str(EXAMPLES / f"{name}.dtm"), "--steps", "2", "-o", str(out)])
    text = capsys.readouterr()
    all_ranks(code == 0, f"dtm run exited {code}: {text.err}")
    comm.Barrier()
    return np.load(out)


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("DTM_DETERMINISTIC", "1")
    monkeypatch.setenv("DTM_TIMEOUT", "60")
    get_config.cache_clear()
    yield
    monkeypatch.undo()
    get_config.cache_clear()


@pytest.mark.parametrize("name", ["tp_mlp", "dp_step", "attention", "collectives", "pipeline"])
def test_dtm_run_of_an_example_equals_the_simulator(
    name: str,
    comm: Any,
    mpi_tmp_path: Path,
    all_ranks: Any,
    deterministic: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    got = run_two_steps(name, mpi_tmp_path / "out.npz", comm, all_ranks, capsys)
    want = run_simulated(load(name), comm.Get_size(), steps=2, deterministic=True).outputs()
    all_ranks(sorted(got.files) == sorted(want), f"{sorted(got.files)} != {sorted(want)}")
    for key, value in want.items():
        same = (
            got[key].dtype == value.dtype
            and got[key].shape == value.shape
            and got[key].tobytes() == value.tobytes()
        )
        all_ranks(same, f"{key} differs from the simulator's")


@pytest.mark.parametrize("name", ["tp_mlp", "dp_step"])
def test_dtm_run_with_overlapped_buckets_in_deterministic_mode_equals_the_simulator(
    name: str,
    comm: Any,
    mpi_tmp_path: Path,
    all_ranks: Any,
    deterministic: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dtm_mpi.plan.program import compile_plan, mesh_for

    monkeypatch.setenv("DTM_OVERLAP", "1")
    monkeypatch.setenv("DTM_BUCKET_BYTES", str(1 << 20))
    get_config.cache_clear()
    module = load(name)
    plan = compile_plan(module, mesh_for(module, comm.Get_size(), None))
    all_ranks(bool(plan.entry_plan.buckets), "the plan overlaps no allreduce")
    got = run_two_steps(name, mpi_tmp_path / "out.npz", comm, all_ranks, capsys)
    monkeypatch.setenv("DTM_OVERLAP", "0")
    get_config.cache_clear()
    want = run_simulated(module, 1, steps=2, deterministic=True).outputs()
    for key, value in want.items():
        all_ranks(got[key].tobytes() == value.tobytes(), f"{key} differs from one rank's")


def test_dtm_run_checkpoints_in_the_background_and_one_simulated_rank_resumes_it(
    comm: Any,
    mpi_tmp_path: Path,
    all_ranks: Any,
    deterministic: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Async checkpoints keeping the last two and the progress line at every rank count of
    the suite; the checkpoint resumes on another mesh (one simulated rank) to the bits of
    the uninterrupted run."""
    from dtm_mpi.io.store import list_checkpoints
    from dtm_mpi.runtime.policies import CheckpointPolicy

    store = mpi_tmp_path / "s"
    saves = ["--store", str(store), "--checkpoint-every", "1", "--checkpoint-async"]
    args = ["run", str(EXAMPLES / "tp_mlp.dtm"), "--steps", "3", *saves, "--keep-last", "2"]
    code = run([*args, "--log-every", "1"])
    text = capsys.readouterr()
    all_ranks(code == 0, f"dtm run exited {code}: {text.err}")
    comm.Barrier()
    if comm.Get_rank() == 0:
        all_ranks("step 3/3:" in text.out, f"no progress line: {text.out}")
    else:
        all_ranks(True)
    saved = [c.step for c in list_checkpoints(store)]
    all_ranks(saved == [2, 3], f"checkpoints {saved}, not [2, 3]")
    same, why = True, ""
    if comm.Get_rank() == 0:  # one process reads the store: another mesh, one simulated rank
        policy = CheckpointPolicy(str(store), resume=True)
        resumed = run_simulated(load("tp_mlp"), 1, steps=5, deterministic=True, checkpoint=policy)
        want = run_simulated(load("tp_mlp"), 1, steps=5, deterministic=True).outputs()
        got = resumed.outputs()
        bad = [k for k, v in want.items() if got[k].tobytes() != v.tobytes()]
        same, why = not bad, f"{bad} differ from the uninterrupted run's"
    all_ranks(same, why)


@pytest.mark.parametrize("name", ["tp_mlp", "attention"])
def test_dtm_run_with_the_fast_deterministic_matmul_has_one_ranks_bits(
    name: str,
    comm: Any,
    mpi_tmp_path: Path,
    all_ranks: Any,
    deterministic: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """DTM_DETERMINISTIC_MATMUL=fast under MPI: the bits of one simulated rank with it, and
    not those of the full precision (the setting is what ran)."""
    monkeypatch.setenv("DTM_DETERMINISTIC_MATMUL", "fast")
    get_config.cache_clear()
    got = run_two_steps(name, mpi_tmp_path / "out.npz", comm, all_ranks, capsys)
    want = run_simulated(load(name), 1, steps=2, deterministic=True).outputs()
    for key, value in want.items():
        all_ranks(got[key].tobytes() == value.tobytes(), f"{key} differs from one rank's")
    monkeypatch.setenv("DTM_DETERMINISTIC_MATMUL", "full")
    get_config.cache_clear()
    full = run_simulated(load(name), 1, steps=2, deterministic=True).outputs()
    all_ranks(
        any(full[k].tobytes() != v.tobytes() for k, v in want.items()),
        "the fast matmul gave the full one's bits",
    )
