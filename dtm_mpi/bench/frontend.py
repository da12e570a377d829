"""``dtm bench frontend``: what the Python frontend costs.

1. **Tracing**: ``train_step`` of a GPT (``--layers`` transformer blocks, width 768, 12 heads,
   context 128, a 96-character vocabulary; AdamW, global-norm clipping) on a 2x2 mesh -- the
   trace, the reverse pass, the optimizer, verification and the canonical print/parse -- best
   of ``--repeat``, against the target of 2 s for 12 layers.
2. **Step time at 1 rank**: the generated training step of an MLP (batch 512, 1024 -> 4096 ->
   1024, gelu, mean-squared error, SGD) run by the executor on one rank, against the same step
   written directly in numpy in this process (forward, hand-derived backward, update), one BLAS
   thread for both (threadpoolctl), the median of ``--steps`` steps after a warm-up, alternating
   the two. Target: within 1.2x of numpy.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dtm_mpi.bench.train_models import mlp_numpy_step

__all__ = ["run_frontend_bench"]

TRACE_TARGET_S = 2.0
STEP_TARGET = 1.2


def _gpt_step(layers: int) -> Any:
    from dtm_mpi import frontend as dtm
    from dtm_mpi.frontend import functional as fn

    vocab, context, dim, heads, batch = 96, 128, 768, 12, 8

    def loss(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
        logits = m(ids)
        return fn.cross_entropy(logits.reshape(-1, vocab), tgt.reshape(-1))

    spec = dtm.Input((batch, context), "i32", ("dp", None))
    return dtm.train_step(
        dtm.nn.GPT(vocab, context, dim, heads, layers),
        loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs={"ids": spec, "tgt": spec},
        optimizer=dtm.optim.AdamW(),
        clip_norm=1.0,
        name="gpt",
    )


def _mlp_module(batch: int, n_in: int, hidden: int) -> Any:
    from dtm_mpi import frontend as dtm
    from dtm_mpi.frontend import functional as fn

    model = dtm.nn.Sequential(
        dtm.nn.Linear(n_in, hidden, bias=False), fn.gelu, dtm.nn.Linear(hidden, n_in, bias=False)
    )

    def loss(m: Any, x: dtm.Tensor, t: dtm.Tensor) -> dtm.Tensor:
        d: dtm.Tensor = m(x) - t
        return (d * d).mean()

    spec = dtm.Input((batch, n_in), "f32")
    return dtm.train_step(
        model,
        loss,
        mesh=dtm.Mesh(x=1),
        inputs={"x": spec, "t": spec},
        optimizer=dtm.optim.SGD(0.01),
        name="mlp",
    )


def _time_alternating(
    a: Callable[[], object], b: Callable[[], object], steps: int
) -> tuple[list[float], list[float]]:
    ta: list[float] = []
    tb: list[float] = []
    a()
    b()
    for _ in range(steps):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return ta, tb


def run_frontend_bench(
    layers: int = 12,
    repeat: int = 3,
    steps: int = 5,
    batch: int = 512,
    n_in: int = 1024,
    hidden: int = 4096,
) -> str:
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    from dtm_mpi.comm.sim import run_ranks
    from dtm_mpi.plan.program import compile_plan, mesh_for
    from dtm_mpi.runtime.executor import Executor
    from dtm_mpi.runtime.simulate import initial_blocks

    lines = []
    best, ops = math.inf, 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        step = _gpt_step(layers)
        best = min(best, time.perf_counter() - t0)
        entry = step.module.entry
        assert entry is not None
        ops = len(entry.body)
    verdict = "met" if best <= TRACE_TARGET_S else "MISSED"
    lines.append(
        f"trace + autodiff + optimizer + verify, GPT {layers} layers (768 wide, 12 heads): {ops} ops, {best:.2f} s (best of {repeat}); target <= {TRACE_TARGET_S:.0f} s: {verdict}"
    )

    mlp = _mlp_module(batch, n_in, hidden)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, n_in)).astype(np.float32)
    t = rng.normal(size=(batch, n_in)).astype(np.float32)
    plan = compile_plan(mlp.module, mesh_for(mlp.module, 1, None))
    entry = plan.entry_plan.function
    index = {p.name: i for i, p in enumerate(entry.params)}
    w1 = 0.02 * rng.normal(size=(n_in, hidden)).astype(np.float32)
    w2 = 0.02 * rng.normal(size=(hidden, n_in)).astype(np.float32)
    nw1, nw2 = w1.copy(), w2.copy()

    def measure(comm: Any) -> tuple[list[float], list[float]]:
        blocks = initial_blocks(
            plan, 0, {"x": x, "t": t, "layers.0.weight": w1, "layers.1.weight": w2}
        )
        ex = Executor(plan, comm, "numpy")
        counter = [0]

        def dtm_step() -> None:
            results = ex.run(blocks, counter[0])
            counter[0] += 1
            for spec, value in zip(entry.results, results, strict=True):
                if spec.updates is not None:
                    blocks[index[spec.updates]] = value

        return _time_alternating(dtm_step, lambda: mlp_numpy_step(x, t, nw1, nw2, 0.01), steps)

    with threadpool_limits(limits=1, user_api="blas"):
        (td, tn), *_ = run_ranks(plan.mesh, measure, timeout_s=3600)
    md, mn = statistics.median(td), statistics.median(tn)
    ratio = md / mn
    verdict = "met" if ratio <= STEP_TARGET else "MISSED"
    lines.append(
        f"MLP training step {batch}x{n_in}x{hidden} f32, 1 rank, 1 BLAS thread: generated {md * 1e3:.0f} ms, numpy {mn * 1e3:.0f} ms (medians of {steps}); ratio {ratio:.2f}, target <= {STEP_TARGET}: {verdict}"
    )
    return "\n".join(lines)
