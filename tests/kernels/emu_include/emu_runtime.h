// emu_runtime.h: runs the CUDA/HIP sources of kernels/ on the CPU, for tests (never a backend).
//
// A module is one kernel source (the loader's text) compiled by g++ as C++17 with this
// directory first on the include path: the shim cuda_fp16.h includes this file. It supplies
// what the sources use (the __global__/__device__/__shared__ qualifiers, threadIdx, blockIdx,
// blockDim, gridDim, warpSize, __syncthreads, __shfl_xor_sync, __half and its conversions, the
// bit casts, rsqrtf/rsqrt) and a launcher that runs a grid as the programming model defines it:
//
//   * blocks run one after another; the threads of a block run as fibers (a stack each) on one
//     OS thread, switched only at __syncthreads and warp shuffles, so a launch is deterministic;
//   * __shared__ variables are thread_local statics: one instance per launching OS thread,
//     used by one block at a time (launches from several threads, as the multi-rank simulator
//     makes them, do not share anything);
//   * warpSize is chosen per launch: 32 as on NVIDIA GPUs, 64 as on CDNA AMD GPUs;
//   * barriers are strict: a __syncthreads that some live thread of the block never reaches
//     (it exited, or waits elsewhere), threads of one barrier arriving from different
//     __syncthreads lines, a shuffle that some lane of the warp never reaches or that reads a
//     lane a partial warp does not have, are errors naming the block and the threads, never a
//     hang; so is a fiber stack overflow (a canary at each stack's bottom);
//   * blocks and threads run in ascending order, or descending (`reverse`), so a read of
//     another thread's write with no barrier between them shows up as a difference.
//
// What it cannot show: speed, coalescing, the memory model beyond barriers, and the exact ulp
// behaviour of the device math library (glibc's is used).
#ifndef DTM_EMU_RUNTIME_H
#define DTM_EMU_RUNTIME_H

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

#ifndef DTM_EMU_NAMES_ONLY  // (defined when the loader only preprocesses to find kernel names)
#include <math.h>  // libstdc++'s <math.h> also puts the float overloads (exp(float)...) in ::
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace emu {

struct dim3u {
  unsigned x, y, z;
};

struct Barrier {
  unsigned expected = 0;
  unsigned arrived = 0;
  long gen = 0;
  int site = 0;  // __syncthreads: the source line of this generation's first arrival
};

struct Fiber {
  dim3u idx{0, 0, 0};
  std::vector<unsigned char> stack;
  void* sp = nullptr;  // saved stack pointer while switched out (x86-64)
#if !defined(__x86_64__)
  ucontext_t ctx;
#endif
  bool done = false;
  Barrier* at = nullptr;  // blocked at this barrier until its generation moves past wait_gen
  long wait_gen = 0;
  const char* what = nullptr;
};

inline thread_local dim3u g_block_idx{0, 0, 0}, g_block_dim{1, 1, 1}, g_grid_dim{1, 1, 1};
inline thread_local int g_warp_size = 32;
inline thread_local Fiber* g_cur = nullptr;
inline thread_local Barrier g_block_bar;
inline thread_local std::vector<Barrier> g_warp_bars;
inline thread_local std::vector<uint64_t> g_slots;  // one shuffle slot per thread
inline thread_local void (*g_body)(void*) = nullptr;
inline thread_local void* g_body_ctx = nullptr;
inline thread_local void* g_sched_sp = nullptr;
inline thread_local std::string g_fault;  // set by a fiber that hit an error; ends the launch
#if !defined(__x86_64__)
inline thread_local ucontext_t g_sched_ctx;
#endif
constexpr size_t kStack = 64 * 1024;
constexpr uint64_t kCanary = 0x5ca1ab1ecafef00dULL;  // at the bottom of each fiber stack

}  // namespace emu

#if defined(__x86_64__)
// Switch stacks: save the callee-saved registers and the stack pointer into *save, load `to`.
extern "C" void emu_switch(void** save, void* to);
asm(".text\n.globl emu_switch\n.hidden emu_switch\n.type emu_switch,@function\nemu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size emu_switch, .-emu_switch\n");
#endif

