#include "encode.h"

// Hot loops compiled twice: baseline x86-64 and an AVX2 clone chosen at load time where the CPU has
// it (32-bit vector multiplies for the hash). Both clones compute identical results: the same IEEE
// operations, and no FMA (-ffp-contract=off, no "fma" target).
#if defined(__x86_64__) && defined(__GNUC__)
#define LB_CLONES __attribute__((target_clones("avx2", "default")))
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

LB_CLONES void normalise_buckets(const float* x, int cnt, float absmax, float* xn, uint32_t* bucket) {
  normalise_tile(x, cnt, absmax, xn);
  for (int j = 0; j < cnt; ++j) bucket[j] = bucket16(xn[j]);
}

LB_CLONES void nearest_tile(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes) {
  const float* thresholds = index.thresholds();
  const uint8_t* bases = index.bases();
  for (int j = 0; j < cnt; ++j) {
    const uint32_t k = b[j] - kFirstBucket;
    codes[j] = bases[k] + static_cast<uint32_t>(xn[j] >= thresholds[k]);
  }
}

LB_CLONES void stochastic_tile(const MapIndex& index, const float* xn, const uint32_t* b, RngKey key, uint64_t counter0,
                               int cnt, uint32_t* codes) {
  const uint8_t* start = index.start();
  const float* boundary = index.boundaries();
  const float* low_gap = index.low_gap();
  // Table lookups in one scalar loop; the draws and the decision in a second one that vectorises.
  float low[kTile];
  float width[kTile];
  for (int j = 0; j < cnt; ++j) {
    const uint32_t k = b[j] - kFirstBucket;
    const uint32_t lo = start[k] + static_cast<uint32_t>(xn[j] >= boundary[k]);
    codes[j] = lo;
    low[j] = low_gap[2 * lo];
    width[j] = low_gap[2 * lo + 1];
  }
  const uint32_t lo0 = static_cast<uint32_t>(counter0);
  const uint32_t hi0 = static_cast<uint32_t>(counter0 >> 32);
  for (int j = 0; j < cnt; ++j) {
    const uint32_t lo = lo0 + static_cast<uint32_t>(j);
    const float u = uniform01(key, lo, hi0 + static_cast<uint32_t>(lo < lo0));
    codes[j] += static_cast<uint32_t>(u * width[j] < xn[j] - low[j]);
  }
}

}  // namespace lowbit::cpu
