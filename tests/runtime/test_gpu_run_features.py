"""The run features on a GPU backend (the ``--backend cuda|hip`` column of docs/RUNTIME.md's
features x modes table), under real ``mpirun`` at 2 ranks: checkpoints written in the
background and resumed on another mesh, a stop on a signal (exit 75), a live resize,
deterministic mode with overlapped allreduces (the same bits on 1 and 2 ranks), an injected
fault named on every rank, payload integrity mode on device buffers, and the progress line. Marker ``gpu``: skipped with the reason
where no device exists (``jobs/gpu-features.sh`` runs them on a GPU machine)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.errors import EXIT_REQUEUE
from dtm_mpi.io.store import list_checkpoints
from tests.kernels.test_cuda_kernels import _open_gpu
from tests.mpi_env import mpirun_env, rank_pid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
]
MLP = str(Path(__file__).parents[2] / "examples" / "tp_mlp.dtm")


def _parallel_hdf5() -> bool:
    import h5py

    return bool(h5py.get_config().mpi)


# checkpoints are parallel HDF5 files: a GPU image whose h5py has no mpio driver (the lent H200
# image's has none) runs the other features and says why these wait
needs_parallel_hdf5 = pytest.mark.skipif(
    not _parallel_hdf5(), reason="h5py without parallel HDF5 (no mpio driver): checkpoints need it"
)


@pytest.fixture(scope="module")
def backend() -> str:
    """The GPU backend's name (``cuda`` or ``hip``); the module is skipped without one."""
    return str(_open_gpu().name)


def _cmd(ranks: int, *args: str) -> list[str]:
    run = [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", "run", MLP, *args]
    return ["mpirun", "--timeout", "200", "--bind-to", "none", "-n", str(ranks), *run]


def _env(**more: str) -> dict[str, str]:
    return mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="120", DTM_GPU_AWARE_MPI="no", **more)


def dtm_run(ranks: int, *args: str, ok: bool = True, **env: str) -> str:
    proc = subprocess.run(
        _cmd(ranks, *args),
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(**env),
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) is ok, out
    return out


def _close(got: Path, want: Path) -> None:
    a, b = np.load(got), np.load(want)
    assert sorted(a.files) == sorted(b.files)
    for k in b.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)


@needs_parallel_hdf5
def test_async_checkpoints_keep_the_last_and_resume_on_another_mesh(
    backend: str, tmp_path: Path
) -> None:
    store = tmp_path / "s"
    saves = ["--store", str(store), "--checkpoint-every", "1", "--checkpoint-async"]
    first = dtm_run(
        2,
        "--mesh",
        "dp=1,tp=2",
        "--steps",
        "4",
        "--backend",
        backend,
        *saves,
        "--keep-last",
        "2",
        "--log-every",
        "1",
    )
    assert "step 4/4:" in first and "written in the background" in first, first
    assert [c.step for c in list_checkpoints(store)] == [3, 4]
    out = tmp_path / "resumed.npz"
    dtm_run(
        1,
        "--mesh",
        "dp=1,tp=1",
        "--steps",
        "6",
        "--backend",
        backend,
        "--store",
        str(store),
        "--resume",
        "-o",
        str(out),
    )
    dtm_run(2, "--mesh", "dp=1,tp=2", "--steps", "6", "-o", str(tmp_path / "numpy.npz"))
    _close(out, tmp_path / "numpy.npz")


