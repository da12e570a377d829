#include "dtm_common.cuh"
// take.cu: rows at integer indices (the take op: embedding lookups) and their transpose, the
// deterministic scatter-add (the embedding gradient).
//
//   dtm_take_rows_<t>(const T* x, const long long* idx, T* y, long long pre, long long n,
//                     long long k, long long post, long long lo)          t: f16 f32 f64
//   dtm_scatter_rows_<t>(const T* u, const long long* perm, const long long* starts, T* y,
//                        long long pre, long long n, long long k, long long post)
//
// take: x is [pre, n, post] (rows lo .. lo+n-1 of a longer dim), idx [k], y [pre, k, post]:
//   y[p, j, c] = x[p, idx[j] - lo, c] if lo <= idx[j] < lo + n, else 0 (a copy: bit exact).
// scatter: u is [pre, k, post], y [pre, n, post]; perm lists the update rows whose index falls
// in the block, grouped by row of y (rows ascending, each group in the order of the updates: a
// stable sort), and starts[r] .. starts[r+1]-1 is row r's group (starts has n + 1 entries):
//   y[p, r, c] = sum over g in that group, in order, of u[p, perm[g], c]
// accumulated in float (f16, f32) or double (f64): each output element is summed by one
// thread in a fixed order, so the result is deterministic (no atomics) and, in f32 and f64,
// equal bit for bit to numpy.add.at on the same updates.
// Empty shapes (any size 0) write nothing out of bounds.
//
// Launch: elementwise grid-stride loops over the output (any gridDim.x, blockDim.x); no
// shared memory.

template <class T>
__device__ void dtm_take_rows_elems(const T* x, const long long* idx, T* y, long long pre,
                                    long long n, long long k, long long post, long long lo) {
  typedef typename DtmAcc<T>::type A;
  const long long total = pre * k * post;
  const long long stride = dtm_grid_stride();
  for (long long i = dtm_global_thread(); i < total; i += stride) {
    const long long c = i % post;
    const long long j = (i / post) % k;
    const long long p = i / (post * k);
    const long long r = idx[j] - lo;
    if (r >= 0 && r < n)
      y[i] = x[(p * n + r) * post + c];
    else
      dtm_store(y + i, (A)0);
  }
}

template <class T>
__device__ void dtm_scatter_rows_elems(const T* u, const long long* perm, const long long* starts,
                                       T* y, long long pre, long long n, long long k,
                                       long long post) {
  typedef typename DtmAcc<T>::type A;
  const long long total = pre * n * post;
  const long long stride = dtm_grid_stride();
  for (long long i = dtm_global_thread(); i < total; i += stride) {
    const long long c = i % post;
    const long long r = (i / post) % n;
    const long long p = i / (post * n);
    A acc = (A)0;
    for (long long g = starts[r]; g < starts[r + 1]; ++g)
      acc += (A)dtm_load(u + (p * k + perm[g]) * post + c);
    dtm_store(y + i, acc);
  }
}

#define DTM_TAKE_KERNELS(SUF, T)                                                                \
  DTM_KERNEL dtm_take_rows_##SUF(const T* x, const long long* idx, T* y, long long pre,        \
                                 long long n, long long k, long long post, long long lo) {     \
    dtm_take_rows_elems<T>(x, idx, y, pre, n, k, post, lo);                                    \
  }                                                                                             \
  DTM_KERNEL dtm_scatter_rows_##SUF(const T* u, const long long* perm, const long long* starts, \
                                    T* y, long long pre, long long n, long long k,             \
                                    long long post) {                                           \
    dtm_scatter_rows_elems<T>(u, perm, starts, y, pre, n, k, post);                             \
  }

DTM_FOR_EACH_DTYPE(DTM_TAKE_KERNELS)
