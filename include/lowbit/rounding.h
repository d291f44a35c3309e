// Counter-based random numbers for stochastic rounding, shared by CPU and CUDA.
//
// A uniform draw is a pure function of (seed, counter), so the same element gets the same draw on
// every device and thread schedule: counter = offset + element index. The seed is mixed once into a
// 64-bit key (SplitMix64's finaliser); each draw then costs two rounds of a 32-bit integer hash,
// which vectorises on the CPU (no 64-bit multiplies) and is cheap on GPUs.
#pragma once

#include <cstdint>

#include "lowbit/dispatch.h"

namespace lowbit {

// SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
LB_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// "lowbias32" (C. Wellons' hash-prospector): a bijective 32-bit mixer with full avalanche.
LB_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

struct RngKey {
  uint32_t lo;
  uint32_t hi;
};

// Mixed into every seed ("lowbit!!"), so that lowbit's draws differ from other users of the same hash.
constexpr uint64_t kSeedSalt = 0x6C6F776269742121ull;

LB_HD RngKey rng_key(uint64_t seed) {
  const uint64_t k = mix64(seed ^ kSeedSalt);
  return RngKey{static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

// 24 random bits as a float in {0, 2^-24, ..., 1 - 2^-24}, exact in fp32.
LB_HD float unit24(uint32_t h) { return static_cast<float>(h >> 8) * 5.9604644775390625e-08f; }

// The draw for a counter given as its low and high 32-bit halves.
LB_HD float uniform01(RngKey key, uint32_t counter_lo, uint32_t counter_hi) {
  return unit24(hash32(hash32(counter_lo ^ key.lo) ^ counter_hi ^ key.hi));
}

LB_HD float uniform01(RngKey key, uint64_t counter) {
  return uniform01(key, static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32));
}

}  // namespace lowbit
