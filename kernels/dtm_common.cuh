// dtm_common.cuh: device helpers shared by every kernel in kernels/ (CUDA and HIP).
//
// How it is included: each .cu starts with the line `#include "dtm_common.cuh"`. The Python
// loader (NVRTC through CuPy; hipRTC on ROCm) replaces that line with the text of this file;
// nvcc and hipcc resolve it with `-I kernels`. So this header must stand alone under NVRTC and
// hipRTC: it includes only the fp16 header (CUDA) or the HIP runtime + fp16 headers (hipcc),
// nothing under hipRTC (which has both built in: including them again redefines __half and
// friends), never <cmath>, <cstdio> or any host-only header, and uses only CUDA/HIP device
// math functions.
//
// Portability rules (see kernels/README.md): warp shuffles go through dtm_shfl_xor; the warp
// size is the runtime `warpSize` (32 on NVIDIA, 64 on most AMD GPUs), never a literal 32;
// shared memory is static (no dynamic shared memory); blockDim.x is a multiple of warpSize and
// at most DTM_MAX_THREADS.
#ifndef DTM_COMMON_CUH
#define DTM_COMMON_CUH

#if defined(__HIPCC_RTC__)
#define DTM_HIP 1
#elif defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#define DTM_HIP 1
#else
#include <cuda_fp16.h>
#endif

// Largest block the kernels support, and the per-block scratch it needs for one partial value
// per warp: 1024 / 32 = 32 entries (also covers 1024 / 64 = 16 on 64-wide AMD wavefronts).
#define DTM_MAX_THREADS 1024
#define DTM_MAX_WARPS 32

// Every exported kernel: C linkage (stable names for the loader) and launchable with up to
// 1024 threads per block on both CUDA and HIP (the bound also caps registers per thread).
#define DTM_KERNEL extern "C" __global__ void __launch_bounds__(DTM_MAX_THREADS)

// Stamp one extern "C" wrapper per dtype suffix: M(suffix, storage type).
#define DTM_FOR_EACH_DTYPE(M) M(f16, __half) M(f32, float) M(f64, double)

// ---------------------------------------------------------------------------------------------
// Accumulation type: float for __half and float storage, double for double.
template <class T>
struct DtmAcc {
  typedef float type;
};
template <>
struct DtmAcc<double> {
  typedef double type;
};

// ---------------------------------------------------------------------------------------------
// Loads and stores: storage <-> compute type. Loads return float for __half/float and double
// for double. Stores take a float or double value and round once to the storage type
// (round-to-nearest-even, including double -> __half).

// double -> __half rounded once (a plain double -> float -> half chain can round twice): round
// to odd into float (24 bits >= 11 + 2), then to nearest even into __half. Uses only the default
// conversion (no __double2half / __double2float_rz, whose availability varies across toolkits).
__device__ __forceinline__ __half dtm_double_to_half(double d) {
  float f = (float)d;
  if (fabs((double)f) > fabs(d)) f = __uint_as_float(__float_as_uint(f) - 1u);  // toward zero
  if ((double)f != d) f = __uint_as_float(__float_as_uint(f) | 1u);  // inexact (or NaN): odd
  return __float2half_rn(f);
}

__device__ __forceinline__ float dtm_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float dtm_load(const float* p) { return *p; }
__device__ __forceinline__ double dtm_load(const double* p) { return *p; }

__device__ __forceinline__ void dtm_store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void dtm_store(__half* p, double v) { *p = dtm_double_to_half(v); }
__device__ __forceinline__ void dtm_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void dtm_store(float* p, double v) { *p = (float)v; }
__device__ __forceinline__ void dtm_store(double* p, float v) { *p = (double)v; }
__device__ __forceinline__ void dtm_store(double* p, double v) { *p = v; }

// ---------------------------------------------------------------------------------------------
// Math on the compute type: explicit float / double overloads, so a generated expression never
// depends on how a toolchain overloads exp(float) and friends.
__device__ __forceinline__ float dtm_exp(float x) { return expf(x); }
__device__ __forceinline__ double dtm_exp(double x) { return exp(x); }
__device__ __forceinline__ float dtm_log(float x) { return logf(x); }
__device__ __forceinline__ double dtm_log(double x) { return log(x); }
__device__ __forceinline__ float dtm_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dtm_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float dtm_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dtm_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float dtm_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double dtm_rsqrt(double x) { return rsqrt(x); }
__device__ __forceinline__ float dtm_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double dtm_abs(double x) { return fabs(x); }
__device__ __forceinline__ float dtm_neg(float x) { return -x; }
__device__ __forceinline__ double dtm_neg(double x) { return -x; }

// numpy.maximum / numpy.minimum: a NaN in either argument gives NaN (fmaxf/fminf would drop
// it). Ties return a, as numpy's scalar loop does.
__device__ __forceinline__ float dtm_maximum(float a, float b) {
  return (a >= b || a != a) ? a : b;
}
__device__ __forceinline__ double dtm_maximum(double a, double b) {
  return (a >= b || a != a) ? a : b;
}
__device__ __forceinline__ float dtm_minimum(float a, float b) {
  return (a <= b || a != a) ? a : b;
}
__device__ __forceinline__ double dtm_minimum(double a, double b) {
  return (a <= b || a != a) ? a : b;
}

