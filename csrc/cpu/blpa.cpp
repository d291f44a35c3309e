// Approximate-activation blocks on the CPU (lowbit/blpa.h). Every pass runs OpenMP over fixed chunks of
// whole 8-code groups and walks each chunk in runs of one channel, so the per-channel constants are
// scalars and the element loops vectorise. The backward reduction keeps one partial sum per chunk and
// channel (double, the fixed chunking of lowbit/blpa.h's kBlpaSumChunk) and adds them in chunk order, so
// results do not depend on the number of threads and equal the CUDA kernel's.
//
// Eight lanes as GCC vector types (the sum lanes of lowbit/blpa.h: one AVX-512 vector of doubles), so
// that every clone runs lowbit/blpa.h's element math eight elements at a time: GCC does not vectorise
// its scalar form (it turns the mask selects back into branches). The lane functions (the header's and
// this file's helpers) are always inlined, so no vector crosses a call: GCC's note that the baseline
// clone passes 32-byte vectors differently from AVX code (-Wpsabi) concerns no real call.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "lowbit/blpa.h"
#include "lowbit/dispatch.h"
#include "lowbit/pack.h"
#include "pack_chunk.h"
#include "parallel.h"

// Compiled for baseline x86-64 with AVX2 and AVX-512 clones chosen at load time, as encode.cpp's loops;
// all clones give identical results (the same IEEE operations, no contraction). The chunk loops stay in
// the cloned functions (not parallel.h's parallel_chunks) so that their bodies are compiled per clone.
#if defined(__x86_64__) && defined(__GNUC__)
#define LB_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define LB_INLINE __attribute__((always_inline))
#else
#define LB_CLONES
#define LB_INLINE
#endif

