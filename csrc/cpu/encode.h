// Tile-wise encoding on the CPU, shared by the quantizers, the optimizer step and LPMM: a
// vectorisable pass normalises a tile, then a scalar pass finds codes (the O(1) map index, or the
// linear quantizer) and bit-packs them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "lowbit/blockwise.h"
#include "lowbit/pack.h"
#include "lowbit/qmap.h"
#include "lowbit/rounding.h"
#include "avx2.h"
#include "avx512.h"
#include "map_index.h"

namespace lowbit::cpu {

// Elements normalised per tile (stack buffers); a multiple of kGroup.
constexpr int kTile = 512;

// Draws for counters counter0 .. counter0 + cnt - 1 (encode.cpp).
void uniform_tile(RngKey key, uint64_t counter0, int cnt, float* u);

// Linear codes (blockwise.h: LinearCoder) of fp32 x against absmax, nearest or stochastic with the
// draws of counters counter0 .. (encode.cpp), and their inverse.
void linear_codes(const float* x, int cnt, float absmax, float qmax, bool stochastic, RngKey key, uint64_t counter0,
                  uint32_t* codes);
void linear_values(const uint32_t* codes, int cnt, float absmax, float qmax, float* out);

// Nearest codes of normalised xn with buckets b, for a map index with nearest_direct() (encode.cpp).
void nearest_tile(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes);

// Stochastic codes of normalised xn with buckets b, with the draws of counters counter0 .., for a
// map index whose buckets need at most one refinement step (encode.cpp).
void stochastic_tile(const MapIndex& index, const float* xn, const uint32_t* b, RngKey key, uint64_t counter0,
                     int cnt, uint32_t* codes);

// Nearest codes of fp32 x against absmax, stored as bytes, for a map index with nearest_direct()
// and at most 256 entries: the optimizer's state encode (encode.cpp).
void nearest_codes_u8(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out);

// xn = normalise(x, absmax) and the buckets of xn, for fp32 input (encode.cpp; an AVX2 clone).
void normalise_buckets(const float* x, int cnt, float absmax, float* xn, uint32_t* bucket);

// Element-wise normalise() with the block's division and its branches hoisted. Always inlined, so that
// it is compiled into each ISA clone that calls it (encode.cpp): an out-of-line copy is built for the
// baseline ISA only, and every clone called it.
template <typename T>
__attribute__((always_inline)) inline void normalise_tile(const T* x, int cnt, float absmax, float* xn) {
  const float inv = block_inverse(absmax);
  if (inv != 0.f) {
    for (int j = 0; j < cnt; ++j) xn[j] = normalise(to_float(x[j]), absmax, inv);
  } else if (absmax > 0.f) {
    for (int j = 0; j < cnt; ++j) xn[j] = normalise(to_float(x[j]), absmax, 0.f);
  } else {
    std::fill(xn, xn + cnt, 0.f);
  }
}

// fp16 and bf16 input (cnt <= kTile): widened to float first, which is exact and what normalise_tile would
// do element by element, so that the fp32 loop's ISA clones (encode.cpp) do the work.
template <typename T>
void normalise_buckets(const T* x, int cnt, float absmax, float* xn, uint32_t* bucket) {
  float wide[kTile];
  for (int j = 0; j < cnt; ++j) wide[j] = to_float(x[j]);
  normalise_buckets(wide, cnt, absmax, xn, bucket);
}

struct MapSpan {
  const MapIndex& index;
  // The gather tiles where gather_encode_active(): AVX-512 (avx512.h) where active, else AVX2 (avx2.h).
  bool gather = false;

  template <bool kSR, typename T>
  void encode(const T* x, int cnt, float absmax, RngKey key, uint64_t counter, uint32_t* codes) const {
    float xn[kTile];
    uint32_t bucket[kTile];
    normalise_buckets(x, cnt, absmax, xn, bucket);
    if (!kSR && index.nearest_direct()) {
      if (gather) {
        if (avx512_active()) return nearest_tile_avx512(index, xn, bucket, cnt, codes);
        return nearest_tile_avx2(index, xn, bucket, cnt, codes);
      }
      return nearest_tile(index, xn, bucket, cnt, codes);
    }
    if (kSR && index.steps() <= 1) {
      if (gather) {
        if (avx512_active()) return stochastic_tile_avx512(index, xn, bucket, key, counter, cnt, codes);
        return stochastic_tile_avx2(index, xn, bucket, key, counter, cnt, codes);
      }
      return stochastic_tile(index, xn, bucket, key, counter, cnt, codes);
    }
    // The step count is a template argument so the common one-step search is fully unrolled.
    switch (index.steps()) {
      case 0:
        return round_tile<kSR>(xn, cnt, key, counter, codes, [&](int j) { return index.floor_index<0>(xn[j], bucket[j]); });
      case 1:
        return round_tile<kSR>(xn, cnt, key, counter, codes, [&](int j) { return index.floor_index<1>(xn[j], bucket[j]); });
      case 2:
        return round_tile<kSR>(xn, cnt, key, counter, codes, [&](int j) { return index.floor_index<2>(xn[j], bucket[j]); });
      default:
        if (index.steps() <= kMaxRefine) {
          return round_tile<kSR>(xn, cnt, key, counter, codes,
                                 [&](int j) { return index.floor_index<kMaxRefine>(xn[j], bucket[j]); });
        }
        return round_tile<kSR>(xn, cnt, key, counter, codes,
                               [&](int j) { return map_floor_index(index.padded(), index.size(), xn[j]); });
    }
  }

