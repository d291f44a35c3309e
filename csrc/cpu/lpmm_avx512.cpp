// AVX-512 loops of LPMM's linear codes: the scalar formulas of lowbit/blockwise.h and
// lowbit/rounding.h, lane for lane (no FMA: -ffp-contract=off and separate multiply and add
// intrinsics; IEEE division where the scalar code divides, except linear_quotient16's exact one), so the
// codes and values are bit-identical to the portable loops and to the CUDA kernels. 12-bit codes are 16 to
// 24 bytes: one VBMI byte permute spreads the two bytes of each code into its 32-bit lane (unpack) or gathers
// the three bytes of each pair back (pack).
#include "lpmm_avx512.h"


#include "avx512.h"
#include "avx512_draws.h"
#include "lowbit/blockwise.h"
#include "map_index.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LB_AVX512 1
// GCC 12's AVX-512 headers build the unmasked results on `__m512i __Y = __Y;` placeholders, which
// -Wmaybe-uninitialized (and -Wuninitialized, for the 256-bit extracts) reports at every inlined call
// here; no lane of them reaches a result.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace lowbit::cpu {

#ifdef LB_AVX512

namespace {

#define LB_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi")))

const bool kHasLpmmIsa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi");

constexpr __mmask64 kBytes12 = (1ull << 24) - 1;  // 16 codes of 12 bits

// Lane i of 16 12-bit codes: byte (i / 2) * 3 + i % 2 and the next one, shifted right by 4 * (i % 2).
LB_TARGET inline __m512i unpack12_index() {
  alignas(64) uint8_t idx[64];
  for (int i = 0; i < 16; ++i) {
    const int b = (i / 2) * 3 + i % 2;
    idx[4 * i] = static_cast<uint8_t>(b);
    idx[4 * i + 1] = static_cast<uint8_t>(b + 1);
    idx[4 * i + 2] = 0;
    idx[4 * i + 3] = 0;
  }
  return _mm512_load_si512(idx);
}

// Byte m of 16 packed 12-bit codes is byte m % 3 of the 24-bit pair word in 64-bit lane m / 3.
LB_TARGET inline __m512i pack12_index() {
  alignas(64) uint8_t idx[64] = {};
  for (int m = 0; m < 24; ++m) idx[m] = static_cast<uint8_t>((m / 3) * 8 + m % 3);
  return _mm512_load_si512(idx);
}

LB_TARGET inline __m512i load_codes16(const uint8_t* p, int bits, __m512i index12) {
  if (bits == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i raw = _mm512_maskz_loadu_epi8(kBytes12, p);
  const __m512i pairs = _mm512_permutexvar_epi8(index12, raw);
  const __m512i shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  return _mm512_and_si512(_mm512_srlv_epi32(pairs, shift), _mm512_set1_epi32(0xFFF));
}

LB_TARGET inline void store_codes16(__m512i codes, int bits, __m512i index12, uint8_t* p) {
  if (bits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(codes));
    return;
  }
  // Lanes 2k and 2k+1 share 64-bit lane k: pair word = even | odd << 12 (codes are < 2^12).
  const __m512i even = _mm512_and_si512(codes, _mm512_set1_epi64(0xFFFFFFFFll));
  const __m512i pair = _mm512_or_si512(even, _mm512_slli_epi64(_mm512_srli_epi64(codes, 32), 12));
  _mm512_mask_storeu_epi8(p, kBytes12, _mm512_permutexvar_epi8(index12, pair));
}

// a < b ? x : y, lane-wise, for the selects of blockwise.h.
LB_TARGET inline __m512 select_lt(__m512 a, __m512 b, __m512 x, __m512 y) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
}

// normalise(v, absmax, inv) (lowbit/blockwise.h) for absmax > 0; inv is block_inverse(absmax), 0
// where v / absmax is used instead.
LB_TARGET inline __m512 normalise16(__m512 v, __m512 absmax, __m512 inv, bool divide) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 minus_one = _mm512_set1_ps(-1.f);
  const __m512 q = divide ? _mm512_div_ps(v, absmax) : _mm512_mul_ps(v, inv);
  __m512 r = select_lt(q, minus_one, minus_one, select_lt(q, one, q, one));
  r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_sub_ps(_mm512_setzero_ps(), absmax), _CMP_EQ_OQ), r,
                           minus_one);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, absmax, _CMP_EQ_OQ), r, one);
}