namespace lowbit {
namespace {
using V8f = float __attribute__((vector_size(32)));
using V8i = int32_t __attribute__((vector_size(32)));
using V8d = double __attribute__((vector_size(64)));
constexpr int kLanes = 8;
static_assert(kBlpaSumLanes == kLanes, "the CPU's sum lanes are eight doubles");
}  // namespace

// lowbit/blpa.h's lanes of eight floats: masks are vectors of -1 and 0, conversions lane by lane.
template <>
struct BlpaLanes<V8f> {
  using Int = V8i;
  static LB_INLINE inline V8i trunc(V8f v) { return __builtin_convertvector(v, V8i); }
  static LB_INLINE inline V8f to_float(V8i i) { return __builtin_convertvector(i, V8f); }
  static LB_INLINE inline V8d widen(V8f v) { return __builtin_convertvector(v, V8d); }
  static LB_INLINE inline V8i splat_mask(bool b) { return V8i{} + (b ? -1 : 0); }
};

namespace cpu {
namespace {

struct Grid {
  const float* t;
  const float* o;
  const float* h;
  const float* side;
  explicit Grid(const BlpaArgs& a)
      : t(a.grid), o(a.grid + a.channels), h(a.grid + 2 * a.channels), side(a.grid + 3 * a.channels) {}
};

// Calls fn(offset, length, channel) for the runs of one channel in elements [lo, lo + cnt).
template <typename Fn>
LB_INLINE inline void for_runs(int64_t lo, int cnt, int64_t channels, int64_t inner, Fn&& fn) {
  int64_t c = (lo / inner) % channels;
  int64_t s = lo % inner;
  for (int j = 0; j < cnt;) {
    const int len = static_cast<int>(std::min<int64_t>(cnt - j, inner - s));
    fn(j, len, c);
    j += len;
    s = 0;
    c = c + 1 == channels ? 0 : c + 1;
  }
}

// Calls fn(std::integral_constant<int, B>{}) for B = bits (1 to 8), so that the packing loops see the
// width as a constant (pack_chunk.h: constant shifts and byte counts instead of per-group variable ones).
template <int B = 1, typename Fn>
void with_bits(int bits, Fn&& fn) {
  if constexpr (B == 8) {
    fn(std::integral_constant<int, B>{});
  } else if (bits == B) {
    fn(std::integral_constant<int, B>{});
  } else {
    with_bits<B + 1>(bits, std::forward<Fn>(fn));
  }
}

template <typename T>
LB_INLINE inline V8f load8(const T* p, int cnt) {
  float f[kLanes] = {};
  for (int k = 0; k < cnt; ++k) f[k] = to_float(p[k]);
  V8f v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

template <>
LB_INLINE inline V8f load8(const float* p, int cnt) {
  float f[kLanes] = {};
  if (cnt == kLanes) {
    std::memcpy(f, p, sizeof f);
  } else {
    std::copy(p, p + cnt, f);
  }
  V8f v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

// Stores lanes [0, cnt) of v to p in T.
template <typename T>
LB_INLINE inline void store8(V8f v, T* p, int cnt) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, static_cast<size_t>(cnt) * sizeof(float));
  } else {
    for (int k = 0; k < cnt; ++k) p[k] = from_float<T>(v[k]);
  }
}

// Stores codes [0, cnt) of q (0..255, so their int and uint32_t bits agree).
LB_INLINE inline void store8(V8i q, uint32_t* p, int cnt) {
  std::memcpy(p, &q, static_cast<size_t>(cnt) * sizeof(uint32_t));
}

// Unpacks a chunk's cnt codes that start at in (its first byte) to floats (exact: codes are below 256),
// a whole group of eight through one 64-bit word and one vector of shifts, so that the element loops
// load codes as ready lane values.
template <typename Bits>
LB_INLINE inline void unpack_codes(const uint8_t* in, int cnt, Bits bits, float* q) {
  using V8u = uint64_t __attribute__((vector_size(64)));
  const V8u shifts = V8u{0, 1, 2, 3, 4, 5, 6, 7} * static_cast<uint64_t>(bits);
  const uint64_t mask = (uint64_t{1} << bits) - 1u;
  const int full = cnt / kGroup;
  for (int g = 0; g < full; ++g) {
    uint64_t acc = 0;
    std::memcpy(&acc, in + g * bits, bits);
    const V8i codes = __builtin_convertvector(((V8u{} + acc) >> shifts) & mask, V8i);
    const V8f f = __builtin_convertvector(codes, V8f);
    std::memcpy(q + g * kGroup, &f, sizeof f);
  }
  if (cnt > full * kGroup) {
    uint32_t rest[kGroup];
    unpack_group(in + full * bits, cnt - full * kGroup, bits, rest);
    for (int k = 0; k < cnt - full * kGroup; ++k) q[full * kGroup + k] = blpa_code_float(rest[k]);
  }
}

// Calls body(j, cnt) over a run of len elements: whole vectors of kLanes (cnt a constant), then one
// partial vector, so that the body is compiled once for full vectors and once for the tail.
template <typename Body>
LB_INLINE inline void for_lanes(int len, Body&& body) {
  int j = 0;
  for (; len - j >= kLanes; j += kLanes) body(j, kLanes);
  if (j < len) body(j, len - j);
}

template <typename T, typename Bits>
LB_CLONES void encode_impl(const BlpaArgs& a, Bits bits, int threads) {
  const T* x = static_cast<const T*>(a.x);
  const T* a2 = static_cast<const T*>(a.a2);
  const Grid g(a);
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, a.n))
  for (int64_t ch = 0; ch < chunks_of(a.n); ++ch) {
    const int64_t lo = ch * kChunk;
    const int cnt = chunk_length(a.n, lo);
    uint32_t codes[kChunk];
    for_runs(lo, cnt, a.channels, a.inner, [&](int j0, int len, int64_t c) LB_INLINE {
      const float mean = a.mean[c], invstd = a.invstd[c], t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c];
      const T* xs = x + lo + j0;
      const T* ps = a2 + lo + j0;
      for_lanes(len, [&](int j, int m) LB_INLINE {
        const V8f a1 = (load8(xs + j, m) - mean) * invstd;
        store8(blpa_code(a1, load8(ps + j, m) > 0.0f, t, o, h, side, bits), codes + j0 + j, m);
      });
    });
    pack_chunk(codes, cnt, bits, a.codes_out + lo / kGroup * bits);
  }
}

template <typename T, typename Bits>
LB_CLONES void decode_impl(const BlpaArgs& a, Bits bits, int threads) {
  T* out = static_cast<T*>(a.out);
  const Grid g(a);
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, a.n))
  for (int64_t ch = 0; ch < chunks_of(a.n); ++ch) {
    const int64_t lo = ch * kChunk;
    const int cnt = chunk_length(a.n, lo);
    float codes[kChunk];
    unpack_codes(a.codes_in + lo / kGroup * bits, cnt, bits, codes);
    for_runs(lo, cnt, a.channels, a.inner, [&](int j0, int len, int64_t c) LB_INLINE {
      const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], gm = a.gamma[c], b = a.beta[c];
      for_lanes(len, [&](int j, int m) LB_INLINE {
        store8(blpa_relu_value(load8(codes + j0 + j, m), t, o, h, side, gm, b), out + lo + j0 + j, m);
      });
    });
  }
}