// relu(x) = numpy.maximum(x, 0): NaN stays NaN.
__device__ __forceinline__ float dtm_relu(float x) { return dtm_maximum(x, 0.0f); }
__device__ __forceinline__ double dtm_relu(double x) { return dtm_maximum(x, 0.0); }

// gelu, tanh approximation: 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))).
__device__ __forceinline__ float dtm_gelu(float v) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
}
__device__ __forceinline__ double dtm_gelu(double v) {
  const double k = 0.79788456080286535588;  // sqrt(2 / pi)
  return 0.5 * v * (1.0 + tanh(k * (v + 0.044715 * v * v * v)));
}
// The generated kernels name gelu by its form (the op's approximate attribute): tanh as above,
// none the exact 0.5 v (1 + erf(v / sqrt 2)).
__device__ __forceinline__ float dtm_gelu_tanh(float v) { return dtm_gelu(v); }
__device__ __forceinline__ double dtm_gelu_tanh(double v) { return dtm_gelu(v); }
__device__ __forceinline__ float dtm_erf(float x) { return erff(x); }
__device__ __forceinline__ double dtm_erf(double x) { return erf(x); }
__device__ __forceinline__ float dtm_gelu_none(float v) {
  return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}
__device__ __forceinline__ double dtm_gelu_none(double v) {
  return 0.5 * v * (1.0 + erf(v * 0.70710678118654752440));
}

// sigmoid(x) = 1 / (1 + exp(-x)), as the registry's numpy function: exp(-x) overflows to inf
// for very negative x, giving exactly 0; NaN stays NaN.
__device__ __forceinline__ float dtm_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ double dtm_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// silu(x) = x / (1 + exp(-x)), as the registry's numpy function (torch's silu): -0 for very
// negative x, where exp(-x) overflows to inf.
__device__ __forceinline__ float dtm_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ double dtm_silu(double x) { return x / (1.0 + exp(-x)); }
// sin and cos (rotary position tables).
__device__ __forceinline__ float dtm_sin(float x) { return sinf(x); }
__device__ __forceinline__ double dtm_sin(double x) { return sin(x); }
__device__ __forceinline__ float dtm_cos(float x) { return cosf(x); }
__device__ __forceinline__ double dtm_cos(double x) { return cos(x); }

// +inf of the compute type, without INFINITY / CUDART_INF_F (not available under NVRTC).
template <class A>
__device__ __forceinline__ A dtm_inf();
template <>
__device__ __forceinline__ float dtm_inf<float>() {
  return __int_as_float(0x7f800000);
}
template <>
__device__ __forceinline__ double dtm_inf<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}

// ---------------------------------------------------------------------------------------------
// Indexing: 64-bit global thread index and grid stride for elementwise grid-stride loops.
__device__ __forceinline__ long long dtm_global_thread() {
  return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}
__device__ __forceinline__ long long dtm_grid_stride() {
  return (long long)blockDim.x * (long long)gridDim.x;
}

// ---------------------------------------------------------------------------------------------
// Reductions. Binary operators on the compute type.
struct DtmSumOp {
  template <class A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a + b;
  }
};
struct DtmMaxOp {  // NaN-propagating
  template <class A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return dtm_maximum(a, b);
  }
};
struct DtmMinOp {  // NaN-propagating
  template <class A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return dtm_minimum(a, b);
  }
};

// Exchange with lane (lane ^ lane_mask) of the same warp; every lane of the warp must call it.
template <class V>
__device__ __forceinline__ V dtm_shfl_xor(V v, int lane_mask) {
#ifdef DTM_HIP
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// Butterfly reduction over the warp: every lane returns the same value (the operators are
// commutative, so both lanes of each exchanged pair compute the same result). All lanes of the
// warp must call it (warpSize a power of two: 32 or 64).
template <class A, class Op>
__device__ __forceinline__ A dtm_warp_reduce(A v, Op op) {
  for (int offset = warpSize >> 1; offset > 0; offset >>= 1) v = op(v, dtm_shfl_xor(v, offset));
  return v;
}

// Reduce one value per thread over the whole block; every thread returns the result.
// Every thread of the block must call it (it contains __syncthreads); blockDim.x is a multiple
// of warpSize and at most DTM_MAX_THREADS; any number of warps (not only powers of two).
// `identity` fills the lanes of warp 0 beyond the number of warps.
// The leading __syncthreads makes back-to-back calls safe: no thread writes the scratch before
// every thread has read the previous call's result.
template <class A, class Op>
__device__ A dtm_block_reduce(A v, Op op, A identity) {
  __shared__ A partial[DTM_MAX_WARPS];
  __shared__ A result;
  const int lane = (int)(threadIdx.x % (unsigned)warpSize);
  const int warp = (int)(threadIdx.x / (unsigned)warpSize);
  const int nwarps = (int)((blockDim.x + (unsigned)warpSize - 1u) / (unsigned)warpSize);
  v = dtm_warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    A w = lane < nwarps ? partial[lane] : identity;
    w = dtm_warp_reduce(w, op);
    if (lane == 0) result = w;
  }
  __syncthreads();
  return result;
}

#endif  // DTM_COMMON_CUH
