"""``dtm run`` for long jobs under real ``mpirun``: a stop signal delivered twice is one stop, a
second one during the save ends at once and commits nothing; ``--resume`` skips a newest
checkpoint that does not verify, saying why; ``--checkpoint-async``, ``--keep-last``, ``--quota``
and ``--log-every``. (Stops at random moments, SIGTERM from a scheduler, kills and ``dtm launch``:
tests/test_mpi_kills.py.) Nothing waits on a fixed sleep: a signal is sent once the run has
shown progress."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from dtm_mpi.comm.abort import DUPLICATE_S
from dtm_mpi.errors import EXIT_REQUEUE
from dtm_mpi.runtime.simulate import run_simulated
from tests.mpi_env import mpirun_env, survivors
from tests.test_mpi_run import EXAMPLES, load, mpirun

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]
MLP = str(EXAMPLES / "tp_mlp.dtm")
MESH = {2: "dp=1,tp=2", 3: "dp=1,tp=3", 4: "dp=2,tp=2"}
DET = {"DTM_TIMEOUT": "60", "DTM_DETERMINISTIC": "1"}


def started(
    ranks: int, store: Path, marker: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """A long run (its output lines collected), returned once it has logged a step."""
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
        "-m",
        "dtm_mpi",
        "run",
        MLP,
        "--mesh",
        MESH[ranks],
        "--steps",
        "100000",
        "--store",
        str(store),
        "--log-every",
        "2",
        "-o",
        marker,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=mpirun_env(PYTHONUNBUFFERED="1", **DET, **(env or {})),
    )
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if re.match(r"step \d+/100000: ", line):
            return proc, lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError("the run ended before logging a step:\n" + "".join(lines))


def finish(proc: subprocess.Popen[str], lines: list[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=150)
    return proc.returncode, "".join(lines) + out


def stopped_step(text: str, signame: str) -> int:
    m = re.search(
        rf"^dtm run: stopped by {signame} after step (\d+): checkpoint (\S+) saved; continue with --resume \(exit code 75: requeue\)$",
        text,
        re.M,
    )
    assert m is not None, text
    assert text.count("stopped by") == 1 and "Traceback" not in text, text  # rank 0 alone
    return int(m.group(1))


def resumed_equals_uninterrupted(ranks: int, store: Path, done: int, tmp_path: Path) -> None:
    out = tmp_path / "resumed.npz"
    code, text, _ = mpirun(
        ranks,
        MLP,
        "--mesh",
        MESH[ranks],
        "--steps",
        str(done + 2),
        "--resume",
        "--store",
        str(store),
        "-o",
        str(out),
        env=DET,
    )
    assert code == 0 and f"(after step {done})" in text, text
    sizes = dict(kv.split("=") for kv in MESH[ranks].split(","))
    want = run_simulated(
        load("tp_mlp"),
        ranks,
        binding={k: int(v) for k, v in sizes.items()},
        steps=done + 2,
        deterministic=True,
    ).outputs()
    got = np.load(out)
    for key, value in want.items():
        assert got[key].tobytes() == value.tobytes(), f"{key} differs bitwise after the stop"


@pytest.mark.parametrize("ranks", sorted(MESH))
def test_a_signal_delivered_twice_is_one_stop(ranks: int, tmp_path: Path) -> None:
    """A scheduler signalling every task while the launcher forwards the same signal: two
    copies at once are one request, not a second one."""
    store, marker = tmp_path / "store", str(tmp_path / "never.npz")
    proc, lines = started(ranks, store, marker)
    os.kill(proc.pid, signal.SIGUSR1)
    os.kill(proc.pid, signal.SIGUSR1)
    code, text = finish(proc, lines)
    assert code == EXIT_REQUEUE, text
    stopped_step(text, "SIGUSR1")


def test_a_second_signal_during_the_save_ends_at_once_and_commits_nothing(tmp_path: Path) -> None:
    """Rank 1 hangs in the stop's save (injected); a second SIGUSR1, later than a duplicate
    would come, ends every rank without saving: no checkpoint is committed, nothing waits."""
    store, marker = tmp_path / "store", str(tmp_path / "never.npz")
    proc, lines = started(3, store, marker, {"DTM_FAULT": "1:ckpt_write:hang"})
    os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(DUPLICATE_S + 1.0)  # past the window in which a repeat is the same signal
    os.kill(proc.pid, signal.SIGUSR1)
    code, text = finish(proc, lines)
    assert code != 0 and code != EXIT_REQUEUE, text
    assert "a second stop signal (SIGUSR1)" in text and "without saving" in text, text
    assert "Traceback" not in text, text
    committed = [p.name for p in store.iterdir() if re.fullmatch(r"ckpt-\d{8}", p.name)]
    assert not (store / "latest").exists() and committed == [], list(store.iterdir())
    assert survivors(marker) == []


def _flip_data_byte(ckpt: Path) -> None:
    data = sorted(ckpt.glob("data-*.h5"))[0]
    with h5py.File(data, "r") as f:
        names: list[str] = []
        f.visititems(
            lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and o.size else None
        )
        offset = f[names[0]].id.get_offset()
    with open(data, "r+b") as fh:
        fh.seek(offset + 5)
        b = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([b[0] ^ 0x40]))


def test_resume_skips_a_newest_checkpoint_that_does_not_verify_and_says_why(tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "out.npz"
    code, text, _ = mpirun(
        3,
        MLP,
        "--mesh",
        MESH[3],
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--store",
        str(store),
        env=DET,
    )
    assert code == 0, text
    _flip_data_byte(store / "ckpt-00000004")
    code, text, _ = mpirun(
        3,
        MLP,
        "--mesh",
        MESH[3],
        "--steps",
        "5",
        "--resume",
        "--store",
        str(store),
        "-o",
        str(out),
        env=DET,
    )
    assert code == 0, text
    assert re.search(r"resume: skipped step 4: .*content hash", text), text
    assert "ckpt-00000002 (after step 2)" in text, text
    want = run_simulated(
        load("tp_mlp"), 3, binding={"dp": 1, "tp": 3}, steps=5, deterministic=True
    ).outputs()
    got = np.load(out)
    assert all(got[k].tobytes() == v.tobytes() for k, v in want.items())


def test_async_checkpoints_keep_last_and_log_every(tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "out.npz"
    code, text, _ = mpirun(
        3,
        MLP,
        "--mesh",
        MESH[3],
        "--steps",
        "6",
        "--checkpoint-every",
        "1",
        "--checkpoint-async",
        "--keep-last",
        "2",
        "--log-every",
        "3",
        "--store",
        str(store),
        "-o",
        str(out),
        env=DET,
    )
    assert code == 0, text
    assert text.count("written in the background") == 6, text
    assert re.search(r"^step 3/6: [0-9.]+ ms/step, [0-9.]+ steps/s$", text, re.M), text
    assert re.search(r"^step 6/6: ", text, re.M), text
    assert sorted(p.name for p in store.glob("ckpt-*")) == ["ckpt-00000005", "ckpt-00000006"]
    want = run_simulated(
        load("tp_mlp"), 3, binding={"dp": 1, "tp": 3}, steps=6, deterministic=True
    ).outputs()
    got = np.load(out)
    assert all(got[k].tobytes() == v.tobytes() for k, v in want.items())


@pytest.mark.parametrize("ranks", sorted(MESH))
def test_a_quota_too_small_is_one_agreed_error(ranks: int, tmp_path: Path) -> None:
    store = tmp_path / "store"
    code, text, _ = mpirun(
        ranks,
        MLP,
        "--mesh",
        MESH[ranks],
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--quota",
        "64K",
        "--store",
        str(store),
        env=DET,
    )
    assert code == 1, text
    lines = {ln for ln in text.splitlines() if ln.startswith("[rank ")}
    assert len({ln.split("] ", 1)[1] for ln in lines}) == 1 and len(lines) == ranks, text
    assert "quota" in text.lower() and "Traceback" not in text, text
    assert not list(store.glob("ckpt-*"))
