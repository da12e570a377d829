"""``dtm bench comm`` runs under mpirun and writes the documented CSV (a smoke test of the
benchmark itself; speed is reported by the benchmark, never asserted in tests)."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtm_mpi.bench.comm import BenchRow, default_sizes, format_table
from tests.mpi_env import mpirun_env

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")


def test_sizes_and_busbw_formulas() -> None:
    assert default_sizes()[0] == 8 and default_sizes()[-1] == 64 << 20
    row = BenchRow("allreduce", 4, 1000, 1e-3, 2e-3)
    assert row.busbw(1e-3) == pytest.approx(1000 / 1e-3 * 2 * 3 / 4)
    assert BenchRow("allgather", 4, 1000, 1.0, 1.0).busbw(1.0) == pytest.approx(1000 * 3 / 4)
    assert BenchRow("broadcast", 4, 1000, 1.0, 1.0).busbw(1.0) == pytest.approx(1000)
    assert row.ratio == pytest.approx(2.0)
    assert "allreduce" in format_table([row])


@pytest.mark.slow
def test_bench_comm_under_mpirun_writes_the_csv(tmp_path: Path) -> None:
    out = tmp_path / "comm.csv"
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
        "comm",
        "--sizes",
        "8,4K",
        "--repeat",
        "1",
        "--csv",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "op",
        "ranks",
        "bytes",
        "dtm_s",
        "raw_s",
        "busbw_dtm",
        "busbw_raw",
        "ratio",
    ]
    ops = {"allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all"}
    assert {(r["op"], r["bytes"]) for r in rows} == {(o, b) for o in ops for b in ("8", "4096")}
    for r in rows:
        assert r["ranks"] == "2"
        assert float(r["dtm_s"]) > 0 and float(r["raw_s"]) > 0 and float(r["ratio"]) > 0
    assert "busbw dtm" in proc.stdout


def test_the_table_shows_integrity_mode_beside_the_plain_path() -> None:
    row = BenchRow("allreduce", 2, 1 << 20, 100e-6, 90e-6, 150e-6)
    assert row.integrity_cost == pytest.approx(0.5)
    text = format_table([row])
    assert "checked us" in text.splitlines()[0] and "+50%" in text
    assert BenchRow("allgather", 2, 8, 1.0, 1.0).integrity_cost is None
    assert "checked us" not in format_table([BenchRow("allgather", 2, 8, 1.0, 1.0)])


@pytest.mark.slow
def test_bench_comm_integrity_times_the_checked_path_in_the_same_run(tmp_path: Path) -> None:
    out = tmp_path / "comm.csv"
    cmd = ["mpirun", "--timeout", "120", "--bind-to", "none", "-n", "2", sys.executable]
    cmd += ["-m", "mpi4py", "-m", "dtm_mpi", "bench", "comm", "--ops", "allreduce,allgather"]
    cmd += ["--sizes", "4K", "--repeat", "1", "--integrity", "--csv", str(out)]
    env = mpirun_env(DTM_TIMEOUT="60")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["op"] for r in rows] == ["allreduce", "allgather"]
    for r in rows:
        assert float(r["checked_s"]) > 0
        cost = float(r["integrity_cost"])
        # the CSV rounds the cost to 4 decimals (and the times to 9): near 0 only abs holds
        want = float(r["checked_s"]) / float(r["dtm_s"]) - 1
        assert cost == pytest.approx(want, rel=1e-3, abs=5e-5 + 1e-9 / float(r["dtm_s"]))
    assert "checked us" in proc.stdout
