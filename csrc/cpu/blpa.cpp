// Approximate-activation blocks on the CPU (lowbit/blpa.h). Every pass runs OpenMP over fixed chunks of
// whole 8-code groups and walks each chunk in runs of one channel, so the per-channel constants are
// scalars and the element loops vectorise. The backward reduction keeps one partial sum per chunk and
// channel (double, the fixed chunking of lowbit/blpa.h's kBlpaSumChunk) and adds them in chunk order, so
// results do not depend on the number of threads and equal the CUDA kernel's.
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

namespace lowbit::cpu {
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

// Eight lanes as GCC vector types (the sum lanes of lowbit/blpa.h: one AVX-512 vector of doubles), so
// that every clone computes the backward's lane sums and element-wise gradient eight elements at a time:
// GCC does not vectorise blpa_add_run's scalar form (it turns the mask selects back into branches).
// Element-wise the operations are those of lowbit/blpa.h, in the same order.
// The helpers below are always inlined, so no vector crosses a call: GCC's note that the baseline
// clone passes 32-byte vectors differently from AVX code (-Wpsabi) concerns no real call.
#pragma GCC diagnostic ignored "-Wpsabi"
using V8f = float __attribute__((vector_size(32)));
using V8i = int32_t __attribute__((vector_size(32)));
using V8d = double __attribute__((vector_size(64)));
static_assert(kBlpaSumLanes == 8, "the CPU's sum lanes are eight doubles");

// Elements [0, cnt) of p as floats, lanes from cnt on 0 (cnt <= 8).
template <typename T>
LB_INLINE inline V8f load8(const T* p, int cnt) {
  float f[kBlpaSumLanes] = {};
  for (int k = 0; k < cnt; ++k) f[k] = to_float(p[k]);
  V8f v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

template <>
LB_INLINE inline V8f load8(const float* p, int cnt) {
  if (cnt == kBlpaSumLanes) {
    V8f v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  float f[kBlpaSumLanes] = {};
  std::copy(p, p + cnt, f);
  V8f v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

// Stores eight values to p in T.
template <typename T>
LB_INLINE inline void store8(V8f v, T* p) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else {
    for (int k = 0; k < kBlpaSumLanes; ++k) p[k] = from_float<T>(v[k]);
  }
}

// A code back from unpack_codes' float.
LB_INLINE inline uint32_t code_of(float q) { return static_cast<uint32_t>(static_cast<int>(q)); }

// Unpacks a chunk's cnt codes that start at in (its first byte) to floats (exact: codes are below 256),
// a whole group of eight through one 64-bit word and one vector of shifts, so that the element loops
// load codes as ready floats.
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
    for (int k = 0; k < cnt - full * kGroup; ++k) q[full * kGroup + k] = static_cast<float>(static_cast<int>(rest[k]));
  }
}

// Codes [0, cnt) of p (as unpack_codes leaves them), lanes from cnt on 0.
LB_INLINE inline V8f codes8(const float* p, int cnt) { return load8(p, cnt); }

// blpa_mask of eight codes q (all lanes -1 or 0), its side cases hoisted out of the loops:
// (q >= o) != (side < 0), or beta > 0 where side == 0.
LB_INLINE inline V8i mask8(V8f q, float o, float side, float beta) {
  const V8f ov = V8f{} + o;
  if (side == 0.0f) return V8i{} + (beta > 0.0f ? -1 : 0);
  return side < 0.0f ? ~(q >= ov) : (q >= ov);
}

// blpa_value of eight codes: t + ((q - o) + 0.5) * h.
LB_INLINE inline V8f value8(V8f q, float t, float o, float h) { return t + ((q - o) + 0.5f) * h; }

// Adds cnt (<= 8) elements to lanes 0..cnt-1 of s1 and s2 as blpa_add_element; the other lanes add
// +0.0, which changes no lane sum (lowbit/blpa.h).
template <typename T>
LB_INLINE inline void add8(const float* cs, const T* gs, int cnt, float t, float o, float h, float side, float beta,
                           V8d& s1, V8d& s2) {
  const V8f q = codes8(cs, cnt);
  V8i m = mask8(q, o, side, beta);
  if (cnt < kBlpaSumLanes) {
    const V8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    m &= lane < cnt;
  }
  const V8f g = m ? load8(gs, cnt) : V8f{};
  const V8f v = m ? value8(q, t, o, h) : V8f{};
  const V8d gd = __builtin_convertvector(g, V8d);
  s1 += gd;
  s2 += gd * __builtin_convertvector(v, V8d);
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
      uint32_t* cs = codes + j0;
      // blpa_code of eight elements, its side cases hoisted: with side 0 the codes are clipped to
      // [0, 2^bits - 1]; otherwise to [o, 2^bits - 1] where a2 > 0 agrees with the sign of gamma, else
      // to [0, o - 1].
      const float top = static_cast<float>((1 << bits) - 1);
      const V8i flip = V8i{} + (side < 0.0f ? -1 : 0);
      int j = 0;
      for (; len - j >= kBlpaSumLanes; j += kBlpaSumLanes) {
        V8f v = ((load8(xs + j, kBlpaSumLanes) - mean) * invstd - t) / h;
        v = v > -512.0f ? v : V8f{} - 512.0f;
        v = v < 512.0f ? v : V8f{} + 512.0f;
        const V8i truncated = __builtin_convertvector(v, V8i);
        const V8i ceiling = truncated - (__builtin_convertvector(truncated, V8f) < v);  // true lanes are -1
        V8f raw = (__builtin_convertvector(ceiling, V8f) - 1.0f) + o;
        V8f lo_code = V8f{}, hi_code = V8f{} + top;
        if (side != 0.0f) {
          const V8i above = (load8(ps + j, kBlpaSumLanes) > 0.0f) ^ flip;
          lo_code = above ? V8f{} + o : V8f{};
          hi_code = above ? V8f{} + top : V8f{} + (o - 1.0f);
        }
        raw = raw < lo_code ? lo_code : raw;
        raw = raw > hi_code ? hi_code : raw;
        const V8i q = __builtin_convertvector(raw, V8i);
        std::memcpy(cs + j, &q, sizeof q);
      }
      for (; j < len; ++j) {
        cs[j] = blpa_code((to_float(xs[j]) - mean) * invstd, to_float(ps[j]) > 0.0f, t, o, h, side, bits);
      }
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
      T* os = out + lo + j0;
      const float* cs = codes + j0;
      int j = 0;
      for (; len - j >= kBlpaSumLanes; j += kBlpaSumLanes) {
        // blpa_relu_value of eight codes.
        const V8f q = codes8(cs + j, kBlpaSumLanes);
        const V8f v = gm * value8(q, t, o, h) + b;
        const V8f r = mask8(q, o, side, b) ? (v < 0.0f ? V8f{} : v) : V8f{};
        store8(r, os + j);
      }
      for (; j < len; ++j) os[j] = from_float<T>(blpa_relu_value(code_of(cs[j]), t, o, h, side, gm, b));
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
      // blpa_add_run's lane order: lane k holds the run's elements k, k + 8, ...
      const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], b = a.beta[c];
      V8d s1 = {}, s2 = {};
      int j = 0;
      for (; len - j >= kBlpaSumLanes; j += kBlpaSumLanes) {
        add8(codes + j0 + j, grad + lo + j0 + j, kBlpaSumLanes, t, o, h, side, b, s1, s2);
      }
      if (j < len) add8(codes + j0 + j, grad + lo + j0 + j, len - j, t, o, h, side, b, s1, s2);
      double l1[kBlpaSumLanes], l2[kBlpaSumLanes];
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
    k1[c] = a.batch_stats ? static_cast<float>(a.gamma[c] * static_cast<double>(a.g_beta[c]) / m) : 0.0f;
    k2[c] = a.batch_stats ? static_cast<float>(a.gamma[c] * static_cast<double>(a.g_gamma[c]) / m) : 0.0f;
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
      const T* gs = grad + lo + j0;
      T* os = out + lo + j0;
      const float* cs = codes + j0;
      int j = 0;
      for (; len - j >= kBlpaSumLanes; j += kBlpaSumLanes) {
        const V8f q = codes8(cs + j, kBlpaSumLanes);
        const V8f ga1 = mask8(q, o, side, b) ? gm * load8(gs + j, kBlpaSumLanes) : V8f{};
        const V8f r = inv * ((ga1 - c1) - value8(q, t, o, h) * c2);
        store8(r, os + j);
      }
      for (; j < len; ++j) {
        const uint32_t q = code_of(cs[j]);
        const float ga1 = blpa_mask(q, o, side, b) ? gm * to_float(gs[j]) : 0.0f;
        os[j] = from_float<T>(inv * ((ga1 - c1) - blpa_value(q, t, o, h) * c2));
      }
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

}  // namespace lowbit::cpu
