// The AVX2 nearest 8-bit encoder's 8-lane steps (map_index.h: order key, bucket, one gather of the step
// word), inline so that a loop in another file can run them between its own work: avx2.cpp's encoders,
// and the optimizer's AVX2 Adam pass (optim.cpp), which steps the parameters while the gathers wait.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>

#include "map_index.h"

#define LB_AVX2_CODES 1

namespace lowbit::cpu {

// order_key (map_index.h) of 8 floats: b ^ (neg | 0x80000000) after the sign broadcast, the same key as
// (b ^ (neg >> 1)) ^ 0x80000000.
__attribute__((target("avx2"))) inline __m256i order_keys8(__m256 x) {
  const __m256i b = _mm256_castps_si256(_mm256_add_ps(x, _mm256_setzero_ps()));
  const __m256i neg = _mm256_srai_epi32(b, 31);
  return _mm256_xor_si256(b, _mm256_or_si256(neg, _mm256_set1_epi32(static_cast<int>(0x80000000u))));
}

// order_key of 8 floats that are +0 or positive (never -0 or NaN): the sign bit set.
__attribute__((target("avx2"))) inline __m256i nonnegative_keys8(__m256 x) {
  return _mm256_or_si256(_mm256_castps_si256(x), _mm256_set1_epi32(static_cast<int>(0x80000000u)));
}

// step_code of the nearest words of 8 keys by the index's nearest_sums() (sums: the table less
// kFirstBucket): one gather, an add and a shift.
__attribute__((target("avx2"))) inline __m256i sum_codes8(const int* sums, __m256i key) {
  const __m256i word = _mm256_i32gather_epi32(sums, _mm256_srli_epi32(key, 16), 4);
  return _mm256_srli_epi32(_mm256_add_epi32(word, key), 16);
}

// Four vectors of 8 codes (0..255) as their 32 bytes in order: saturating packs (exact for codes below 256)
// interleave the 128-bit lanes, one dword permute restores the order.
__attribute__((target("avx2"))) inline __m256i pack_codes32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// map[c] for 8 codes c in 0..15 from the map's halves m0 = map[0..7] and m1 = map[8..15]: the permutes use
// the low 3 bits, bit 3 (moved to the sign) picks the half.
__attribute__((target("avx2"))) inline __m256 lookup16(__m256 m0, __m256 m1, __m256i c) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(m0, c), _mm256_permutevar8x32_ps(m1, c),
                          _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}

// 32 codes of a 4-bit state (16 bytes at packed, code 2j in the low nibble of byte j: pack.h) decoded as
// map[code] * scale into out[0..4), 8 each, in order; m0, m1: the map's halves (lookup16).
__attribute__((target("avx2"))) inline void decode_u4_32x8(__m256 m0, __m256 m1, __m256 scale, const uint8_t* packed,
                                                          __m256 (&out)[4]) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i lo = _mm_and_si128(b, nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  // Interleaving the low and high nibbles restores the element order.
  const __m128i c[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
  for (int h = 0; h < 2; ++h) {
    out[2 * h] = _mm256_mul_ps(lookup16(m0, m1, _mm256_cvtepu8_epi32(c[h])), scale);
    out[2 * h + 1] = _mm256_mul_ps(lookup16(m0, m1, _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(c[h], c[h]))), scale);
  }
}

// The low bytes of 8 32-bit lanes, in order, as the low 8 bytes of the result.
__attribute__((target("avx2"))) inline __m128i low_bytes8(__m256i v) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                                        -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, pick), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  return _mm256_castsi256_si128(b);
}

// 16 codes (0..15; a: the first 8, b: the next) as 8 bytes at out, the even code in the low nibble (pack.h):
// the codes as 16-bit lanes in order, then each pair to a byte.
__attribute__((target("avx2"))) inline void pack_u4_16x8(__m256i a, __m256i b, uint8_t* out) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  const __m256i pair = _mm256_or_si256(w, _mm256_srli_epi32(w, 12));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), low_bytes8(pair));
}

}  // namespace lowbit::cpu

#endif
