"""``dtm bench recipe`` (dtm_mpi/bench/recipe.py), tiny: every dtm configuration (f32 and
bf16, each recomputation choice) has a row with its time and memory, the plan's peak falls
with recomputation, every choice ends at the same loss (the same bits), and torch's rows are
beside where it is installed."""

from __future__ import annotations

import importlib.util

from dtm_mpi.bench.recipe import run_recipe_bench


def test_the_recipe_bench_reports_every_configuration() -> None:
    torch = importlib.util.find_spec("torch") is not None and bool(
        importlib.util.find_spec("transformers")
    )
    text = run_recipe_bench(layers=2, hidden=64, vocab=128, batch=4, context=32, steps=1, warmup=1)
    rows = [line.split() for line in text.splitlines() if line.startswith(("dtm ", "torch "))]
    dtm = {(r[1], r[2]): r for r in rows if r[0] == "dtm"}
    assert set(dtm) == {(p, c) for p in ("f32", "bf16") for c in ("none", "selective", "full")}
    assert all("failed:" not in r for r in rows), text
    for p in ("f32", "bf16"):
        planned = [float(dtm[(p, c)][6]) for c in ("none", "selective", "full")]
        assert planned[2] < planned[1] < planned[0], text
        assert len({dtm[(p, c)][-1] for c in ("none", "selective", "full")}) == 1, text
    assert sum(r[0] == "torch" for r in rows) == (4 if torch else 0), text


def test_the_recipe_trained_by_dtm_and_pytorch_ends_within_2_percent(tmp_path: object) -> None:
    import pytest

    if (
        importlib.util.find_spec("torch") is None
        or importlib.util.find_spec("transformers") is None
    ):
        pytest.skip("the comparison runs torch and transformers (the bench and llm extras)")
    from dtm_mpi.bench.recipe import run_recipe_curve

    text = run_recipe_curve(6, warmup=2, val_batches=1, workdir=str(tmp_path))
    assert "(within 2%)" in text, text