def test_a_stop_signal_stops_every_rank_after_the_same_step(backend: str, tmp_path: Path) -> None:
    """SIGUSR1 to rank 1 alone (this test's subject is the GPU run's stop, not whether mpirun
    forwards signals: the lent H200 image's Open MPI 4.1.6 forwards none): every rank stops
    after the same step; with parallel HDF5 the stop saves a checkpoint and exits 75, without
    it the run says nothing was saved and exits 1."""
    store = tmp_path / "s"
    saves = ["--store", str(store)] if _parallel_hdf5() else ["-o", str(tmp_path / "never.npz")]
    cmd = _cmd(
        2,
        "--mesh",
        "dp=1,tp=2",
        "--steps",
        "100000",
        "--backend",
        backend,
        *saves,
        "--log-every",
        "1",
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(r"step \d+/100000: ", line):
            os.kill(rank_pid(str(tmp_path), 1), signal.SIGUSR1)
            break
    rest, _ = proc.communicate(timeout=200)
    text = "".join(lines) + rest
    if _parallel_hdf5():
        assert proc.returncode == EXIT_REQUEUE, text
        m = re.search(r"stopped by a peer's signal after step (\d+): checkpoint", text)
        assert m is not None, text
        assert [c.step for c in list_checkpoints(store)] == [int(m.group(1))]
    else:
        assert proc.returncode == 1, text
        m = re.search(r"stopped by a peer's signal after step (\d+); nothing saved", text)
        assert m is not None and int(m.group(1)) < 100000, text


def test_a_live_resize_equals_the_numpy_run(backend: str, tmp_path: Path) -> None:
    out = tmp_path / "live.npz"
    resize = ["--resize-at", "2:dp=1,tp=1", "--resize-at", "4:dp=1,tp=2"]
    text = dtm_run(
        2, "--mesh", "dp=1,tp=2", "--steps", "6", "--backend", backend, *resize, "-o", str(out)
    )
    assert (
        "resized after step 2: 2 -> 1 rank(s)" in text and "resized after step 4: 1 -> 2" in text
    ), text
    dtm_run(2, "--mesh", "dp=1,tp=2", "--steps", "6", "-o", str(tmp_path / "numpy.npz"))
    _close(out, tmp_path / "numpy.npz")


def test_deterministic_mode_with_overlap_gives_1_and_2_ranks_the_same_bits(
    backend: str, tmp_path: Path
) -> None:
    det: dict[str, Any] = {
        "DTM_DETERMINISTIC": "1",
        "DTM_OVERLAP": "1",
        "DTM_BUCKET_BYTES": "65536",
    }
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    dtm_run(1, "--mesh", "dp=1,tp=1", "--steps", "3", "--backend", backend, "-o", str(one), **det)
    dtm_run(2, "--mesh", "dp=1,tp=2", "--steps", "3", "--backend", backend, "-o", str(two), **det)
    a, b = np.load(one), np.load(two)
    for k in a.files:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs bitwise"


def test_an_injected_fault_is_named_on_every_rank(backend: str) -> None:
    text = dtm_run(
        2,
        "--mesh",
        "dp=1,tp=2",
        "--steps",
        "3",
        "--backend",
        backend,
        ok=False,
        DTM_FAULT="1:step:raise",
    )
    named = [
        ln
        for ln in text.splitlines()
        if "injected failure (DTM_FAULT=1:step:raise) on rank 1" in ln
    ]
    assert len(named) == 2 and "Traceback" not in text, text


def test_integrity_mode_gives_the_same_bits_and_names_a_corrupted_result(
    backend: str, tmp_path: Path
) -> None:
    """Payload integrity mode on device buffers (it takes the host path): the same bits as
    the run without it, and a bit flipped in one rank's allreduce result named on every rank
    (without the mode that run ends 0: what io/WIRE.md §4 says cannot be detected)."""
    args = ("--mesh", "dp=1,tp=2", "--steps", "3", "--backend", backend)
    plain, checked = tmp_path / "plain.npz", tmp_path / "checked.npz"
    dtm_run(2, *args, "-o", str(plain))
    dtm_run(2, *args, "--integrity", "-o", str(checked))
    a, b = np.load(plain), np.load(checked)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a.files)
    text = dtm_run(2, *args, "--integrity", ok=False, DTM_FAULT="1:allreduce:corrupt")
    named = [ln for ln in text.splitlines() if "the members' results differ" in ln]
    assert len(named) == 2 and "Traceback" not in text, text
