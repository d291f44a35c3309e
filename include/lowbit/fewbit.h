// Few-bit backward (fewbit-backward.txt section 3): the forward pass stores, per element, the index
// of the interval of the sorted boundaries b_1 < .. < b_{2^bits - 1} that x falls in, and the
// backward pass multiplies the incoming gradient by that interval's level, a piecewise-constant
// approximation of f'. Interval i is (b_i, b_{i+1}] with b_0 = -inf and b_{2^bits} = +inf, so the
// code is the number of boundaries < x (torch.bucketize's convention: a point on a boundary takes
// the lower interval, which makes ReLU's 1-bit table exact at 0 like torch's ReLU gradient); NaN
// compares false with every boundary and gets code 0.
#pragma once

#include <cstdint>
#include <cstring>

#include "lowbit/dispatch.h"
#include "lowbit/pack.h"

namespace lowbit {

constexpr int kMaxFewbitBits = 8;

// The number of boundaries < x, by a branch-free binary search over the 2^bits - 1 sorted ones.
LB_HD uint32_t interval_code(float x, const float* bounds, int bits) {
  uint32_t pos = 0;
  for (uint32_t step = 1u << (bits - 1); step > 0; step >>= 1) {
    pos += (x > bounds[pos + step - 1]) ? step : 0u;
  }
  return pos;
}

// Eight codes of `bits` bits fill exactly `bits` bytes (pack.h's layout): one 64-bit word.
LB_HD uint64_t pack8(const uint32_t* codes, int bits) {
  uint64_t acc = 0;
  for (int k = 0; k < kGroup; ++k) acc |= static_cast<uint64_t>(codes[k]) << (bits * k);
  return acc;
}

}  // namespace lowbit
