#include "dtm_common.cuh"
// bias_gelu.cu: fused bias add + gelu (tanh approximation), elementwise.
//
//   dtm_bias_gelu_<t>(const T* x, const T* bias, T* y, long long n, long long cols)
//                                                                               t: f16 f32 f64
//
// y[i] = gelu(x[i] + bias[i % cols]) for i in [0, n): x is a row-major [n / cols, cols] array
// and bias broadcasts over its last dim. gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
// (dtm_gelu in dtm_common.cuh), computed in float (f16, f32) or double (f64).
// n == 0 or cols <= 0 writes nothing. y may alias x (in place).
//
// Launch: elementwise grid-stride loop (any gridDim.x, blockDim.x); no shared memory.

template <class T>
__device__ void dtm_bias_gelu_elems(const T* x, const T* bias, T* y, long long n,
                                    long long cols) {
  typedef typename DtmAcc<T>::type A;
  if (cols <= 0) return;  // no __syncthreads here: an early return is safe
  const long long stride = dtm_grid_stride();
  for (long long i = dtm_global_thread(); i < n; i += stride)
    dtm_store(y + i, dtm_gelu((A)dtm_load(x + i) + (A)dtm_load(bias + i % cols)));
}

#define DTM_BIAS_GELU_KERNELS(SUF, T)                                                         \
  DTM_KERNEL dtm_bias_gelu_##SUF(const T* x, const T* bias, T* y, long long n, long long cols) { \
    dtm_bias_gelu_elems<T>(x, bias, y, n, cols);                                              \
  }

DTM_FOR_EACH_DTYPE(DTM_BIAS_GELU_KERNELS)
