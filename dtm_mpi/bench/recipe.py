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

__all__ = ["RecipeRow", "recipe_config", "run_recipe_bench", "run_recipe_curve"]


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
    transformers.logging.set_verbosity_error()
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config: Any = transformers.LlamaConfig(**fields)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config)
    if row.recompute == "full":  # per decoder layer, torch.utils.checkpoint
        with warnings.catch_warnings():  # (renamed activation_checkpointing_enable in v6)
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
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


def _corpus_tokens(path: str) -> Any:
    """The Python standard library's sources as bytes (token ids 0..255), 90% a training
    token file at ``path``, the rest its validation file beside it."""
    import sysconfig
    from pathlib import Path

    from dtm_mpi.frontend.token_data import write_tokens

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib.glob("*.py"))[:120]
    ids = np.frombuffer(b"\n".join(f.read_bytes() for f in files), np.uint8).astype(np.int64)
    cut = int(len(ids) * 0.9)
    out = Path(path)
    write_tokens(ids[:cut], 256, out, split="train", sources=["python stdlib"])
    write_tokens(ids[cut:], 256, out.with_name(f"{out.stem}.val{out.suffix}"), split="validation")
    return out


def run_recipe_curve(
    steps: int = 1000,
    *,
    layers: int = 2,
    hidden: int = 64,
    batch: int = 8,
    context: int = 64,
    accumulate: int = 2,
    warmup: int = 20,
    peak_lr: float = 3e-3,
    val_batches: int = 8,
    workdir: str | None = None,
    precision: str = "bf16",
) -> str:
    """The recipe (bf16 with float32 masters, selective recomputation, warmup then cosine,
    accumulation, clipping at 1.0, AdamW) trained ``steps`` steps by dtm (2 simulated ranks,
    dp=2) and by PyTorch (transformers' LlamaForCausalLM, autocast bf16, torch's AdamW, the
    same schedule, accumulation and clipping) from the same initial weights on the same token
    batches; both validation losses at the end (float32, the same held-out batches) and the
    wall times."""
    import tempfile
    from pathlib import Path

    from dtm_mpi import frontend as dtm
    from dtm_mpi.frontend import functional as fn
    from dtm_mpi.frontend.hf_store import write_random_model

    work = Path(workdir or tempfile.mkdtemp(prefix="dtm-recipe-"))
    tokens = _corpus_tokens(str(work / "tokens.bin"))
    cfg = recipe_config(layers, hidden, 256)
    hf_dir = write_random_model(work / "hf", cfg, seed=7)
    train = dtm.TokenLoader(tokens, context=context, batch=batch, seed=1)
    val = dtm.TokenLoader(tokens.with_name("tokens.val.bin"), context=context, batch=batch, seed=2)
    whole = {"ids": (slice(0, batch), slice(0, context))}
    sched = dtm.optim.schedule("cosine", peak=peak_lr, total=steps, warmup=warmup, floor=0.1)

    def loss(m: Any, ids: Any) -> Any:
        return fn.causal_lm_loss(m(ids), ids)

    inputs = {"ids": dtm.Input((batch, context), "i32", ("dp", None))}
    mesh = dtm.Mesh(dp=2, tp=1)
    hf = dtm.hf.load(hf_dir)
    step = dtm.train_step(
        hf.model,
        loss,
        mesh=mesh,
        inputs=inputs,
        optimizer=dtm.optim.AdamW(sched, weight_decay=0.01),
        clip_norm=1.0,
        precision=dtm.MixedPrecision() if precision == "bf16" else None,
        recompute="selective",
        accumulate=accumulate,
    )
    t0 = time.perf_counter()
    ours = dtm.fit(step, train, steps=steps, sim=2, values=hf.weights, quiet=True)
    dtm_s = time.perf_counter() - t0
    weights = {k: v for k, v in ours.outputs.items() if k in dict(hf.weights)}
    ev = dtm.eval_step(hf.model, loss, mesh=mesh, inputs=inputs)
    dtm_val = float(
        np.mean(
            [
                m["loss"]
                for m in dtm.fit(
                    ev, val, steps=val_batches, sim=2, values=weights, quiet=True
                ).metrics
            ]
        )
    )
    # PyTorch: the same weights, batches, schedule, accumulation, clipping and optimizer
    modes = ("autocast", "policy") if precision == "bf16" else ("f32", "f32")
    torch_runs = {
        mode: _torch_curve(
            hf_dir, mode, train, val, whole, sched, steps, accumulate, peak_lr, val_batches
        )
        for mode in dict.fromkeys(modes)
    }
    torch_val, theirs, torch_s = torch_runs[modes[0]]
    policy_val, policy_losses, policy_s = torch_runs[modes[1]]
    # the runs' own sensitivity: PyTorch again from weights one ulp apart in one element
    nudged = _nudged_copy(hf_dir, work / "hf-nudged")
    floor_val, floor_losses, _ = _torch_curve(
        nudged, modes[0], train, val, whole, sched, steps, accumulate, peak_lr, val_batches
    )
    tail = max(1, steps // 10)
    dtm_train = float(np.mean([m["loss"] for m in ours.metrics[-tail:]]))
    torch_train = float(np.mean(theirs[-tail:]))
    rel = abs(dtm_val - torch_val) / torch_val
    return (
        f"LLM recipe, {steps} steps: Llama {layers} layers, hidden {hidden}; batch {batch} x "
        f"{context} bytes of the Python standard library (accumulated over {accumulate}); bf16 "
        f"with float32 masters (torch: autocast), selective recomputation (dtm), warmup "
        f"{warmup} then cosine to 0.1 x {peak_lr}, clipping at 1.0, AdamW; the same initial "
        "weights and batches\n"
        f"  dtm (2 simulated ranks, dp=2): validation loss {dtm_val:.4f}, last {tail} steps' "
        f"train loss {dtm_train:.4f}, {dtm_s:.1f} s ({dtm_s / steps * 1e3:.1f} ms/step)\n"
        f"  PyTorch (2 threads):           validation loss {torch_val:.4f}, last {tail} steps' "
        f"train loss {torch_train:.4f}, {torch_s:.1f} s ({torch_s / steps * 1e3:.1f} ms/step)\n"
        f"  PyTorch, dtm's policy (bf16 copies of float32 masters): validation loss "
        f"{policy_val:.4f}, last {tail} steps' train loss {float(np.mean(policy_losses[-tail:])):.4f}, "
        f"{policy_s:.1f} s\n"
        f"  validation losses differ by {100 * rel:.2f}% from autocast's "
        f"({'within' if rel <= 0.02 else 'NOT within'} 2%), by "
        f"{100 * abs(dtm_val - policy_val) / policy_val:.2f}% from the same policy's; "
        f"dtm/torch wall time {dtm_s / torch_s:.2f}\n"
        f"  the noise floor: PyTorch ({modes[0]}) from weights one ulp apart in one element "
        f"ends at validation loss {floor_val:.4f} ({100 * abs(floor_val - torch_val) / torch_val:.2f}% "
        f"from its own), train {float(np.mean(floor_losses[-tail:])):.4f} "
        f"({100 * abs(float(np.mean(floor_losses[-tail:])) - torch_train) / torch_train:.2f}%)\n"
    )


def _nudged_copy(hf_dir: Any, out: Any) -> Any:
    """A copy of the Hugging Face directory ``hf_dir`` whose final norm's first weight is one
    ulp larger: how far a training run moves from a change at rounding level."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        w = model.model.norm.weight
        w[0] = torch.nextafter(w[0], torch.tensor(float("inf"), dtype=w.dtype))
    model.save_pretrained(out)
    return out


def _torch_curve(
    hf_dir: Any,
    mode: str,
    train: Any,
    val: Any,
    whole: Any,
    sched: Any,
    steps: int,
    accumulate: int,
    peak_lr: float,
    val_batches: int,
) -> tuple[float, list[float], float]:
    """PyTorch trains the recipe: ``autocast`` (torch.autocast bf16 over the float32 model)
    or ``policy`` (float32 masters, a bf16 copy for each forward and backward, the gradients
    back in float32: dtm's MixedPrecision); the validation loss in float32, the train
    losses, the wall time."""
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()

    def load(dtype: Any = None) -> Any:
        kw = {"torch_dtype": dtype} if dtype is not None else {}
        return transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, attn_implementation="eager", **kw
        )

    model = load()
    work = load(torch.bfloat16) if mode == "policy" else model
    model.train()
    work.train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.01)
    t0 = time.perf_counter()
    losses = []
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = sched.lr(s)
        ids = torch.from_numpy(train(s, whole)["ids"].astype(np.int64))
        opt.zero_grad()
        if mode == "policy":
            work.zero_grad()
            with torch.no_grad():
                for w, m in zip(work.parameters(), params, strict=True):
                    w.copy_(m.to(torch.bfloat16))
        total = 0.0
        for part in ids.chunk(accumulate):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                got = work(part, labels=part).loss
            (got / accumulate).backward()
            total += float(got.detach()) / accumulate
        if mode == "policy":
            for w, m in zip(work.parameters(), params, strict=True):
                m.grad = w.grad.float()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(total)
    wall = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        got_val = float(
            np.mean(
                [
                    float(model(x, labels=x).loss)
                    for x in (
                        torch.from_numpy(val(s, whole)["ids"].astype(np.int64))
                        for s in range(val_batches)
                    )
                ]
            )
        )
    return got_val, losses, wall
