"""Overlapped collectives (:mod:`dtm_mpi.plan.overlap`, pure): allreduce buckets' members
start after their values are defined and complete before their results are used, buckets
respect the size cap, and a chained allreduce never joins the bucket that gives its operand;
gathers of parameters stored sharded are prefetched one ahead."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.plan.cost import function_cost
from dtm_mpi.plan.explain import explain_text
from dtm_mpi.plan.overlap import overlap_buckets
from dtm_mpi.plan.program import OpKind, compile_plan, mesh_for
from dtm_mpi.sharding.steps import StepKind
from tests.runtime.test_sim_examples import load


def test_buckets_respect_the_size_and_start_after_their_values() -> None:
    module = load("tp_mlp")
    plan = compile_plan(module, mesh_for(module, 4, {"dp": 2, "tp": 2}), bucket_bytes=1 << 20)
    fp = plan.entry_plan
    assert fp.buckets, "the dp gradients form a bucket"
    defined = {r: i for i, p in enumerate(fp.ops) for r in p.op.results}
    for b in fp.buckets:
        for m in b.members:
            operand = fp.ops[m].op.operands[0]
            assert defined.get(operand, -1) < b.start < b.finish
    small = overlap_buckets(fp, bucket_bytes=8)
    assert all(len(b.members) == 1 or b.nbytes <= 8 for b in small)


def test_an_allreduce_of_a_value_computed_from_a_bucket_result_is_not_in_that_bucket() -> None:
    text = """dtm 1.0