// linear_clamp(normalise(v, absmax, inv) * qmax, qmax) (lowbit/blockwise.h) for absmax > 0.
LB_TARGET inline __m512 linear_scaled16(__m512 v, __m512 absmax, __m512 inv, bool divide, __m512 qmax) {
  const __m512 y = _mm512_mul_ps(normalise16(v, absmax, inv, divide), qmax);
  const __m512 neg_qmax = _mm512_sub_ps(_mm512_setzero_ps(), qmax);
  return select_lt(y, neg_qmax, neg_qmax, select_lt(y, qmax, y, qmax));
}

// (code - qmax) / qmax of linear_decode (lowbit/blockwise.h) for the centred codes x, integers with |x| <= qmax:
// q0 = x * y with y = 1 / qmax rounded, then one correction q0 + (x - qmax q0) y, each by one FMA, which gives
// the division's bits without the divider (two divisions per element, parameters and gradients: the decode
// loops held 15% of the LPMM-SGDM step's `perf` samples, mostly after the division). The divisor is a constant
// and x one of 2 qmax + 1 integers, so the claim is finite: test_lpmm_ops.py's
// test_step_decodes_every_linear_code_exactly checks every code of both widths the loops take (8 and 12 bits)
// against the division.
LB_TARGET inline __m512 linear_quotient16(__m512 x, __m512 qmax, __m512 y) {
  const __m512 q0 = _mm512_mul_ps(x, y);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(qmax, q0, x), y, q0);
}

// round_even by the magic number, as on the host (lowbit/blockwise.h).
LB_TARGET inline __m512 round_even16(__m512 y) {
  const __m512 magic = _mm512_set1_ps(12582912.f);
  return _mm512_sub_ps(_mm512_add_ps(y, magic), magic);
}

}  // namespace

bool lpmm_avx512_active() { return kHasLpmmIsa && avx512_active(); }

LB_TARGET int linear_values_avx512(const uint8_t* packed, int cnt, int bits, float absmax, float qmax, float* out) {
  const int done = cnt - cnt % 16;
  const __m512i index12 = unpack12_index();
  const __m512 q = _mm512_set1_ps(qmax);
  const __m512 y = _mm512_set1_ps(1.f / qmax);
  const __m512 a = _mm512_set1_ps(absmax);
  for (int j = 0; j < done; j += 16) {
    const __m512i codes = load_codes16(packed + (j / 8) * bits, bits, index12);
    const __m512 centred = _mm512_sub_ps(_mm512_cvtepi32_ps(codes), q);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(linear_quotient16(centred, q, y), a));
  }
  return done;
}

LB_TARGET int linear_codes_avx512(const float* x, int cnt, int bits, float absmax, float qmax, bool stochastic,
                                  RngKey key, uint64_t counter0, uint8_t* packed) {
  const int done = cnt - cnt % 16;
  const __m512i index12 = pack12_index();
  const __m512 q = _mm512_set1_ps(qmax);
  const __m512 a = _mm512_set1_ps(absmax);
  const float inv_s = block_inverse(absmax);
  const __m512 inv = _mm512_set1_ps(inv_s);
  const bool divide = inv_s == 0.f;
  const bool zero = !(absmax > 0.f);  // all-zero or poisoned block: every normalised value is 0
  for (int j = 0; j < done; j += 16) {
    const __m512 y = zero ? _mm512_setzero_ps() : linear_scaled16(_mm512_loadu_ps(x + j), a, inv, divide, q);
    const __m512 r = round_even16(y);
    __m512 level;
    if (stochastic) {
      const __m512 u = counter_draws16(key, counter0 + static_cast<uint64_t>(j));
      const __m512 f = _mm512_mask_sub_ps(r, _mm512_cmp_ps_mask(r, y, _CMP_GT_OQ), r, _mm512_set1_ps(1.f));
      const __m512 up = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, _mm512_sub_ps(y, f), _CMP_LT_OQ), _mm512_set1_ps(1.f));
      level = _mm512_add_ps(_mm512_add_ps(f, up), q);
    } else {
      level = _mm512_add_ps(r, q);
    }
    store_codes16(_mm512_cvttps_epi32(level), bits, index12, packed + (j / 8) * bits);
  }
  return done;
}

