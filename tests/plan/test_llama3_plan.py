"""Llama 3.1 8B and 70B (``examples/llama3.py``): the configs build the models Meta ships
(their parameter counts), and ``dtm explain`` plans the 8B step with its parameters sharded
over dp (ZeRO-3, as FSDP does) without running it."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dtm_mpi import frontend as dtm

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama3", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("size", "count"), [("8b", 8_030_261_248), ("70b", 70_553_706_496)])
def test_the_configs_have_metas_parameter_counts(size: str, count: int) -> None:
    model = dtm.nn.Llama.for_mesh(_example().CONFIGS[size], {"tp": 8})
    assert sum(math.prod(p.shape) for _, _, _, p in model.named_parameters()) == count


@pytest.mark.slow
def test_explain_plans_the_8b_step_with_the_parameters_sharded_over_dp() -> None:
    cmd = [sys.executable, "-m", "dtm_mpi", "explain", str(EXAMPLE), "--"]
    proc = subprocess.run(
        [*cmd, "--size", "8b", "--mesh", "dp=8,tp=1", "--seq", "256", "--local-batch", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # every layer's weights are gathered over dp before use (FSDP) and the gradients
    # reduce-scattered back to their shards
    assert "allgather       %model.layers.31.mlp.down_proj.weight" in out, out[-3000:]
    assert re.search(r"reduce_scatter x\d+", out), out[-3000:]
    peak = re.search(r"peak memory:\s+([0-9.]+) (GiB|TiB)", out)
    assert peak is not None, out[-3000:]
    # at least the rank's eighth of the parameters, gradients and AdamW's two moments in f32
    gib = float(peak.group(1)) * (1024 if peak.group(2) == "TiB" else 1)
    assert gib >= 4 * 4 * 8.03e9 / 8 / 2**30, out[-3000:]
