// AVX2 state coders: the algorithms of avx512.cpp eight lanes at a time. The 256-entry map and the
// bucket tables are read by vpgatherdd (a 256-entry table does not fit in AVX2 registers; byte-plane
// vpshufb lookups need 16 shuffles per plane for 256 entries); the 16-entry 4-bit map is two
// registers. No FMA: every result is the same IEEE operation as in the portable loops.
#include "avx2.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "avx2_codes.h"
#include "encode.h"
#include "map_index.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LB_AVX2 1
#endif

namespace lowbit::cpu {
namespace {

#ifdef LB_AVX2
const bool kHasAvx2 = __builtin_cpu_supports("avx2");
#else
const bool kHasAvx2 = false;
#endif

bool enabled_by_environment() {
  const char* v = std::getenv("LOWBIT_CPU_AVX2");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

std::atomic<bool> g_enabled{enabled_by_environment()};

}  // namespace

bool avx2_active() { return kHasAvx2 && g_enabled.load(std::memory_order_relaxed); }

bool set_avx2_enabled(bool enabled) {
  g_enabled.store(enabled, std::memory_order_relaxed);
  return kHasAvx2;
}

#ifdef LB_AVX2

#define LB_TARGET __attribute__((target("avx2")))

LB_TARGET void decode_u8_avx2(const float* map, const uint8_t* codes, int cnt, float scale, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 16 <= cnt; i += 16) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    const __m256 v0 = _mm256_i32gather_ps(map, _mm256_cvtepu8_epi32(c), 4);
    const __m256 v1 = _mm256_i32gather_ps(map, _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(c, c)), 4);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(v0, s));
    _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(v1, s));
  }
  for (; i < cnt; ++i) out[i] = map[codes[i]] * scale;
}

namespace {

// step_code (map_index.h) of 8 elements with order keys `key` in buckets `bucket`: the step words by
// one gather. Both compared halves are below 2^17, so a signed compare orders them.
LB_TARGET inline __m256i step_codes8(const int* table, __m256i key, __m256i bucket) {
  const __m256i word = _mm256_i32gather_epi32(table, bucket, 4);
  const __m256i low = _mm256_and_si256(key, _mm256_set1_epi32(0xFFFF));
  const __m256i step = _mm256_and_si256(word, _mm256_set1_epi32(static_cast<int>(kStepMask)));
  // code + (low >= step) = code + 1 + (step > low), the comparison's true being -1.
  const __m256i below = _mm256_cmpgt_epi32(step, low);
  const __m256i code = _mm256_srli_epi32(word, kStepBits);
  return _mm256_add_epi32(_mm256_add_epi32(code, _mm256_set1_epi32(1)), below);
}

// normalise() of blockwise.h for 8 lanes of x with absmax > 0 and a finite inverse inv: the product,
// its clamp (NaN to -1, as the scalar max/min order gives) and the exact +-1 at +-absmax.
LB_TARGET inline __m256 normalise8(__m256 v, __m256 inv, __m256 am, __m256 neg_am) {
  const __m256 plus1 = _mm256_set1_ps(1.f), minus1 = _mm256_set1_ps(-1.f);
  __m256 xn = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, inv), minus1), plus1);
  xn = _mm256_blendv_ps(xn, plus1, _mm256_cmp_ps(v, am, _CMP_EQ_OQ));
  return _mm256_blendv_ps(xn, minus1, _mm256_cmp_ps(v, neg_am, _CMP_EQ_OQ));
}

// gather_codes of avx512.cpp: kExactUnit keeps normalise()'s clamp and exact +-1, which maps whose
// index is unit_stable() do without (the reasoning is written there).
template <bool kExactUnit>
LB_TARGET void gather_codes(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out) {
  const int* table = reinterpret_cast<const int*>(index.nearest_steps()) - kFirstBucket;
  const bool scale = absmax > 0.f;
  const __m256 am = _mm256_set1_ps(absmax);
  const __m256 neg_am = _mm256_set1_ps(-absmax);
  const __m256 inv = _mm256_set1_ps(block_inverse(absmax));
  int j = 0;
  for (; j + 8 <= cnt; j += 8) {
    __m256 xn = _mm256_setzero_ps();
    if (scale) {
      const __m256 v = _mm256_loadu_ps(x + j);
      xn = kExactUnit ? normalise8(v, inv, am, neg_am) : _mm256_mul_ps(v, inv);
    }
    const __m256i key = order_keys8(xn);
    const __m256i code = step_codes8(table, key, _mm256_srli_epi32(key, 16));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), low_bytes8(code));
  }
  if (j < cnt) nearest_codes_u8(index, x + j, cnt - j, absmax, out + j);
}


