"""``jobs/link_bench.py``: ``dtm bench comm`` between two network namespaces over TCP, the
link shaped by ``tc tbf``: the quantized and the checked paths run and report beside the
plain one, and the shaping holds (a float32 allreduce cannot beat the link's rate). Skipped
with the reason where namespaces cannot be made (not root)."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns_hosts import why_not

JOB = Path(__file__).resolve().parents[1] / "jobs" / "link_bench.py"
WHY_NOT = why_not()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
    pytest.mark.xdist_group("netns-hosts"),
]

RATE_BITS = 100e6  # --rate 100mbit
SIZE = 262144  # 256 KiB


@pytest.mark.parametrize(("third", "column"), [("--quantize", "speedup"), ("--integrity", "")])
def test_the_third_path_runs_beside_float32_on_a_shaped_link(
    tmp_path: Path, third: str, column: str
) -> None:
    out = tmp_path / "link.csv"
    args = [third, "64"] if third == "--quantize" else [third]
    cmd = [sys.executable, str(JOB), "--rate", "100mbit", "--timeout", "240", "--"]
    cmd += ["--ops", "allreduce", "--sizes", str(SIZE), "--repeat", "1", "--csv", str(out)]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "link: 100mbit each way" in done.stdout
    (row,) = list(csv.DictReader(out.open()))
    assert row["op"] == "allreduce" and int(row["bytes"]) == SIZE and row["ranks"] == "2"
    # each of the 2 ranks sends at least half the array twice (reduce-scatter, allgather):
    # no faster than the link allows (half of it, for the burst the shaping lets through)
    assert float(row["dtm_s"]) >= 0.5 * SIZE * 8 / RATE_BITS
    if column:  # the quantized allreduce: its time and its speedup, measured
        assert float(row["quantized_s"]) > 0 and float(row[column]) > 0
    else:
        assert float(row["checked_s"]) > 0 and row["integrity_cost"] != ""
