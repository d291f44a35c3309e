// 16 lanes of fp32, bf16 or fp16 storage as fp32, and back: the vector forms of to_float and from_float
// (lowbit/dispatch.h) that the AVX-512 loops of the activation layers and of the optimizer step share.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "lowbit/dispatch.h"

namespace lowbit::cpu {

// 16 inputs as fp32 (bf16 and fp16 widen exactly).
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 fp32 results stored as the element type: bf16 rounds to nearest even with NaN as 0x7FC0, as from_float
// does (vcvtneps2bf16 would flush subnormal inputs to zero and keep NaN payloads).
__attribute__((target("avx512f"), always_inline)) inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
__attribute__((target("avx512f"), always_inline)) inline void store16(BFloat16* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
// fp16 rounds to nearest even, subnormals and overflow to inf included, as from_float does; NaN becomes
// sign | 0x7E00: each NaN lane is first made the fp32 quiet NaN of its sign (vcvtps2ph keeps a payload's top
// bits).
__attribute__((target("avx512f"), always_inline)) inline void store16(Half* p, __m512 v) {
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 quiet = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x7FC00000)));
  const __m512 w = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, quiet);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace lowbit::cpu

#endif