namespace emu {

inline void yield_to_scheduler() {
#if defined(__x86_64__)
  emu_switch(&g_cur->sp, g_sched_sp);
#else
  swapcontext(&g_cur->ctx, &g_sched_ctx);
#endif
}

extern "C" inline void emu_fiber_entry() {
  g_body(g_body_ctx);
  g_cur->done = true;
  yield_to_scheduler();  // never resumed
  __builtin_trap();
}

inline void start(Fiber& f) {
  f.done = false;
  f.at = nullptr;
  f.what = nullptr;
#if defined(__x86_64__)
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack.data()) + kStack) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                          // the entry's "return address"
  *--sp = reinterpret_cast<void*>(&emu_fiber_entry);        // where the first switch returns
  for (int k = 0; k < 6; ++k) *--sp = nullptr;              // rbp rbx r12 r13 r14 r15
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack.data();
  f.ctx.uc_stack.ss_size = kStack;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, reinterpret_cast<void (*)()>(&emu_fiber_entry), 0);
#endif
}

inline void resume(Fiber& f) {
  g_cur = &f;
#if defined(__x86_64__)
  emu_switch(&g_sched_sp, f.sp);
#else
  swapcontext(&g_sched_ctx, &f.ctx);
#endif
}

// Arrive at `b`; the last arrival releases everyone, earlier ones wait for it.
inline void wait(Barrier& b, const char* what) {
  const long gen = b.gen;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  g_cur->at = &b;
  g_cur->wait_gen = gen;
  g_cur->what = what;
  yield_to_scheduler();
}

// End this thread with an error that ends the launch (reported by `run`).
[[noreturn]] inline void fault(const std::string& what) {
  if (g_fault.empty()) g_fault = what;
  g_cur->done = true;
  yield_to_scheduler();
  __builtin_trap();
}

// Every thread of a generation must arrive from the same __syncthreads (the same source line):
// divergent barriers are undefined behaviour on GPUs even when the counts happen to match.
inline void syncthreads(int line) {
  Barrier& b = g_block_bar;
  if (b.arrived == 0) {
    b.site = line;
  } else if (b.site != line) {
    fault("divergent __syncthreads in block " + std::to_string(g_block_idx.x) + ": thread " +
          std::to_string(g_cur->idx.x) + " at line " + std::to_string(line) +
          ", other threads of the same barrier at line " + std::to_string(b.site));
  }
  wait(b, "__syncthreads");
}

template <class V>
inline V shfl_xor(V v, int lane_mask) {
  static_assert(sizeof(V) <= sizeof(uint64_t), "shuffle of a value wider than 8 bytes");
  const unsigned t = g_cur->idx.x, ws = (unsigned)g_warp_size;
  const unsigned lane = t % ws, base = t - lane;
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(V));
  g_slots[t] = bits;
  wait(g_warp_bars[t / ws], "a warp shuffle");
  const unsigned src = lane ^ (unsigned)lane_mask;
  if (src < ws && base + src >= g_block_dim.x)  // a lane of a partial warp that does not exist
    fault("warp shuffle in block " + std::to_string(g_block_idx.x) + ": thread " +
          std::to_string(t) + " reads lane " + std::to_string(src) + " of a partial warp (blockDim " +
          std::to_string(g_block_dim.x) + " is not a multiple of warpSize " + std::to_string(ws) + ")");
  const uint64_t got = g_slots[base + (src < ws ? src : lane)];
  wait(g_warp_bars[t / ws], "a warp shuffle");
  V r;
  memcpy(&r, &got, sizeof(V));
  return r;
}

