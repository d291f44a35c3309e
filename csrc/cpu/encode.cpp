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

LB_CLONES void nearest_tile(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes) {
  const float* thresholds = index.thresholds();
  const uint8_t* bases = index.bases();
  for (int j = 0; j < cnt; ++j) {
    const uint32_t k = b[j] - kFirstBucket;
    codes[j] = bases[k] + static_cast<uint32_t>(xn[j] >= thresholds[k]);
  }
}

LB_CLONES void stochastic_tile(const MapIndex& index, const float* xn, const uint32_t* b, const float* u, int cnt,
                               uint32_t* codes) {
  const uint8_t* start = index.start();
  const float* m = index.padded();
  const float* gap = index.gaps();
  // The loads for both possible floors are issued together; selecting after them keeps the chain of
  // dependent loads at two (bucket table, then map), instead of three.
  for (int j = 0; j < cnt; ++j) {
    const uint32_t lo = start[b[j] - kFirstBucket];
    const float x = xn[j];
    const bool past = m[lo + 1] <= x;
    const float low = past ? m[lo + 1] : m[lo];
    const float width = past ? gap[lo + 1] : gap[lo];
    codes[j] = lo + static_cast<uint32_t>(past) + static_cast<uint32_t>(u[j] * width < x - low);
  }
}

}  // namespace lowbit::cpu
