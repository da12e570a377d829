"""Every example runs under the in-process simulator at 1..4 ranks (and on explicit 2-D
meshes) and matches the single-process numpy evaluation of the module; the communication each
rank performs is exactly what the plan counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import PlanError
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module
from dtm_mpi.plan.cost import function_cost
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
NAMES = ["tp_mlp", "dp_step", "attention", "collectives", "pipeline"]


def load(name: str) -> Module:
    path = EXAMPLES / f"{name}.dtm"
    module = parse_module(path.read_text(encoding="utf-8"), str(path))
    verify_module(module)
    return module


def assert_matches(module: Module, nranks: int, binding: dict[str, int] | None) -> None:
    steps = 2
    ref_params, ref_results = run_reference(module, steps=steps)
    got = run_simulated(module, nranks, binding=binding, steps=steps)
    for s in range(steps):
        for i, (a, b) in enumerate(zip(got.results[s], ref_results[s], strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype, (s, i, a.shape, b.shape)
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"step {s} result {i}")
    for name, value in ref_params.items():
        np.testing.assert_allclose(got.params[name.lstrip("%")], value, rtol=2e-5, atol=2e-6)
    # every rank performed exactly the collectives the plan counts, and the point-to-point
    # transfers its coordinates call for
    plan = compile_plan(module, mesh_for(module, nranks, binding))
    cost = function_cost(plan, plan.entry_plan)
    want = {k: v for k, v in cost.collectives if k not in ("send", "recv")}
    mesh = plan.mesh
    for rank, stats in enumerate(got.stats):
        calls = {k: v // steps for k, v in stats.calls.items()}
        p2p = {k: calls.pop(k, 0) for k in ("send", "recv")}
        assert calls == want, f"rank {rank}: performed {calls}, plan counts {want}"
        sends = sum(
            1
            for c in cost.ops
            if c.plan_op.op.name == "send"
            and mesh.index_along(rank, c.plan_op.axes) == c.plan_op.root
        )
        recvs = sum(
            1
            for c in cost.ops
            if c.plan_op.op.name == "recv"
            and mesh.index_along(rank, c.plan_op.axes) == c.plan_op.dst
        )
        assert p2p == {"send": sends, "recv": recvs}, (rank, p2p)
        assert stats.bytes_sent == steps * cost.sent[rank], (rank, stats.bytes_sent)
        assert stats.bytes_received == steps * cost.received[rank], (rank, stats.bytes_received)


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "pipeline"])
def test_example_matches_reference(name: str, nranks: int) -> None:
    assert_matches(load(name), nranks, None)


@pytest.mark.parametrize(
    ("name", "nranks", "binding"),
    [
        ("tp_mlp", 4, {"dp": 2, "tp": 2}),
        ("tp_mlp", 3, {"dp": 1, "tp": 3}),
        ("collectives", 4, {"dp": 2, "tp": 2}),
        ("collectives", 3, {"dp": 1, "tp": 3}),
        ("attention", 4, {"dp": 2, "tp": 2}),
        ("dp_step", 3, None),
        ("pipeline", 2, None),
        ("pipeline", 3, None),
        ("pipeline", 4, {"pp": 2, "dp": 2}),
    ],
)
def test_example_on_explicit_mesh(name: str, nranks: int, binding: dict[str, int] | None) -> None:
    assert_matches(load(name), nranks, binding)


def test_pipeline_needs_two_stages() -> None:
    module = load("pipeline")
    with pytest.raises(PlanError, match=r"pipeline.dtm:\d+:\d+: send dst 1 is out of range 0..0"):
        compile_plan(module, mesh_for(module, 1, None))


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_mode_gives_every_rank_count_the_same_bits(name: str) -> None:
    """Deterministic mode's sums are exact (dtm_mpi/kernels/exact.py): the outputs of two
    steps on 1-4 ranks (2-4 for the pipeline) are bit for bit the same."""
    module = load(name)
    counts = (2, 3, 4) if name == "pipeline" else (1, 2, 3, 4)
    outs = [run_simulated(module, n, steps=2, deterministic=True).outputs() for n in counts]
    for n, out in zip(counts, outs, strict=True):
        assert sorted(out) == sorted(outs[0])
        for key, value in out.items():
            assert value.tobytes() == outs[0][key].tobytes(), f"{key} on {n} ranks differs"
