// Approximate-activation backprop (approx-activations-blpa.txt section 3.2; lowbit/nn/blpa.py): K-bit
// codes of the batch-normalised activation a1 = (x - mean) * invstd of a BatchNorm -> ReLU -> linear
// block, on a per-channel grid of width h whose cut t (the ReLU threshold in a1) lies between code o - 1
// and code o. Every code sits on the side of the cut that the exact pre-ReLU value a2 > 0 decides, so
// the ReLU mask is recovered exactly from the code.
//
// grid: [4][channels] fp32 rows t, o, h, side (side = sign of gamma: +1, -1, or 0 when gamma == 0, where
// the mask is beta > 0 and the codes are unconstrained). Element i of an (N, C, inner) tensor is in
// channel (i / inner) % C.
#pragma once

#include <cmath>
#include <cstdint>

#include "lowbit/dispatch.h"
#include "lowbit/pack.h"

namespace lowbit {

constexpr int kBlpaGridRows = 4;

// The code of a1; ceil(.) - 1 puts a value on the cut below it, as ReLU's gradient treats 0. The
// quotient is first limited to +-512 (NaN to -512), which changes no code (codes are clipped to
// 0..255 after adding o <= 255) and lets ceil be an integer conversion that vectorises without
// SSE4.1. The side clip is written as selects, without branches, so that the CPU's element loops
// vectorise (lowbit/blpa.h's callers in csrc/cpu/blpa.cpp).
LB_HD uint32_t blpa_code(float a1, bool positive, float t, float o, float h, float side, int bits) {
  float v = (a1 - t) / h;
  v = v > -512.0f ? v : -512.0f;
  v = v < 512.0f ? v : 512.0f;
  const int truncated = static_cast<int>(v);
  const int ceiling = truncated + (static_cast<float>(truncated) < v ? 1 : 0);
  float raw = static_cast<float>(ceiling) - 1.0f + o;
  // With gamma == 0 (side 0) the codes are unconstrained; otherwise a code lies at or above o exactly
  // where a2 > 0 agrees with the sign of gamma.
  const bool constrained = side != 0.0f;
  const bool above = positive != (side < 0.0f);
  const float lo = constrained && above ? o : 0.0f;
  const float hi = constrained && !above ? o - 1.0f : static_cast<float>((1 << bits) - 1);
  raw = raw < lo ? lo : raw;
  raw = raw > hi ? hi : raw;
  return static_cast<uint32_t>(static_cast<int>(raw));
}

// The interval midpoint of a code (eq. 10).
// Codes are below 256, so the signed conversion is exact (and vectorises where an unsigned one does not).
LB_HD float blpa_value(uint32_t code, float t, float o, float h) {
  return t + ((static_cast<float>(static_cast<int>(code)) - o) + 0.5f) * h;
}

// The exact ReLU mask a2 > 0 of a code.
LB_HD bool blpa_mask(uint32_t code, float o, float side, float beta) {
  return side == 0.0f ? beta > 0.0f : ((static_cast<float>(static_cast<int>(code)) >= o) != (side < 0.0f));
}

// Code i of a packed stream of `bits`-bit codes (pack.h layout) holding nbytes bytes.
LB_HD uint32_t read_code(const uint8_t* packed, int64_t i, int bits, int64_t nbytes) {
  const int64_t bit = i * bits;
  const int64_t byte = bit >> 3;
  uint32_t word = packed[byte];
  if (byte + 1 < nbytes) word |= static_cast<uint32_t>(packed[byte + 1]) << 8;
  return (word >> (bit & 7)) & ((1u << bits) - 1u);
}

// The order of the backward's per-channel sums of mask * g and mask * g * a1 (eq. 8), one order for the
// CPU and CUDA loops so that their float results are bit-identical. The flat tensor is cut into chunks of
// kBlpaSumChunk elements (the last one shorter), and a chunk into runs at the multiples of inner (a run
// lies in one channel). A run's sums are kBlpaSumLanes lane sums: lane k starts at 0.0 and adds, in
// order, the masked elements at offsets k, k + kBlpaSumLanes, ... from the run's start; the lanes are
// then added pairwise (blpa_add_run). The lanes let the CPU keep one vector of sums per run instead of a
// serial chain of dependent double additions. A chunk's partial sums of a channel start at 0.0 and add
// that channel's runs in order; a channel's sums start at 0.0 and add its chunk partials in chunk order.
// A chunk without the channel may be left out: its partials are +0.0, and adding +0.0 changes no sum
// that started at +0.0 (such sums are never -0.0). For the same reason an unmasked element may add +0.0
// instead of nothing, which lets the loops select rather than branch.
// A multiple of kGroup (lowbit/pack.h), so a chunk's codes start on a whole byte.
constexpr int kBlpaSumChunk = 4096;
static_assert(kBlpaSumChunk % kGroup == 0, "a chunk of the backward sums starts on a whole group of codes");
// One AVX-512 vector of doubles; a power of two for blpa_lane_sum's pairwise tree.
constexpr int kBlpaSumLanes = 8;
static_assert(kBlpaSumLanes == 8, "blpa_lane_sum adds eight lanes");

// Adds element q (code), gv (gradient) to lane sums s1 (mask * g) and s2 (mask * g * a1). Sums in
// double: a product g * a1 of two floats is exact there.
LB_HD void blpa_add_element(uint32_t q, float gv, float t, float o, float h, float side, float beta, double& s1,
                            double& s2) {
  const bool m = blpa_mask(q, o, side, beta);
  const double g = m ? static_cast<double>(gv) : 0.0;
  s1 += g;
  s2 += m ? g * static_cast<double>(blpa_value(q, t, o, h)) : 0.0;
}

// The pairwise sum ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of a run's lanes.
LB_HD double blpa_lane_sum(const double* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

// Adds the sums of run [i0, i1) of one channel to p[0] (mask * g) and p[1] (mask * g * a1), in the lane
// order above; code(i) and grad(i) give element i's code and gradient (as float). The lanes are indexed
// by constants only (whole groups of kBlpaSumLanes, then one predicated group), so CUDA keeps them in
// registers and the CPU in one vector each.
template <typename I, typename Code, typename Grad>
LB_HD void blpa_add_run(I i0, I i1, Code&& code, Grad&& grad, float t, float o, float h, float side, float beta,
                        double* p) {
  double s1[kBlpaSumLanes] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  double s2[kBlpaSumLanes] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  I i = i0;
  for (; i1 - i >= kBlpaSumLanes; i += kBlpaSumLanes) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int k = 0; k < kBlpaSumLanes; ++k) {
      blpa_add_element(code(i + k), grad(i + k), t, o, h, side, beta, s1[k], s2[k]);
    }
  }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int k = 0; k < kBlpaSumLanes; ++k) {
    if (i + k < i1) blpa_add_element(code(i + k), grad(i + k), t, o, h, side, beta, s1[k], s2[k]);
  }
  p[0] += blpa_lane_sum(s1);
  p[1] += blpa_lane_sum(s2);
}

// relu(gamma * a1 + beta) of a code where its exact mask is set, else 0 (the decoded ReLU output).
LB_HD float blpa_relu_value(uint32_t code, float t, float o, float h, float side, float gamma, float beta) {
  if (!blpa_mask(code, o, side, beta)) return 0.0f;
  const float v = gamma * blpa_value(code, t, o, h) + beta;
  return v < 0.0f ? 0.0f : v;
}

}  // namespace lowbit