inline void describe_deadlock(std::vector<Fiber>& fibers, char* err, size_t n) {
  unsigned sync = 0, shfl = 0, exited = 0, first_sync = 0, first_shfl = 0, first_exit = 0;
  for (unsigned t = 0; t < fibers.size(); ++t) {
    Fiber& f = fibers[t];
    if (f.done) {
      if (!exited++) first_exit = t;
    } else if (f.at == &g_block_bar) {
      if (!sync++) first_sync = t;
    } else {
      if (!shfl++) first_shfl = t;
    }
  }
  std::string s = "deadlock in block " + std::to_string(g_block_idx.x) + " of " +
                  std::to_string(g_grid_dim.x) + " (blockDim " + std::to_string(g_block_dim.x) +
                  ", warpSize " + std::to_string(g_warp_size) + "):";
  auto part = [&](unsigned count, unsigned first, const char* what) {
    s += " " + std::to_string(count) + " " + what;
    if (count) s += " (first: thread " + std::to_string(first) + ")";
    s += ",";
  };
  part(sync, first_sync, "thread(s) wait at __syncthreads");
  part(shfl, first_shfl, "at a warp shuffle");
  part(exited, first_exit, "exited");
  s += " a barrier not reached by every thread it waits for";
  snprintf(err, n, "%s", s.c_str());
}

// Run `body` as every thread of a grid of `grid` blocks of `block` threads; 0 or 1 with `err`.
// `reverse`: run blocks and the threads of a block in descending order (a kernel that reads
// another thread's write without a barrier between them gets a different answer).
inline int run(unsigned grid, unsigned block, int warp, bool reverse, void (*body)(void*),
               void* ctx, char* err, size_t n) {
  if (warp != 32 && warp != 64) return snprintf(err, n, "warpSize %d: only 32 or 64", warp), 1;
  if (block < 1 || block > 1024) return snprintf(err, n, "blockDim %u not in 1..1024", block), 1;
  if (grid < 1) return snprintf(err, n, "gridDim %u: at least 1", grid), 1;
  std::vector<Fiber> fibers(block);
  for (unsigned t = 0; t < block; ++t) {
    fibers[t].idx = dim3u{t, 0, 0};
    fibers[t].stack.resize(kStack);
  }
  std::vector<Fiber*> order(block);
  for (unsigned t = 0; t < block; ++t) order[t] = &fibers[reverse ? block - 1 - t : t];
  g_fault.clear();
  g_body = body;
  g_body_ctx = ctx;
  g_warp_size = warp;
  g_block_dim = dim3u{block, 1, 1};
  g_grid_dim = dim3u{grid, 1, 1};
  g_slots.assign(block, 0);
  const unsigned nwarps = (block + (unsigned)warp - 1) / (unsigned)warp;
  for (unsigned k = 0; k < grid; ++k) {
    const unsigned b = reverse ? grid - 1 - k : k;
    g_block_idx = dim3u{b, 0, 0};
    g_block_bar = Barrier{block, 0, 0};
    g_warp_bars.assign(nwarps, Barrier{});
    for (unsigned w = 0; w < nwarps; ++w)
      g_warp_bars[w].expected = std::min((unsigned)warp, block - w * (unsigned)warp);
    for (Fiber& f : fibers) {
      memcpy(f.stack.data(), &kCanary, sizeof kCanary);
      start(f);
    }
    for (;;) {
      bool progressed = false, live = false;
      for (Fiber* fp : order) {
        Fiber& f = *fp;
        if (f.done) continue;
        live = true;
        if (f.at != nullptr && f.at->gen == f.wait_gen) continue;  // still blocked
        f.at = nullptr;
        resume(f);
        progressed = true;
        uint64_t canary;
        memcpy(&canary, f.stack.data(), sizeof canary);
        if (canary != kCanary)
          g_fault = "thread " + std::to_string(f.idx.x) + " of block " + std::to_string(b) +
                    " overflowed its " + std::to_string(kStack / 1024) + " KiB emulator stack";
        if (!g_fault.empty()) {
          snprintf(err, n, "%s", g_fault.c_str());
          g_cur = nullptr;
          return 1;
        }
      }
      if (!live) break;
      if (!progressed) {
        describe_deadlock(fibers, err, n);
        g_cur = nullptr;
        return 1;
      }
    }
  }
  g_cur = nullptr;
  return 0;
}

