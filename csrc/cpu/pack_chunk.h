// A chunk's codes to and from the packed stream of lowbit/pack.h, a whole 8-code group (bits bytes) at
// a time through one 64-bit word. A chunk starts on a whole group (parallel.h), so only the tensor's
// last chunk has a partial group. `bits` is an int, or a std::integral_constant where the caller's
// loops are compiled per width (the memcpy sizes and shifts then fold to constants).
#pragma once

#include <cstdint>
#include <cstring>

#include "lowbit/fewbit.h"
#include "lowbit/pack.h"

namespace lowbit::cpu {

// Packs cnt codes to out, the chunk's first byte.
template <typename Bits>
void pack_chunk(const uint32_t* codes, int cnt, Bits bits, uint8_t* out) {
  const int full = cnt / kGroup;
  for (int g = 0; g < full; ++g) {
    const uint64_t acc = pack8(codes + g * kGroup, bits);
    std::memcpy(out + g * bits, &acc, bits);
  }
  if (cnt > full * kGroup) pack_group(codes + full * kGroup, cnt - full * kGroup, bits, out + full * bits);
}

// Unpacks the cnt codes that start at in, the chunk's first byte.
template <typename Bits>
void unpack_chunk(const uint8_t* in, int cnt, Bits bits, uint32_t* codes) {
  const uint64_t mask = (uint64_t{1} << bits) - 1u;
  const int full = cnt / kGroup;
  for (int g = 0; g < full; ++g) {
    uint64_t acc = 0;
    std::memcpy(&acc, in + g * bits, bits);
    for (int k = 0; k < kGroup; ++k) codes[g * kGroup + k] = static_cast<uint32_t>((acc >> (bits * k)) & mask);
  }
  if (cnt > full * kGroup) unpack_group(in + full * bits, cnt - full * kGroup, bits, codes + full * kGroup);
}

}  // namespace lowbit::cpu
