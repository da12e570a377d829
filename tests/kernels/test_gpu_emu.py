"""The CPU emulator the kernel tests run on (tests/kernels/gpu_emu.py) does what it claims:
its __half conversions are IEEE round-to-nearest-even (bit for bit against numpy), warp size
and block reductions follow the programming model at 32 and 64 lanes, and it refuses what a
GPU would silently get wrong: a barrier some thread never reaches, a write outside an array,
an argument whose type is not the kernel's parameter type."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from dtm_mpi.kernels.sources import kernel_dir
from tests.kernels.gpu_emu import EmuCupy, EmuError

HEADER = '#include "cuda_fp16.h"\n'
CONVERT = (
    HEADER
    + """
extern "C" __global__ void to_half(const float* x, __half* y, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) y[i] = __float2half_rn(x[i]);
}
extern "C" __global__ void from_half(const __half* x, float* y, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) y[i] = __half2float(x[i]);
}
"""
)


def _fn(cp: EmuCupy, code: str, name: str) -> Any:
    return cp.RawModule(code=code).get_function(name)


def test_half_to_float_is_exact_for_every_half() -> None:
    cp = EmuCupy(32)
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    y = cp.empty(h.shape, np.float32)
    _fn(cp, CONVERT, "from_half")((64,), (256,), (cp.asarray(h), y, np.int64(h.size)))
    want = h.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(y.get()), nan)
    assert np.array_equal(y.get()[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_float_to_half_rounds_to_nearest_even() -> None:
    cp = EmuCupy(32)
    rng = np.random.default_rng(0)
    edges = [
        0.0,
        -0.0,
        65504.0,
        65519.99,
        65520.0,
        1e6,
        -1e6,
        np.inf,
        -np.inf,
        np.nan,
        2.0**-24,
        2.0**-25,
        1.5 * 2.0**-25,
        2.0**-14,
        2.0**-14 - 2.0**-25,
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        1.0 + 2.0**-11 + 2.0**-23,
        3 * 2.0**-26,
        2.0**-26,
    ]
    mags = np.exp2(rng.uniform(-30, 17, 200_000))
    x = np.concatenate([np.asarray(edges), mags * rng.choice([-1.0, 1.0], mags.size)]).astype(
        np.float32
    )
    # exact ties: halfway between two normal halves (low 13 float bits 0x1000), and halfway
    # between two subnormal halves ((k + 1/2) * 2^-24)
    ties = (np.arange(0x38800000, 0x38900000, 0x2000, dtype=np.uint32) | 0x1000).view(np.float32)
    sub_ties = ((np.arange(1024) + 0.5) * 2.0**-24).astype(np.float32)
    x = np.concatenate([x, ties, -ties, sub_ties, -sub_ties])
    y = cp.empty(x.shape, np.float16)
    _fn(cp, CONVERT, "to_half")((128,), (256,), (cp.asarray(x), y, np.int64(x.size)))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(y.get()), nan)
    assert np.array_equal(y.get()[~nan].view(np.uint16), want[~nan].view(np.uint16))


REDUCE = (
    (kernel_dir() / "dtm_common.cuh").read_text(encoding="utf-8")
    + """
extern "C" __global__ void block_sum(const double* x, double* out, int* warp, long long n) {
  double s = 0;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = dtm_block_reduce(s, DtmSumOp(), 0.0);
  s = dtm_block_reduce(s * 2.0, DtmSumOp(), 0.0);  // back to back: the scratch is reused
  if (threadIdx.x == 0) { out[blockIdx.x] = s; *warp = warpSize; }
}
"""
)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    ("warp", "block"), [(32, 64), (32, 96), (32, 1024), (64, 64), (64, 192), (64, 1024)]
)
def test_block_reduction_at_every_warp_size_and_warp_count(
    warp: int, block: int, reverse: bool
) -> None:
    """96 threads are 3 warps at 32 lanes, 192 are 3 at 64: the reduction handles counts that
    are not powers of two; 1024 threads the most a block has; in either thread order."""
    cp = EmuCupy(warp, reverse=reverse)
    x = np.arange(1, 1001, dtype=np.float64)
    out, got_warp = cp.full((3,), np.nan, np.float64), cp.full((1,), 0, np.int32)
    _fn(cp, REDUCE, "block_sum")((3,), (block,), (cp.asarray(x), out, got_warp, np.int64(x.size)))
    assert got_warp.get()[0] == warp
    total = x.sum()
    assert np.array_equal(out.get(), [total * block * 2.0] * 3)


def test_a_shuffle_into_a_missing_lane_is_an_error() -> None:
    """96 threads at 64 lanes leave a partial warp: its lanes 32..63 do not exist, and the
    kernels' contract (blockDim a multiple of warpSize) rules it out."""
    cp = EmuCupy(64)
    out, w = cp.full((1,), np.nan, np.float64), cp.full((1,), 0, np.int32)
    x = cp.asarray(np.ones(10))
    with pytest.raises(
        EmuError,
        match=r"thread \d+ reads lane \d+ of a partial warp \(blockDim 96 is not a multiple of warpSize 64\)",
    ):
        _fn(cp, REDUCE, "block_sum")((1,), (96,), (x, out, w, np.int64(10)))