template <class P, class... Ps, size_t... I>
inline std::tuple<P, Ps...> unpack(void** args, std::index_sequence<I...>) {
  return std::tuple<P, Ps...>{*static_cast<std::remove_cv_t<std::remove_reference_t<
      std::tuple_element_t<I, std::tuple<P, Ps...>>>>*>(args[I])...};
}

// Launch `fn` with `args` (args[i] points at the value of parameter i, as CuPy packs them).
template <class... P>
inline int launch(void (*fn)(P...), unsigned grid, unsigned block, int warp, bool reverse,
                  void** args, char* err, size_t n) {
  struct Call {
    void (*fn)(P...);
    std::tuple<P...> values;
  } call{fn, unpack<P...>(args, std::index_sequence_for<P...>{})};
  auto body = [](void* ctx) {
    Call* c = static_cast<Call*>(ctx);
    std::apply(c->fn, c->values);
  };
  return run(grid, block, warp, reverse, body, &call, err, n);
}

template <class T>
inline std::string kind() {
  typedef std::remove_cv_t<T> U;
  if constexpr (std::is_pointer_v<U>) {
    return "p" + kind<std::remove_pointer_t<U>>();
  } else if constexpr (std::is_floating_point_v<U>) {
    return "f" + std::to_string(sizeof(U));
  } else if constexpr (std::is_integral_v<U>) {
    return (std::is_signed_v<U> ? "i" : "u") + std::to_string(sizeof(U));
  } else {
    return "h" + std::to_string(sizeof(U));  // __half
  }
}

// The parameter kinds of `fn`, space-separated: "pf4" (float*), "ph2" (__half*), "i8", "f8"...
template <class... P>
inline std::string signature(void (*)(P...)) {
  std::string s;
  ((s += (s.empty() ? "" : " ") + kind<P>()), ...);
  return s;
}

}  // namespace emu

#define threadIdx (::emu::g_cur->idx)
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
#define warpSize (::emu::g_warp_size)

inline void __syncthreads(int line = __builtin_LINE()) { ::emu::syncthreads(line); }
template <class V>
inline V __shfl_xor_sync(unsigned, V v, int lane_mask) {
  return ::emu::shfl_xor(v, lane_mask);
}
template <class V>
inline V __shfl_xor(V v, int lane_mask, int = 0) {
  return ::emu::shfl_xor(v, lane_mask);
}

// ---- bit casts and device math that glibc lacks ----------------------------------------------
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
// the round-to-nearest arithmetic intrinsics: x86-64's SSE arithmetic is IEEE, rounded once
// (and -ffp-contract=off keeps a * b + c two operations)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return sqrt(a); }

// ---- __half: IEEE binary16 storage, conversions rounded to nearest even ----------------------
struct __half {
  unsigned short x;
};

inline float __half2float(__half h) {
  const uint32_t s = (uint32_t)(h.x & 0x8000u) << 16, e = (h.x >> 10) & 0x1fu, m = h.x & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float v = (float)m * 5.9604644775390625e-8f;
    return s ? -v : v;
  }
  const uint32_t bits = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112u) << 23) | (m << 13));
  return __uint_as_float(bits);
}

inline __half __float2half_rn(float f) {
  const uint32_t x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  __half h;
  if (ax >= 0x7f800000u) {  // inf, or NaN (kept quiet, payload's top bits)
    h.x = (unsigned short)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
  } else if (ax >= 0x477ff000u) {  // >= 65520: rounds to infinity
    h.x = (unsigned short)(sign | 0x7c00u);
  } else if (ax <= 0x33000000u) {  // <= 2^-25: rounds to zero (2^-25 ties to even 0)
    h.x = (unsigned short)sign;
  } else if ((ax >> 23) < 113u) {  // half subnormal: units of 2^-24
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    h.x = (unsigned short)(sign | q);
  } else {
    uint32_t q = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;  // a carry moves into the exponent
    h.x = (unsigned short)(sign | q);
  }
  return h;
}

#endif  // DTM_EMU_NAMES_ONLY
#endif  // DTM_EMU_RUNTIME_H
