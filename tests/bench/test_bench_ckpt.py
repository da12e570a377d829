"""``dtm bench ckpt`` runs under mpirun, checks its own restores and writes the documented CSV
(a smoke test of the benchmark; speed is reported by the benchmark, never asserted in tests)."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtm_mpi.bench.ckpt import CkptRow
from tests.mpi_env import mpirun_env

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")


def test_ratio_is_value_over_baseline() -> None:
    assert CkptRow("save_GBps", 0.8, 1.0).ratio == pytest.approx(0.8)
    assert CkptRow("reshard_restore_s", 3.0, 2.0).ratio == pytest.approx(1.5)
    assert CkptRow("x", 1.0, 0.0).ratio == 0.0


def bench_ckpt(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``dtm bench ckpt --repeat 1 --dir tmp_path ARGS`` on 2 ranks under mpirun."""
    env = mpirun_env(DTM_TIMEOUT="60")
    cmd = [
        "mpirun",
        "--timeout",
        "120",
        "--bind-to",
        "none",
        "-n",
        "2",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "bench",
        "ckpt",
        "--repeat",
        "1",
        "--dir",
        str(tmp_path),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)


@pytest.mark.slow
def test_bench_ckpt_under_mpirun_writes_the_csv(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.csv"
    proc = bench_ckpt(tmp_path, "--bytes", "4M", "--tensors", "3", "--csv", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["metric", "value", "baseline", "ratio"]
    assert [r["metric"] for r in rows] == [
        "save_GBps",
        "first_save_GBps",
        "restore_GBps",
        "reshard_restore_s",
        "reshard_transpose_s",
        "peak_extra_rss_bytes",
    ]
    for r in rows:
        value, baseline, ratio = float(r["value"]), float(r["baseline"]), float(r["ratio"])
        assert value > 0 and baseline > 0, r
        assert ratio == pytest.approx(value / baseline, rel=1e-2, abs=1e-3), r  # 3 decimals written
    assert float(rows[5]["baseline"]) == pytest.approx(4 * 2**20 / 2, rel=0.05)  # local shard
    assert rows[1]["baseline"] == rows[0]["baseline"]  # the first save against the best raw write
    assert "peak extra RSS" in proc.stdout
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("dtm-bench-ckpt-")]
    assert leftovers == [], "the benchmark leaves nothing behind"


@pytest.mark.slow
def test_bench_ckpt_cold_adds_the_restore_from_storage_row_or_says_why_not(tmp_path: Path) -> None:
    """``--cold`` drops the page cache before each timed read: a row ``restore_cold_GBps``
    where that is allowed (root), else one clear error on every rank."""
    out = tmp_path / "ckpt.csv"
    proc = bench_ckpt(tmp_path, "--bytes", "2M", "--tensors", "2", "--csv", str(out), "--cold")
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        assert proc.returncode != 0 and "needs root" in proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with out.open() as f:
        rows = {r["metric"]: r for r in csv.DictReader(f)}
    assert list(rows)[:4] == ["save_GBps", "first_save_GBps", "restore_GBps", "restore_cold_GBps"]
    cold = rows["restore_cold_GBps"]
    assert float(cold["value"]) > 0 and float(cold["baseline"]) > 0, cold


@pytest.mark.slow
def test_bench_ckpt_async_times_the_loop_three_ways(tmp_path: Path) -> None:
    env = mpirun_env(DTM_TIMEOUT="60")
    cmd = [
        "mpirun",
        "--timeout",
        "120",
        "--bind-to",
        "none",
        "-n",
        "2",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "dtm_mpi",
        "bench",
        "ckpt-async",
        "--batch",
        "16",
        "--width",
        "32",
        "--hidden",
        "64",
        "--steps",
        "3",
        "--every",
        "1",
        "--repeat",
        "1",
        "--dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = {
        ln.split("  ")[0]: ln.split()
        for ln in lines
        if ln.startswith(("no checkpoints", "synchronous", "async"))
    }
    assert sorted(rows) == ["async saves", "no checkpoints", "synchronous saves"], proc.stdout
    assert all(float(r[-3]) > 0 for r in rows.values())  # every loop ran and was timed
    state = re.search(r"state ([0-9.]+) MiB", proc.stdout)
    # 32x64 and 64x32 float32 weights, each with AdamW's two moments
    assert state is not None and float(state.group(1)) == pytest.approx(
        6 * 32 * 64 * 4 / 2**20, rel=0.01
    )
    # (a loaded machine can hide the small saves' cost in the loop's noise: then said so)
    assert re.search(
        r"hidden by async: (-?[0-9]+% of the synchronous saves' cost|not measurable: the synchronous saves cost -?[0-9.]+ s)",
        proc.stdout,
    ), proc.stdout
    assert [p for p in tmp_path.iterdir() if p.name.startswith("dtm-bench-ckpt-async-")] == []
