// Approximate-activation blocks on the CPU (lowbit/blpa.h). Every pass runs OpenMP over fixed chunks of
// whole 8-code groups and walks each chunk in runs of one channel, so the per-channel constants are
// scalars and the element loops vectorise. The backward reduction keeps one partial sum per chunk and
// channel (double, the fixed chunking of lowbit/blpa.h's kBlpaSumChunk) and adds them in chunk order, so
// results do not depend on the number of threads and equal the CUDA kernel's.
#include <algorithm>
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

template <typename T>
LB_CLONES void encode_impl(const BlpaArgs& a, int threads) {
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
      for (int j = 0; j < len; ++j) {
        cs[j] = blpa_code((to_float(xs[j]) - mean) * invstd, to_float(ps[j]) > 0.0f, t, o, h, side, a.bits);
      }
    });
    pack_chunk(codes, cnt, a.bits, a.codes_out + lo / kGroup * a.bits);
  }
}

template <typename T>
LB_CLONES void decode_impl(const BlpaArgs& a, int threads) {
  T* out = static_cast<T*>(a.out);
  const Grid g(a);
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, a.n))
  for (int64_t ch = 0; ch < chunks_of(a.n); ++ch) {
    const int64_t lo = ch * kChunk;
    const int cnt = chunk_length(a.n, lo);
    uint32_t codes[kChunk];
    unpack_chunk(a.codes_in + lo / kGroup * a.bits, cnt, a.bits, codes);
    for_runs(lo, cnt, a.channels, a.inner, [&](int j0, int len, int64_t c) LB_INLINE {
      const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], gm = a.gamma[c], b = a.beta[c];
      T* os = out + lo + j0;
      const uint32_t* cs = codes + j0;
      for (int j = 0; j < len; ++j) os[j] = from_float<T>(blpa_relu_value(cs[j], t, o, h, side, gm, b));
    });
  }
}

template <typename T>
LB_CLONES void backward_impl(const BlpaArgs& a, int threads) {
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
    uint32_t codes[kChunk];
    unpack_chunk(a.codes_in + lo / kGroup * a.bits, cnt, a.bits, codes);
    double* p = partial.data() + ch * channels * 2;
    const auto code = [&](int j) LB_INLINE { return codes[j]; };
    const auto gv = [&](int j) LB_INLINE { return to_float(grad[lo + j]); };
    for_runs(lo, cnt, channels, a.inner, [&](int j0, int len, int64_t c) LB_INLINE {
      blpa_add_run(j0, j0 + len, code, gv, g.t[c], g.o[c], g.h[c], g.side[c], a.beta[c], p + 2 * c);
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
    uint32_t codes[kChunk];
    unpack_chunk(a.codes_in + lo / kGroup * a.bits, cnt, a.bits, codes);
    for_runs(lo, cnt, channels, a.inner, [&](int j0, int len, int64_t c) LB_INLINE {
      const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], b = a.beta[c], gm = a.gamma[c];
      const float inv = a.invstd[c], c1 = k1[c], c2 = k2[c];
      const T* gs = grad + lo + j0;
      T* os = out + lo + j0;
      const uint32_t* cs = codes + j0;
      for (int j = 0; j < len; ++j) {
        const float ga1 = blpa_mask(cs[j], o, side, b) ? gm * to_float(gs[j]) : 0.0f;
        os[j] = from_float<T>(inv * ((ga1 - c1) - blpa_value(cs[j], t, o, h) * c2));
      }
    });
  }
}

}  // namespace

void blpa_encode(const BlpaArgs& a, int threads) { LB_DISPATCH_DTYPE(a.dtype, (encode_impl<scalar_t>(a, threads))); }

void blpa_decode(const BlpaArgs& a, int threads) { LB_DISPATCH_DTYPE(a.dtype, (decode_impl<scalar_t>(a, threads))); }

void blpa_backward(const BlpaArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, (backward_impl<scalar_t>(a, threads)));
}

}  // namespace lowbit::cpu
