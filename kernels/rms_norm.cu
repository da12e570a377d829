#include "dtm_common.cuh"
// rms_norm.cu: root-mean-square normalisation over the last dim of a row-major [rows, cols]
// array (Llama's RMSNorm, as Hugging Face computes it).
//
//   dtm_rms_norm_<t>(const T* x, const T* w, T* y, long long rows, long long cols, double eps)
//                                                                           t: f16 f32 f64
//
// Per row: ms = sum(x^2) / cols; y[j] = T(x[j] * (1 / sqrt(ms + eps))) * w[j]: the normalised
// value rounded to the storage type before the weight multiplies it (the reference's order),
// w of length cols. Accumulation in float (f16, f32) or double (f64). cols == 0 writes
// nothing. y may alias x (in place).
//
// Launch: one thread block per row, grid-stride over rows (any gridDim.x, rows may exceed it);
// blockDim.x a multiple of warpSize, at most 1024; static shared memory only.

template <class T>
__device__ void dtm_rms_norm_rows(const T* x, const T* w, T* y, long long rows, long long cols,
                                  double eps) {
  typedef typename DtmAcc<T>::type A;
  const long long tid = (long long)threadIdx.x;
  const long long nthreads = (long long)blockDim.x;
  const A n = (A)cols;
  // Block-uniform row loop (depends only on blockIdx): every thread reaches every __syncthreads.
  for (long long r = (long long)blockIdx.x; r < rows; r += (long long)gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;

    A sq = 0;
    for (long long j = tid; j < cols; j += nthreads) {
      const A v = (A)dtm_load(xr + j);
      sq += v * v;
    }
    const A ms = dtm_block_reduce(sq, DtmSumOp(), (A)0) / n;
    const A inv = (A)1 / dtm_sqrt(ms + (A)eps);

    for (long long j = tid; j < cols; j += nthreads) {
      T normed;  // rounded to the storage type before the weight (the reference's order)
      dtm_store(&normed, (A)dtm_load(xr + j) * inv);
      dtm_store(yr + j, (A)dtm_load(&normed) * (A)dtm_load(w + j));
    }
  }
}

#define DTM_RMS_NORM_KERNELS(SUF, T)                                                        \
  DTM_KERNEL dtm_rms_norm_##SUF(const T* x, const T* w, T* y, long long rows, long long cols, \
                                double eps) {                                               \
    dtm_rms_norm_rows<T>(x, w, y, rows, cols, eps);                                         \
  }

DTM_FOR_EACH_DTYPE(DTM_RMS_NORM_KERNELS)
