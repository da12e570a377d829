"""Overlapped allreduce buckets (:mod:`dtm_mpi.plan.overlap`, pure): members start after
their values are defined and complete before their results are used, buckets respect the
size cap, and a chained allreduce never joins the bucket that gives its operand."""

from __future__ import annotations

from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.plan.overlap import overlap_buckets
from dtm_mpi.plan.program import compile_plan, mesh_for
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
