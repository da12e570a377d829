"""Overlapped allreduces (``DTM_OVERLAP=1``): buckets planned alike on every rank
(:mod:`dtm_mpi.plan.overlap`), run by the executor's one loop; the examples give the
reference's values with exactly the collectives the plan counts (one per bucket), and
deterministic mode overlaps them too, with the same bits as on one rank."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from dtm_mpi.config import get_config
from dtm_mpi.runtime.simulate import run_simulated
from tests.runtime.test_sim_examples import NAMES, assert_matches, load


@pytest.fixture
def overlap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("DTM_OVERLAP", "1")
    monkeypatch.setenv("DTM_BUCKET_BYTES", str(1 << 20))
    get_config.cache_clear()
    yield
    monkeypatch.delenv("DTM_OVERLAP")
    monkeypatch.delenv("DTM_BUCKET_BYTES")
    get_config.cache_clear()


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "pipeline"])
def test_examples_with_overlapped_buckets_match_the_reference(
    overlap: None, name: str, nranks: int
) -> None:
    assert_matches(load(name), nranks, None)


def test_deterministic_mode_with_buckets_keeps_its_bits(overlap: None) -> None:
    module = load("tp_mlp")
    got = run_simulated(
        module, 4, binding={"dp": 2, "tp": 2}, steps=2, deterministic=True
    ).outputs()
    one = run_simulated(module, 1, steps=2, deterministic=True).outputs()
    for k, v in one.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


CHAINED = """dtm 1.0
module chained
mesh @m = [dp=2, tp=2]
entry func @f(%a: f32[4,4]{dp,tp}, %w: f32[8]) -> (f32[], f32[8]) on @m {
  %s = sum %a dims [0, 1] : f32[] partial(sum: dp,tp)
  %b = allreduce sum %s on dp : f32[] partial(sum: tp)
  %p = mul %w, %w : f32[8]
  %d = allreduce sum %b on tp : f32[]
  %q = mul %p, %w : f32[8]
  %g = add %d, %d : f32[]
  return %g, %q
}
"""

BF16 = """dtm 1.0
module halves
mesh @m = [dp=2]
entry func @f(%a: bf16[4,8]{dp,-}, %w: bf16[8]) -> (bf16[8], bf16[8]) on @m {
  %s = sum %a dims [0] : bf16[8] partial(sum: dp)
  %b = allreduce sum %s on dp : bf16[8]
  %p = mul %w, %w : bf16[8]
  %q = mul %p, %w : bf16[8]
  %c = add %b, %q : bf16[8]
  return %c, %b
}
"""


@pytest.mark.parametrize("text", [CHAINED, BF16], ids=["allreduce-of-a-bucket-result", "bf16"])
def test_chained_and_bf16_allreduces_with_overlap_equal_the_run_without(
    text: str, overlap: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtm_mpi.ir import parse_module, verify_module
    from dtm_mpi.ir.dtypes import round_bf16

    module = parse_module(text, "case.dtm")
    verify_module(module)
    rng = np.random.default_rng(2)
    inputs = {
        "a": rng.standard_normal((4, 4) if text is CHAINED else (4, 8)).astype(np.float32),
        "w": rng.standard_normal(8).astype(np.float32),
    }
    if text is BF16:
        inputs = {k: round_bf16(v) for k, v in inputs.items()}
    sizes = dict(module.meshes[0].axes)
    n = int(np.prod(list(sizes.values())))
    got = run_simulated(module, n, binding=sizes, inputs=inputs, steps=1).outputs()
    monkeypatch.setenv("DTM_OVERLAP", "0")
    get_config.cache_clear()
    want = run_simulated(module, n, binding=sizes, inputs=inputs, steps=1).outputs()
    for k, v in want.items():
        assert np.array_equal(got[k], v), k
        if text is BF16:
            assert np.array_equal(got[k], round_bf16(got[k])), f"{k} is not bf16"


@pytest.mark.parametrize(
    ("ranks", "binding"),
    [(2, {"dp": 2, "tp": 1}), (3, {"dp": 3, "tp": 1}), (4, {"dp": 2, "tp": 2})],
)
def test_prefetched_gathers_of_sharded_parameters_keep_the_unsharded_bits(
    overlap: None, ranks: int, binding: dict[str, int]
) -> None:
    """ZeRO-3 with its gathers prefetched one ahead (plan.overlap.prefetch_gathers) trains
    to the bits of the unsharded step without overlap (deterministic mode)."""
    from dtm_mpi.plan.program import compile_plan, mesh_for
    from dtm_mpi.sharding.steps import StepKind
    from tests.frontend.test_optim import digits_params_sharded, same_params, trained

    sharded = digits_params_sharded("dp").module
    got = trained(sharded, ranks, binding)
    plan = compile_plan(sharded, mesh_for(sharded, ranks, binding))
    assert any(b.kind is StepKind.ALLGATHER for b in plan.entry_plan.buckets)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("DTM_OVERLAP", "0")
        get_config.cache_clear()
        want = trained(digits_params_sharded(None).module, ranks, binding)
    get_config.cache_clear()
    same_params(got, want)


def test_prefetched_gathers_of_stored_parameters_are_not_kept_by_the_communicator() -> None:
    """A prefetched gather is skipped where it stands (its bucket runs it), so the executor
    tells the communicator its outputs are transient when it builds the program: a path that
    keeps collective outputs for reuse (the MPI path's staged device gathers) would otherwise
    hold every parameter whole between steps."""
    from dtm_mpi.comm.sim import SimComm, SimWorld
    from dtm_mpi.plan.program import compile_plan, mesh_for
    from dtm_mpi.runtime.executor import Executor
    from dtm_mpi.sharding.steps import StepKind
    from tests.frontend.test_optim import digits_params_sharded

    module = digits_params_sharded("dp").module
    mesh = mesh_for(module, 2, {"dp": 2, "tp": 1})
    plan = compile_plan(module, mesh, bucket_bytes=1 << 20)
    fp = plan.entry_plan
    fetched = [b.members[0] for b in fp.buckets if b.kind is StepKind.ALLGATHER]
    assert fetched

    class Recording(SimComm):
        marked: list[object]

        def transient(self, spec: object) -> None:
            self.marked.append(spec)

    comm = Recording(SimWorld(mesh, 10.0), 0)
    comm.marked = []
    executor = Executor(plan, comm)
    executor._program(fp)
    marked = {id(s) for s in comm.marked}
    for m in fetched:
        assert all(id(s) in marked for s in executor._specs(fp.ops[m])), fp.ops[m].op.results
