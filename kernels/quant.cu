#include "dtm_common.cuh"
// quant.cu: int8 block quantisation of a flat array cut into consecutive blocks of `block`
// elements (n = nblocks * block), and the inverse.
//
//   dtm_quantize_<t>(const T* x, signed char* q, float* scales, long long nblocks, int block)
//       per quant block b: amax = max |x| (in double, NaN-propagating);
//       scale = amax > 0 ? amax / 127.0 : 1.0 (double; a block holding NaN gets 1.0);
//       q[i] = clamp(rint((double)x[i] / scale), -127, 127), NaN -> 0; scales[b] = (float)scale.
//       All math in double for every dtype, so q and scales match a float64 numpy reference
//       bit for bit (rint rounds half to even, like numpy.rint).
//   dtm_dequantize_<t>(const signed char* q, const float* scales, T* y, long long n, int block)
//       y[i] = (T)((double)q[i] * (double)scales[i / block]) (the product is exact in double;
//       one rounding to T).                                                     t: f16 f32 f64
//
// Launch: dtm_quantize_*: one warp per quant block, warps per thread block = blockDim.x /
// warpSize, grid-stride over quant blocks (any gridDim.x); blockDim.x a multiple of warpSize,
// at most 1024; no shared memory (warp-shuffle max). dtm_dequantize_*: elementwise grid-stride.
// block <= 0 writes nothing.

template <class T>
__device__ void dtm_quantize_blocks(const T* x, signed char* q, float* scales, long long nblocks,
                                    int block) {
  const long long ws = (long long)warpSize;
  const long long lane = (long long)threadIdx.x % ws;
  const long long warps_per_block = (long long)blockDim.x / ws;
  const long long warp = (long long)threadIdx.x / ws;
  // No __syncthreads in this kernel, so early returns are safe; a trailing partial warp (a
  // blockDim.x outside the contract) sits out rather than shuffle with missing lanes.
  if (block <= 0 || warp >= warps_per_block) return;
  const long long first = (long long)blockIdx.x * warps_per_block + warp;
  const long long nwarps = warps_per_block * (long long)gridDim.x;
  // The loop depends only on the warp index: all lanes of a warp run the same quant blocks, so
  // every lane reaches every shuffle of dtm_warp_reduce.
  for (long long b = first; b < nblocks; b += nwarps) {
    const T* xb = x + b * (long long)block;
    signed char* qb = q + b * (long long)block;

    double amax = 0.0;
    for (long long j = lane; j < block; j += ws)
      amax = dtm_maximum(amax, fabs((double)dtm_load(xb + j)));
    amax = dtm_warp_reduce(amax, DtmMaxOp());  // the same value on every lane
    const double scale = amax > 0.0 ? amax / 127.0 : 1.0;

    for (long long j = lane; j < block; j += ws) {
      double v = rint((double)dtm_load(xb + j) / scale);
      if (v != v) v = 0.0;
      v = v > 127.0 ? 127.0 : (v < -127.0 ? -127.0 : v);
      qb[j] = (signed char)(int)v;
    }
    if (lane == 0) scales[b] = (float)scale;
  }
}

template <class T>
__device__ void dtm_dequantize_elems(const signed char* q, const float* scales, T* y, long long n,
                                     int block) {
  if (block <= 0) return;
  const long long stride = dtm_grid_stride();
  for (long long i = dtm_global_thread(); i < n; i += stride)
    dtm_store(y + i, (double)q[i] * (double)scales[i / block]);
}

#define DTM_QUANT_KERNELS(SUF, T)                                                             \
  DTM_KERNEL dtm_quantize_##SUF(const T* x, signed char* q, float* scales, long long nblocks, \
                                int block) {                                                  \
    dtm_quantize_blocks<T>(x, q, scales, nblocks, block);                                     \
  }                                                                                           \
  DTM_KERNEL dtm_dequantize_##SUF(const signed char* q, const float* scales, T* y,            \
                                  long long n, int block) {                                   \
    dtm_dequantize_elems<T>(q, scales, y, n, block);                                          \
  }

DTM_FOR_EACH_DTYPE(DTM_QUANT_KERNELS)