module chain
mesh @m = [dp=2]
entry func @f(%a: f32[4,8]{dp,-}, %h: f32[4,8]{dp,-}, %w: f32[8]) -> (f32[8], f32[8]) on @m {
  %s = sum %a dims [0] : f32[8] partial(sum: dp)
  %b = allreduce sum %s on dp : f32[8]
  %p = mul %w, %w : f32[8]
  %q = mul %p, %w : f32[8]
  %hs = sum %h dims [0] : f32[8] partial(sum: dp)
  %c = mul %b, %hs : f32[8] partial(sum: dp)
  %d = allreduce sum %c on dp : f32[8]
  %e = mul %q, %p : f32[8]
  %g = add %e, %b : f32[8]
  return %d, %g
}
"""
    module = parse_module(text, "chain.dtm")
    verify_module(module)
    fp = compile_plan(module, mesh_for(module, 2, None), bucket_bytes=1 << 20).entry_plan
    assert fp.buckets, "the first allreduce overlaps the muls after it"
    producer = {r: i for i, p in enumerate(fp.ops) for r in p.op.results}

    def depends(name: str, on: set[str]) -> bool:
        if name in on:
            return True
        i = producer.get(name)
        return i is not None and any(depends(n, on) for n in fp.ops[i].op.operands)

    for b in fp.buckets:
        results = {fp.ops[m].op.results[0] for m in b.members}
        assert not any(depends(fp.ops[m].op.operands[0], results) for m in b.members)


def test_a_bucket_reducing_another_buckets_result_starts_once_that_one_completed() -> None:
    from tests.runtime.test_overlap_run import CHAINED

    module = parse_module(CHAINED, "chained.dtm")
    verify_module(module)
    fp = compile_plan(module, mesh_for(module, 4, None), bucket_bytes=1 << 20).entry_plan
    finish_of = {fp.ops[m].op.results[0]: b.finish for b in fp.buckets for m in b.members}
    for b in fp.buckets:
        for m in b.members:
            operand = fp.ops[m].op.operands[0]
            assert b.start >= finish_of.get(operand, 0), (b, operand)


def _zero3_plans(model: str) -> tuple[Any, Any]:
    """The ``model`` step with parameters stored sharded (ZeRO-3) at dp=2, planned without and
    with overlap."""
    from dtm_mpi.bench.train_models import MODELS

    step = MODELS[model].build(None, "dp")
    mesh = mesh_for(step.module, 2, {"dp": 2, "tp": 1})
    return compile_plan(step.module, mesh, bucket_bytes=0), compile_plan(
        step.module, mesh, bucket_bytes=1 << 20
    )


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_gathers_of_parameters_stored_sharded_are_prefetched_one_ahead(model: str) -> None:
    """FSDP's prefetch: each gather of a stored parameter starts where the one needed before
    it is first used (never later than where it stood), completes before its own first use,
    and so at most one prefetched gather is in flight at a time; the traffic is the same as
    without overlap, and the peak memory counts a prefetched parameter from its start."""
    plain, fetched = _zero3_plans(model)
    fp = fetched.entry_plan
    assert not plain.entry_plan.buckets
    params = {q.name for q in fp.function.params}
    first_use: dict[str, int] = {}
    for i, p in enumerate(fp.ops):
        for n in p.op.operands:
            first_use.setdefault(n, i)
    gathers = sorted(
        (first_use[p.op.results[0]], i)
        for i, p in enumerate(fp.ops)
        if p.kind is OpKind.REDIST
        and p.redist is not None
        and [s.kind for s in p.redist.steps] == [StepKind.ALLGATHER]
        and p.op.operands[0] in params
    )
    prefetches = [b for b in fp.buckets if b.kind is StepKind.ALLGATHER]
    assert len(prefetches) >= (1 if model == "mlp" else len(gathers) // 2), prefetches
    by_member = {b.members[0]: b for b in prefetches}
    for k, (needed, i) in enumerate(gathers):
        b = by_member.get(i)
        if b is None:
            continue
        assert b.op is None and b.members == (i,) and b.finish == needed
        assert b.start == (i if k == 0 else min(i, gathers[k - 1][0]))
    spans = sorted((b.start, b.finish) for b in prefetches)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    cost0, cost1 = function_cost(plain, plain.entry_plan), function_cost(fetched, fp)
    assert cost1.sent == cost0.sent and cost1.received == cost0.received
    assert cost1.peak[0] >= cost0.peak[0]
    assert any("prefetched: in flight over ops" in c for o in cost1.ops for c in o.comm)
    text = explain_text(fetched)
    assert f"prefetch {fp.buckets.index(prefetches[0]) + 1}: allgather on dp of" in text


def test_a_prefetched_gather_is_counted_in_memory_from_its_start() -> None:
    """Two stored parameters gathered where used: the second's gather starts where the
    first is used, so both gathered values are alive at that op: the peak counts them."""
    text = """dtm 1.0
module fetch
mesh @m = [dp=2]
entry func @f(state %w1: f32[64,64]{dp,-}, state %w2: f32[64,64]{dp,-}, %x: f32[8,64]) -> (f32[8,64]) on @m {
  %a = allgather %w1 on dp : f32[64,64]
  %h = matmul %x, %a : f32[8,64]
  %g = tanh %h : f32[8,64]
  %b = allgather %w2 on dp : f32[64,64]
  %y = matmul %g, %b : f32[8,64]
  return %y
}
"""
    module = parse_module(text, "fetch.dtm")
    verify_module(module)
    mesh = mesh_for(module, 2, None)
    plain = compile_plan(module, mesh, bucket_bytes=0)
    fetched = compile_plan(module, mesh, bucket_bytes=1 << 20)
    (b,) = fetched.entry_plan.buckets
    assert (b.kind, b.members, b.start, b.finish) == (StepKind.ALLGATHER, (3,), 1, 4)
    whole, half, row = 64 * 64 * 4, 32 * 64 * 4, 8 * 64 * 4
    p0 = function_cost(plain, plain.entry_plan).peak[0]
    p1 = function_cost(fetched, fetched.entry_plan).peak[0]
    # at the first matmul: the two stored halves, %x, %a and %b whole, and %h
    assert p1 == 2 * half + row + 2 * whole + row > p0, (p0, p1)
