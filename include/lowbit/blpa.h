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

// The element math below is written once for lanes of type F: F = float (one element: the CUDA kernels
// and blpa_add_run) or a GCC vector of floats (the CPU's loops, csrc/cpu/blpa.cpp, which specialises
// BlpaLanes for it and so computes eight elements per operation with the same IEEE operations in the
// same order). Comparisons of F give its mask type: bool, or a vector of -1 (true) and 0. Codes enter
// as floats (blpa_code_float), which is exact as codes are below 256.
// The lane functions are always inlined on the host, so that no vector of lanes crosses a call between
// the CPU's ISA clones, whose vector calling conventions differ (GCC's -Wpsabi).
#if defined(__CUDACC__) || !defined(__GNUC__)
#define LB_LANES LB_HD
#else
#define LB_LANES LB_HD __attribute__((always_inline))
#endif

template <typename F>
struct BlpaLanes {
  using Int = int;
  // Truncation toward zero, as a vector conversion does.
  LB_HD static Int trunc(F v) { return static_cast<int>(v); }
  LB_HD static F to_float(Int i) { return static_cast<float>(i); }
  LB_HD static double widen(F v) { return static_cast<double>(v); }
  LB_HD static bool splat_mask(bool b) { return b; }
};

// A code as a lane value of the functions below. Codes are below 256, so the signed conversion is exact
// (and vectorises where an unsigned one does not).
LB_HD float blpa_code_float(uint32_t code) { return static_cast<float>(static_cast<int>(code)); }

// The code of a1 (as an integer lane); ceil(.) - 1 puts a value on the cut below it, as ReLU's gradient
// treats 0. The quotient is first limited to +-512 (NaN to -512), which changes no code (codes are
// clipped to 0..255 after adding o <= 255) and lets ceil be an integer conversion. positive: a2 > 0.
template <typename F, typename M>
LB_LANES typename BlpaLanes<F>::Int blpa_code(F a1, M positive, float t, float o, float h, float side, int bits) {
  using L = BlpaLanes<F>;
  F v = (a1 - t) / h;
  v = v > -512.0f ? v : -512.0f;
  v = v < 512.0f ? v : 512.0f;
  const auto truncated = L::trunc(v);
  const auto ceiling = truncated + (L::to_float(truncated) < v ? 1 : 0);
  F raw = L::to_float(ceiling) - 1.0f + o;
  const float top = static_cast<float>((1 << bits) - 1);
  if (side == 0.0f) {
    // gamma == 0: the codes are unconstrained.
    raw = raw < 0.0f ? 0.0f : raw;
    raw = raw > top ? top : raw;
  } else {
    // A code lies at or above o exactly where a2 > 0 agrees with the sign of gamma.
    const M above = side < 0.0f ? !positive : positive;
    const F lo = above ? o : 0.0f;
    const F hi = above ? top : o - 1.0f;
    raw = raw < lo ? lo : raw;
    raw = raw > hi ? hi : raw;
  }
  return L::trunc(raw);
}

// The interval midpoint of a code q (eq. 10).
template <typename F>
LB_LANES F blpa_value(F q, float t, float o, float h) {
  return t + ((q - o) + 0.5f) * h;
}

// The exact ReLU mask a2 > 0 of a code q.
template <typename F>
LB_LANES auto blpa_mask(F q, float o, float side, float beta) -> decltype(q >= o) {
  if (side == 0.0f) return BlpaLanes<F>::splat_mask(beta > 0.0f);
  return side < 0.0f ? !(q >= o) : (q >= o);
}

// relu(gamma * a1 + beta) of a code q where its exact mask is set, else 0 (the decoded ReLU output).
template <typename F>
LB_LANES F blpa_relu_value(F q, float t, float o, float h, float side, float gamma, float beta) {
  const F v = gamma * blpa_value(q, t, o, h) + beta;
  return blpa_mask(q, o, side, beta) ? (v < 0.0f ? 0.0f : v) : 0.0f;
}

// k1 or k2 of blpa_input_grad from the float sum s of mask * g (or mask * g * a1) over the m elements of a
// channel: gamma * s / m, rounded once from double (one expression for the CPU and CUDA).
LB_HD float blpa_mean_term(float gamma, float s, double m) {
  return static_cast<float>(gamma * static_cast<double>(s) / m);
}

// dL/dx of an element with code q and gradient g = dL/d(ReLU output) (eq. 8): k1 = gamma mean(mask g)
// and k2 = gamma mean(mask g a1) with batch statistics, both 0 with running statistics.
template <typename F>
LB_LANES F blpa_input_grad(F q, F g, float t, float o, float h, float side, float gamma, float beta, float invstd,
                           float k1, float k2) {
  const F ga1 = blpa_mask(q, o, side, beta) ? gamma * g : 0.0f;
  return invstd * ((ga1 - k1) - blpa_value(q, t, o, h) * k2);
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

// Adds an element with code q and gradient gv to lane sums s1 (mask * g) and s2 (mask * g * a1). Sums in
// double: a product g * a1 of two floats is exact there. An unmasked element adds +0.0 to both.
template <typename F, typename D>
LB_LANES void blpa_add_element(F q, F gv, float t, float o, float h, float side, float beta, D& s1, D& s2) {
  using L = BlpaLanes<F>;
  const auto m = blpa_mask(q, o, side, beta);
  const D g = L::widen(m ? gv : 0.0f);
  s1 += g;
  s2 += g * L::widen(m ? blpa_value(q, t, o, h) : 0.0f);
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
      blpa_add_element(blpa_code_float(code(i + k)), grad(i + k), t, o, h, side, beta, s1[k], s2[k]);
    }
  }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int k = 0; k < kBlpaSumLanes; ++k) {
    if (i + k < i1) blpa_add_element(blpa_code_float(code(i + k)), grad(i + k), t, o, h, side, beta, s1[k], s2[k]);
  }
  p[0] += blpa_lane_sum(s1);
  p[1] += blpa_lane_sum(s2);
}

}  // namespace lowbit
