"""The plan of GPT-3 175B on 1,024 ranks (tp=8, pp=16, dp=8; ``examples/gpt_175b.py``)
against closed forms from the papers, not from our code:

* parameters per rank: Narayanan et al. 2021 (Megatron-LM at scale), ``12 h^2 (1 + 13/(12h))``
  per layer split over ``t``, the first stage adding the embedding ``V h / t`` and positions
  ``s h``, the last the head ``V h / t``;
* optimizer state and gradients: 16 bytes per parameter (float32 weight, gradient and Adam's
  two moments; the same 16 as mixed precision's 2 + 2 + 12 in the ZeRO paper);
* activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models") eq. for tensor parallelism without sequence parallelism or
  recomputation, ``sbh (10 + 24/t + 5as/(ht))`` bytes per layer in 16 bits with dropout,
  restated for float32 values without dropout (no masks; the dropped-out softmax is the
  softmax): the two layer norms' inputs and the QKV and MLP inputs, ``16 sbh``; q, k, v, the
  output projection's input, the GeLU's input and output, ``48 sbh / t``; the softmax output,
  ``4 a s^2 b / t``; the last stage adds the final layer norm's and the head's inputs
  (``8 sbh``) and float32 logits (``4 s b V / t``);
* microbatches held at the peak (Narayanan et al. 2021, Korthikanti et al. section 4.2): GPipe
  ``m``; 1F1B ``p - rank``; ZB-H1 (Qi et al. 2024) at most ``p`` on any rank, 1F1B's peak;
  the interleaved schedule's first rank ``L (1 + (p - 1) / (p v))`` layers' worth.

Each rank's figure is within 5% of its closed form.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from dtm_mpi.plan.pipeline import PipelinePlan, rank_memory
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.plan.schedule import ScheduleKind, plan_schedule
from dtm_mpi.runtime.pipeline_step import plan_pipelined_run
from dtm_mpi.sharding.mesh import MeshShape

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt_175b.py"
P, D, T = 16, 8, 8  # pp, dp, tp
M = 64  # microbatches per step
B = 1  # sequences per microbatch


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpt_175b", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpt_175b", module)
    spec.loader.exec_module(module)
    return module


G = _example()
L, H, A, S, V = G.LAYERS, G.HIDDEN, G.HEADS, G.SEQUENCE, G.VOCAB


def _plan(schedule: str) -> tuple[PipelinePlan, MeshShape]:
    step = G.gpt_step(schedule, M, B, D)
    assert step.pipeline is not None
    plan = compile_plan(step.module, mesh_for(step.module, P * D * T, {"pp": P, "dp": D, "tp": T}))
    return plan_pipelined_run(step.pipeline, plan, fed=step.inputs), plan.mesh


@pytest.fixture(scope="module")
def one_chunk() -> tuple[PipelinePlan, MeshShape]:
    return _plan("1f1b")


def closed_params(rank: int) -> float:
    """Narayanan et al. 2021: a stage's parameters on one of its tensor-parallel ranks."""
    n = 12 * H * H * (1 + 13 / (12 * H)) * (L / P) / T
    if rank == 0:
        n += V * H / T + S * H
    if rank == P - 1:
        n += V * H / T
    return n


def layer_bytes() -> float:
    """Korthikanti et al. 2022, float32 without dropout: one layer, one microbatch."""
    sbh = S * B * H
    return sbh * (16 + 48 / T) + 4 * A * S * S * B / T


def closed_held(rank: int, layers: float) -> float:
    """One microbatch's activations on a stage of ``layers`` layers."""
    held = layers * layer_bytes()
    if rank == P - 1:
        held += 8 * S * B * H + 4 * S * B * V / T
    return held


def within(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= 0.05 * want, (
        f"{what}: plan {got / 2**30:.3f} GiB, closed form {want / 2**30:.3f} GiB ({got / want - 1:+.1%})"
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_per_rank_memory_of_175b_agrees_with_the_closed_forms(
    one_chunk: tuple[PipelinePlan, MeshShape], schedule: str
) -> None:
    pplan, mesh = one_chunk
    shape = pplan.schedule.shape
    pplan = replace(pplan, schedule=plan_schedule(ScheduleKind(schedule), shape))
    mems = rank_memory(pplan, mesh)
    assert [m.coord for m in mems] == list(range(P))
    for m in mems:
        c = m.coord
        within(m.params, 4 * closed_params(c), f"pp={c} parameters")
        within(m.state, 16 * closed_params(c), f"pp={c} parameters, gradients and Adam")
        within(m.held, closed_held(c, L / P), f"pp={c} activations of one microbatch")
        if schedule == "zb-h1":  # at most p microbatches on any rank: 1F1B's peak
            assert m.peak <= P, (c, m.peak)
            assert m.activations <= 1.05 * P * closed_held(c, L / P), c
            continue
        peak = M if schedule == "gpipe" else P - c
        assert m.peak == peak, (c, m.peak, peak)
        within(m.activations, peak * closed_held(c, L / P), f"pp={c} peak activations")
    if schedule != "gpipe":  # Korthikanti: the first stage holds L layers' worth, whatever p
        within(mems[0].activations, L * layer_bytes(), "the first stage's activations")


def test_the_interleaved_first_rank_holds_what_korthikanti_says() -> None:
    pplan, mesh = _plan("interleaved")
    v = pplan.schedule.shape.chunks
    assert v == 2 and len(pplan.stages.passes) == P * v
    first = rank_memory(pplan, mesh)[0]
    within(first.held, closed_held(0, L / (P * v)), "one chunk's microbatch")
    within(first.activations, L * (1 + (P - 1) / (P * v)) * layer_bytes(), "pp=0 peak")
