// The stochastic-rounding draws of lowbit/rounding.h (hash32, uniform01) 16 lanes at a time, inline for the
// loops that draw while they compute: LPMM's codes (lpmm_avx512.cpp) and the fused 4-bit Adam loop (optim.cpp).
// The same bits as the scalar functions, lane for lane.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>

#include "lowbit/rounding.h"

#define LB_AVX512_DRAWS 1

namespace lowbit::cpu {

// hash32 (lowbit/rounding.h) of 16 lanes.
__attribute__((target("avx512f"))) inline __m512i hash32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// uniform01(key, lo, hi) of 16 counters (lowbit/rounding.h).
__attribute__((target("avx512f"))) inline __m512 uniform01x16(RngKey key, __m512i lo, __m512i hi) {
  const __m512i h1 = hash32x16(_mm512_xor_si512(lo, _mm512_set1_epi32(static_cast<int>(key.lo))));
  const __m512i h2 =
      hash32x16(_mm512_xor_si512(_mm512_xor_si512(h1, hi), _mm512_set1_epi32(static_cast<int>(key.hi))));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h2, 8)), _mm512_set1_ps(5.9604644775390625e-08f));
}

// The draws of the 16 elements at counters counter, counter + 1, ..., counter + 15: uniform_tile's (encode.h),
// the carry into the high half included.
__attribute__((target("avx512f"))) inline __m512 counter_draws16(RngKey key, uint64_t counter) {
  const __m512i lo0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(counter)));
  const __m512i lo = _mm512_add_epi32(lo0, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i hi0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(counter >> 32)));
  return uniform01x16(key, lo, _mm512_mask_add_epi32(hi0, _mm512_cmplt_epu32_mask(lo, lo0), hi0, _mm512_set1_epi32(1)));
}

}  // namespace lowbit::cpu

#endif
