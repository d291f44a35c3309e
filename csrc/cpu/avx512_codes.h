// The AVX-512 nearest 8-bit encoder's 16-lane step (map_index.h: order key, bucket, one gather of the
// step word), inline so that a loop in another file can run it between its own work: the optimizer's
// Adam pass (optim.cpp) updates parameters, which needs the divider, while the encoder waits on its
// gathers. avx512.cpp's nearest_codes_u8_avx512 is the same step in a loop of its own.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>

#include "lowbit/blockwise.h"
#include "map_index.h"

#define LB_AVX512_CODES 1

namespace lowbit::cpu {

// What the encoder needs of one block: the nearest-step table indexed by bucket, and the block's absmax
// with its inverse (block_inverse; the caller keeps blocks whose inverse is not finite for the scalar
// path).
struct NearestBlock {
  const int* table;
  float absmax;
  float inv;
};

inline NearestBlock nearest_block(const MapIndex& index, float absmax) {
  return {reinterpret_cast<const int*>(index.nearest_steps()) - kFirstBucket, absmax, block_inverse(absmax)};
}

// order_key (map_index.h) of 16 floats, as b ^ (neg | 0x80000000): the same key in one three-input logic
// operation (imm 0x1E: a ^ (b | c)) after the sign broadcast.
__attribute__((target("avx512f"))) inline __m512i order_keys(__m512 x) {
  const __m512i b = _mm512_castps_si512(_mm512_add_ps(x, _mm512_setzero_ps()));
  const __m512i neg = _mm512_srai_epi32(b, 31);
  return _mm512_ternarylogic_epi32(b, neg, _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0x1E);
}

// order_key of 16 floats that are +0 or positive (never -0 or NaN): the sign bit set.
__attribute__((target("avx512f"))) inline __m512i nonnegative_keys(__m512 x) {
  return _mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
}

// step_code of the nearest words of 16 keys by the index's nearest_sums() (sums: the table less
// kFirstBucket): one gather, an add and a shift.
__attribute__((target("avx512f"))) inline __m512i sum_codes16(const int* sums, __m512i key) {
  const __m512i word = _mm512_i32gather_epi32(_mm512_srli_epi32(key, 16), sums, 4);
  return _mm512_srli_epi32(_mm512_add_epi32(word, key), 16);
}

// The nearest codes of 16 keys for a 16-entry map by a binary search over its step keys in one register
// (steps: MapIndex::nearest_keys()): the count of steps at or below each key,
// found bit by bit from the top, each probe's step key permuted from the register. Four permutes and four
// compares where sum_codes16 gathers: gathers take about a cycle per element on Zen 4. The same codes as
// sum_codes16 for any key of a nearest_direct() index's buckets (MapIndex::nearest_keys).
__attribute__((target("avx512f"))) inline __m512i search_codes16(__m512i steps, __m512i key) {
  __m512i code = _mm512_setzero_si512();
  for (int bit = 8; bit >= 1; bit /= 2) {
    const __m512i probe = _mm512_or_si512(code, _mm512_set1_epi32(bit));
    code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(key, _mm512_permutexvar_epi32(probe, steps)), probe);
  }
  return code;
}

// Four vectors of 16 codes (0..255) as their 64 bytes in order: saturating packs (exact for codes below
// 256) interleave the 128-bit lanes, one dword permute restores the order. Three shuffles where four
// vpmovdb take eight.
__attribute__((target("avx512f,avx512bw"))) inline __m512i pack_codes64(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes);
}

// 32 codes of a 4-bit state (16 bytes at packed, code 2j in the low nibble of byte j: pack.h) decoded as
// map[code] * scale into out[0] (codes 0..15) and out[1] (16..31); map: the 16 map values in one register.
__attribute__((target("avx512f"))) inline void decode_u4_32(__m512 map, __m512 scale, const uint8_t* packed,
                                                           __m512 (&out)[2]) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i lo = _mm_and_si128(b, nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  // Interleaving the low and high nibbles restores the element order.
  out[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), map), scale);
  out[1] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), map), scale);
}

// 16 codes (0..15) as 8 bytes at out, the even code in the low nibble (pack.h): each 64-bit lane's two codes
// joined into its low byte, then one truncating move.
__attribute__((target("avx512f"))) inline void pack_u4_16(__m512i code, uint8_t* out) {
  const __m512i pair = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(pair));
}

