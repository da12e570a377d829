"""One interpreter: every executor feature in every combination -- overlapped allreduces with
deterministic mode and with a GPU backend's fused chains, deterministic mode with fused chains
(the GPU's and the CPU's chunks), injected faults with all of them -- run by the same loop."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from dtm_mpi.config import get_config
from dtm_mpi.errors import DtmError
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.kernels.backends import BackendKind
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime import chunked, executor
from dtm_mpi.runtime.simulate import RunResult, run_simulated
from tests.kernels.test_cuda_backend_on_host import HostCuda, launchers_on_host
from tests.runtime.test_sim_examples import load


def _set(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_config.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_config() -> Iterator[None]:
    get_config.cache_clear()
    yield
    get_config.cache_clear()


@pytest.fixture
def gpu_on_host(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The cuda backend's kernel table on host arrays, its launchers numpy twins; returns the
    launchers called."""
    return launchers_on_host(monkeypatch)


def _bits(got: RunResult, want: RunResult) -> None:
    a, b = got.outputs(), want.outputs()
    assert a.keys() == b.keys()
    for k, v in b.items():
        assert a[k].tobytes() == v.tobytes(), f"{k} differs"


def _allreduces(result: RunResult) -> int:
    return result.stats[0].calls["allreduce"]


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_deterministic_mode_overlaps_its_buckets_with_the_same_bits(
    nranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load("dp_step")
    plan = compile_plan(module, mesh_for(module, nranks, None))
    _set(monkeypatch, DTM_OVERLAP="0")
    apart = run_simulated(module, nranks, steps=2, deterministic=True)
    _set(monkeypatch, DTM_OVERLAP="1", DTM_BUCKET_BYTES=str(1 << 20))
    plan = compile_plan(module, mesh_for(module, nranks, None))
    (bucket,) = plan.entry_plan.buckets
    assert len(bucket.members) == 2  # two gradients in one message
    got = run_simulated(module, nranks, steps=2, deterministic=True)
    assert _allreduces(got) == _allreduces(apart) - 2  # one message fewer each step
    _bits(got, apart)
    _bits(got, run_simulated(module, 1, steps=2, deterministic=True))


@pytest.mark.parametrize("name", ["tp_mlp", "dp_step"])
def test_a_gpu_backends_fused_chains_run_with_overlapped_buckets(
    name: str, gpu_on_host: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load(name)
    binding = {"dp": 2, "tp": 2} if name == "tp_mlp" else None
    _set(monkeypatch, DTM_OVERLAP="1", DTM_BUCKET_BYTES=str(1 << 20))
    assert compile_plan(module, mesh_for(module, 4, binding)).entry_plan.buckets
    want = run_simulated(module, 4, binding=binding, steps=2)
    got = run_simulated(module, 4, binding=binding, steps=2, backend=HostCuda(BackendKind.CUDA))
    assert _allreduces(got) == _allreduces(want)  # the buckets, one message each
    for k, v in want.outputs().items():
        np.testing.assert_allclose(got.outputs()[k], v, rtol=2e-5, atol=1e-6, err_msg=k)
    if name == "tp_mlp":
        assert "fused" in gpu_on_host


def test_deterministic_mode_with_a_gpu_backends_fused_chains_gives_every_mesh_the_same_bits(
    gpu_on_host: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load("tp_mlp")
    _set(monkeypatch, DTM_OVERLAP="1", DTM_BUCKET_BYTES=str(1 << 20))
    runs = [
        run_simulated(
            module, n, binding=b, steps=2, deterministic=True, backend=HostCuda(BackendKind.CUDA)
        )
        for n, b in [(1, None), (2, {"dp": 1, "tp": 2}), (4, {"dp": 2, "tp": 2})]
    ]
    assert "fused" in gpu_on_host
    for got in runs[1:]:
        _bits(got, runs[0])


CHAIN = """dtm 1.0
module chain
mesh @m = [dp=2]
entry func @f(%a: f32[1600,200], %b: f32[200], %w: f32[1600,200]{dp,-}) -> (f32[1600,200], f32[200]) on @m {
  %bb = broadcast_to %b : f32[1600,200]
  %x = add %a, %bb : f32[1600,200]
  %y = tanh %x : f32[1600,200]
  %z = mul %y, %x : f32[1600,200]
  %r = sub %z, %a : f32[1600,200]
  %g = sum %w dims [0] : f32[200] partial(sum: dp)
  %h = mul %g, %b : f32[200] partial(sum: dp)
  %s = allreduce sum %h on dp : f32[200]
  return %r, %s
}
"""


def test_deterministic_mode_runs_cpu_chains_in_chunks_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = parse_module(CHAIN, "chain.dtm")
    verify_module(module)
    rng = np.random.default_rng(5)
    inputs = {
        "a": rng.standard_normal((1600, 200)).astype(np.float32),
        "b": rng.standard_normal(200).astype(np.float32),
        "w": rng.standard_normal((1600, 200)).astype(np.float32),
    }
    ran: list[int] = []
    real = chunked.run_chunked

    def counted(plan: chunked.Chunked, xs: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        ran.append(len(plan.steps))
        return real(plan, xs)

    monkeypatch.setattr(executor, "run_chunked", counted)
    _set(monkeypatch, DTM_FUSE="0")
    apart = run_simulated(module, 2, binding={"dp": 2}, inputs=inputs, deterministic=True)
    assert not ran
    _set(monkeypatch, DTM_FUSE="1")
    got = run_simulated(module, 2, binding={"dp": 2}, inputs=inputs, deterministic=True)
    assert sum(ran) == 2 * 5  # on each rank: the bias+add and tanh, mul, sub chains, in chunks
    _bits(got, apart)
    _bits(got, run_simulated(module, 1, binding={"dp": 1}, inputs=inputs, deterministic=True))


@pytest.mark.parametrize("mode", ["plain", "deterministic", "gpu-fused"])
def test_an_injected_fault_at_an_overlapped_allreduce_is_named_in_every_mode(
    mode: str, gpu_on_host: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load("dp_step")
    _set(monkeypatch, DTM_OVERLAP="1", DTM_BUCKET_BYTES=str(1 << 20), DTM_FAULT="1:allreduce:raise")
    assert compile_plan(module, mesh_for(module, 3, None)).entry_plan.buckets
    backend = HostCuda(BackendKind.CUDA) if mode == "gpu-fused" else "numpy"
    with pytest.raises(
        DtmError, match=r"injected failure \(DTM_FAULT=1:allreduce:raise\) on rank 1 at allreduce"
    ) as got:
        run_simulated(module, 3, steps=2, deterministic=mode == "deterministic", backend=backend)
    assert "dp_step.dtm:" in f"{got.value} {getattr(got.value, 'phase', '')}"
