// O(1) code search on the CPU: tables over the float bit patterns of x in [-1, 1].
//
// x is reduced to a 16-bit bucket of its order-preserving bit pattern (sign, exponent and the top 7
// mantissa bits). A bucket is narrower than the gap between neighbouring values of the dynamic and
// linear maps, so it holds at most one step of any of the step functions below:
// - floor index: the floor index at the start of each bucket; one branch-free comparison finishes
//   the search (maps with closer values get as many steps as their densest bucket needs, and beyond
//   kMaxRefine the binary search of qmap.h takes over). Stochastic rounding starts from it.
// - nearest: the nearest code is itself a non-decreasing step function of x, so each bucket stores
//   its code at the bucket start and the exact x at which it steps up, found at build time by
//   bisecting map_encode_nearest over float bit patterns.
// For one-step buckets both are packed into one word per bucket (see step_code), so a code costs
// one table load plus arithmetic that vectorises. The answers equal those of qmap.h's binary
// search exactly, so CPU and CUDA codes agree.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lowbit/dispatch.h"

namespace lowbit::cpu {

// Order-preserving key of a float: negative patterns inverted, positive ones with the sign bit set,
// so that x <= y exactly when order_key(x) <= order_key(y) for non-NaN floats. Branch-free so that
// loops over it vectorise. -0 is keyed as +0 (x + 0 is exact otherwise): both compare equal to any
// map value, and this keeps the two zero entries of symmetric maps out of the bucket below zero,
// which would otherwise need a second search step.
inline uint32_t order_key(float x) {
  const uint32_t b = float_to_bits(x + 0.f);
  const uint32_t neg = static_cast<uint32_t>(static_cast<int32_t>(b) >> 31);
  return (b ^ (neg >> 1)) ^ 0x80000000u;
}

// The bucket of x: the top 16 bits of its key.
inline uint32_t bucket16(float x) { return order_key(x) >> 16; }

// A bucket's step word: (code at the bucket start) << kStepBits | the low 16 bits of the order key at
// which the code steps up by one inside the bucket (kNoStep if it does not). The key's top 16 bits
// are the bucket's, so comparing low halves equals comparing x with the step's float.
constexpr int kStepBits = 17;
constexpr uint32_t kStepMask = (1u << kStepBits) - 1u;
constexpr uint32_t kNoStep = 0x10000u;

// The code of x from the step word of its bucket.
inline uint32_t step_code(uint32_t word, float x) {
  return (word >> kStepBits) + static_cast<uint32_t>((order_key(x) & 0xFFFFu) >= (word & kStepMask));
}

constexpr uint32_t kFirstBucket = 0x407Fu;  // bucket16(-1.0f)
constexpr uint32_t kLastBucket = 0xBF80u;   // bucket16(+1.0f)
constexpr int kMaxRefine = 4;

class MapIndex {
 public:
  MapIndex(const float* map, uint32_t n);

  // Largest i with map[i] <= x (0 if none) for x in [-1, 1] with bucket16(x) == bucket, using
  // kSteps refinement steps; kSteps must be at least steps().
  template <int kSteps>
  uint32_t floor_index(float x, uint32_t bucket) const {
    uint32_t i = start_[bucket - kFirstBucket];
    for (int k = 0; k < kSteps; ++k) i += static_cast<uint32_t>(padded_[i + 1] <= x);
    return i;
  }

  // Step words indexed by bucket - kFirstBucket: step_code(word, x) is the floor index of x (valid
  // when steps() <= 1) or its nearest code (valid when nearest_direct()).
  const uint32_t* floor_steps() const { return floor_steps_.data(); }
  const uint32_t* nearest_steps() const { return nearest_steps_.data(); }
  // The nearest steps as sums, indexed by bucket - kFirstBucket: (nearest_sums()[bucket - kFirstBucket] +
  // key) >> 16, in uint32 arithmetic, is step_code of the nearest word for any key of the bucket (valid when
  // nearest_direct()). Two operations instead of step_code's five: the word (code << 16) + 0x10000 - step,
  // less the bucket's key bits (bucket << 16), adds up to (code << 16) + 0x10000 + low - step, whose bit 16
  // is set exactly when the key's low half low >= step.
  const uint32_t* nearest_sums() const { return nearest_sums_.data(); }

  // The order keys at which the nearest code steps up: nearest_keys()[j], j = 1..size()-1, is the least key of
  // [-1, 1] whose nearest code is j or more (0 where that is -1's, so that keys below -1 take -1's code as in
  // the index's first bucket; UINT32_MAX where no x up to 1 has it); [0] is 0. The nearest code of a key of
  // [-1, 1], or of the index's first and last buckets, is then the number of j >= 1 with nearest_keys()[j] <= key:
  // a search over size() - 1 sorted words that needs no table of buckets (search_codes16 of avx512_codes.h).
  const uint32_t* nearest_keys() const { return nearest_keys_.data(); }
  // True when no bucket holds more than one step of the nearest code.
  bool nearest_direct() const { return nearest_direct_; }
  // True when the nearest codes of +-1 and of +-(1 - 2^-24) agree. x * (1 / absmax) at x = +-absmax
  // is one of these, so an encoder may then skip normalise()'s exact +-1 select (blockwise.h).
  bool unit_stable() const { return unit_stable_; }
  // Refinement steps the densest bucket needs; above kMaxRefine use map_floor_index instead.
  int steps() const { return steps_; }
  // The map followed by +inf, so that padded()[floor + 1] is always readable.
  const float* padded() const { return padded_.data(); }
  // low_gap()[2i] = map[i] and low_gap()[2i + 1] = padded()[i + 1] - padded()[i] (the fp32
  // subtraction stochastic_up does; +inf for the last entry), side by side so one load fetches both.
  const float* low_gap() const { return low_gap_.data(); }
  uint32_t size() const { return n_; }
  bool matches(const float* map, uint32_t n) const;

 private:
  uint32_t n_;
  int steps_;
  bool nearest_direct_;
  bool unit_stable_;
  std::vector<float> padded_;
  std::vector<float> low_gap_;
  std::vector<uint8_t> start_;  // floor index at each bucket's first x; bytes keep it cache-resident
  std::vector<uint32_t> floor_steps_;
  std::vector<uint32_t> nearest_steps_;
  std::vector<uint32_t> nearest_sums_;
  std::vector<uint32_t> nearest_keys_;
};

// The index for this map, built on first use and kept in a small cache keyed by the map values.
std::shared_ptr<const MapIndex> map_index(const float* map, uint32_t n);

}  // namespace lowbit::cpu
