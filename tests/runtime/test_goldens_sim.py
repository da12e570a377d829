"""Every golden valid module (io/vectors/ir/valid) runs under the in-process simulator and gives
the single-process reference's values: at its declared mesh sizes and at one rank. Together the
goldens use every op, so this runs every numpy kernel on local blocks (uneven ones included)
and every collective of the executor. The simulator folds reductions in group order, so two
runs are bitwise identical."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.conformance import against_reference, inputs_for
from dtm_mpi.errors import PlanError
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module
from dtm_mpi.ir.registry import OPS, lookup_op
from dtm_mpi.ir.verify import function_mesh
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.simulate import RunResult, run_simulated

VALID = Path(__file__).resolve().parents[2] / "io" / "vectors" / "ir" / "valid"
GOLDENS = sorted(p.stem for p in VALID.glob("*.dtm"))
STEPS = 2
MAX_RANKS = 8

# At one rank every axis has size 1: these name coordinates beyond it (broadcast root 3 on
# tp; send/recv to pp coordinates 1 and 2). The planner must refuse them before running.
NEEDS_COORDS = {"collectives": "root 3", "sendrecv": "dst 1"}


def load(name: str) -> Module:
    path = VALID / f"{name}.dtm"
    module = parse_module(path.read_text(encoding="utf-8"), str(path))
    verify_module(module)
    return module


def declared_sizes(module: Module) -> dict[str, int] | None:
    entry = module.entry
    assert entry is not None
    mesh = function_mesh(module, entry)
    return None if mesh is None else dict(mesh.axes)


def check(module: Module, got: RunResult, inputs: dict[str, np.ndarray]) -> None:
    assert len(got.results) == STEPS
    assert module.entry is not None
    assert set(got.params) == {p.name.lstrip("%") for p in module.entry.params}
    against_reference(module, inputs, STEPS, got.params, got.results)  # (every step, value)


def test_goldens_use_every_op() -> None:
    lookup_op("add")
    used = {op.name for name in GOLDENS for f in load(name).functions for op in f.body}
    assert used == set(OPS), sorted(set(OPS) - used)


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_at_declared_mesh(name: str) -> None:
    module = load(name)
    sizes = declared_sizes(module)
    nranks = int(np.prod(list(sizes.values()))) if sizes else 1
    if nranks > MAX_RANKS:
        pytest.skip(f"{name} declares {nranks} ranks")
    inputs = inputs_for(module)
    got = run_simulated(module, nranks, binding=sizes, inputs=inputs, steps=STEPS, timeout_s=30)
    check(module, got, inputs)


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_at_one_rank(name: str) -> None:
    module = load(name)
    inputs = inputs_for(module)
    if name in NEEDS_COORDS:
        with pytest.raises(PlanError, match=rf"{NEEDS_COORDS[name]} is out of range 0..0"):
            compile_plan(module, mesh_for(module, 1, None))
        return
    got = run_simulated(module, 1, inputs=inputs, steps=STEPS, timeout_s=30)
    check(module, got, inputs)
    # one rank communicates nothing
    assert got.stats[0].bytes_sent == got.stats[0].bytes_received == 0


@pytest.mark.parametrize("name", ["create", "elementwise", "normalize", "partial_linear"])
def test_golden_on_uneven_first_axis(name: str) -> None:
    """Without --mesh every rank goes on the first axis: 3 ranks split 8 as 3, 3, 2."""
    module = load(name)
    inputs = inputs_for(module)
    got = run_simulated(module, 3, inputs=inputs, steps=STEPS, timeout_s=30)
    check(module, got, inputs)


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_runs_are_bitwise_identical(name: str) -> None:
    module = load(name)
    sizes = declared_sizes(module)
    nranks = int(np.prod(list(sizes.values()))) if sizes else 1
    inputs = inputs_for(module, seed=1)
    runs = [
        run_simulated(module, nranks, binding=sizes, inputs=inputs, steps=STEPS, timeout_s=30)
        for _ in range(2)
    ]
    for s in range(STEPS):
        for a, b in zip(runs[0].results[s], runs[1].results[s], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()
    for key, value in runs[0].params.items():
        assert value.tobytes() == runs[1].params[key].tobytes(), key
