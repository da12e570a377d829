"""What a training run reports (dtm_mpi/frontend/run_report.py): the model FLOPs counted
from the traced step equal torchtitan's formula (6 N per token plus the attention's
12 L H d T) exactly; fit's metrics file has a line per step (loss, lr, tokens/s, MFU, memory)
and a resumed run appends to it; ``dtm plot metrics`` draws it; bad input is one error."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.frontend.fit import FitResult
from dtm_mpi.frontend.run_report import module_flops, peak_flops, read_metrics, step_cost
from dtm_mpi.frontend.trace import TracedStep
from tests.test_cli_run import dtm as dtm_cli
from tests.test_cli_run import one_line_error

CFG = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
}
B, T = 4, 8


def _loss(m: dtm.nn.Llama, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
    logits = m(ids)
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _step(model: dtm.nn.Llama, **kw: Any) -> dtm.TracedStep:
    return dtm.train_step(
        model,
        _loss,
        mesh=dtm.Mesh(dp=1, tp=1),
        inputs={k: dtm.Input((B, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(dtm.optim.schedule("cosine", peak=1e-2, warmup=1, total=6)),
        **kw,
    )


def _loader(step: int, regions: Mapping[str, tuple[slice, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    data = {k: rng.integers(0, 32, (B, T)).astype(np.int32) for k in ("ids", "tgt")}
    return {k: data[k][r] for k, r in regions.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_the_counted_flops_are_torchtitans_formula(tied: bool) -> None:
    model = dtm.nn.Llama({**CFG, "tie_word_embeddings": tied}, axis=None)
    cost = step_cost(_step(model))
    matmul_params = sum(
        int(np.prod(p.shape))
        for path, _, _, p in model.named_parameters()
        if len(p.shape) == 2 and "embed_tokens" not in path
    )
    if tied:  # the head is the embedding, used as a matmul
        matmul_params += CFG["vocab_size"] * CFG["hidden_size"]
    layers, heads, hd = CFG["num_hidden_layers"], CFG["num_attention_heads"], CFG["head_dim"]
    per_token = 6 * matmul_params + 12 * layers * heads * hd * T
    assert cost.tokens == B * T
    assert cost.flops == B * T * per_token
    assert cost.dtype == "f32"
    forward = dtm.forward_step(
        model,
        lambda m, ids: m(ids),
        mesh=dtm.Mesh(dp=1, tp=1),
        inputs={"ids": dtm.Input((B, T), "i32")},
    )
    assert 3 * module_flops(forward.module) == cost.flops  # forward, and twice it backward
    again = step_cost(_step(model, recompute="full"))  # the repeats are not model FLOPs
    assert (
        again.flops == cost.flops
        and module_flops(_step(model, recompute="full").module) > cost.flops
    )


def fit_llama(
    step: TracedStep, store: str, steps: int, *, resume: bool = False, **out: Any
) -> FitResult:
    """``steps`` steps of ``step`` on 2 simulated ranks: the first run checkpoints at its last
    step, a ``resume`` run continues from it; ``out``: where fit reports (metrics, events)."""
    policy = (
        dtm.CheckpointPolicy(store, resume=True)
        if resume
        else dtm.CheckpointPolicy(store, every=steps)
    )
    return dtm.fit(step, _loader, steps=steps, sim=2, quiet=True, checkpoint=policy, **out)


def test_fit_writes_a_metrics_line_per_step_and_a_resumed_run_appends(tmp_path: Path) -> None:
    step = _step(dtm.nn.Llama(CFG, axis=None))
    path = tmp_path / "run" / "metrics.jsonl"
    store = str(tmp_path / "s")
    got = fit_llama(step, store, 3, metrics_file=path)
    lines = read_metrics(path)
    assert [x["step"] for x in lines] == [0, 1, 2]
    for line, m, t in zip(lines, got.metrics, got.timings, strict=True):
        assert line["loss"] == m["loss"] and line["lr"] == m["lr"]
        assert line["tokens_per_s"] == t["tokens_per_s"] > 0
        assert 0 < line["mfu"] < 1 and line["rss_gib"] > 0.01
        assert line["step_s"] == pytest.approx(B * T / line["tokens_per_s"])
    assert got.peak is not None and "measured float32 GEMM" in got.peak.source
    assert got.cost is not None and got.cost.flops > 0
    fit_llama(step, store, 5, resume=True, metrics_file=path)
    assert [x["step"] for x in read_metrics(path)] == [0, 1, 2, 3, 4]


def test_the_cpu_peak_is_the_measured_gemm_rate_times_the_ranks() -> None:
    one, four = peak_flops("f32", "numpy", 1), peak_flops("f32", "numpy", 4)
    assert four.flops_per_s == pytest.approx(4 * one.flops_per_s) and one.flops_per_s > 1e8
    sim = peak_flops("f64", "numpy", 64, simulated=True)  # at most the cores
    assert (
        "float64" in sim.source and sim.flops_per_s < 64 * peak_flops("f64", "numpy", 1).flops_per_s
    )


def test_bad_metrics_files_are_one_error_naming_the_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such metrics file"):
        read_metrics(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n{oops\n")
    with pytest.raises(UsageError, match=r"bad.jsonl:2: not a JSON line"):
        read_metrics(bad)
    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match="is not a directory"):
        dtm.fit(
            _step(dtm.nn.Llama(CFG, axis=None)),
            _loader,
            steps=1,
            sim=1,
            quiet=True,
            metrics_file=tmp_path / "f" / "m.jsonl",
        )


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="dtm plot draws with matplotlib (the train extra; make setup installs it)",
)
def test_dtm_plot_metrics_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for k in range(2):
        p = tmp_path / f"run{k}.jsonl"
        p.write_text(
            "".join(
                json.dumps({"step": s, "loss": 3.0 - 0.1 * s - k, "lr": 0.01 * s}) + "\n"
                for s in range(5)
            )
        )
        runs.append(str(p))
    out = tmp_path / "curves.png"
    code, text, _ = dtm_cli(capsys, "plot", "metrics", *runs, "-o", str(out))
    assert code == 0 and "loss, lr over 2 run(s)" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = dtm_cli(capsys, "plot", "metrics", runs[0], "-o", str(out), "--keys", "mfu")
    assert code == 2 and "have none of mfu" in one_line_error(err)


def test_dtm_plot_help_names_the_default_curves_and_dtm_does_not_import_the_frontend() -> None:
    """The help's default is :data:`PLOTTED`; building the CLI's parser (every ``dtm``
    command does) imports no frontend module."""
    import subprocess
    import sys

    from dtm_mpi.frontend.run_report import PLOTTED

    probe = (
        "import sys; from dtm_mpi.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('dtm_mpi.frontend')))"
    )
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "[]", got.stdout
    helped = subprocess.run(
        [sys.executable, "-m", "dtm_mpi", "plot", "metrics", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert all(k in " ".join(helped.split()) for k in PLOTTED), helped


def test_grad_norm_is_reported_plain_clipped_pipelined_and_accumulated() -> None:
    """``grad_norm=True``: the gradients' 2-norm before clipping, as a metric; at the first
    step (the same weights) the clipped and unclipped steps report the same norm, and the
    pipelined and accumulating steps (with clipping) the unpipelined one's."""
    from tests.pipeline_case import gpt, lm_loss, token_batch

    def feed(s: int, regions: Mapping[str, tuple[slice, ...]]) -> dict[str, np.ndarray]:
        data = token_batch(8, 40 + s)
        return {k: data[k][r] for k, r in regions.items()}

    def step(mesh: dtm.Mesh, **kw: Any) -> dtm.TracedStep:
        return dtm.train_step(
            gpt(),
            lm_loss,
            mesh=mesh,
            inputs={k: dtm.Input((8, 6), "i32", ("dp", None)) for k in ("ids", "tgt")},
            optimizer=dtm.optim.AdamW(1e-2),
            grad_norm=True,
            **kw,
        )

    plain = dtm.fit(step(dtm.Mesh(dp=1, tp=1)), feed, steps=3, sim=1, quiet=True)
    clipped = dtm.fit(step(dtm.Mesh(dp=1, tp=1), clip_norm=0.5), feed, steps=3, sim=1, quiet=True)
    norms = [m["grad_norm"] for m in clipped.metrics]
    assert plain.metrics[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-12)
    assert all(n > 0.5 for n in norms)  # the clip acted (the norms are before it)
    piped = dtm.fit(
        step(dtm.Mesh(pp=1, dp=1, tp=1), clip_norm=0.5, pipeline=dtm.Pipeline(microbatches=2)),
        feed,
        steps=3,
        sim=2,
        mesh={"pp": 2},
        quiet=True,
    )
    acc = dtm.fit(
        step(dtm.Mesh(dp=2, tp=1), clip_norm=0.5, accumulate=2), feed, steps=3, sim=2, quiet=True
    )
    for got in (piped, acc):
        np.testing.assert_allclose([m["grad_norm"] for m in got.metrics], norms, rtol=1e-10)
    with pytest.raises(
        UsageError, match="grad_norm=True in a pipelined or accumulating step needs clip_norm"
    ):
        step(dtm.Mesh(dp=1, tp=1), accumulate=2)