// The entries of a 16-entry map that bracket 8 normalised lanes: map_floor_index's four probes give lo, and
// hi = min(lo + 1, 15) (map_encode_nearest and map_encode_stochastic, qmap.h).
struct U4Brackets8 {
  __m256i lo, hi;
  __m256 lo_value, hi_value;
};

LB_TARGET inline U4Brackets8 brackets16(__m256 m0, __m256 m1, __m256 xn) {
  __m256i lo = _mm256_setzero_si256();
  for (int step = 8; step > 0; step >>= 1) {
    const __m256i probe = _mm256_add_epi32(lo, _mm256_set1_epi32(step));
    const __m256 le = _mm256_cmp_ps(lookup16(m0, m1, probe), xn, _CMP_LE_OQ);
    lo = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(probe), le));
  }
  const __m256i hi = _mm256_min_epu32(_mm256_add_epi32(lo, _mm256_set1_epi32(1)), _mm256_set1_epi32(15));
  return {lo, hi, lookup16(m0, m1, lo), lookup16(m0, m1, hi)};
}

// The upper entry where up is set, else the lower one.
LB_TARGET inline __m256i pick16(const U4Brackets8& b, __m256 up) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b.lo), _mm256_castsi256_ps(b.hi), up));
}

// map_encode_nearest (qmap.h) of 8 normalised lanes: nearest_up, hi - x < x - lo.
LB_TARGET inline __m256i nearest16(__m256 m0, __m256 m1, __m256 xn) {
  const U4Brackets8 b = brackets16(m0, m1, xn);
  return pick16(b, _mm256_cmp_ps(_mm256_sub_ps(b.hi_value, xn), _mm256_sub_ps(xn, b.lo_value), _CMP_LT_OQ));
}

// map_encode_stochastic (qmap.h) of 8 normalised lanes with draws u: stochastic_up, u * (hi - lo) < x - lo, each
// operation rounded once as in the scalar rule.
LB_TARGET inline __m256i stochastic16(__m256 m0, __m256 m1, __m256 xn, __m256 u) {
  const U4Brackets8 b = brackets16(m0, m1, xn);
  const __m256 lhs = _mm256_mul_ps(u, _mm256_sub_ps(b.hi_value, b.lo_value));
  return pick16(b, _mm256_cmp_ps(lhs, _mm256_sub_ps(xn, b.lo_value), _CMP_LT_OQ));
}

// codes_u4 of avx512.cpp 8 lanes at a time; the nearest codes come from the bucket's sum word where by_sums.
template <bool kStochastic>
LB_TARGET int codes_u4(const MapIndex& index, bool by_sums, const float* x, int cnt, float absmax, const float* u,
                       uint8_t* packed) {
  const float inv = block_inverse(absmax);
  if (absmax > 0.f && inv == 0.f) return 0;
  const float* map = index.padded();
  const __m256 m0 = _mm256_loadu_ps(map), m1 = _mm256_loadu_ps(map + 8);
  const int* sums = by_sums ? reinterpret_cast<const int*>(index.nearest_sums()) - kFirstBucket : nullptr;
  const bool scale = absmax > 0.f;
  const __m256 am = _mm256_set1_ps(absmax);
  const __m256 neg_am = _mm256_set1_ps(-absmax);
  const __m256 vinv = _mm256_set1_ps(inv);
  const int vec = cnt - cnt % 16;
  for (int j = 0; j < vec; j += 16) {
    __m256i code[2];
    for (int h = 0; h < 2; ++h) {
      const int i = j + 8 * h;
      const __m256 xn = scale ? normalise8(_mm256_loadu_ps(x + i), vinv, am, neg_am) : _mm256_setzero_ps();
      if constexpr (kStochastic) {
        code[h] = stochastic16(m0, m1, xn, _mm256_loadu_ps(u + i));
      } else {
        code[h] = by_sums ? sum_codes8(sums, order_keys8(xn)) : nearest16(m0, m1, xn);
      }
    }
    pack_u4_16x8(code[0], code[1], packed + j / 2);
  }
  return vec;
}

}  // namespace

