// Encoding against a quantization map: a sorted table of 2^bits values in [-1, 1].
//
// "nearest" returns a true argmin of |map[j] - x| (ties go to the lower index), found with a
// branchless binary search: O(log n), at most 8 probes for 8-bit maps. "stochastic" picks one of the
// two neighbours that bracket x with probability proportional to closeness, so E[map[code]] = x
// for x inside [map[0], map[n-1]] (paper: lpmm.txt section 5.1, "binary search ... then stochastic
// rounding"). Values outside the map's range clamp to its end codes.
#pragma once

#include <cstdint>

#include "lowbit/dispatch.h"

namespace lowbit {

// Largest i with map[i] <= x, or 0 when x < map[0] (and for NaN). n must be a power of two.
LB_HD uint32_t map_floor_index(const float* map, uint32_t n, float x) {
  uint32_t i = 0;
  for (uint32_t step = n >> 1; step > 0; step >>= 1) i += step & (0u - static_cast<uint32_t>(map[i + step] <= x));
  return i;
}

// Rounding decisions between the bracketing map values lo <= x <= hi. Both distances are single
// correctly rounded subtractions, exactly what a brute-force argmin over |map[j] - x| computes, so
// "nearest" agrees with it bit for bit (ties go to the lower value). With lo == hi (x at or above
// the top of the map) neither rule moves up; an infinite hi never wins either.
LB_HD bool nearest_up(float x, float lo, float hi) { return hi - x < x - lo; }

// u is uniform on [0, 1): rounds up with probability (x - lo) / (hi - lo), up to one 2^-24 step of u.
LB_HD bool stochastic_up(float x, float lo, float hi, float u) { return u * (hi - lo) < x - lo; }

LB_HD uint32_t map_encode_nearest(const float* map, uint32_t n, float x) {
  const uint32_t lo = map_floor_index(map, n, x);
  const uint32_t hi = lo + 1 < n ? lo + 1 : lo;
  return nearest_up(x, map[lo], map[hi]) ? hi : lo;
}

LB_HD uint32_t map_encode_stochastic(const float* map, uint32_t n, float x, float u) {
  const uint32_t lo = map_floor_index(map, n, x);
  const uint32_t hi = lo + 1 < n ? lo + 1 : lo;
  return stochastic_up(x, map[lo], map[hi], u) ? hi : lo;
}

}  // namespace lowbit
