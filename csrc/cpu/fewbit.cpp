// Few-bit backward on the CPU (lowbit/fewbit.h): OpenMP over chunks of whole 8-code groups, so each
// chunk owns its bytes of the packed stream. The bit width is a template argument, so the code loops
// are fully unrolled and the compare-and-count form vectorises.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "avx512.h"
#include "kernels.h"
#include "lowbit/dispatch.h"
#include "lowbit/fewbit.h"
#include "lowbit/pack.h"
#include "pack_chunk.h"
#include "parallel.h"

namespace lowbit::cpu {
namespace {

// Up to 4 bits (15 boundaries), counting the boundaries < x element-wise is cheaper than a
// search and vectorises; above, the binary search of fewbit.h.
template <int kBits, typename T>
void encode_chunk(const T* x, int cnt, const float* bounds, uint32_t* codes) {
  constexpr int kBounds = (1 << kBits) - 1;
  if constexpr (kBits <= 4) {
    float b[kBounds];
    std::copy_n(bounds, kBounds, b);
    for (int j = 0; j < cnt; ++j) {
      const float v = to_float(x[j]);
      uint32_t c = 0;
      for (int i = 0; i < kBounds; ++i) c += static_cast<uint32_t>(v > b[i]);
      codes[j] = c;
    }
  } else {
    for (int j = 0; j < cnt; ++j) codes[j] = interval_code(to_float(x[j]), bounds, kBits);
  }
}

// out = grad * levels[code], decoding each 8-code group from one 64-bit word in registers.
template <int kBits, typename T>
void scale_chunk(const T* grad, const uint8_t* in, const float* levels, int cnt, T* out) {
  constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1u;
  const int full = cnt / kGroup;
  for (int g = 0; g < full; ++g) {
    uint64_t acc = 0;
    std::memcpy(&acc, in + g * kBits, kBits);
    const T* gr = grad + g * kGroup;
    T* o = out + g * kGroup;
    for (int k = 0; k < kGroup; ++k) o[k] = from_float<T>(to_float(gr[k]) * levels[(acc >> (kBits * k)) & kMask]);
  }
  if (cnt > full * kGroup) {
    uint32_t codes[kGroup];
    const int rest = cnt - full * kGroup;
    unpack_group(in + full * kBits, rest, kBits, codes);
    for (int k = 0; k < rest; ++k) {
      out[full * kGroup + k] = from_float<T>(to_float(grad[full * kGroup + k]) * levels[codes[k]]);
    }
  }
}

// Calls fn(std::integral_constant<int, B>{}) for B = bits (1 to kMaxFewbitBits; other widths read as
// the largest), so the loops see the width as a constant.
template <int B = 1, typename Fn>
void with_bits(int bits, Fn&& fn) {
  if constexpr (B == kMaxFewbitBits) {
    fn(std::integral_constant<int, B>{});
  } else if (bits == B) {
    fn(std::integral_constant<int, B>{});
  } else {
    with_bits<B + 1>(bits, std::forward<Fn>(fn));
  }
}

template <int kBits, typename T>
void encode_impl(const FewbitEncodeArgs& a, int threads) {
  const T* x = static_cast<const T*>(a.x);
  parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
    uint8_t* out = a.packed + lo / kGroup * kBits;
    int done = 0;
    if constexpr (kBits <= 4 && (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>)) {
      if (avx512_active()) {
        done = cnt - cnt % 16;
        fewbit_encode_avx512(kBits, x + lo, done, a.bounds, out);
      }
    }
    uint32_t codes[kChunk];
    encode_chunk<kBits>(x + lo + done, cnt - done, a.bounds, codes);
    pack_chunk(codes, cnt - done, std::integral_constant<int, kBits>{}, out + done / kGroup * kBits);
  });
}

template <int kBits, typename T>
void grad_impl(const FewbitGradArgs& a, int threads) {
  const T* grad = static_cast<const T*>(a.grad);
  T* out = static_cast<T*>(a.out);
  parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
    const uint8_t* in = a.packed + lo / kGroup * kBits;
    int done = 0;
    if constexpr (kBits <= 4 && (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>)) {
      if (avx512_active()) {
        done = cnt - cnt % 16;
        fewbit_grad_avx512(kBits, grad + lo, in, a.levels, done, out + lo);
      }
    }
    scale_chunk<kBits>(grad + lo + done, in + done / kGroup * kBits, a.levels, cnt - done, out + lo + done);
  });
}

}  // namespace

void fewbit_encode(const FewbitEncodeArgs& a, int threads) {
  with_bits(a.bits, [&](auto bits) { LB_DISPATCH_DTYPE(a.dtype, (encode_impl<decltype(bits)::value, scalar_t>(a, threads))); });
}

void fewbit_grad(const FewbitGradArgs& a, int threads) {
  with_bits(a.bits, [&](auto bits) { LB_DISPATCH_DTYPE(a.dtype, (grad_impl<decltype(bits)::value, scalar_t>(a, threads))); });
}

}  // namespace lowbit::cpu
