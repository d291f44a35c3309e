#include "encode.h"

#include <cstring>

// Hot loops compiled for baseline x86-64 with AVX2 and AVX-512 clones, chosen at load time by what
// the CPU has (32-bit vector multiplies for the hash, wider lanes). All clones compute identical
// results: the same IEEE operations, and no FMA (-ffp-contract=off, no "fma" target).
#if defined(__x86_64__) && defined(__GNUC__)
#define LB_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LB_CLONES
#endif

namespace lowbit::cpu {

// 32-bit lanes; the carry into the counter's high half is explicit.
LB_CLONES void uniform_tile(RngKey key, uint64_t counter0, int cnt, float* u) {
  const uint32_t lo0 = static_cast<uint32_t>(counter0);
  const uint32_t hi0 = static_cast<uint32_t>(counter0 >> 32);
  for (int j = 0; j < cnt; ++j) {
    const uint32_t lo = lo0 + static_cast<uint32_t>(j);
    u[j] = uniform01(key, lo, hi0 + static_cast<uint32_t>(lo < lo0));
  }
}

LB_CLONES void linear_codes(const float* x, int cnt, float absmax, float qmax, bool stochastic, RngKey key,
                            uint64_t counter0, uint32_t* codes) {
  float y[kTile];
  normalise_tile(x, cnt, absmax, y);
  for (int j = 0; j < cnt; ++j) y[j] = linear_clamp(y[j] * qmax, qmax);
  if (!stochastic) {
    for (int j = 0; j < cnt; ++j) codes[j] = linear_code_nearest(y[j], qmax);
    return;
  }
  const uint32_t lo0 = static_cast<uint32_t>(counter0);
  const uint32_t hi0 = static_cast<uint32_t>(counter0 >> 32);
  for (int j = 0; j < cnt; ++j) {
    const uint32_t lo = lo0 + static_cast<uint32_t>(j);
    codes[j] = linear_code_stochastic(y[j], qmax, uniform01(key, lo, hi0 + static_cast<uint32_t>(lo < lo0)));
  }
}

LB_CLONES void linear_values(const uint32_t* codes, int cnt, float absmax, float qmax, float* out) {
  for (int j = 0; j < cnt; ++j) out[j] = linear_decode(codes[j], absmax, qmax);
}

LB_CLONES void normalise_buckets(const float* x, int cnt, float absmax, float* xn, uint32_t* bucket) {
  normalise_tile(x, cnt, absmax, xn);
  for (int j = 0; j < cnt; ++j) bucket[j] = bucket16(xn[j]);
}

namespace {

// codes[j] = step_code of element j, given its bucket. The table lookup is a bare load-load-store
// loop; the arithmetic around it is a second loop that vectorises. Keeping scalar work per element
// this small is what makes the O(1) search cheap.
inline void step_codes(const uint32_t* table, const float* xn, const uint32_t* b, int cnt, uint32_t* codes) {
  for (int j = 0; j < cnt; ++j) codes[j] = table[static_cast<int64_t>(b[j]) - kFirstBucket];
  for (int j = 0; j < cnt; ++j) codes[j] = step_code(codes[j], xn[j]);
}

}  // namespace

LB_CLONES void nearest_tile(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes) {
  step_codes(index.nearest_steps(), xn, b, cnt, codes);
}

LB_CLONES void stochastic_tile(const MapIndex& index, const float* xn, const uint32_t* b, RngKey key,
                               uint64_t counter0, int cnt, uint32_t* codes) {
  step_codes(index.floor_steps(), xn, b, cnt, codes);
  const float* low_gap = index.low_gap();
  float pair[2 * kTile];  // (map value, gap) of each element's floor code, fetched by a bare loop
  for (int j = 0; j < cnt; ++j) std::memcpy(pair + 2 * j, low_gap + 2 * codes[j], 2 * sizeof(float));
  const uint32_t lo0 = static_cast<uint32_t>(counter0);
  const uint32_t hi0 = static_cast<uint32_t>(counter0 >> 32);
  for (int j = 0; j < cnt; ++j) {
    const uint32_t lo = lo0 + static_cast<uint32_t>(j);
    const float u = uniform01(key, lo, hi0 + static_cast<uint32_t>(lo < lo0));
    codes[j] += static_cast<uint32_t>(u * pair[2 * j + 1] < xn[j] - pair[2 * j]);
  }
}

LB_CLONES void nearest_codes_u8(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out) {
  const uint32_t* table = index.nearest_steps();
  float xn[kTile];
  uint32_t word[kTile];
  for (int lo = 0; lo < cnt; lo += kTile) {
    const int m = std::min(kTile, cnt - lo);
    normalise_tile(x + lo, m, absmax, xn);
    for (int j = 0; j < m; ++j) word[j] = bucket16(xn[j]);
    for (int j = 0; j < m; ++j) word[j] = table[static_cast<int64_t>(word[j]) - kFirstBucket];
    for (int j = 0; j < m; ++j) out[lo + j] = static_cast<uint8_t>(step_code(word[j], xn[j]));
  }
}

}  // namespace lowbit::cpu
