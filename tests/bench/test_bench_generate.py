"""``dtm bench generate`` runs dtm's generation at 1 and 2 ranks (mpirun) and transformers'
beside it, and says whether the greedy ids agree (a smoke test of the benchmark: its speed is
reported by the benchmark, never asserted)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from dtm_mpi.bench.generate import run_generate_bench

HAS_HF = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")
def test_bench_generate_reports_every_run_and_the_ids_agree() -> None:
    table = run_generate_bench(
        layers=1, hidden=128, vocab=64, prompt=4, new=6, repeat=1, with_torch=HAS_HF
    )
    rows = table.splitlines()
    assert rows[0].startswith("greedy generation: Llama 1 layers, hidden 128"), table
    runs = [r for r in rows[2:] if r.startswith(("dtm", "transformers"))]
    assert [r.split()[1] for r in runs[:2]] == ["1", "2"], table
    if HAS_HF:
        assert len(runs) == 4, table
        assert all(r.split()[-1] == "same" for r in runs), table  # dtm's ids are transformers'
    for r in runs:
        assert float(r.split()[-3]) > 0, table  # a decode rate was measured
    for r in runs[:2]:  # dtm's planning and weights: a part of its first token's time
        first, setup = float(r.split()[-5]), float(r.split()[-4])
        assert 0 < setup <= first, table
