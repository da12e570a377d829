"""Under real ``mpirun``: ``dequantize`` blocks that straddle shards are refused at plan time
on every rank, with the op's location, before any communication (a numpy reshape error
mid-run before the fix), and the same module runs where the shards hold whole blocks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.mpi_env import mpirun_env

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH"),
    pytest.mark.slow,
]

SOURCE = """dtm 1.0
module deq
mesh @m = [tp=3]
entry func @main(%x: f32[4,48] init normal(seed=1, std=1.0)) -> f32[4,48]{-,tp} on @m requires [CAP_QUANT] {
  %q, %s = quantize %x block 16 : i8[4,48], f32[4,3]
  %qs = redistribute %q : i8[4,48]{-,tp}
  %ss = redistribute %s : f32[4,3]{-,tp}
  %y = dequantize %qs, %ss block 16 : f32[4,48]{-,tp}
  return %y
}
"""


def _mpirun(ranks: int, *args: str) -> tuple[int, str]:
    env = mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="60")
    cmd = [
        "mpirun",
        "--timeout",
        "200",
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
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("ranks", [2, 4])
def test_straddling_blocks_fail_at_plan_time_on_every_rank(ranks: int, tmp_path: Path) -> None:
    path = tmp_path / "deq.dtm"
    path.write_text(SOURCE)
    code, text = _mpirun(ranks, str(path), "-o", str(tmp_path / "out.npz"))
    assert code != 0, text
    lines = [ln for ln in text.splitlines() if "dtm: error:" in ln]
    assert sorted(ln.split("]")[0] for ln in lines) == [f"[rank {r}" for r in range(ranks)], text
    for ln in lines:
        assert "(plan)" in ln and "deq.dtm:8:8: dequantize: every shard of the last dim" in ln
    assert "reshape" not in text and not (tmp_path / "out.npz").exists()


def test_whole_blocks_per_shard_run(tmp_path: Path) -> None:
    path = tmp_path / "deq.dtm"
    path.write_text(SOURCE)
    code, text = _mpirun(3, str(path), "-o", str(tmp_path / "out.npz"))
    assert code == 0, text
    with np.load(tmp_path / "out.npz") as out:
        y, x = out["result0"], out["x"]
    assert y.shape == (4, 48) and np.abs(y - x).max() <= np.abs(x).max() / 127
