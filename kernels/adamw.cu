#include "dtm_common.cuh"
// adamw.cu: AdamW's update of one parameter and its two moments in one pass (IR op `adamw`,
// docs/spec/ir.md §8.15), with the op's reference values bit for bit:
//
//   dtm_adamw_<t>(const T* p, const T* g, const T* m, const T* v, const T* bc1, const T* bc2,
//                 T* p2, T* m2, T* v2, long long n, double lr, double b1, double c1,
//                 double b2, double c2, double eps, double decay)          t: f16 f32 f64
//
//   m2 = m*B1 + g*C1;  v2 = v*B2 + (g*g)*C2;  s = (m2 / bc1) / (sqrt(v2 / bc2) + EPS);
//   s = s + p*DECAY if decay > 0;  p2 = p - s*LR
//
// bc1, bc2: device scalars (the bias corrections); c1 = 1 - b1, c2 = 1 - b2 computed by the
// caller in binary64; every constant is rounded to T first. Every operation is one IEEE
// operation rounded to nearest in float (f16, f32) or double (f64) -- the _rn intrinsics, so
// no fused multiply-add is contracted -- and, for f16, rounded to half after each operation, as
// numpy computes half values op by op. n == 0 writes nothing.
//
// Launch: elementwise grid-stride loop (any gridDim.x, blockDim.x); no shared memory.

template <class T>
struct DtmRn;  // one correctly rounded operation of the compute type, then rounded to T

template <>
struct DtmRn<float> {
  typedef float A;
  static __device__ __forceinline__ A r(A x) { return x; }
  static __device__ __forceinline__ A add(A a, A b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ A sub(A a, A b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ A mul(A a, A b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ A div(A a, A b) { return __fdiv_rn(a, b); }
  static __device__ __forceinline__ A sqrt(A a) { return __fsqrt_rn(a); }
  static __device__ __forceinline__ A k(double c) { return (float)c; }
};

template <>
struct DtmRn<double> {
  typedef double A;
  static __device__ __forceinline__ A r(A x) { return x; }
  static __device__ __forceinline__ A add(A a, A b) { return __dadd_rn(a, b); }
  static __device__ __forceinline__ A sub(A a, A b) { return __dsub_rn(a, b); }
  static __device__ __forceinline__ A mul(A a, A b) { return __dmul_rn(a, b); }
  static __device__ __forceinline__ A div(A a, A b) { return __ddiv_rn(a, b); }
  static __device__ __forceinline__ A sqrt(A a) { return __dsqrt_rn(a); }
  static __device__ __forceinline__ A k(double c) { return c; }
};

template <>
struct DtmRn<__half> {  // float arithmetic, each result rounded to half (exact in float)
  typedef float A;
  static __device__ __forceinline__ A r(A x) { return __half2float(__float2half_rn(x)); }
  static __device__ __forceinline__ A add(A a, A b) { return r(__fadd_rn(a, b)); }
  static __device__ __forceinline__ A sub(A a, A b) { return r(__fsub_rn(a, b)); }
  static __device__ __forceinline__ A mul(A a, A b) { return r(__fmul_rn(a, b)); }
  static __device__ __forceinline__ A div(A a, A b) { return r(__fdiv_rn(a, b)); }
  static __device__ __forceinline__ A sqrt(A a) { return r(__fsqrt_rn(a)); }
  static __device__ __forceinline__ A k(double c) { return __half2float(dtm_double_to_half(c)); }
};

template <class T>
__device__ void dtm_adamw_elems(const T* p, const T* g, const T* m, const T* v, const T* bc1,
                                const T* bc2, T* p2, T* m2, T* v2, long long n, double lr,
                                double b1, double c1, double b2, double c2, double eps,
                                double decay) {
  typedef DtmRn<T> R;
  typedef typename R::A A;
  const A LR = R::k(lr), B1 = R::k(b1), C1 = R::k(c1), B2 = R::k(b2), C2 = R::k(c2);
  const A EPS = R::k(eps), DECAY = R::k(decay);
  const A BC1 = dtm_load(bc1), BC2 = dtm_load(bc2);
  const long long stride = dtm_grid_stride();
  for (long long i = dtm_global_thread(); i < n; i += stride) {
    const A pi = dtm_load(p + i), gi = dtm_load(g + i);
    const A mn = R::add(R::mul(dtm_load(m + i), B1), R::mul(gi, C1));
    const A vn = R::add(R::mul(dtm_load(v + i), B2), R::mul(R::mul(gi, gi), C2));
    A s = R::div(R::div(mn, BC1), R::add(R::sqrt(R::div(vn, BC2)), EPS));
    if (decay > 0.0) s = R::add(s, R::mul(pi, DECAY));
    dtm_store(p2 + i, R::sub(pi, R::mul(s, LR)));
    dtm_store(m2 + i, mn);
    dtm_store(v2 + i, vn);
  }
}

#define DTM_ADAMW_KERNELS(SUF, T)                                                              \
  DTM_KERNEL dtm_adamw_##SUF(const T* p, const T* g, const T* m, const T* v, const T* bc1,     \
                             const T* bc2, T* p2, T* m2, T* v2, long long n, double lr,        \
                             double b1, double c1, double b2, double c2, double eps,           \
                             double decay) {                                                   \
    dtm_adamw_elems<T>(p, g, m, v, bc1, bc2, p2, m2, v2, n, lr, b1, c1, b2, c2, eps, decay);   \
  }

DTM_FOR_EACH_DTYPE(DTM_ADAMW_KERNELS)
