// Counter-based random numbers and rounding rules shared by CPU and CUDA.
//
// A uniform draw is a pure function of (seed, counter), so the same element gets the same draw on
// every device and thread schedule: counter = offset + element index, key = mix64(seed).
#pragma once

#include <cstdint>

#include "lowbit/dispatch.h"

namespace lowbit {

// SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mixer that passes BigCrush
// when applied to a Weyl sequence, which is exactly how uniform01 uses it.
LB_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

LB_HD uint64_t rng_key(uint64_t seed) { return mix64(seed ^ 0x6C6F776269742121ull); }

// Uniform on {0, 2^-24, ..., 1 - 2^-24}: 24 bits so that the value is exact in fp32.
LB_HD float uniform01(uint64_t key, uint64_t counter) {
  const uint64_t z = mix64(key + counter * 0x9E3779B97F4A7C15ull);
  return static_cast<float>(static_cast<uint32_t>(z >> 40)) * 5.9604644775390625e-08f;
}

}  // namespace lowbit
