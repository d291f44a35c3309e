// Bit packing: code i of a stream occupies bits [i*b, i*b + b) of a little-endian byte string,
// least significant bit first, so n codes take exactly ceil(n*b/8) bytes. Eight codes always
// fill exactly b bytes, which is why blocks and work items start at multiples of 8 elements.
#pragma once

#include <cstdint>

#include "lowbit/dispatch.h"

namespace lowbit {

constexpr int kGroup = 8;

// A loop over the first `count` (at most kGroup) entries of a group. CUDA devices run it unrolled to
// kGroup, stopping at count, so that the caller's per-thread arrays of kGroup entries are only indexed by
// constants and stay in registers (indexed at run time, they would live in local memory). Hosts loop to
// count: the unrolled form runs slower there.
#if defined(__CUDA_ARCH__)
#define LB_FOR_GROUP(k, count) _Pragma("unroll") for (int k = 0; k < kGroup && k < (count); ++k)
#else
#define LB_FOR_GROUP(k, count) for (int k = 0; k < (count); ++k)
#endif

LB_HD int64_t packed_bytes(int64_t n, int bits) { return (n * bits + 7) / 8; }

// Packs count <= 8 codes of `bits` <= 16 bits each into ceil(count*bits/8) bytes at out.
LB_HD void pack_group(const uint32_t* codes, int count, int bits, uint8_t* out) {
  uint64_t acc = 0;
  int filled = 0;
  int o = 0;
  LB_FOR_GROUP(k, count) {
    acc |= static_cast<uint64_t>(codes[k]) << filled;
    filled += bits;
    while (filled >= 8) {
      out[o++] = static_cast<uint8_t>(acc);
      acc >>= 8;
      filled -= 8;
    }
  }
  if (filled > 0) out[o] = static_cast<uint8_t>(acc);
}

LB_HD void unpack_group(const uint8_t* in, int count, int bits, uint32_t* codes) {
  const uint32_t mask = (1u << bits) - 1u;
  uint64_t acc = 0;
  int filled = 0;
  int i = 0;
  LB_FOR_GROUP(k, count) {
    while (filled < bits) {
      acc |= static_cast<uint64_t>(in[i++]) << filled;
      filled += 8;
    }
    codes[k] = static_cast<uint32_t>(acc) & mask;
    acc >>= bits;
    filled -= bits;
  }
}

}  // namespace lowbit