SHUFFLE = (
    HEADER
    + """
extern "C" __global__ void shfl(const int* masks, float* y, int nmasks) {
  for (int k = 0; k < nmasks; ++k)
    y[k * blockDim.x + threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, masks[k]);
}
extern "C" __global__ void racy(float* y) {
  __shared__ float s[64];
  s[threadIdx.x] = (float)threadIdx.x + 1.0f;
  y[threadIdx.x] = s[(threadIdx.x + 1) % 64];  // no __syncthreads between the write and the read
}
"""
)


@pytest.mark.parametrize("warp", [32, 64])
def test_shuffle_exchanges_with_lane_xor_mask(warp: int) -> None:
    cp = EmuCupy(warp)
    masks = np.array([1, 2, 5, 16, 31, warp - 1, warp, warp + 3], dtype=np.int32)
    y = cp.full((len(masks), 128), np.nan, np.float32)
    _fn(cp, SHUFFLE, "shfl")((1,), (128,), (cp.asarray(masks), y, np.int32(len(masks))))
    t = np.arange(128)
    lane, base = t % warp, t - t % warp
    for k, m in enumerate(masks):
        src = lane ^ m
        want = np.where(src < warp, base + src, t)  # beyond the warp: a lane keeps its own value
        assert np.array_equal(y.get()[k], want), (warp, m)


def test_thread_order_exposes_a_missing_barrier() -> None:
    """Reading a neighbour's write with no barrier between: the answer depends on the order the
    threads run in, so the two orders differ (the kernel tests run both)."""
    got = []
    for reverse in (False, True):
        cp = EmuCupy(32, reverse=reverse)
        y = cp.full((64,), np.nan, np.float32)
        _fn(cp, SHUFFLE, "racy")((1,), (64,), (y,))
        got.append(y.get())
    assert not np.array_equal(got[0], got[1])


def test_launches_from_several_threads_stay_apart() -> None:
    """The simulator's ranks launch from their own threads: shared memory and the emulator's
    state are per thread, so concurrent block reductions all get their own sums."""
    results: dict[int, np.ndarray] = {}
    start = threading.Barrier(4)

    def worker(i: int) -> None:
        cp = EmuCupy(32 if i % 2 else 64)
        x = cp.asarray(np.arange(1, 1001, dtype=np.float64) * (i + 1))
        out, w = cp.full((4,), np.nan, np.float64), cp.full((1,), 0, np.int32)
        fn = _fn(cp, REDUCE, "block_sum")
        start.wait()
        for _ in range(5):
            fn((4,), (256,), (x, out, w, np.int64(1000)))
        results[i] = out.get()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    for i in range(4):
        assert np.array_equal(results[i], [500500.0 * (i + 1) * 256 * 2] * 4), i


BROKEN = (
    HEADER
    + """
extern "C" __global__ void early_exit(float* y) {
  if (threadIdx.x == 5) return;  // thread 5 never reaches the barrier
  __syncthreads();
  y[threadIdx.x] = 1.0f;
}
extern "C" __global__ void split_barriers(float* y) {
  if (threadIdx.x < 32) __syncthreads(); else { __syncthreads(); __syncthreads(); }
  y[threadIdx.x] = 1.0f;
}
extern "C" __global__ void divergent(float* y) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  y[threadIdx.x] = 1.0f;
}
extern "C" __global__ void partial_shuffle(float* y) {
  float v = (float)threadIdx.x;
  if (threadIdx.x % warpSize != 3) v = __shfl_xor_sync(0xffffffffu, v, 1);
  y[threadIdx.x] = v;
}
extern "C" __global__ void off_by_one(float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i <= n) y[i] = 2.0f;  // writes y[n]
}
extern "C" __global__ void takes_long(float* y, long long n) { if (threadIdx.x < n) y[threadIdx.x] = 0; }
"""
)