LB_TARGET int normalise_buckets_avx512(const float* x, int cnt, float absmax, float* xn, uint32_t* bucket) {
  const int done = cnt - cnt % 16;
  const __m512 a = _mm512_set1_ps(absmax);
  const float inv_s = block_inverse(absmax);
  const __m512 inv = _mm512_set1_ps(inv_s);
  const bool divide = inv_s == 0.f;
  const bool zero = !(absmax > 0.f);
  for (int j = 0; j < done; j += 16) {
    const __m512 v = zero ? _mm512_setzero_ps() : normalise16(_mm512_loadu_ps(x + j), a, inv, divide);
    _mm512_storeu_ps(xn + j, v);
    // order_key (map_index.h), -0 keyed as +0 by the added zero, then its top 16 bits.
    const __m512i b = _mm512_castps_si512(_mm512_add_ps(v, _mm512_setzero_ps()));
    const __m512i neg = _mm512_srli_epi32(_mm512_srai_epi32(b, 31), 1);
    const __m512i key = _mm512_xor_si512(_mm512_xor_si512(b, neg), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    _mm512_storeu_si512(bucket + j, _mm512_srli_epi32(key, 16));
  }
  return done;
}

LB_TARGET int map_codes_u8_avx512(const MapIndex& index, const float* x, int cnt, float absmax, bool stochastic,
                                  RngKey key, uint64_t counter0, uint8_t* out) {
  const int done = cnt - cnt % 16;
  const int* table =
      reinterpret_cast<const int*>(stochastic ? index.floor_steps() : index.nearest_steps()) - kFirstBucket;
  const float* low_gap = index.low_gap();
  const __m512 a = _mm512_set1_ps(absmax);
  const float inv_s = block_inverse(absmax);
  const __m512 inv = _mm512_set1_ps(inv_s);
  const bool divide = inv_s == 0.f;
  const bool zero = !(absmax > 0.f);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int j = 0; j < done; j += 16) {
    const __m512 xn = zero ? _mm512_setzero_ps() : normalise16(_mm512_loadu_ps(x + j), a, inv, divide);
    // order_key and bucket16 (map_index.h), then step_code with the bucket's step word.
    const __m512i b = _mm512_castps_si512(_mm512_add_ps(xn, _mm512_setzero_ps()));
    const __m512i neg = _mm512_srli_epi32(_mm512_srai_epi32(b, 31), 1);
    const __m512i okey = _mm512_xor_si512(_mm512_xor_si512(b, neg), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __m512i word = _mm512_i32gather_epi32(_mm512_srli_epi32(okey, 16), table, 4);
    const __mmask16 step = _mm512_cmpge_epu32_mask(_mm512_and_si512(okey, _mm512_set1_epi32(0xFFFF)),
                                                   _mm512_and_si512(word, _mm512_set1_epi32(static_cast<int>(kStepMask))));
    __m512i code = _mm512_mask_add_epi32(_mm512_srli_epi32(word, kStepBits), step, _mm512_srli_epi32(word, kStepBits), one);
    if (stochastic) {
      // stochastic_tile (encode.cpp): up by one when u * gap < xn - map[floor].
      const __m512 u = counter_draws16(key, counter0 + static_cast<uint64_t>(j));
      // Each (map value, gap) pair by one 8-byte gather: half the gathered elements of two 4-byte ones.
      const __m512 lo_pairs = _mm512_castsi512_ps(_mm512_i32gather_epi64(_mm512_castsi512_si256(code), low_gap, 8));
      const __m512 hi_pairs =
          _mm512_castsi512_ps(_mm512_i32gather_epi64(_mm512_extracti32x8_epi32(code, 1), low_gap, 8));
      const __m512 value = _mm512_permutex2var_ps(lo_pairs, even, hi_pairs);
      const __m512 gap = _mm512_permutex2var_ps(lo_pairs, _mm512_add_epi32(even, one), hi_pairs);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, gap), _mm512_sub_ps(xn, value), _CMP_LT_OQ);
      code = _mm512_mask_add_epi32(code, up, code, one);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(code));
  }
  return done;
}

LB_TARGET int max_abs_bits_avx512(const float* x, int cnt, uint32_t* max_bits) {
  const int done = cnt - cnt % 16;
  const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i m = _mm512_setzero_si512();
  for (int j = 0; j < done; j += 16) m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(x + j), mask));
  *max_bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(m));
  return done;
}

#else

int max_abs_bits_avx512(const float*, int, uint32_t* max_bits) {
  *max_bits = 0;
  return 0;
}
int map_codes_u8_avx512(const MapIndex&, const float*, int, float, bool, RngKey, uint64_t, uint8_t*) { return 0; }
int normalise_buckets_avx512(const float*, int, float, float*, uint32_t*) { return 0; }
bool lpmm_avx512_active() { return false; }
int linear_values_avx512(const uint8_t*, int, int, float, float, float*) { return 0; }
int linear_codes_avx512(const float*, int, int, float, float, bool, RngKey, uint64_t, uint8_t*) { return 0; }

#endif

}  // namespace lowbit::cpu
