#include "dtm_common.cuh"
// softmax.cu: row softmax and log-softmax over the last dim of a row-major [rows, cols] array.
//
//   dtm_softmax_<t>(const T* x, T* y, long long rows, long long cols)
//   dtm_log_softmax_<t>(const T* x, T* y, long long rows, long long cols)     t: f16 f32 f64
//
// Per row, like the float64 numpy reference: m = max(row) (NaN-propagating),
//   softmax     = exp(x - m) / sum(exp(x - m))
//   log_softmax = (x - m) - log(sum(exp(x - m)))
// Accumulation in float (f16, f32) or double (f64). A NaN in a row makes the row NaN; a row of
// all -inf gives NaN, as numpy does. cols == 0 writes nothing. y may alias x (in place).
//
// Launch: one thread block per row, grid-stride over rows (any gridDim.x, rows may exceed it);
// blockDim.x a multiple of warpSize, at most 1024; static shared memory only.

template <class T, bool LOG>
__device__ void dtm_softmax_rows(const T* x, T* y, long long rows, long long cols) {
  typedef typename DtmAcc<T>::type A;
  const long long tid = (long long)threadIdx.x;
  const long long nthreads = (long long)blockDim.x;
  // The row loop depends only on blockIdx: every thread of the block runs the same rows, so
  // the __syncthreads inside dtm_block_reduce are reached by all of them.
  for (long long r = (long long)blockIdx.x; r < rows; r += (long long)gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;

    A m = -dtm_inf<A>();
    for (long long j = tid; j < cols; j += nthreads) m = dtm_maximum(m, (A)dtm_load(xr + j));
    m = dtm_block_reduce(m, DtmMaxOp(), -dtm_inf<A>());

    A s = 0;
    for (long long j = tid; j < cols; j += nthreads) s += dtm_exp((A)dtm_load(xr + j) - m);
    s = dtm_block_reduce(s, DtmSumOp(), (A)0);

    if (LOG) {
      const A log_s = dtm_log(s);
      for (long long j = tid; j < cols; j += nthreads)
        dtm_store(yr + j, ((A)dtm_load(xr + j) - m) - log_s);
    } else {
      for (long long j = tid; j < cols; j += nthreads)
        dtm_store(yr + j, dtm_exp((A)dtm_load(xr + j) - m) / s);
    }
  }
}

#define DTM_SOFTMAX_KERNELS(SUF, T)                                                    \
  DTM_KERNEL dtm_softmax_##SUF(const T* x, T* y, long long rows, long long cols) {     \
    dtm_softmax_rows<T, false>(x, y, rows, cols);                                      \
  }                                                                                    \
  DTM_KERNEL dtm_log_softmax_##SUF(const T* x, T* y, long long rows, long long cols) { \
    dtm_softmax_rows<T, true>(x, y, rows, cols);                                       \
  }

DTM_FOR_EACH_DTYPE(DTM_SOFTMAX_KERNELS)