// The 16 codes of a 4-bit state at x[0..16): normalise() of blockwise.h as written (the product, its clamp,
// exact +-1 at +-absmax; 0 for a zero absmax), then map_floor_index's four probes. Returns the floor codes
// and sets xn (the normalised values) and the map values at the floor and at the code above it (the top
// code's own value at the top), from which nearest and stochastic rounding choose (qmap.h).
struct U4Brackets {
  __m512i lo;
  __m512i hi;
  __m512 xn;
  __m512 lo_value;
  __m512 hi_value;
};

__attribute__((target("avx512f"))) inline U4Brackets u4_brackets(const __m512 m, const float* x, float absmax,
                                                                float inv) {
  __m512 xn = _mm512_setzero_ps();
  if (absmax > 0.f) {
    const __m512 v = _mm512_loadu_ps(x);
    const __m512 product = _mm512_mul_ps(v, _mm512_set1_ps(inv));
    xn = _mm512_min_ps(_mm512_max_ps(product, _mm512_set1_ps(-1.f)), _mm512_set1_ps(1.f));
    xn = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(absmax), _CMP_EQ_OQ), xn, _mm512_set1_ps(1.f));
    xn = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-absmax), _CMP_EQ_OQ), xn, _mm512_set1_ps(-1.f));
  }
  __m512i lo = _mm512_setzero_si512();
  for (int step = 8; step > 0; step >>= 1) {
    const __m512i probe = _mm512_add_epi32(lo, _mm512_set1_epi32(step));
    const __mmask16 le = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(probe, m), xn, _CMP_LE_OQ);
    lo = _mm512_mask_mov_epi32(lo, le, probe);
  }
  const __m512i hi = _mm512_min_epu32(_mm512_add_epi32(lo, _mm512_set1_epi32(1)), _mm512_set1_epi32(15));
  return {lo, hi, xn, _mm512_permutexvar_ps(lo, m), _mm512_permutexvar_ps(hi, m)};
}

// The codes stochastic_up (qmap.h) picks from brackets b, element i drawing u[i]: the code above the floor when
// u * (hi - lo) < x - lo, each operation rounded once as in the scalar rule.
__attribute__((target("avx512f"))) inline __m512i stochastic_codes16(const U4Brackets& b, __m512 u) {
  const __m512 lhs = _mm512_mul_ps(u, _mm512_sub_ps(b.hi_value, b.lo_value));
  return _mm512_mask_mov_epi32(b.lo, _mm512_cmp_ps_mask(lhs, _mm512_sub_ps(b.xn, b.lo_value), _CMP_LT_OQ), b.hi);
}

// step_code (map_index.h) of 16 elements with order keys `key` in buckets `bucket`: the step words by
// one gather.
__attribute__((target("avx512f"))) inline __m512i step_codes16(const int* table, __m512i key, __m512i bucket) {
  const __m512i word = _mm512_i32gather_epi32(bucket, table, 4);
  const __mmask16 up = _mm512_cmpge_epu32_mask(_mm512_and_si512(key, _mm512_set1_epi32(0xFFFF)),
                                               _mm512_and_si512(word, _mm512_set1_epi32(static_cast<int>(kStepMask))));
  const __m512i code = _mm512_srli_epi32(word, kStepBits);
  return _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
}

// The nearest codes of x[0..16) in block b, as 16 bytes: normalise() of blockwise.h (0 for non-positive
// and NaN absmax), order_key (with -0 keyed as +0), the bucket's step word, step_code.
// kExactUnit: normalise() as written, with its clamp and its exact +-1 at +-absmax. For maps whose index is
// unit_stable() the plain product gives the same codes: it lies within one ulp of [-1, 1], in the index's
// first or last bucket, where the code is that of +-1 (no map value lies beyond +-1), and at +-absmax it is
// +-1 or +-(1 - 2^-24), which unit_stable() says code alike.
template <bool kExactUnit>
__attribute__((target("avx512f"))) inline __m128i nearest_codes16(const NearestBlock& b, const float* x) {
  __m512 xn = _mm512_setzero_ps();
  if (b.absmax > 0.f) {
    const __m512 v = _mm512_loadu_ps(x);
    xn = _mm512_mul_ps(v, _mm512_set1_ps(b.inv));
    if (kExactUnit) {
      const __m512 plus1 = _mm512_set1_ps(1.f), minus1 = _mm512_set1_ps(-1.f);
      xn = _mm512_min_ps(_mm512_max_ps(xn, minus1), plus1);
      xn = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(b.absmax), _CMP_EQ_OQ), xn, plus1);
      xn = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-b.absmax), _CMP_EQ_OQ), xn, minus1);
    }
  }
  const __m512i key = order_keys(xn);
  return _mm512_cvtepi32_epi8(step_codes16(b.table, key, _mm512_srli_epi32(key, 16)));
}

}  // namespace lowbit::cpu

#endif
