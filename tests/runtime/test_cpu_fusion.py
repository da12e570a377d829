"""Fused elementwise chains on the CPU (``DTM_FUSE``, the numpy backend's fast loop): each
chain runs at its root in chunks of rows, its ops the same bound calls in the same order, so
the results equal the op-by-op run (``DTM_FUSE=0``) bit for bit: every example at 1-3 ranks,
and chains over many chunks in f16, bf16, f32 and f64 with bias broadcasts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from dtm_mpi.config import get_config
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module
from dtm_mpi.plan.fusion import fusion_groups
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime import chunked
from dtm_mpi.runtime.simulate import run_simulated
from tests.runtime.test_sim_examples import NAMES, load


@contextmanager
def fuse(on: bool, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("DTM_FUSE", "1" if on else "0")
    get_config.cache_clear()
    try:
        yield
    finally:
        monkeypatch.delenv("DTM_FUSE")
        get_config.cache_clear()


def outputs(
    module: Module, ranks: int, on: bool, monkeypatch: pytest.MonkeyPatch, **kw: object
) -> dict[str, np.ndarray]:
    with fuse(on, monkeypatch):
        return run_simulated(module, ranks, steps=2, **kw).outputs()  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "pipeline"])
def test_examples_fused_on_the_cpu_equal_op_by_op_bit_for_bit(
    name: str, ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load(name)
    want = outputs(module, ranks, False, monkeypatch)
    got = outputs(module, ranks, True, monkeypatch)
    for k, v in want.items():
        assert np.array_equal(got[k], v, equal_nan=True), k


CHAIN = """dtm 1.0
module chain
mesh @m = [x=2]
entry func @f(%a: {t}[800,200], %b: {t}[200], %c: {t}[800,200]) -> ({t}[800,200]) on @m {{
  %bb = broadcast_to %b : {t}[800,200]
  %s = add %a, %bb : {t}[800,200]
  %g = gelu %s : {t}[800,200]
  %m = mul %g, %c : {t}[800,200]
  %e = exp %m : {t}[800,200]
  %d = div %e, %c : {t}[800,200]
  %r = sub %d, %a : {t}[800,200]
  return %r
}}
"""


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
def test_a_chain_over_many_chunks_equals_op_by_op(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = parse_module(CHAIN.format(t=dtype), "chain.dtm")
    verify_module(module)
    plan = compile_plan(module, mesh_for(module, 2, None))
    (group,) = fusion_groups(plan.entry_plan)
    assert len(group.members) == 7  # the whole chain, the bias broadcast absorbed
    rows, cols = 800, 200  # every rank computes the whole (replicated): several chunks of rows
    assert rows > chunked.CHUNK_ELEMS // cols and rows * cols >= chunked.MIN_CHUNKED_ELEMS
    rng = np.random.default_rng(3)
    np_t = np.float32 if dtype == "bf16" else np.dtype(dtype.replace("f", "float"))
    a, b = rng.standard_normal((800, 200)).astype(np_t), rng.standard_normal(200).astype(np_t)
    inputs = {"a": a, "b": b, "c": (rng.random((800, 200)) + 0.5).astype(np_t)}
    if dtype == "bf16":
        from dtm_mpi.ir.dtypes import round_bf16

        inputs = {k: round_bf16(v) for k, v in inputs.items()}
    want = outputs(module, 2, False, monkeypatch, inputs=inputs)
    got = outputs(module, 2, True, monkeypatch, inputs=inputs)
    assert np.array_equal(
        got["result0"] if "result0" in got else next(iter(got.values())),
        next(iter(want.values())),
        equal_nan=True,
    )
    monkeypatch.setattr(chunked, "CHUNK_ELEMS", 7 * cols)  # uneven last chunk
    odd = outputs(module, 2, True, monkeypatch, inputs=inputs)
    assert np.array_equal(next(iter(odd.values())), next(iter(want.values())), equal_nan=True)


def test_a_long_vector_chain_in_chunks_equals_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    text = """dtm 1.0
module vec
entry func @f(%a: f32[200000], %c: f32[200000]) -> (f32[200000]) {
  %s = mul %a, %c : f32[200000]
  %g = tanh %s : f32[200000]
  %r = sub %g, %a : f32[200000]
  return %r
}
"""
    module = parse_module(text, "vec.dtm")
    verify_module(module)
    rng = np.random.default_rng(5)
    inputs = {k: rng.standard_normal(200000).astype(np.float32) for k in ("a", "c")}
    want = outputs(module, 1, False, monkeypatch, inputs=inputs)
    got = outputs(module, 1, True, monkeypatch, inputs=inputs)
    assert np.array_equal(next(iter(got.values())), next(iter(want.values())))


REUSED = """dtm 1.0
module reused
entry func @f(%a: f32[600,300], %b: f32[300], %w: f32[300]) -> (f32[600,300]) {
  %bw = mul %b, %w : f32[300]
  %bb = broadcast_to %bw : f32[600,300]
  %s = add %a, %bb : f32[600,300]
  %t = tanh %s : f32[600,300]
  %u = mul %t, %t : f32[600,300]
  %v = sub %u, %s : f32[600,300]
  %x = mul %v, %t : f32[600,300]
  %y = add %x, %s : f32[600,300]
  %n = neg %y : f32[600,300]
  %z = maximum %n, %a : f32[600,300]
  return %z
}
"""


@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_a_chain_writing_into_reused_buffers_equals_op_by_op(
    chunk_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ops that are one ufunc write into block buffers the chain reuses once their value was
    read (the values read several times, ``%s`` and ``%t``, end chains of their own and are
    read whole by the longest), a bias broadcast stays an alias of its vector, and the results
    equal op by op, with an uneven last block too."""
    module = parse_module(REUSED, "reused.dtm")
    verify_module(module)
    plan = compile_plan(module, mesh_for(module, 1, None))
    groups = fusion_groups(plan.entry_plan)
    group = max(groups, key=lambda g: len(g.members))
    steps = chunked.chunked_chain(plan.entry_plan, group, lambda m: None, (600, 300)).steps
    into = {result for _, _, result, _, ufunc, _ in steps if ufunc is not None}
    assert {"%u", "%v", "%x", "%y", "%n", "%z"} <= into, into
    first = min(groups, key=lambda g: min(g.members))
    steps = chunked.chunked_chain(plan.entry_plan, first, lambda m: None, (600, 300)).steps
    assert [(r, u is not None) for _, _, r, _, u, _ in steps][:2] == [("%bb", False), ("%s", True)]
    if chunk_rows is not None:
        monkeypatch.setattr(chunked, "CHUNK_ELEMS", chunk_rows * 300)
    rng = np.random.default_rng(11)
    inputs = {
        "a": rng.standard_normal((600, 300)).astype(np.float32),
        "b": rng.standard_normal(300).astype(np.float32),
        "w": rng.standard_normal(300).astype(np.float32),
    }
    want = outputs(module, 1, False, monkeypatch, inputs=inputs)
    got = outputs(module, 1, True, monkeypatch, inputs=inputs)
    assert np.array_equal(next(iter(got.values())), next(iter(want.values())))
