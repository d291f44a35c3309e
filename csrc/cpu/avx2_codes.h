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

}  // namespace lowbit::cpu

#endif
