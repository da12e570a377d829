"""Quantized allreduce (dtm_mpi/comm/quantized.py) on simulated ranks: every element within
the stated bound of the exact sum at 2, 3 and 4 ranks; error feedback makes the mean over steps
converge to the exact sum; small, integer and non-sum allreduces pass through exactly; the
bytes sent are about a quarter of float32's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm_mpi.comm.quantized import MIN_COUNT, QuantizedComm, error_bound, quantized_bytes
from dtm_mpi.comm.sim import SimComm, run_ranks
from dtm_mpi.cpu_cache import CHUNK_ELEMS
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import allreduce_spec


def _inputs(p: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.01, 100, p)  # members of very different magnitudes
    return [(rng.standard_normal(n) * scale[r]).astype(np.float32) for r in range(p)]


def _run(xs: list[np.ndarray], block: int, steps: int = 1) -> list[list[np.ndarray]]:
    p = len(xs)
    mesh = MeshShape((("dp", p),))

    def body(comm: SimComm) -> list[np.ndarray]:
        q = QuantizedComm(comm, block)
        spec = allreduce_spec(mesh, comm.rank, ("dp",), ReduceOp.SUM, xs[0].size)
        out = []
        for _ in range(steps):
            q.begin_step()
            out.append(q.allreduce(xs[comm.rank].copy(), ("dp",), spec))
        return out

    return run_ranks(mesh, body, timeout_s=30)


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(2, 4),
    n=st.integers(MIN_COUNT, 5000),
    block=st.sampled_from([8, 32, 64]),
    seed=st.integers(0, 10**6),
)
def test_every_element_is_within_the_bound(p: int, n: int, block: int, seed: int) -> None:
    xs = _inputs(p, n, seed)
    got = _run(xs, block)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    bound = error_bound(xs, block) + 1e-30
    for r in range(p):
        (out,) = got[r]
        assert out.dtype == np.float32 and out.shape == xs[0].shape
        assert np.array_equal(out, got[0][0])  # the same bits on every member
        err = np.abs(out.astype(np.float64) - exact)
        assert np.all(err <= bound), float(np.max(err / bound))
    assert np.max(np.abs(got[0][0] - exact)) > 0  # it is quantized (not the exact path)


def test_error_feedback_makes_the_mean_converge() -> None:
    xs = _inputs(3, 4096, 7)
    steps = 40
    got = _run(xs, 64, steps)[0]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    first = np.max(np.abs(got[0] - exact))
    assert np.all(np.abs(got[0] - exact) <= error_bound(xs, 64))
    mean = np.mean([g.astype(np.float64) for g in got], axis=0)
    assert np.max(np.abs(mean - exact)) < first / 8  # without feedback the mean keeps the bias


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunks_zero_blocks_and_tiny_values_stay_within_the_bound(dtype: type) -> None:
    """Arrays of several cache-sized chunks (the quantization works chunk by chunk), an
    all-zero block (scale 1, exactly zero) and, in binary64, a block too small for a float32
    scale (no infinity, no stray int8): every element within the bound, the same bits
    everywhere, and float64 arrays computed in float64."""
    n = 2 * CHUNK_ELEMS + 4 * 64 + 5
    xs = [x.astype(dtype) for x in _inputs(2, n, 11)]
    for x in xs:
        x[64:128] = 0
        if dtype is np.float64:
            x[128:192] = 1e-300
    got = _run(xs, 64)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    bound = error_bound(xs, 64) + 1e-30
    for (out,) in got:
        assert out.dtype == dtype and np.array_equal(out, got[0][0])
        assert np.all(np.abs(out.astype(np.float64) - exact) <= bound)
    assert np.all(got[0][0][64:128] == 0)
    if dtype is np.float64:
        assert np.all(np.abs(got[0][0][128:192]) <= 4e-300)


def test_subnormal_blocks_keep_their_signs_within_half_a_step() -> None:
    """Blocks so small that their float32 scale is subnormal (coarse: rounded down, it would
    put values past 127 and wrap the int8 to the other sign): the scale goes one step up, so
    every element keeps its sign and stays within half a step of its value."""
    from dtm_mpi.comm.quantized import _dequantize_row, _quantize_rows, _row_bytes

    tiny = float(np.float32(2.0**-149))
    for dtype in (np.float32, np.float64):
        x = np.zeros((1, 4 * 64), dtype)
        for b, m in enumerate((189, 5000, 16000, 3)):
            x[0, 64 * b : 64 * b + 64] = np.linspace(-m, m, 64) * tiny
        rows = np.empty((1, _row_bytes(x.shape[1], 64)), np.uint8)
        dropped = np.empty_like(x)
        _quantize_rows(x, 64, rows, dropped)
        out = np.empty(x.shape[1], dtype)
        _dequantize_row(rows[0], x.shape[1], 64, out)
        scales = np.repeat(rows[0, x.shape[1] :].view(np.float32).astype(np.float64), 64)
        assert np.all(np.sign(out) * np.sign(x[0]) >= 0)  # no sign flipped
        assert np.all(np.abs(out - x[0]) <= scales / 2)
        np.testing.assert_array_equal(dropped[0], x[0] - out)  # what the rounding dropped


def test_a_nan_block_comes_out_nan_and_leaves_no_residual() -> None:
    """A NaN or an infinity in a block makes that block NaN (and only it); nothing of it is
    carried over: the next step, with finite inputs, is finite and within the bound."""
    p, n = 2, 4096
    xs = _inputs(p, n, 5)
    bad = [x.copy() for x in xs]
    bad[0][70] = np.nan
    bad[1][200] = np.inf
    mesh = MeshShape((("dp", p),))

    def body(comm: SimComm) -> list[np.ndarray]:
        q = QuantizedComm(comm, 64)
        spec = allreduce_spec(mesh, comm.rank, ("dp",), ReduceOp.SUM, n)
        q.begin_step()
        first = q.allreduce(bad[comm.rank].copy(), ("dp",), spec)
        q.begin_step()
        return [first, q.allreduce(xs[comm.rank].copy(), ("dp",), spec)]

    (first, second), _ = run_ranks(mesh, body, timeout_s=30)
    nan = np.zeros(n, bool)
    nan[64:128] = nan[192:256] = True
    assert np.all(np.isnan(first[nan])) and np.all(np.isfinite(first[~nan]))
    assert np.all(np.isfinite(second))
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    # the finite blocks' residuals are carried (within twice the bound), the bad ones' not
    assert np.all(np.abs(second - exact) <= 2 * error_bound(xs, 64) + 1e-30)


def test_small_integer_and_max_allreduces_pass_through_exactly() -> None:
    mesh = MeshShape((("dp", 2),))

    def body(comm: SimComm) -> list[np.ndarray]:
        q = QuantizedComm(comm, 32)
        small = np.full(MIN_COUNT - 1, 0.1 * (comm.rank + 1), np.float32)
        ints = np.arange(4096, dtype=np.int64) * (comm.rank + 1)
        big = np.linspace(-1, 1, 4096).astype(np.float32) * (comm.rank + 1)
        spec = lambda n, op: allreduce_spec(mesh, comm.rank, ("dp",), op, n)  # noqa: E731
        return [
            q.allreduce(small, ("dp",), spec(small.size, ReduceOp.SUM)),
            q.allreduce(ints, ("dp",), spec(ints.size, ReduceOp.SUM)),
            q.allreduce(big, ("dp",), spec(big.size, ReduceOp.MAX)),
        ]

    small, ints, biggest = run_ranks(mesh, body)[0]
    np.testing.assert_array_equal(small, np.full(MIN_COUNT - 1, np.float32(0.1) + np.float32(0.2)))
    np.testing.assert_array_equal(ints, np.arange(4096) * 3)
    line = np.linspace(-1, 1, 4096).astype(np.float32)
    np.testing.assert_array_equal(biggest, np.maximum(line, line * 2))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_quarter_of_the_bytes(p: int) -> None:
    n = 1 << 18  # 1 MiB of float32
    sent = quantized_bytes(n, p, 64)
    ring = 2 * (p - 1) * n * 4 // p  # a float32 allreduce moves 2 (p - 1) / p of the array
    assert 0.25 < sent / ring < 0.27


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_quantized_allgather_keeps_every_element_within_half_a_step(p: int) -> None:
    from dtm_mpi.ir.ops.quant import quantize_values
    from dtm_mpi.sharding.steps import AllgatherSpec

    mesh = MeshShape((("dp", p),))
    rng = np.random.default_rng(p)
    extents = tuple(int(e) for e in rng.integers(40, 90, p))  # uneven blocks along dim 0
    blocks = [
        (rng.standard_normal((e, 24)) * 10.0**r).astype(np.float32) for r, e in enumerate(extents)
    ]

    def body(comm: SimComm) -> np.ndarray:
        spec = AllgatherSpec(tuple(range(p)), comm.rank, 0, extents, tuple(e * 24 for e in extents))
        return QuantizedComm(comm, 16).allgather(blocks[comm.rank], ("dp",), spec)

    outs = run_ranks(mesh, body)
    want = np.concatenate(blocks, axis=0)
    for out in outs:
        assert out.shape == want.shape and np.array_equal(out, outs[0])
    at = 0
    for blk in blocks:
        flat = blk.reshape(-1).astype(np.float64)
        n = -(-flat.size // 16) * 16
        padded = np.zeros(n)
        padded[: flat.size] = flat
        _, scale = quantize_values(padded[None, :], 16)
        half = np.repeat(scale[0] / 2, 16)[: flat.size] * (1 + 1e-6) + np.abs(flat) * 2**-22
        got = outs[0][at : at + blk.shape[0]].reshape(-1).astype(np.float64)
        assert np.all(np.abs(got - flat) <= half)
        assert np.any(got != flat)  # quantized, not passed through
        at += blk.shape[0]


def test_a_started_allgather_is_the_quantized_one_or_the_inner_communicators() -> None:
    """``start_allgather`` (a prefetched gather under quantization): a large float gather runs
    quantized at once, as ``allgather`` does (the same values); a small one passes to the
    inner communicator's started gather, exact."""
    from dtm_mpi.comm.interface import Completed
    from dtm_mpi.sharding.steps import AllgatherSpec

    p = 2
    mesh = MeshShape((("dp", p),))
    rng = np.random.default_rng(7)
    big = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(p)]
    small = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(p)]

    def body(comm: SimComm) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q = QuantizedComm(comm, 16)
        group = tuple(range(p))
        spec = AllgatherSpec(group, comm.rank, 0, (64,) * p, (64 * 32,) * p)
        started = q.start_allgather(big[comm.rank], ("dp",), spec)
        assert isinstance(started, Completed)
        direct = q.allgather(big[comm.rank], ("dp",), spec)
        tiny = AllgatherSpec(group, comm.rank, 0, (2,) * p, (6,) * p)
        return started.wait(), direct, q.start_allgather(small[comm.rank], ("dp",), tiny).wait()

    for started, direct, exact in run_ranks(mesh, body):
        assert np.array_equal(started, direct)
        assert not np.array_equal(started, np.concatenate(big))  # quantized
        assert np.array_equal(exact, np.concatenate(small))
