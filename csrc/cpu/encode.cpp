#include "encode.h"

namespace lowbit::cpu {

// A loop over 32-bit lanes (the carry into the counter's high half is explicit) that vectorises.
// Baseline x86-64 has no 32-bit vector multiply, so an AVX2 clone is chosen at load time where the
// CPU has it (4x faster here); both clones compute identical integers.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
void uniform_tile(RngKey key, uint64_t counter0, int cnt, float* u) {
  const uint32_t lo0 = static_cast<uint32_t>(counter0);
  const uint32_t hi0 = static_cast<uint32_t>(counter0 >> 32);
  for (int j = 0; j < cnt; ++j) {
    const uint32_t lo = lo0 + static_cast<uint32_t>(j);
    u[j] = uniform01(key, lo, hi0 + static_cast<uint32_t>(lo < lo0));
  }
}

}  // namespace lowbit::cpu
