#include "dtm_common.cuh"
// fused_elementwise.cu: template for generated fused elementwise chains.
//
// The Python side prepends `#define` lines to this text (and replaces the include line above
// with dtm_common.cuh); with nothing defined it compiles on its own with the defaults below.
//
//   DTM_FUSED_NAME    kernel name                      default dtm_fused_default
//   DTM_FUSED_PARAMS  pointer parameter list           default const float* in0, float* out0
//   DTM_FUSED_ACC     compute type (float or double)   default float
//   DTM_FUSED_BODY    statements run for each element index `i` (long long, in [0, n)); may use
//                     `cols` (> 0) to index last-dim broadcast inputs as in1[i % cols], and the
//                     helpers of dtm_common.cuh: dtm_load, dtm_store, dtm_exp, dtm_log,
//                     dtm_tanh, dtm_sqrt, dtm_rsqrt, dtm_abs, dtm_neg, dtm_relu, dtm_gelu,
//                     dtm_sigmoid, dtm_maximum, dtm_minimum (each fusible op's `c_expr` in
//                     the op registry, dtm_mpi/ir/ops/elementwise.py, names one of them).
//
//   extern "C" __global__ void DTM_FUSED_NAME(DTM_FUSED_PARAMS, long long n, long long cols)
//
// Launch: elementwise grid-stride loop over i in [0, n) (any gridDim.x, blockDim.x <= 1024);
// no shared memory. cols <= 0 (only meaningful with n == 0) is treated as 1, so `i % cols`
// never divides by zero.

#ifndef DTM_FUSED_NAME
#define DTM_FUSED_NAME dtm_fused_default
#endif
#ifndef DTM_FUSED_PARAMS
#define DTM_FUSED_PARAMS const float* in0, float* out0
#endif
#ifndef DTM_FUSED_ACC
#define DTM_FUSED_ACC float
#endif
#ifndef DTM_FUSED_BODY
#define DTM_FUSED_BODY out0[i] = (float)((DTM_FUSED_ACC)in0[i]);
#endif

DTM_KERNEL DTM_FUSED_NAME(DTM_FUSED_PARAMS, long long n, long long dtm_cols_arg) {
  const long long cols = dtm_cols_arg > 0 ? dtm_cols_arg : 1;
  (void)cols;  // a body without broadcast inputs does not use it
  const long long stride = dtm_grid_stride();
  for (long long i = dtm_global_thread(); i < n; i += stride) {
    DTM_FUSED_BODY
  }
}
