"""``dtm bench recipe``: what the LLM training recipe's switches cost, on one rank, side by side
with PyTorch on the same model (Hugging Face's ``LlamaForCausalLM``).

For a random Llama (the size given on the command line), every combination of precision
(float32, or bf16 compute with float32 masters: :class:`~dtm_mpi.frontend.MixedPrecision`)
and activation recomputation (``none``, ``selective``, ``full``) trains ``warmup + steps``
AdamW steps on one simulated rank in this process; each row gives the median step time of
the timed steps, tokens/s, the plan's peak per rank (values alive at once,
:mod:`dtm_mpi.plan.cost`) and the resident memory the run took above what the process held
before it (:class:`~dtm_mpi.bench.rss.RssPeak`: planning included). PyTorch beside it (where
installed), one thread as dtm's rank has: float32 and ``torch.autocast(bf16)``, without and
with per-layer activation checkpointing (``gradient_checkpointing_enable()``, the full
recomputation), the resident memory of its training loop. Ratios are against the row of the
same side and precision without recomputation, and dtm's time against torch's.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RecipeRow", "recipe_config", "run_recipe_bench"]


@dataclass
class RecipeRow:
    side: str  # dtm | torch
    precision: str  # f32 | bf16
    recompute: str  # none | selective | full
    step_s: float = float("nan")
    planned: int = -1  # the plan's peak per rank (dtm)
    rss: int = 0  # resident memory above the start
    loss: float = float("nan")
    error: str = ""


def recipe_config(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    heads = max(1, hidden // 32)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden + hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": hidden // heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


def _batches(vocab: int, batch: int, context: int, n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (n, batch, context)).astype(np.int32)


def _dtm_row(
    row: RecipeRow, cfg: dict[str, Any], data: np.ndarray, steps: int, warmup: int
) -> None:
    from dtm_mpi import frontend as dtm
    from dtm_mpi.bench.rss import RssPeak
    from dtm_mpi.frontend import functional as fn
    from dtm_mpi.plan.cost import function_cost
    from dtm_mpi.plan.program import compile_plan, mesh_for

    _, batch, context = data.shape

    def loss(m: Any, ids: Any) -> Any:
        return fn.causal_lm_loss(m(ids), ids)

    step = dtm.train_step(
        dtm.nn.Llama(cfg, axis=None),
        loss,
        mesh=dtm.Mesh(dp=1),
        inputs={"ids": dtm.Input((batch, context), "i32")},
        optimizer=dtm.optim.AdamW(1e-3),
        precision=dtm.MixedPrecision() if row.precision == "bf16" else None,
        recompute=row.recompute,
    )
    plan = compile_plan(step.module, mesh_for(step.module, 1, None))
    row.planned = int(max(function_cost(plan, plan.entry_plan).peak))
    with RssPeak() as peak:
        got = dtm.fit(
            step,
            lambda s, r: {"ids": data[s][r["ids"]]},
            steps=warmup + steps,
            sim=1,
            quiet=True,
        )
    row.rss = peak.above
    row.step_s = statistics.median(t["step_s"] for t in got.timings[warmup:])
    row.loss = got.metrics[-1]["loss"]


def _torch_row(
    row: RecipeRow, cfg: dict[str, Any], data: np.ndarray, steps: int, warmup: int
) -> None:
    import torch
    import transformers

    from dtm_mpi.bench.rss import RssPeak

    torch.set_num_threads(1)
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config: Any = transformers.LlamaConfig(**fields)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config)
    if row.recompute == "full":  # per decoder layer, torch.utils.checkpoint
        with warnings.catch_warnings():  # (renamed activation_checkpointing_enable in v6)
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()  # type: ignore[no-untyped-call]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    with RssPeak() as peak:
        for s in range(warmup + steps):
            ids = torch.from_numpy(data[s].astype(np.int64))
            t0 = time.perf_counter()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=row.precision == "bf16"):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            row.loss = float(loss.detach())
    row.rss = peak.above
    row.step_s = statistics.median(times[warmup:])


def _mib(n: int) -> str:
    return "-" if n < 0 else f"{n / (1 << 20):.1f}"


def run_recipe_bench(
    layers: int = 4,
    hidden: int = 128,
    vocab: int = 512,
    batch: int = 8,
    context: int = 128,
    steps: int = 6,
    warmup: int = 2,
    with_torch: bool = True,
) -> str:
    """The table of every configuration (module doc)."""
    cfg = recipe_config(layers, hidden, vocab)
    data = _batches(vocab, batch, context, warmup + steps)
    rows: list[RecipeRow] = []
    for precision in ("f32", "bf16"):
        for rc in ("none", "selective", "full"):
            rows.append(RecipeRow("dtm", precision, rc))
    why_not = None
    if with_torch:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as exc:
            why_not = f"no PyTorch rows: {exc} (the bench and llm extras)"
        else:
            for precision in ("f32", "bf16"):
                for rc in ("none", "full"):
                    rows.append(RecipeRow("torch", precision, rc))
    # a first run, not shown: the process's one-time allocations (imports, caches, the GEMM
    # choice) are not any configuration's memory
    _dtm_row(RecipeRow("dtm", "f32", "none"), cfg, data[:1], 1, 0)
    for row in rows:
        try:
            (_dtm_row if row.side == "dtm" else _torch_row)(row, cfg, data, steps, warmup)
        except Exception as exc:  # a row that fails is reported, the others still run
            row.error = f"{type(exc).__name__}: {exc}"
    tokens = batch * context

    def base(r: RecipeRow) -> RecipeRow | None:
        return next(
            (
                b
                for b in rows
                if (b.side, b.precision, b.recompute) == (r.side, r.precision, "none")
            ),
            None,
        )

    def peer(r: RecipeRow) -> RecipeRow | None:
        rc = "full" if r.recompute == "full" else "none"
        return next(
            (b for b in rows if (b.side, b.precision, b.recompute) == ("torch", r.precision, rc)),
            None,
        )

    head = (
        f"LLM recipe on one rank: Llama {layers} layers, hidden {hidden}, vocabulary {vocab}, "
        f"batch {batch} x {context} tokens; {steps} timed steps after {warmup} (median)"
    )
    lines = [head, ""]
    lines.append(
        f"{'side':<6} {'precision':<9} {'recompute':<10} {'step ms':>9} {'tokens/s':>9} "
        f"{'x none':>7} {'planned MiB':>11} {'RSS MiB':>8} {'dtm/torch':>9} {'loss':>8}"
    )
    for r in rows:
        if r.error:
            lines.append(f"{r.side:<6} {r.precision:<9} {r.recompute:<10} failed: {r.error}")
            continue
        b, p = base(r), peer(r) if r.side == "dtm" else None
        vs = f"{r.step_s / b.step_s:.2f}" if b is not None and not b.error else "-"
        ratio = f"{r.step_s / p.step_s:.2f}" if p is not None and not p.error else "-"
        lines.append(
            f"{r.side:<6} {r.precision:<9} {r.recompute:<10} {r.step_s * 1e3:>9.1f} "
            f"{tokens / r.step_s:>9.0f} {vs:>7} {_mib(r.planned):>11} {_mib(r.rss):>8} "
            f"{ratio:>9} {r.loss:>8.4f}"
        )
    if why_not:
        lines.append(why_not)
    lines.append(
        "(dtm/torch: against torch at the same precision, with full recomputation for dtm's "
        "full and without for the others; bf16 is dtm's MixedPrecision and torch's autocast)"
    )
    return "\n".join(lines) + "\n"
