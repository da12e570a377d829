"""``dtm explain`` figures: per-rank local shapes, communication steps, bytes and peak memory
of the tensor-parallel MLP, checked against numbers computed by hand from the accounting rules
of ``dtm_mpi.sharding.redistribute`` (ALLREDUCE: a reduce-scatter of the flattened local array
in §5 pieces plus an allgather: sent = received = ``(m - p) + (k-1)·p`` elements, ``p`` the
rank's piece)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtm_mpi.errors import PlanError
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module
from dtm_mpi.plan.cost import FunctionCost, OpCost, function_cost, local_bytes
from dtm_mpi.plan.explain import check_memory, explain_text, human_bytes
from dtm_mpi.plan.program import ExecPlan, OpKind, compile_plan, mesh_for
from dtm_mpi.sharding.blocks import local_shape

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
F32 = 4


def load(name: str) -> Module:
    path = EXAMPLES / f"{name}.dtm"
    module = parse_module(path.read_text(encoding="utf-8"), str(path))
    verify_module(module)
    return module


def plan_for(nranks: int, binding: dict[str, int], bucket_bytes: int = 0) -> ExecPlan:
    """The example's plan; without overlapped buckets unless ``bucket_bytes`` (the by-hand
    figures below count each allreduce where it stands)."""
    module = load("tp_mlp")
    return compile_plan(module, mesh_for(module, nranks, binding), bucket_bytes=bucket_bytes)


def allreduce_bytes(m: int, k: int, pos: int, itemsize: int = F32) -> int:
    """The documented ALLREDUCE volume of a rank at ``pos`` in a group of ``k`` (m elements)."""
    b = -(-m // k)
    own = max(0, min(b, m - pos * b))
    return ((m - own) + (k - 1) * own) * itemsize


def op_cost(cost: FunctionCost, result: str) -> OpCost:
    (found,) = [c for c in cost.ops if result in c.plan_op.op.results]
    return found


def row(text: str, function: str, result: str) -> str:
    """The table row of the op whose result column starts with ``result`` (``%y,`` for a
    call with several results) in the section of ``function``."""
    section = text.split(f"function @{function}\n", 1)[1].split("\n\n", 1)[0]
    rows = [ln for ln in section.splitlines()[1:] if ln.split()[3] == result]
    assert len(rows) == 1, (result, rows)
    return rows[0]


# --- 2x2 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan4() -> ExecPlan:
    return plan_for(4, {"dp": 2, "tp": 2})


def test_forward_has_one_allreduce_over_tp(plan4: ExecPlan) -> None:
    fp = plan4.function("forward")
    cost = function_cost(plan4, fp)
    assert cost.collectives == (("allreduce", 1),)
    comms = [(c.plan_op.op.name, c.comm) for c in cost.ops if c.comm]
    assert comms == [("allreduce", ("allreduce sum on tp",))]
    kinds = [p.kind for p in fp.ops]
    assert kinds == [OpKind.LOCAL, OpKind.LOCAL, OpKind.LOCAL, OpKind.REDIST]


def test_forward_allreduce_bytes_by_hand(plan4: ExecPlan) -> None:
    # %p is f32[64,256]{dp,-} partial(sum: tp): the local block is [32,256] (8192 elements);
    # k = 2, each rank's piece is 4096 elements: (8192 - 4096) + 1 * 4096 = 8192 -> 32768 B
    m = 32 * 256
    want = allreduce_bytes(m, 2, 0)
    assert want == allreduce_bytes(m, 2, 1) == 32768
    cost = function_cost(plan4, plan4.function("forward"))
    y = op_cost(cost, "%y")
    assert y.sent == (32768,) * 4
    assert y.received == (32768,) * 4
    assert cost.sent == (32768,) * 4 and cost.received == (32768,) * 4
    # the kernels move nothing
    for c in cost.ops:
        if c.plan_op.kind is OpKind.LOCAL:
            assert c.sent == (0,) * 4 and c.received == (0,) * 4 and c.comm == ()


def test_local_shapes_2x2(plan4: ExecPlan) -> None:
    fwd = function_cost(plan4, plan4.function("forward"))
    assert op_cost(fwd, "%h").local_shapes == (((32, 512),),) * 4
    assert op_cost(fwd, "%a").local_shapes == (((32, 512),),) * 4
    assert op_cost(fwd, "%p").local_shapes == (((32, 256),),) * 4
    assert op_cost(fwd, "%y").local_shapes == (((32, 256),),) * 4
    entry = function_cost(plan4, plan4.entry_plan)
    assert op_cost(entry, "%y").local_shapes == (((32, 256), (32, 512), (32, 512)),) * 4
    assert op_cost(entry, "%loss").local_shapes == (((),),) * 4
    assert op_cost(entry, "%aT").local_shapes == (((512, 32),),) * 4
    assert op_cost(entry, "%gw1").local_shapes == (((256, 512),),) * 4


def test_entry_totals_by_hand(plan4: ExecPlan) -> None:
    entry = function_cost(plan4, plan4.entry_plan)
    # allreduce x4 per step: %y on tp (in @forward), %loss, %gw2, %gw1 on dp
    assert entry.collectives == (("allreduce", 4),)
    loss = allreduce_bytes(1, 2, 0)  # a scalar: rank 0 owns the one element
    assert loss == allreduce_bytes(1, 2, 1) == 4
    gw = allreduce_bytes(512 * 256, 2, 0)  # [512,256] and [256,512] local blocks
    assert gw == 524288
    total = 32768 + loss + 2 * gw
    assert entry.sent == (total,) * 4
    assert entry.received == (total,) * 4
    assert op_cost(entry, "%gw2").sent == (gw,) * 4
    assert op_cost(entry, "%gw1").received == (gw,) * 4
    # the call reports the callee's traffic and communication
    call = op_cost(entry, "%y")
    assert call.sent == (32768,) * 4
    assert call.comm == ("allreduce sum on tp (in @forward)",)


def test_overlapped_buckets_count_one_message_each_by_hand() -> None:
    plan = plan_for(4, {"dp": 2, "tp": 2}, bucket_bytes=25 * 2**20)
    fp = plan.entry_plan
    (bucket,) = fp.buckets  # %loss, %gw2 and %gw1 on dp: one message, started after %gw1p
    names = [fp.ops[m].op.results[0] for m in bucket.members]
    assert sorted(names) == ["%gw1", "%gw2", "%loss"] and bucket.axes == ("dp",)
    index = {p.op.results[0]: i for i, p in enumerate(fp.ops) if p.op.results}
    assert bucket.start == index["%gw1p"] + 1 and bucket.finish == index["%s1"]
    entry = function_cost(plan, fp)
    assert entry.collectives == (("allreduce", 2),)  # the call's tp allreduce and the bucket
    one = allreduce_bytes(1 + 2 * 512 * 256, 2, 0)
    assert entry.sent == (32768 + one,) * 4
    first = op_cost(entry, fp.ops[min(bucket.members)].op.results[0])
    assert first.sent == (one,) * 4 and "bucket of 3" in first.comm[0]
    assert "bucket of 3" in explain_text(plan)
    small = plan_for(4, {"dp": 2, "tp": 2}, bucket_bytes=4).entry_plan.buckets
    assert sorted(len(b.members) for b in small) == [1, 1, 1]  # each started on its own


def test_explain_text_rows_and_totals(plan4: ExecPlan) -> None:
    text = explain_text(plan4)
    assert text.startswith("module tp_mlp on mesh [dp=2, tp=2] (4 ranks)\n")
    fwd = text.split("function @forward\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(fwd) == 1 + 4  # header + 4 ops
    y = [ln for ln in fwd if " allreduce " in ln]
    assert len(y) == 1
    cols = y[0].split()
    assert cols[:5] == ["4", "14", "allreduce", "%y", "[32,256]"]
    assert "allreduce sum on tp" in y[0]
    assert human_bytes(32768) == "32.0 KiB"
    assert "32.0 KiB/32.0 KiB" in y[0]
    h = [ln for ln in fwd if " %h " in ln]
    assert len(h) == 1 and "[32,512]" in h[0]
    # one allreduce row in @forward, and no other row communicates
    assert sum("allreduce sum" in ln for ln in fwd) == 1
    total = 32768 + 4 + 2 * 524288
    assert f"  bytes sent:     {human_bytes(total)}\n" in text
    assert f"  bytes received: {human_bytes(total)}\n" in text
    assert human_bytes(total) == "1.0 MiB"
    assert "  communication steps: allreduce x4\n" in text
    peak = function_cost(plan4, plan4.entry_plan).peak
    assert f"  peak memory:    {human_bytes(peak[0])}\n" in text


def test_peak_covers_parameters(plan4: ExecPlan) -> None:
    mesh = plan4.mesh
    for name, fp in plan4.functions:
        cost = function_cost(plan4, fp)
        for r in range(mesh.size):
            params = sum(local_bytes(p.type, mesh, r) for p in fp.function.params)
            assert cost.peak[r] >= params, (name, r)
            assert cost.peak[r] == max([params, *(c.live[r] for c in cost.ops)])
    # entry parameters on each rank: x, target [32,256]; w1 [256,512]; w2 [512,256]
    entry = function_cost(plan4, plan4.entry_plan)
    params = (2 * 32 * 256 + 2 * 256 * 512) * F32
    assert all(p >= params for p in entry.peak)
    # the weights' update keeps w, its gradient and the update alive at once
    assert all(p >= params + 2 * 256 * 512 * F32 for p in entry.peak)


def test_check_memory_limit(plan4: ExecPlan) -> None:
    cost = function_cost(plan4, plan4.entry_plan)
    peak = [v + k for v, k in zip(cost.peak, cost.retained, strict=True)]
    assert len(set(peak)) == 1
    check_memory(plan4, peak[0])  # at the peak: fine
    check_memory(plan4, peak[0] + 1)
    with pytest.raises(PlanError) as info:
        check_memory(plan4, peak[0] - 1)
    msg = str(info.value)
    assert "on rank 0" in msg
    assert f"({peak[0]} bytes)" in msg and f"({peak[0] - 1} bytes)" in msg
    assert "tp_mlp.dtm:" in msg
    with pytest.raises(PlanError, match=r"on rank 0 at \w+ \(.*tp_mlp\.dtm:\d+:\d+\)"):
        check_memory(plan4, 1024)


# --- uneven: 1024 over tp=3 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan3() -> ExecPlan:
    return plan_for(3, {"dp": 1, "tp": 3})


def test_uneven_local_shapes(plan3: ExecPlan) -> None:
    fwd = function_cost(plan3, plan3.function("forward"))
    assert op_cost(fwd, "%h").local_shapes == (((64, 342),), ((64, 342),), ((64, 340),))
    assert op_cost(fwd, "%p").local_shapes == (((64, 256),),) * 3
    entry = function_cost(plan3, plan3.entry_plan)
    assert op_cost(entry, "%aT").local_shapes == (((342, 64),), ((342, 64),), ((340, 64),))
    text = explain_text(plan3)
    assert "(3 ranks)" in text.splitlines()[0]
    h = row(text, "forward", "%h")
    assert "r0:[64,342] r1:[64,342] r2:[64,340]" in h
    assert "r0:[342,64] r1:[342,64] r2:[340,64]" in row(text, "train_step", "%aT")
    # the call row lists every result per rank
    assert (
        "r0:[64,256] [64,342] [64,342] r1:[64,256] [64,342] [64,342] r2:[64,256] [64,340] [64,340]"
        in row(text, "train_step", "%y,")
    )


def test_uneven_allreduce_bytes(plan3: ExecPlan) -> None:
    # %p local block [64,256] = 16384 elements over k = 3: pieces 5462, 5462, 5460
    m = 64 * 256
    want = tuple(allreduce_bytes(m, 3, pos) for pos in range(3))
    assert want == (87384, 87384, 87376)
    fwd = function_cost(plan3, plan3.function("forward"))
    assert op_cost(fwd, "%y").sent == want
    assert op_cost(fwd, "%y").received == want
    # over dp=1 the dp allreduces move nothing
    entry = function_cost(plan3, plan3.entry_plan)
    assert op_cost(entry, "%loss").sent == (0, 0, 0)
    assert op_cost(entry, "%loss").comm == ()
    assert entry.collectives == (("allreduce", 1),)
    assert entry.sent == want
    # rank 2's smaller blocks give it a smaller peak
    assert entry.peak[0] == entry.peak[1] > entry.peak[2]


def test_uneven_check_memory_names_the_rank(plan3: ExecPlan) -> None:
    cost = function_cost(plan3, plan3.entry_plan)
    peak = [v + k for v, k in zip(cost.peak, cost.retained, strict=True)]
    assert peak[0] > peak[2]
    check_memory(plan3, peak[0])
    with pytest.raises(PlanError, match=r"on rank 0 at "):
        check_memory(plan3, peak[2])


def test_unknown_function_plan(plan4: ExecPlan) -> None:
    with pytest.raises(PlanError, match="@nope"):
        plan4.function("nope")


def test_kept_outputs_bound_the_reuse_cache(plan4: ExecPlan) -> None:
    """Collective outputs of 64 KiB or more are kept (OutputCache), once each."""
    from dtm_mpi.comm.buffers import ALIGN_FROM

    def kept(fp_name: str, rank: int) -> int:
        total = 0
        for p in plan4.function(fp_name).ops:
            if p.kind is OpKind.REDIST and p.redist is not None:
                for s in p.redist.steps:
                    n = local_bytes(s.out_type, plan4.mesh, rank)
                    if s.kind.is_collective and n >= ALIGN_FROM:
                        total += n
            elif p.kind is OpKind.CALL:
                total += kept(str(p.op.attr("callee")), rank)
        return total

    cost = function_cost(plan4, plan4.entry_plan)
    assert cost.retained == tuple(kept(plan4.entry, r) for r in range(plan4.mesh.size))
    assert all(k > 0 for k in cost.retained)  # the tp_mlp allreduces are 256 KiB each
    assert "+ kept outputs:" in explain_text(plan4)


def test_gathers_of_parameters_stored_sharded_are_not_kept() -> None:
    """ZeRO-3 (`shard_params="dp"`): the allgather of a stored parameter is freed after its
    uses, so neither the MPI path (`Comm.transient`) nor the planner keeps it; the other
    collectives' outputs still are."""
    from dtm_mpi.bench.train_models import MODELS
    from dtm_mpi.comm.buffers import ALIGN_FROM

    step = MODELS["mlp"].build(None, "dp")
    plan = compile_plan(step.module, mesh_for(step.module, 2, {"dp": 2, "tp": 1}))
    fp = plan.entry_plan
    state = {q.name for q in fp.function.params if q.state}
    gathered, other = 0, 0
    for p in fp.ops:
        if p.kind is OpKind.REDIST and p.redist is not None:
            n = sum(
                local_bytes(s.out_type, plan.mesh, 0)
                for s in p.redist.steps
                if s.kind.is_collective and local_bytes(s.out_type, plan.mesh, 0) >= ALIGN_FROM
            )
            if p.op.operands[0] in state:
                gathered += n
            else:
                other += n
    assert gathered >= 2 * 1024 * 4096 * 4  # both weights gathered whole, at least once
    assert function_cost(plan, fp).retained[0] == other


