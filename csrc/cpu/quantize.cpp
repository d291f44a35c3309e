// CPU loops for block-wise quantization: OpenMP over blocks. Each block is read once for its
// absmax and again, while still in L1, in tiles: a vectorisable pass normalises a tile, then a
// scalar pass finds codes (map_index.h) and packs them.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernels.h"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/pack.h"
#include "lowbit/qmap.h"
#include "lowbit/rounding.h"
#include "avx512.h"
#include "encode.h"
#include "map_index.h"
#include "parallel.h"

namespace lowbit::cpu {
namespace {

template <typename T>
uint32_t absmax_bits(const T* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, abs_bits(to_float(x[i])));
  return m;
}

// Encodes x[begin, end) of one block; begin is a multiple of kGroup.
template <bool kSR, typename T, typename Span>
void encode_range(const T* x, int64_t begin, int64_t end, float absmax, const Span& span, int bits, RngKey key,
                  uint64_t offset, uint8_t* out) {
  uint32_t codes[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, end - t));
    span.template encode<kSR>(x + t, cnt, absmax, key, offset + static_cast<uint64_t>(t), codes);
    store_codes(codes, cnt, bits, t, out);
  }
}

template <typename T, typename Coder>
void decode_range(const uint8_t* in, int64_t begin, int64_t end, float absmax, const Coder& coder, int bits, T* out) {
  uint32_t codes[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, end - t));
    load_codes(in, cnt, bits, t, codes);
    if constexpr (std::is_same_v<Coder, LinearCoder>) {
      // The vectorised decoder (encode.cpp), straight into fp32 output or through a tile.
      if constexpr (std::is_same_v<T, float>) {
        linear_values(codes, cnt, absmax, coder.qmax, out + t);
      } else {
        float v[kTile];
        linear_values(codes, cnt, absmax, coder.qmax, v);
        for (int j = 0; j < cnt; ++j) out[t + j] = from_float<T>(v[j]);
      }
    } else {
      for (int j = 0; j < cnt; ++j) out[t + j] = from_float<T>(coder.decode(codes[j], absmax));
    }
  }
}

template <bool kSR, typename T, typename Span>
void quantize_impl(const QuantizeArgs& a, const Span& span, int threads) {
  const T* x = static_cast<const T*>(a.x);
  const int64_t n = a.n;
  const RngKey key = rng_key(a.seed);
  const bool par = run_parallel(threads, n);
  if (a.blocksize > 0) {
    const int64_t bs = a.blocksize;
    const int64_t nblocks = (n + bs - 1) / bs;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t lo = b * bs;
      const int64_t hi = std::min(n, lo + bs);
      const float amax = absmax_from_bits(absmax_bits(x + lo, hi - lo));
      a.absmax[b] = amax;
      encode_range<kSR>(x, lo, hi, amax, span, a.bits, key, a.offset, a.out);
    }
    return;
  }
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  uint32_t m = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (par) reduction(max : m)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * kChunk;
    m = std::max(m, absmax_bits(x + lo, std::min(n, lo + kChunk) - lo));
  }
  const float amax = absmax_from_bits(m);
  a.absmax[0] = amax;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * kChunk;
    encode_range<kSR>(x, lo, std::min(n, lo + kChunk), amax, span, a.bits, key, a.offset, a.out);
  }
}

template <typename T, typename Coder>
void dequantize_impl(const DequantizeArgs& a, const Coder& coder, int threads) {
  T* out = static_cast<T*>(a.out);
  const int64_t n = a.n;
  const int64_t len = a.blocksize > 0 ? a.blocksize : kChunk;
  const int64_t nspans = (n + len - 1) / len;
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, n))
  for (int64_t s = 0; s < nspans; ++s) {
    const int64_t lo = s * len;
    decode_range(a.in, lo, std::min(n, lo + len), a.absmax[a.blocksize > 0 ? s : 0], coder, a.bits, out);
  }
}

// Calls fn with the span coder for this map (map_n > 0) or for the linear quantizer.
template <typename Fn>
void with_span(const float* map, int64_t map_n, int bits, Fn&& fn) {
  if (map_n > 0) {
    const auto index = map_index(map, static_cast<uint32_t>(map_n));
    // Decided (and on first use timed) here, outside the parallel loops.
    fn(MapSpan{*index, gather_encode_active()});
  } else {
    fn(LinearSpan{static_cast<float>((1 << (bits - 1)) - 1)});
  }
}

}  // namespace

void quantize(const QuantizeArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, with_span(a.map, a.map_n, a.bits, [&](const auto& span) {
    if (a.stochastic) {
      quantize_impl<true, scalar_t>(a, span, threads);
    } else {
      quantize_impl<false, scalar_t>(a, span, threads);
    }
  }));
}

void dequantize(const DequantizeArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, {
    if (a.map_n > 0) {
      dequantize_impl<scalar_t>(a, MapCoder{a.map, static_cast<uint32_t>(a.map_n)}, threads);
    } else {
      dequantize_impl<scalar_t>(a, LinearCoder{static_cast<float>((1 << (a.bits - 1)) - 1)}, threads);
    }
  });
}

void pack_bits(const PackArgs& a, int threads) {
  parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
    uint32_t codes[kChunk];
    for (int j = 0; j < cnt; ++j) codes[j] = a.in[lo + j] & ((1u << a.bits) - 1u);
    store_codes(codes, cnt, a.bits, lo, a.out);
  });
}

void unpack_bits(const PackArgs& a, int threads) {
  parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
    uint32_t codes[kChunk];
    load_codes(a.in, cnt, a.bits, lo, codes);
    for (int j = 0; j < cnt; ++j) a.out[lo + j] = static_cast<uint8_t>(codes[j]);
  });
}

}  // namespace lowbit::cpu