DEADLOCKS = {
    "early_exit": r"deadlock in block 0 of 2 .*63 thread\(s\) wait at __syncthreads.*1 exited \(first: thread 5\)",
    "split_barriers": r"deadlock in block 0 .*32 thread\(s\) wait at __syncthreads.*32 exited",
    "divergent": r"divergent __syncthreads in block 0: thread 32 at line \d+, other threads of the same barrier at line \d+",
    "partial_shuffle": r"deadlock in block 0 .*at a warp shuffle \(first: thread 0\).*exited \(first: thread 3\)",
}


@pytest.mark.parametrize(("name", "match"), DEADLOCKS.items(), ids=list(DEADLOCKS))
def test_a_barrier_not_every_thread_reaches_is_an_error(name: str, match: str) -> None:
    cp = EmuCupy(32)
    y = cp.empty((64,), np.float32)
    with pytest.raises(EmuError, match=match):
        _fn(cp, BROKEN, name)((2,), (64,), (y,))


def test_a_write_past_the_end_is_an_error() -> None:
    cp = EmuCupy(32)
    y = cp.full((100,), 0.0, np.float32)
    with pytest.raises(EmuError, match=r"off_by_one: wrote outside argument 0 \(float32\[100\]\)"):
        _fn(cp, BROKEN, "off_by_one")((1,), (128,), (y, np.int64(100)))
    ok = cp.full((100,), 0.0, np.float32)
    _fn(cp, BROKEN, "off_by_one")((1,), (128,), (ok, np.int64(99)))  # in bounds: no complaint
    assert (ok.get() == 2.0).all()


def test_arguments_must_have_the_kernels_types() -> None:
    cp = EmuCupy(32)
    fn = _fn(cp, BROKEN, "takes_long")
    assert fn.params == ["pf4", "i8"]
    y = cp.empty((8,), np.float32)
    with pytest.raises(EmuError, match=r"argument 1: the kernel takes i8; got i4"):
        fn((1,), (32,), (y, np.int32(8)))
    with pytest.raises(
        EmuError, match=r"argument 0: the kernel takes a f4 pointer; got a float16 array"
    ):
        fn((1,), (32,), (cp.empty((8,), np.float16), np.int64(8)))
    with pytest.raises(EmuError, match=r"takes_long takes 2 arguments"):
        fn((1,), (32,), (y,))
    with pytest.raises(EmuError, match=r"argument 0 must be a device array \(pf4\); got ndarray"):
        fn((1,), (32,), (np.zeros(8, np.float32), np.int64(8)))
    fn((1,), (32,), (y, 8))  # a Python int goes as int64, as CuPy passes it
    assert (y.get() == 0).all()


def test_launch_shape_limits() -> None:
    cp = EmuCupy(64)
    fn = _fn(cp, BROKEN, "takes_long")
    with pytest.raises(EmuError, match=r"blockDim 2048 not in 1..1024"):
        fn((1,), (2048,), (cp.empty((8,), np.float32), np.int64(8)))
    with pytest.raises(EmuError, match=r"only 1-d grids"):
        fn((1, 2), (32,), (cp.empty((8,), np.float32), np.int64(8)))


@pytest.mark.parametrize("hip", [False, True])
def test_the_hip_build_takes_the_sources_hip_branch(hip: bool) -> None:
    code = (
        REDUCE
        + """
extern "C" __global__ void branch(int* out) {
#ifdef DTM_HIP
  *out = 1;
#else
  *out = 0;
#endif
}
"""
    )
    cp = EmuCupy(64, hip=hip)
    out = cp.full((1,), -1, np.int32)
    _fn(cp, code, "branch")((1,), (64,), (out,))
    assert out.get()[0] == int(hip)
    x, sums, warp = (
        np.arange(1, 101, dtype=np.float64),
        cp.full((2,), np.nan),
        cp.full((1,), 0, np.int32),
    )
    _fn(cp, code, "block_sum")((2,), (128,), (cp.asarray(x), sums, warp, np.int64(x.size)))
    assert np.array_equal(sums.get(), [x.sum() * 128 * 2] * 2)