template <typename T, typename Bits>
LB_CLONES void backward_impl(const BlpaArgs& a, Bits bits, int threads) {
  const T* grad = static_cast<const T*>(a.grad);
  T* out = static_cast<T*>(a.out);
  const Grid g(a);
  const int64_t channels = a.channels;
  // Pass 1: per chunk and channel, sum(mask * g) and sum(mask * g * a1), in the order of lowbit/blpa.h
  // (the CUDA kernel's), whose chunks are this file's.
  static_assert(kBlpaSumChunk == kChunk, "the backward sums add per chunk of lowbit/blpa.h");
  const int64_t nchunks = chunks_of(a.n);
  std::vector<double> partial(static_cast<size_t>(nchunks * channels * 2), 0.0);
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, a.n))
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t lo = ch * kChunk;
    const int cnt = chunk_length(a.n, lo);
    float codes[kChunk];
    unpack_codes(a.codes_in + lo / kGroup * bits, cnt, bits, codes);
    double* p = partial.data() + ch * channels * 2;
    for_runs(lo, cnt, channels, a.inner, [&](int j0, int len, int64_t c) LB_INLINE {
      // blpa_add_run's lane order: lane k holds the run's elements k, k + 8, ... The lanes past a run's
      // end in its last vector load code 0 and gradient +0.0, so they add +0.0 * value, a zero, which
      // changes no lane sum (lowbit/blpa.h: a lane sum that starts at +0.0 is never -0.0).
      const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], b = a.beta[c];
      V8d s1 = {}, s2 = {};
      for_lanes(len, [&](int j, int m) LB_INLINE {
        blpa_add_element(load8(codes + j0 + j, m), load8(grad + lo + j0 + j, m), t, o, h, side, b, s1, s2);
      });
      double l1[kLanes], l2[kLanes];
      std::memcpy(l1, &s1, sizeof l1);
      std::memcpy(l2, &s2, sizeof l2);
      p[2 * c] += blpa_lane_sum(l1);
      p[2 * c + 1] += blpa_lane_sum(l2);
    });
  }
  const double m = static_cast<double>(a.n / channels);
  std::vector<float> k1(static_cast<size_t>(channels)), k2(static_cast<size_t>(channels));
  for (int64_t c = 0; c < channels; ++c) {
    double s1 = 0.0, s2 = 0.0;
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      s1 += partial[static_cast<size_t>((ch * channels + c) * 2)];
      s2 += partial[static_cast<size_t>((ch * channels + c) * 2 + 1)];
    }
    a.g_beta[c] = static_cast<float>(s1);
    a.g_gamma[c] = static_cast<float>(s2);
    // Eq. 8 with mean(g_a1) = gamma s1 / m and mean(a1 g_a1) = gamma s2 / m, from the float sums as the
    // CUDA kernel computes them.
    k1[c] = a.batch_stats ? blpa_mean_term(a.gamma[c], a.g_beta[c], m) : 0.0f;
    k2[c] = a.batch_stats ? blpa_mean_term(a.gamma[c], a.g_gamma[c], m) : 0.0f;
  }
  // Pass 2: dL/dx element-wise.
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, a.n))
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t lo = ch * kChunk;
    const int cnt = chunk_length(a.n, lo);
    float codes[kChunk];
    unpack_codes(a.codes_in + lo / kGroup * bits, cnt, bits, codes);
    for_runs(lo, cnt, channels, a.inner, [&](int j0, int len, int64_t c) LB_INLINE {
      const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], b = a.beta[c], gm = a.gamma[c];
      const float inv = a.invstd[c], c1 = k1[c], c2 = k2[c];
      const int64_t e = lo + j0;
      for_lanes(len, [&](int j, int n) LB_INLINE {
        const V8f q = load8(codes + j0 + j, n);
        store8(blpa_input_grad(q, load8(grad + e + j, n), t, o, h, side, gm, b, inv, c1, c2), out + e + j, n);
      });
    });
  }
}

}  // namespace

void blpa_encode(const BlpaArgs& a, int threads) {
  with_bits(a.bits, [&](auto bits) { LB_DISPATCH_DTYPE(a.dtype, (encode_impl<scalar_t>(a, bits, threads))); });
}

void blpa_decode(const BlpaArgs& a, int threads) {
  with_bits(a.bits, [&](auto bits) { LB_DISPATCH_DTYPE(a.dtype, (decode_impl<scalar_t>(a, bits, threads))); });
}

void blpa_backward(const BlpaArgs& a, int threads) {
  with_bits(a.bits, [&](auto bits) { LB_DISPATCH_DTYPE(a.dtype, (backward_impl<scalar_t>(a, bits, threads))); });
}

}  // namespace cpu
}  // namespace lowbit