void nearest_codes_u8_avx2(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out) {
  // A subnormal absmax (no finite reciprocal) is rare enough for the scalar path.
  if (absmax > 0.f && block_inverse(absmax) == 0.f) return nearest_codes_u8(index, x, cnt, absmax, out);
  if (index.unit_stable()) return gather_codes<false>(index, x, cnt, absmax, out);
  gather_codes<true>(index, x, cnt, absmax, out);
}

LB_TARGET void nearest_tile_avx2(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes) {
  const int* table = reinterpret_cast<const int*>(index.nearest_steps()) - kFirstBucket;
  int j = 0;
  for (; j + 8 <= cnt; j += 8) {
    const __m256i key = order_keys8(_mm256_loadu_ps(xn + j));
    const __m256i bucket = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j), step_codes8(table, key, bucket));
  }
  if (j < cnt) nearest_tile(index, xn + j, b + j, cnt - j, codes + j);
}

LB_TARGET void stochastic_tile_avx2(const MapIndex& index, const float* xn, const uint32_t* b, RngKey key,
                                    uint64_t counter0, int cnt, uint32_t* codes) {
  // stochastic_tile's steps: the floor code from its bucket's step word, then up by one when
  // u * gap < xn - map[floor], with map[floor] and the gap fetched by gathers.
  const int* table = reinterpret_cast<const int*>(index.floor_steps()) - kFirstBucket;
  const float* low_gap = index.low_gap();
  float u[kTile];
  const int vec = cnt - cnt % 8;
  uniform_tile(key, counter0, vec, u);
  for (int j = 0; j < vec; j += 8) {
    const __m256 x = _mm256_loadu_ps(xn + j);
    const __m256i bucket = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j));
    const __m256i floor = step_codes8(table, order_keys8(x), bucket);
    const __m256i pair = _mm256_slli_epi32(floor, 1);
    const __m256 value = _mm256_i32gather_ps(low_gap, pair, 4);
    const __m256 gap = _mm256_i32gather_ps(low_gap, _mm256_add_epi32(pair, _mm256_set1_epi32(1)), 4);
    const __m256 lhs = _mm256_mul_ps(_mm256_loadu_ps(u + j), gap);
    const __m256 up = _mm256_cmp_ps(lhs, _mm256_sub_ps(x, value), _CMP_LT_OQ);
    // The comparison's true is -1: subtracting it adds one.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j), _mm256_sub_epi32(floor, _mm256_castps_si256(up)));
  }
  if (vec < cnt) stochastic_tile(index, xn + vec, b + vec, key, counter0 + vec, cnt - vec, codes + vec);
}

LB_TARGET int decode_u4_avx2(const float* map, const uint8_t* packed, int cnt, float scale, float* out) {
  const __m256 m0 = _mm256_loadu_ps(map), m1 = _mm256_loadu_ps(map + 8);
  const __m256 s = _mm256_set1_ps(scale);
  const int vec = cnt - cnt % 32;
  for (int i = 0; i < vec; i += 32) {
    __m256 values[4];
    decode_u4_32x8(m0, m1, s, packed + i / 2, values);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + i + 8 * k, values[k]);
  }
  return vec;
}

int nearest_codes_u4_avx2(const MapIndex& index, bool gather, const float* x, int cnt, float absmax,
                          uint8_t* packed) {
  return codes_u4<false>(index, gather && index.nearest_direct(), x, cnt, absmax, nullptr, packed);
}

int stochastic_codes_u4_avx2(const MapIndex& index, const float* x, int cnt, float absmax, const float* u,
                             uint8_t* packed) {
  return codes_u4<true>(index, false, x, cnt, absmax, u, packed);
}

#else

void decode_u8_avx2(const float*, const uint8_t*, int, float, float*) {}
void nearest_codes_u8_avx2(const MapIndex&, const float*, int, float, uint8_t*) {}
void nearest_tile_avx2(const MapIndex&, const float*, const uint32_t*, int, uint32_t*) {}
void stochastic_tile_avx2(const MapIndex&, const float*, const uint32_t*, RngKey, uint64_t, int, uint32_t*) {}
int decode_u4_avx2(const float*, const uint8_t*, int, float, float*) { return 0; }
int nearest_codes_u4_avx2(const MapIndex&, bool, const float*, int, float, uint8_t*) { return 0; }
int stochastic_codes_u4_avx2(const MapIndex&, const float*, int, float, const float*, uint8_t*) { return 0; }

#endif

}  // namespace lowbit::cpu
