// CPU loops for block-wise quantization: OpenMP over blocks, each block read once for its absmax
// and once more, while still in L1, to encode and pack.
#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/pack.h"
#include "lowbit/rounding.h"

namespace lowbit::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;
// Work unit for tensor-wise blocks and for packing: a multiple of kGroup that fits in L1.
constexpr int64_t kChunk = 4096;

template <typename T>
uint32_t absmax_bits(const T* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, abs_bits(to_float(x[i])));
  return m;
}

// Encodes x[begin, end) of one block; begin is a multiple of kGroup so that packed output starts
// on a byte boundary.
template <bool kSR, typename T, typename Coder>
void encode_span(const T* x, int64_t begin, int64_t end, float absmax, const Coder& coder, int bits,
                 uint64_t key, uint64_t offset, uint8_t* out) {
  if (bits == 8) {
    for (int64_t i = begin; i < end; ++i) {
      const float u = kSR ? uniform01(key, offset + static_cast<uint64_t>(i)) : 0.f;
      out[i] = static_cast<uint8_t>(coder.template encode<kSR>(to_float(x[i]), absmax, u));
    }
    return;
  }
  uint32_t c[kGroup];
  for (int64_t g = begin; g < end; g += kGroup) {
    const int cnt = static_cast<int>(std::min<int64_t>(kGroup, end - g));
    for (int k = 0; k < cnt; ++k) {
      const float u = kSR ? uniform01(key, offset + static_cast<uint64_t>(g + k)) : 0.f;
      c[k] = coder.template encode<kSR>(to_float(x[g + k]), absmax, u);
    }
    pack_group(c, cnt, bits, out + (g / kGroup) * bits);
  }
}

template <typename T, typename Coder>
void decode_span(const uint8_t* in, int64_t begin, int64_t end, float absmax, const Coder& coder, int bits,
                 T* out) {
  if (bits == 8) {
    for (int64_t i = begin; i < end; ++i) out[i] = from_float<T>(coder.decode(in[i], absmax));
    return;
  }
  uint32_t c[kGroup];
  for (int64_t g = begin; g < end; g += kGroup) {
    const int cnt = static_cast<int>(std::min<int64_t>(kGroup, end - g));
    unpack_group(in + (g / kGroup) * bits, cnt, bits, c);
    for (int k = 0; k < cnt; ++k) out[g + k] = from_float<T>(coder.decode(c[k], absmax));
  }
}

template <bool kSR, typename T, typename Coder>
void quantize_impl(const QuantizeArgs& a, const Coder& coder, int threads) {
  const T* x = static_cast<const T*>(a.x);
  const int64_t n = a.n;
  const uint64_t key = rng_key(a.seed);
  const bool par = threads > 1 && n >= kParallelMin;
  if (a.blocksize > 0) {
    const int64_t bs = a.blocksize;
    const int64_t nblocks = (n + bs - 1) / bs;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t lo = b * bs;
      const int64_t hi = std::min(n, lo + bs);
      const float amax = absmax_from_bits(absmax_bits(x + lo, hi - lo));
      a.absmax[b] = amax;
      encode_span<kSR>(x, lo, hi, amax, coder, a.bits, key, a.offset, a.out);
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
    encode_span<kSR>(x, lo, std::min(n, lo + kChunk), amax, coder, a.bits, key, a.offset, a.out);
  }
}

template <typename T, typename Coder>
void dequantize_impl(const DequantizeArgs& a, const Coder& coder, int threads) {
  T* out = static_cast<T*>(a.out);
  const int64_t n = a.n;
  const int64_t span = a.blocksize > 0 ? a.blocksize : kChunk;
  const int64_t nspans = (n + span - 1) / span;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= kParallelMin)
  for (int64_t s = 0; s < nspans; ++s) {
    const int64_t lo = s * span;
    const float amax = a.absmax[a.blocksize > 0 ? s : 0];
    decode_span(a.in, lo, std::min(n, lo + span), amax, coder, a.bits, out);
  }
}

template <typename Fn>
void with_coder(const float* map, int64_t map_n, int bits, Fn&& fn) {
  if (map_n > 0) {
    fn(MapCoder{map, static_cast<uint32_t>(map_n)});
  } else {
    fn(LinearCoder{static_cast<float>((1 << (bits - 1)) - 1)});
  }
}

}  // namespace

void quantize(const QuantizeArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, with_coder(a.map, a.map_n, a.bits, [&](const auto& coder) {
    if (a.stochastic) {
      quantize_impl<true, scalar_t>(a, coder, threads);
    } else {
      quantize_impl<false, scalar_t>(a, coder, threads);
    }
  }));
}

void dequantize(const DequantizeArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, with_coder(a.map, a.map_n, a.bits, [&](const auto& coder) {
    dequantize_impl<scalar_t>(a, coder, threads);
  }));
}

void pack_bits(const PackArgs& a, int threads) {
  const int64_t nchunks = (a.n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && a.n >= kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t end = std::min(a.n, (c + 1) * kChunk);
    uint32_t codes[kGroup];
    for (int64_t g = c * kChunk; g < end; g += kGroup) {
      const int cnt = static_cast<int>(std::min<int64_t>(kGroup, end - g));
      for (int k = 0; k < cnt; ++k) codes[k] = a.in[g + k] & ((1u << a.bits) - 1u);
      pack_group(codes, cnt, a.bits, a.out + (g / kGroup) * a.bits);
    }
  }
}

void unpack_bits(const PackArgs& a, int threads) {
  const int64_t nchunks = (a.n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && a.n >= kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t end = std::min(a.n, (c + 1) * kChunk);
    uint32_t codes[kGroup];
    for (int64_t g = c * kChunk; g < end; g += kGroup) {
      const int cnt = static_cast<int>(std::min<int64_t>(kGroup, end - g));
      unpack_group(a.in + (g / kGroup) * a.bits, cnt, a.bits, codes);
      for (int k = 0; k < cnt; ++k) a.out[g + k] = static_cast<uint8_t>(codes[k]);
    }
  }
}

}  // namespace lowbit::cpu
