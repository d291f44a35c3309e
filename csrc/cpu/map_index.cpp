#include "map_index.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>


namespace lowbit::cpu {
namespace {

float bucket_value(uint32_t key) {
  return bits_to_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

constexpr size_t kCacheSize = 16;

}  // namespace

MapIndex::MapIndex(const float* map, uint32_t n)
    : n_(n), steps_(0), padded_(map, map + n), start_(kLastBucket - kFirstBucket + 1) {
  padded_.push_back(std::numeric_limits<float>::infinity());
  uint32_t lo = 0;
  for (uint32_t b = kFirstBucket; b <= kLastBucket; ++b) {
    const float first = bucket_value(b << 16);
    // bucket16 never yields -0, the top pattern of the bucket just below zero.
    const float last = bucket_value(b == 0x7FFFu ? 0x7FFFFFFEu : (b << 16) | 0xFFFFu);
    while (lo + 1 < n && map[lo + 1] <= first) ++lo;
    start_[b - kFirstBucket] = static_cast<uint8_t>(lo);
    int inside = 0;
    for (uint32_t i = lo + 1; i < n && map[i] <= last; ++i) ++inside;
    steps_ = std::max(steps_, inside);
  }
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
