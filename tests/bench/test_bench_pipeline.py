"""``dtm bench pipeline`` runs under mpirun and writes one row per schedule (a smoke test of
the benchmark itself: speed is reported by the benchmark, never asserted in tests; what is
asserted is the plan's side: activation memory and the predicted bubbles' order)."""

from __future__ import annotations

import csv
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi_env import mpirun_env

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")


@pytest.mark.slow
def test_bench_pipeline_under_mpirun_writes_a_row_per_schedule(tmp_path: Path) -> None:
    out = tmp_path / "pp.csv"
    cmd = [
        "mpirun",
        "--timeout",
        "200",
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
        "pipeline",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--layers",
        "4",
        "--dim",
        "16",
        "--batch",
        "16",
        "--seq",
        "8",
        "--microbatches",
        "8",
        "--csv",
        str(out),
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        env=mpirun_env(DTM_TIMEOUT="60"),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dtm bench pipeline: 2 rank(s)" in done.stdout and "predicted" in done.stdout
    assert "boundary block, transfer + receive (us, measured): gpipe " in done.stdout
    rows = {r["schedule"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"none (1 rank)", "gpipe", "1f1b", "interleaved", "zb-h1"}
    assert float(rows.pop("none (1 rank)")["ms_per_step"]) > 0  # the unpipelined step
    for r in rows.values():
        assert float(r["ms_per_step"]) > 0 and 0 <= float(r["predicted"]) < 1
        assert 0 <= float(r["bubble"]) < 1
        # the cost model's boundary costs, measured: a receive takes some time, a block
        # (2 x 8 x 16 float32) arrives within a second
        assert 0 < float(r["receive_us"]) < 1e6 and 0 <= float(r["transfer_us"]) < 1e6
    assert rows["interleaved"]["stages"] == "4" and rows["1f1b"]["stages"] == "2"
    # the plan: 1F1B holds at most p = 2 microbatches where GPipe holds all 8, zb-h1 as 1F1B
    assert (int(rows["gpipe"]["held"]), int(rows["1f1b"]["held"]), int(rows["zb-h1"]["held"])) == (
        8,
        2,
        2,
    )
    assert float(rows["1f1b"]["act_mib"]) < float(rows["gpipe"]["act_mib"])
    assert all(float(r["rss_mib"]) >= 0 for r in rows.values())
    losses = re.search(r"first step's loss: dtm ([0-9.]+)(?:, torch ([0-9.]+))?", done.stdout)
    assert losses is not None, done.stdout
    if importlib.util.find_spec("torch") is not None:  # the peer: the same GPT, stages, m
        assert all(float(r["torch_ms_per_step"]) > 0 for r in rows.values())
        assert losses.group(2) is not None, done.stdout
        assert abs(float(losses.group(1)) - float(losses.group(2))) < 1e-4, losses.group(0)


def test_a_bad_schedule_is_one_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dtm_mpi", "bench", "pipeline", "--schedules", "pipedream"],
        capture_output=True,
        text=True,
        timeout=120,
        env=mpirun_env(),
        check=False,
    )
    assert done.returncode != 0
    assert "unknown pipeline schedule 'pipedream'" in done.stderr and "Traceback" not in done.stderr