@pytest.mark.parametrize(("nranks", "binding"), [(3, {"dp": 3, "tp": 1}), (6, {"dp": 3, "tp": 2})])
def test_the_figures_of_every_rank_at_once_equal_each_ranks_own(
    nranks: int, binding: dict[str, int]
) -> None:
    # dp=3 splits the 64 rows unevenly (22, 22, 20): the costing of all ranks at once (one
    # array per tensor type) gives each rank what local_shape and the redistribution give it
    plan = plan_for(nranks, binding)
    for _, fp in plan.functions:
        cost = function_cost(plan, fp)
        for c in cost.ops:
            for r in range(nranks):
                want = tuple(
                    local_shape(t.shape, t.layout, plan.mesh, r) for t in c.plan_op.op.result_types
                )
                assert c.local_shapes[r] == want, (c.plan_op.op.results, r)
                if c.plan_op.redist is not None:
                    assert c.sent[r] == c.plan_op.redist.bytes_sent(r)
                    assert c.received[r] == c.plan_op.redist.bytes_received(r)
    entry = function_cost(plan, plan.entry_plan)
    qs = plan.entry_plan.function.params
    params = [sum(local_bytes(q.type, plan.mesh, r) for q in qs) for r in range(nranks)]
    assert all(peak >= held for peak, held in zip(entry.peak, params, strict=True))
    assert len(set(entry.peak)) > 1  # the uneven split shows


TWICE = """dtm 1.0
module twice
mesh @m = [tp=2]
entry func @f(%x: f32[8,6]{-,tp} init normal(seed=1, std=1.0)) -> (f32[8,6], f32[8,6]) on @m {
  %y = neg %x : f32[8,6]{-,tp}
  %a = allgather %y on tp : f32[8,6]
  %b = allgather %y on tp : f32[8,6]
  %c = allgather %x on tp : f32[8,6]
  %d = allgather %x on tp : f32[8,6]
  %s = add %a, %c : f32[8,6]
  %t = add %b, %d : f32[8,6]
  return %s, %t
}
"""


def test_explain_lists_a_value_moved_to_one_layout_twice() -> None:
    module = parse_module(TWICE, "twice.dtm")
    verify_module(module)
    text = explain_text(compile_plan(module, mesh_for(module, 2, None)))
    assert "values moved to one layout more than once" in text
    (line,) = [ln for ln in text.splitlines() if "times (ops" in ln]
    # the intermediate %y, not the parameter %x (gathering one again is FSDP's choice)
    assert line.startswith(
        "  @f: %y moved to f32[8,6] 2 times (ops 2, 3; the second at twice.dtm:7:"
    )