  template <bool kSR, typename Floor>
  void round_tile(const float* xn, int cnt, RngKey key, uint64_t counter, uint32_t* codes, Floor&& floor) const {
    const float* m = index.padded();
    float u[kTile];
    if (kSR) uniform_tile(key, counter, cnt, u);
    for (int j = 0; j < cnt; ++j) {
      const uint32_t lo = floor(j);
      const bool up = kSR ? stochastic_up(xn[j], m[lo], m[lo + 1], u[j]) : nearest_up(xn[j], m[lo], m[lo + 1]);
      codes[j] = lo + static_cast<uint32_t>(up);
    }
  }
};

// Stores cnt codes of the tile starting at element t (a multiple of kGroup), in pack.h's layout.
// Widths 4, 8, 12 and 16 have byte-aligned loops that vectorise; the others pack 8 codes at a time.
inline void store_codes(const uint32_t* codes, int cnt, int bits, int64_t t, uint8_t* out) {
  uint8_t* o = out + (t / kGroup) * bits;
  switch (bits) {
    case 8:
      for (int j = 0; j < cnt; ++j) o[j] = static_cast<uint8_t>(codes[j]);
      return;
    case 16:
      for (int j = 0; j < cnt; ++j) {
        o[2 * j] = static_cast<uint8_t>(codes[j]);
        o[2 * j + 1] = static_cast<uint8_t>(codes[j] >> 8);
      }
      return;
    case 12:
      if (cnt % 2 == 0) {
        for (int j = 0; j < cnt / 2; ++j) {
          const uint32_t a = codes[2 * j];
          const uint32_t b = codes[2 * j + 1];
          o[3 * j] = static_cast<uint8_t>(a);
          o[3 * j + 1] = static_cast<uint8_t>((a >> 8) | (b << 4));
          o[3 * j + 2] = static_cast<uint8_t>(b >> 4);
        }
        return;
      }
      break;
    case 4:
      if (cnt % 2 == 0) {
        for (int j = 0; j < cnt / 2; ++j) o[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
        return;
      }
      break;
    default:
      break;
  }
  for (int j = 0; j < cnt; j += kGroup) pack_group(codes + j, std::min(kGroup, cnt - j), bits, o + (j / kGroup) * bits);
}

inline void load_codes(const uint8_t* in, int cnt, int bits, int64_t t, uint32_t* codes) {
  const uint8_t* s = in + (t / kGroup) * bits;
  switch (bits) {
    case 8:
      for (int j = 0; j < cnt; ++j) codes[j] = s[j];
      return;
    case 16:
      for (int j = 0; j < cnt; ++j) codes[j] = s[2 * j] | (static_cast<uint32_t>(s[2 * j + 1]) << 8);
      return;
    case 12:
      if (cnt % 2 == 0) {
        for (int j = 0; j < cnt / 2; ++j) {
          const uint32_t b0 = s[3 * j];
          const uint32_t b1 = s[3 * j + 1];
          const uint32_t b2 = s[3 * j + 2];
          codes[2 * j] = b0 | ((b1 & 0xFu) << 8);
          codes[2 * j + 1] = (b1 >> 4) | (b2 << 4);
        }
        return;
      }
      break;
    case 4:
      if (cnt % 2 == 0) {
        for (int j = 0; j < cnt / 2; ++j) {
          codes[2 * j] = s[j] & 0xFu;
          codes[2 * j + 1] = s[j] >> 4;
        }
        return;
      }
      break;
    default:
      break;
  }
  for (int j = 0; j < cnt; j += kGroup) unpack_group(s + (j / kGroup) * bits, std::min(kGroup, cnt - j), bits, codes + j);
}

struct LinearSpan {
  float qmax;

  template <bool kSR, typename T>
  void encode(const T* x, int cnt, float absmax, RngKey key, uint64_t counter, uint32_t* codes) const {
    if constexpr (std::is_same_v<T, float>) {
      linear_codes(x, cnt, absmax, qmax, kSR, key, counter, codes);
    } else {
      float v[kTile];
      for (int j = 0; j < cnt; ++j) v[j] = to_float(x[j]);
      linear_codes(v, cnt, absmax, qmax, kSR, key, counter, codes);
    }
  }
};

}  // namespace lowbit::cpu
