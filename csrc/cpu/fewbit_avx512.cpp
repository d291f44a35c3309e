// AVX-512 few-bit kernels for fp32 and 1-4 bit codes (fewbit.cpp keeps the portable loops and the
// other cases). Encoding counts the boundaries below 16 inputs at once and merges each 8-code group
// into one word with per-lane shifts and an in-register OR tree; decoding spreads a group word over
// 8 lanes with per-lane shifts and looks the levels up with one permute, the 2**bits <= 16 levels
// sitting in one register. Results equal the portable loops bit for bit (the same compares, the same
// IEEE multiply; tests run both paths).
#include <cstring>

#include "avx512.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LB_AVX512 1
#endif

namespace lowbit::cpu {

#ifdef LB_AVX512

#define LB_TARGET __attribute__((target("avx512f")))

namespace {

// Lane k of each 8-lane half holds a code's offset kBits * k within its group word.
template <int kBits>
LB_TARGET inline __m512i group_shifts() {
  return _mm512_setr_epi32(0, kBits, 2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits, 6 * kBits, 7 * kBits, 0, kBits,
                           2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits, 6 * kBits, 7 * kBits);
}

template <int kBits>
LB_TARGET void encode_f32(const float* x, int cnt, const float* bounds, uint8_t* out) {
  static_assert(kBits >= 1 && kBits <= 4, "8 codes must fit one 32-bit lane");
  constexpr int kBounds = (1 << kBits) - 1;
  constexpr int kGroupBytes = kBits;  // 8 codes of kBits bits
  __m512 b[kBounds];
  for (int i = 0; i < kBounds; ++i) b[i] = _mm512_set1_ps(bounds[i]);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i shifts = group_shifts<kBits>();
  for (int i = 0; i + 16 <= cnt; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __m512i c = _mm512_setzero_si512();
    // x > b is false for NaN, as in the portable count: NaN gets code 0.
    for (int k = 0; k < kBounds; ++k) c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(v, b[k], _CMP_GT_OQ), c, one);
    __m512i t = _mm512_sllv_epi32(c, shifts);
    t = _mm512_or_si512(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
    t = _mm512_or_si512(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
    t = _mm512_or_si512(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    const uint64_t w0 = static_cast<uint32_t>(_mm512_cvtsi512_si32(t));
    const uint64_t w1 = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_extracti32x4_epi32(t, 2)));
    const uint64_t both = w0 | (w1 << (8 * kGroupBytes));
    std::memcpy(out + i / 8 * kGroupBytes, &both, 2 * kGroupBytes);
  }
}

template <int kBits>
LB_TARGET void grad_f32(const float* grad, const uint8_t* in, const float* levels, int cnt, float* out) {
  static_assert(kBits >= 1 && kBits <= 4, "8 codes must fit one 32-bit lane");
  constexpr int kGroupBytes = kBits;
  constexpr uint32_t kWordMask = kBits == 4 ? 0xFFFFFFFFu : (1u << (8 * kBits)) - 1u;
  const __m512 lv = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (1 << kBits)) - 1u), levels);
  const __m512i shifts = group_shifts<kBits>();
  const __m512i mask = _mm512_set1_epi32((1 << kBits) - 1);
  for (int i = 0; i + 16 <= cnt; i += 16) {
    uint64_t both = 0;
    std::memcpy(&both, in + i / 8 * kGroupBytes, 2 * kGroupBytes);
    const __m512i words = _mm512_mask_blend_epi32(static_cast<__mmask16>(0xFF00),
                                                  _mm512_set1_epi32(static_cast<int>(both & kWordMask)),
                                                  _mm512_set1_epi32(static_cast<int>(both >> (8 * kGroupBytes))));
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), mask);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(grad + i), _mm512_permutexvar_ps(codes, lv)));
  }
}

}  // namespace

void fewbit_encode_f32_avx512(int bits, const float* x, int cnt, const float* bounds, uint8_t* out) {
  switch (bits) {
    case 1:
      return encode_f32<1>(x, cnt, bounds, out);
    case 2:
      return encode_f32<2>(x, cnt, bounds, out);
    case 3:
      return encode_f32<3>(x, cnt, bounds, out);
    default:
      return encode_f32<4>(x, cnt, bounds, out);
  }
}

void fewbit_grad_f32_avx512(int bits, const float* grad, const uint8_t* in, const float* levels, int cnt, float* out) {
  switch (bits) {
    case 1:
      return grad_f32<1>(grad, in, levels, cnt, out);
    case 2:
      return grad_f32<2>(grad, in, levels, cnt, out);
    case 3:
      return grad_f32<3>(grad, in, levels, cnt, out);
    default:
      return grad_f32<4>(grad, in, levels, cnt, out);
  }
}

#else

void fewbit_encode_f32_avx512(int, const float*, int, const float*, uint8_t*) {}
void fewbit_grad_f32_avx512(int, const float*, const uint8_t*, const float*, int, float*) {}

#endif

}  // namespace lowbit::cpu
