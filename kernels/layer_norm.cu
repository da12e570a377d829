#include "dtm_common.cuh"
// layer_norm.cu: layer normalisation over the last dim of a row-major [rows, cols] array.
//
//   dtm_layer_norm_<t>(const T* x, const T* gamma, const T* beta, T* y,
//                      long long rows, long long cols, double eps)              t: f16 f32 f64
//
// Per row: mean = sum(x) / cols; var = sum((x - mean)^2) / cols (two passes over the row in
// global memory: no limit on cols); y[j] = (x[j] - mean) * rsqrt(var + eps) * gamma[j] + beta[j],
// gamma and beta of length cols. Accumulation in float (f16, f32) or double (f64).
// cols == 0 writes nothing. y may alias x (in place).
//
// Launch: one thread block per row, grid-stride over rows (any gridDim.x, rows may exceed it);
// blockDim.x a multiple of warpSize, at most 1024; static shared memory only.

template <class T>
__device__ void dtm_layer_norm_rows(const T* x, const T* gamma, const T* beta, T* y,
                                    long long rows, long long cols, double eps) {
  typedef typename DtmAcc<T>::type A;
  const long long tid = (long long)threadIdx.x;
  const long long nthreads = (long long)blockDim.x;
  const A n = (A)cols;
  // Block-uniform row loop (depends only on blockIdx): every thread reaches every __syncthreads.
  for (long long r = (long long)blockIdx.x; r < rows; r += (long long)gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;

    A s = 0;
    for (long long j = tid; j < cols; j += nthreads) s += (A)dtm_load(xr + j);
    const A mean = dtm_block_reduce(s, DtmSumOp(), (A)0) / n;

    A sq = 0;
    for (long long j = tid; j < cols; j += nthreads) {
      const A d = (A)dtm_load(xr + j) - mean;
      sq += d * d;
    }
    const A var = dtm_block_reduce(sq, DtmSumOp(), (A)0) / n;
    const A inv_std = dtm_rsqrt(var + (A)eps);

    for (long long j = tid; j < cols; j += nthreads) {
      const A v = ((A)dtm_load(xr + j) - mean) * inv_std;
      dtm_store(yr + j, v * (A)dtm_load(gamma + j) + (A)dtm_load(beta + j));
    }
  }
}

#define DTM_LAYER_NORM_KERNELS(SUF, T)                                                      \
  DTM_KERNEL dtm_layer_norm_##SUF(const T* x, const T* gamma, const T* beta, T* y,          \
                                  long long rows, long long cols, double eps) {             \
    dtm_layer_norm_rows<T>(x, gamma, beta, y, rows, cols, eps);                             \
  }

DTM_FOR_EACH_DTYPE(DTM_LAYER_NORM_KERNELS)
