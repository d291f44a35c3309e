#include "map_index.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

#include "lowbit/qmap.h"

namespace lowbit::cpu {
namespace {

// The float with this order key (order_key inverted).
float bucket_value(uint32_t key) {
  return bits_to_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// T[j] = smallest key whose nearest code is >= j, for j = 1..n-1 (UINT32_MAX if none in [-1, 1]).
std::vector<uint32_t> nearest_jumps(const float* map, uint32_t n) {
  const uint32_t lo_key = order_key(-1.f);
  const uint32_t hi_key = order_key(1.f);
  auto code = [&](uint32_t key) { return map_encode_nearest(map, n, bucket_value(key)); };
  std::vector<uint32_t> steps(n, UINT32_MAX);
  for (uint32_t j = 1; j < n; ++j) {
    if (code(hi_key) < j) continue;
    uint32_t lo = lo_key;
    uint32_t hi = hi_key;
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (code(mid) >= j) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    steps[j] = lo;
  }
  return steps;
}

constexpr size_t kCacheSize = 16;

}  // namespace

MapIndex::MapIndex(const float* map, uint32_t n)
    : n_(n),
      steps_(0),
      nearest_direct_(true),
      unit_stable_(false),
      padded_(map, map + n),
      start_(kLastBucket - kFirstBucket + 1),
      floor_steps_(kLastBucket - kFirstBucket + 1),
      nearest_steps_(kLastBucket - kFirstBucket + 1),
      nearest_sums_(kLastBucket - kFirstBucket + 1) {
  padded_.push_back(std::numeric_limits<float>::infinity());
  for (uint32_t i = 0; i < n; ++i) {
    low_gap_.push_back(padded_[i]);
    low_gap_.push_back(padded_[i + 1] - padded_[i]);
  }
  const std::vector<uint32_t> up = nearest_jumps(map, n);
  nearest_keys_ = up;
  nearest_keys_[0] = 0;
  for (uint32_t j = 1; j < n; ++j) {
    if (up[j] == order_key(-1.f)) nearest_keys_[j] = 0;
  }
  uint32_t lo = 0;
  for (uint32_t b = kFirstBucket; b <= kLastBucket; ++b) {
    const uint32_t first_key = b << 16;
    // bucket16 never yields -0, the top pattern of the bucket just below zero.
    const uint32_t last_key = b == 0x7FFFu ? 0x7FFFFFFEu : first_key | 0xFFFFu;
    const float first = bucket_value(first_key);
    const float last = bucket_value(last_key);
    while (lo + 1 < n && map[lo + 1] <= first) ++lo;
    start_[b - kFirstBucket] = static_cast<uint8_t>(lo);
    int inside = 0;
    for (uint32_t i = lo + 1; i < n && map[i] <= last; ++i) ++inside;
    // map[lo + 1] lies in (first, last], so its key shares this bucket's top 16 bits.
    const uint32_t step = inside > 0 ? order_key(map[lo + 1]) & 0xFFFFu : kNoStep;
    floor_steps_[b - kFirstBucket] = lo << kStepBits | step;
    steps_ = std::max(steps_, inside);

    const uint32_t base = map_encode_nearest(map, n, first);
    uint32_t jump = kNoStep;
    int jumps = 0;
    for (uint32_t j = base + 1; j < n && up[j] <= last_key; ++j) {
      if (up[j] > first_key) {
        jump = up[j] & 0xFFFFu;
        ++jumps;
      }
    }
    nearest_steps_[b - kFirstBucket] = base << kStepBits | jump;
    nearest_sums_[b - kFirstBucket] = (base << 16) + (0x10000u - jump) - (b << 16);
    nearest_direct_ = nearest_direct_ && jumps <= 1;
  }
  const float below_one = std::nextafter(1.f, 0.f);
  unit_stable_ = map_encode_nearest(map, n, below_one) == map_encode_nearest(map, n, 1.f) &&
                 map_encode_nearest(map, n, -below_one) == map_encode_nearest(map, n, -1.f);
}

bool MapIndex::matches(const float* map, uint32_t n) const {
  return n == n_ && std::memcmp(map, padded_.data(), n * sizeof(float)) == 0;
}

std::shared_ptr<const MapIndex> map_index(const float* map, uint32_t n) {
  static std::mutex mutex;
  static std::vector<std::shared_ptr<const MapIndex>> cache;  // most recently used last
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if ((*it)->matches(map, n)) {
      auto hit = *it;
      cache.erase(it);
      cache.push_back(hit);
      return hit;
    }
  }
  auto built = std::make_shared<const MapIndex>(map, n);
  if (cache.size() == kCacheSize) cache.erase(cache.begin());
  cache.push_back(built);
  return built;
}

}  // namespace lowbit::cpu
