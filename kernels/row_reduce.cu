#include "dtm_common.cuh"
// row_reduce.cu: reductions over the last dim of a row-major [rows, cols] array -> y[rows].
//
//   dtm_row_sum_<t>(const T* x, T* y, long long rows, long long cols, double scale)
//       y[r] = scale * sum(x[r, :])   (the caller passes 1.0 for sum, 1 / global count for mean;
//                                      the sum is accumulated in float (f16, f32) or double
//                                      (f64) and multiplied by scale in double)
//   dtm_row_max_<t>(const T* x, T* y, long long rows, long long cols)
//   dtm_row_min_<t>(const T* x, T* y, long long rows, long long cols)          t: f16 f32 f64
//       NaN-propagating like numpy.max / numpy.min.
// Empty rows (cols == 0): sum 0 (times scale), max -inf, min +inf (the identities, so a rank
// holding an empty block contributes nothing to a cross-rank reduction).
//
// Launch: one thread block per row, grid-stride over rows (any gridDim.x, rows may exceed it);
// blockDim.x a multiple of warpSize, at most 1024; static shared memory only.

template <class T, class Op>
__device__ void dtm_row_reduce_rows(const T* x, T* y, long long rows, long long cols,
                                    typename DtmAcc<T>::type identity, Op op, double scale,
                                    bool scaled) {
  typedef typename DtmAcc<T>::type A;
  const long long tid = (long long)threadIdx.x;
  const long long nthreads = (long long)blockDim.x;
  // Block-uniform row loop (depends only on blockIdx): every thread reaches every __syncthreads.
  for (long long r = (long long)blockIdx.x; r < rows; r += (long long)gridDim.x) {
    const T* xr = x + r * cols;
    A v = identity;
    for (long long j = tid; j < cols; j += nthreads) v = op(v, (A)dtm_load(xr + j));
    v = dtm_block_reduce(v, op, identity);
    if (threadIdx.x == 0) {
      if (scaled)
        dtm_store(y + r, scale * (double)v);
      else
        dtm_store(y + r, v);
    }
  }
}

#define DTM_ROW_REDUCE_KERNELS(SUF, T)                                                        \
  DTM_KERNEL dtm_row_sum_##SUF(const T* x, T* y, long long rows, long long cols,              \
                               double scale) {                                                \
    typedef DtmAcc<T>::type A;                                                                \
    dtm_row_reduce_rows<T>(x, y, rows, cols, (A)0, DtmSumOp(), scale, true);                  \
  }                                                                                           \
  DTM_KERNEL dtm_row_max_##SUF(const T* x, T* y, long long rows, long long cols) {            \
    typedef DtmAcc<T>::type A;                                                                \
    dtm_row_reduce_rows<T>(x, y, rows, cols, -dtm_inf<A>(), DtmMaxOp(), 1.0, false);          \
  }                                                                                           \
  DTM_KERNEL dtm_row_min_##SUF(const T* x, T* y, long long rows, long long cols) {            \
    typedef DtmAcc<T>::type A;                                                                \
    dtm_row_reduce_rows<T>(x, y, rows, cols, dtm_inf<A>(), DtmMinOp(), 1.0, false);           \
  }

DTM_FOR_EACH_DTYPE(DTM_ROW_REDUCE_KERNELS)
