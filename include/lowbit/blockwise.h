// Per-block absmax and the two element coders (map-based and linear absmax), shared by the CPU
// loops and the CUDA kernels. Paper: 8bit-optimizers.txt section 2.1 (block-wise normalisation,
// eq. 4); lpmm.txt section 3.3 (stochastic rounding) and eq. 6 (linear quantizer Q_{delta,B}).
//
// Non-finite policy: a block holding NaN or +-Inf is "poisoned": its absmax is stored as NaN, its
// codes are the code of 0, and every element of it dequantizes to NaN. Divergence stays visible
// and a single bad value never corrupts other blocks. An all-zero block has absmax 0 and
// dequantizes to exact zeros.
#pragma once

#include <cmath>
#include <cstdint>

#include "lowbit/dispatch.h"
#include "lowbit/qmap.h"

namespace lowbit {

// Non-negative floats order like their bit patterns, so the absmax is an exact integer max that
// vectorises, and every NaN/Inf shows up as a pattern >= kNonFiniteBits.
constexpr uint32_t kNonFiniteBits = 0x7F800000u;
constexpr uint32_t kQuietNaNBits = 0x7FC00000u;

LB_HD uint32_t abs_bits(float v) { return float_to_bits(v) & 0x7FFFFFFFu; }

LB_HD float absmax_from_bits(uint32_t m) { return bits_to_float(m >= kNonFiniteBits ? kQuietNaNBits : m); }

// 1 / absmax, the one division per block. 0 for all-zero and poisoned blocks, and also for a subnormal
// absmax below 2^-128, whose reciprocal overflows: normalise() then divides instead.
LB_HD float block_inverse(float absmax) {
  const float r = 1.f / absmax;
  return absmax > 0.f && r <= 3.40282347e38f ? r : 0.f;
}

// Normalised input of one element, v * (1 / absmax) with inv = block_inverse(absmax): a multiply per
// element instead of a division, as bitsandbytes normalises (v / absmax when inv is 0). The absmax
// element maps to exactly +-1 (so it is reconstructed exactly), and the product, which can land one
// ulp beyond 1, is clamped to [-1, 1]; 0 for all-zero and poisoned (NaN absmax) blocks. Selects
// rather than branches, so the CPU loops vectorise; v is finite wherever absmax > 0.
LB_HD float normalise(float v, float absmax, float inv) {
  const float q = inv != 0.f ? v * inv : v / absmax;
  const float c = q < -1.f ? -1.f : (q < 1.f ? q : 1.f);
  const float r = v == absmax ? 1.f : (v == -absmax ? -1.f : c);
  return absmax > 0.f ? r : 0.f;
}
LB_HD float normalise(float v, float absmax) { return normalise(v, absmax, block_inverse(absmax)); }

// Codes are indices into a sorted map of `n` entries (dynamic, linear, quantile, ... maps).
struct MapCoder {
  const float* map;
  uint32_t n;

  template <bool kStochastic>
  LB_HD uint32_t encode(float v, float absmax, float u) const {
    const float x = normalise(v, absmax);
    return kStochastic ? map_encode_stochastic(map, n, x, u) : map_encode_nearest(map, n, x);
  }
  LB_HD float decode(uint32_t code, float absmax) const { return map[code] * absmax; }
};

// Symmetric linear absmax quantizer with qmax = 2^(bits-1) - 1 levels each side; the code is
// q + qmax in [0, 2*qmax]. normalise(v) * qmax is exactly +-qmax at the absmax element, so the
// absmax is reconstructed exactly under both rounding modes.
// Comparisons rather than fminf/fmaxf, whose NaN rules keep them from vectorising on the CPU;
// y is never NaN here (normalise() is finite for finite inputs).
LB_HD float linear_clamp(float y, float qmax) { return y < -qmax ? -qmax : (y < qmax ? y : qmax); }
LB_HD float linear_scaled(float v, float absmax, float qmax) { return linear_clamp(normalise(v, absmax) * qmax, qmax); }

// rintf and floorf for |y| <= 2^22 (linear codes have |y| <= 2^15). On the CPU the magic-number
// form replaces a libm call with two additions that vectorise on baseline x86-64, which has no
// rounding instruction; results are identical, so CPU and CUDA codes still agree.
LB_HD float round_even(float y) {
#if defined(__CUDA_ARCH__)
  return rintf(y);
#else
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: y + kMagic lies where the fp32 spacing is 1
  return (y + kMagic) - kMagic;
#endif
}
LB_HD float round_down(float y) {
#if defined(__CUDA_ARCH__)
  return floorf(y);
#else
  const float r = round_even(y);
  return r > y ? r - 1.f : r;
#endif
}

LB_HD uint32_t linear_code_nearest(float y, float qmax) {
  return static_cast<uint32_t>(static_cast<int32_t>(round_even(y) + qmax));
}
LB_HD uint32_t linear_code_stochastic(float y, float qmax, float u) {
  const float f = round_down(y);
  return static_cast<uint32_t>(static_cast<int32_t>(f + ((u < y - f) ? 1.f : 0.f) + qmax));
}
LB_HD float linear_decode(uint32_t code, float absmax, float qmax) {
  return ((static_cast<float>(code) - qmax) / qmax) * absmax;
}

struct LinearCoder {
  float qmax;

  template <bool kStochastic>
  LB_HD uint32_t encode(float v, float absmax, float u) const {
    const float y = linear_scaled(v, absmax, qmax);
    return kStochastic ? linear_code_stochastic(y, qmax, u) : linear_code_nearest(y, qmax);
  }
  LB_HD float decode(uint32_t code, float absmax) const { return linear_decode(code, absmax, qmax); }
};

}  // namespace lowbit
