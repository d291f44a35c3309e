// Fused optimizer step on the CPU: OpenMP over the blocks of all tensors of a call. Each block is
// dequantized into an L1-resident fp32 buffer, updated with the rule of optim_rules.h, and
// requantized against a fresh block absmax (8bit-optimizers.txt section 2: "dequantize ... perform
// the update, and then quantize the states back to 8-bit").
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "avx2.h"
#include "avx2_codes.h"
#include "avx512.h"
#include "avx512_codes.h"
#include "avx512_convert.h"
#include "avx512_draws.h"
#include "encode.h"
#include "kernels.h"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/factored.h"
#include "lowbit/norm_order.h"
#include "lowbit/optim_rules.h"
#include "lowbit/rank1.h"
#include "lowbit/state_form.h"
#include "lowbit/state_rounding.h"
#include "map_index.h"
#include "pack_chunk.h"
#include "parallel.h"
#include "vbmi_decode.h"

namespace lowbit::cpu {
namespace {

constexpr int kMaxBlock = 4096;

struct TensorView {
  void* param;
  const void* grad;
  void* state[kMaxStates];
  float* absmax[kMaxStates];
  int64_t n;
  int dtype;
  int bits;        // 8 or 4: codes into the call's maps (kernels.h: kStateBits); 32: fp32 states
  bool quantized;  // bits != 32
  StepScalars scalars;
  Rank1View rank1;  // ndim 0: every quantized state is block-wise
  int rank1_slot;   // the state slot normalised rank-1 (the second moment), or -1
  FactoredView factored;  // batch 0: the second moment is not factorized
  bool stochastic;  // stochastic rounding of the quantized states (lowbit/state_rounding.h)
  uint64_t round_seed;
  uint64_t round_offset;
};

TensorView view(const OptimArgs& a, int64_t t) {
  const int64_t* m = a.meta + t * kMetaCols;
  return TensorView{cell_address(m[kParam]),
                    cell_address(m[kGrad]),
                    {cell_address(m[kState1]), cell_address(m[kState2]), cell_address(m[kState3])},
                    {static_cast<float*>(cell_address(m[kAbsmax1])), static_cast<float*>(cell_address(m[kAbsmax2])),
                     static_cast<float*>(cell_address(m[kAbsmax3]))},
                    m[kNumel],
                    static_cast<int>(m[kDtype]),
                    static_cast<int>(m[kStateBits]),
                    m[kStateBits] != 32,
                    scalars_row(a.scalars, t, a.grad_scales != nullptr ? a.grad_scales[t] : 1.f, 1.f),
                    rank1_row(a.rank1, t),
                    a.rank1 != nullptr && a.rank1[t * kRank1Cols + kR1Ndim] > 0 ? second_moment_slot(a.rule) : -1,
                    factored_row(a.factored, t),
                    a.rounding != nullptr,
                    a.rounding != nullptr ? static_cast<uint64_t>(a.rounding[t * kRoundCols + kRoundSeed]) : 0,
                    a.rounding != nullptr ? static_cast<uint64_t>(a.rounding[t * kRoundCols + kRoundOffset]) : 0};
}

// Stochastic rounding of quantized state k of a block (lowbit/state_rounding.h): the codes of `in`
// against absmax, element lo + j drawing at counter round_offset + lo + j of the state's stream. The
// tile encoders' stochastic path (encode.h) rather than the nearest-only vector loops.
void store_stochastic(const TensorView& t, int k, int64_t lo, int cnt, float amax, const MapIndex* index, bool gather,
                      const float* in) {
  const RngKey key = state_stream_key(t.round_seed, k);
  uint8_t* out = static_cast<uint8_t*>(t.state[k]) + (t.bits == 4 ? lo / 2 : lo);
  uint32_t tile[kTile];
  float u[kTile];
  const MapSpan span{*index, gather};
  for (int j = 0; j < cnt; j += kTile) {
    const int m = std::min(kTile, cnt - j);
    const uint64_t counter = t.round_offset + static_cast<uint64_t>(lo + j);
    if (t.bits == 4) {
      // The 16-entry map in one register (two with AVX2): the draws of the tile, then the vector rule on whole
      // groups of 16 (pack.h: they end on a whole byte), the rest by the tile encoder.
      int done = 0;
      if (avx512_active()) {
        uniform_tile(key, counter, m, u);
        done = stochastic_codes_u4_avx512(index->padded(), in + j, m, amax, u, out + j / 2);
      } else if (avx2_active()) {
        uniform_tile(key, counter, m, u);
        done = stochastic_codes_u4_avx2(*index, in + j, m, amax, u, out + j / 2);
      }
      if (done < m) {
        span.encode<true>(in + j + done, m - done, amax, key, counter + static_cast<uint64_t>(done), tile);
        pack_chunk(tile, m - done, std::integral_constant<int, 4>{}, out + (j + done) / 2);
      }
    } else {
      span.encode<true>(in + j, m, amax, key, counter, tile);
      for (int i = 0; i < m; ++i) out[j + i] = static_cast<uint8_t>(tile[i]);
    }
  }
}

// The element loops of the rank-1 normalised state of a block (lowbit/rank1.h), on x in place: the decoded
// map entries times their scales from `stats` (kDecode), the stored values normalised by them (kEncode),
// or the axis maxima stat_bits raised to the stored values x (kRaise). Compiled for the widest vector
// unit in use as update() is: the entry points flatten rank1.h's run loops into themselves, and min,
// max, the product and normalise's division and selects give the same results at any width.
enum class Rank1Loop { kDecode, kEncode, kRaise };

template <Rank1Loop kLoop>
__attribute__((always_inline)) inline void rank1_loop_body(const Rank1View& r, const float* stats, int64_t lo,
                                                           int cnt, float* x, uint32_t* stat_bits) {
  if constexpr (kLoop == Rank1Loop::kRaise) {
    rank1_raise(stat_bits, r, lo, cnt, x);
  } else {
    float scale[kMaxBlock];
    rank1_scales(stats, r, lo, cnt, scale);
    for (int i = 0; i < cnt; ++i) {
      x[i] = kLoop == Rank1Loop::kDecode ? x[i] * scale[i] : rank1_normalise(x[i], scale[i]);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
template <Rank1Loop kLoop>
__attribute__((target("avx2"), flatten)) void rank1_loop_avx2(const Rank1View& r, const float* stats, int64_t lo,
                                                               int cnt, float* x, uint32_t* stat_bits) {
  rank1_loop_body<kLoop>(r, stats, lo, cnt, x, stat_bits);
}

template <Rank1Loop kLoop>
__attribute__((target("avx512f"), flatten)) void rank1_loop_avx512(const Rank1View& r, const float* stats,
                                                                    int64_t lo, int cnt, float* x,
                                                                    uint32_t* stat_bits) {
  rank1_loop_body<kLoop>(r, stats, lo, cnt, x, stat_bits);
}
#endif

template <Rank1Loop kLoop>
void rank1_loop(const Rank1View& r, const float* stats, int64_t lo, int cnt, float* x, uint32_t* stat_bits) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx512_active()) return rank1_loop_avx512<kLoop>(r, stats, lo, cnt, x, stat_bits);
  if (avx2_active()) return rank1_loop_avx2<kLoop>(r, stats, lo, cnt, x, stat_bits);
#endif
  rank1_loop_body<kLoop>(r, stats, lo, cnt, x, stat_bits);
}

// Decodes the rank-1 normalised 4-bit state k (lowbit/rank1.h) of the block at element lo into out,
// with the scales of `stats`.
void load_rank1(const TensorView& t, int k, int64_t lo, int cnt, const float* map, float* out) {
  const uint8_t* packed = static_cast<const uint8_t*>(t.state[k]) + lo / 2;
  // The map entries first (the block-wise decoders with scale 1, which is exact), then each times its own
  // scale: the same products as map[code] * scale element by element.
  const int done = avx512_active() ? decode_u4_avx512(map, packed, cnt, 1.f, out)
                   : avx2_active()   ? decode_u4_avx2(map, packed, cnt, 1.f, out)
                                     : 0;
  uint32_t tile[kTile];
  for (int j = done; j < cnt; j += kTile) {
    const int m = std::min(kTile, cnt - j);
    unpack_chunk(packed + j / 2, m, std::integral_constant<int, 4>{}, tile);
    for (int i = 0; i < m; ++i) out[j + i] = map[tile[i]];
  }
  rank1_loop<Rank1Loop::kDecode>(t.rank1, t.rank1.stats, lo, cnt, out, nullptr);
}

// Encodes the stored values `in` of the rank-1 normalised state k of a block against the new statistics:
// each is normalised by its own scale, and the normalised values are encoded like a block of absmax 1
// (normalise(x, 1) is x, so this is the nearest code of x / scale).
void store_rank1(const TensorView& t, int k, int64_t lo, int cnt, const MapIndex* index, bool gather,
                 const float* in) {
  float normalised[kMaxBlock];
  std::copy_n(in, cnt, normalised);
  rank1_loop<Rank1Loop::kEncode>(t.rank1, t.rank1.new_stats, lo, cnt, normalised, nullptr);
  if (t.stochastic) return store_stochastic(t, k, lo, cnt, 1.f, index, gather, normalised);
  uint8_t* packed = static_cast<uint8_t*>(t.state[k]) + lo / 2;
  uint32_t tile[kTile];
  const MapSpan span{*index, gather};
  const int done = avx512_active() ? nearest_codes_u4_avx512(index->padded(), normalised, cnt, 1.f, packed)
                   : avx2_active()   ? nearest_codes_u4_avx2(*index, gather, normalised, cnt, 1.f, packed)
                                     : 0;
  for (int j = done; j < cnt; j += kTile) {
    const int m = std::min(kTile, cnt - j);
    span.encode<false>(normalised + j, m, 1.f, RngKey{0, 0}, 0, tile);
    pack_chunk(tile, m, std::integral_constant<int, 4>{}, packed + j / 2);
  }
}

// Decodes quantized state k of a block into out: the stored forms of state_form.h, which the update
// loops turn into state values and back. Blocks start on whole bytes of 4-bit codes (lo is a multiple of
// the block size, at least 64).
void load_state(const TensorView& t, int k, int64_t block, int64_t lo, int cnt, const float* map,
                const BytePlanes* planes, float* out) {
  if (k == t.rank1_slot) return load_rank1(t, k, lo, cnt, map, out);
  const float amax = t.absmax[k][block];
  if (t.bits == 4) {
    const uint8_t* packed = static_cast<const uint8_t*>(t.state[k]) + lo / 2;
    uint32_t tile[kTile];
    const int done = avx512_active() ? decode_u4_avx512(map, packed, cnt, amax, out)
                     : avx2_active()   ? decode_u4_avx2(map, packed, cnt, amax, out)
                                       : 0;
    for (int j = done; j < cnt; j += kTile) {
      const int m = std::min(kTile, cnt - j);
      unpack_chunk(packed + j / 2, m, std::integral_constant<int, 4>{}, tile);
      for (int i = 0; i < m; ++i) out[j + i] = map[tile[i]] * amax;
    }
    return;
  }
  const uint8_t* codes = static_cast<const uint8_t*>(t.state[k]) + lo;
  if (planes != nullptr) return decode_u8_vbmi(*planes, map, codes, cnt, amax, out);
  if (avx512_active()) return decode_u8_avx512(map, codes, cnt, amax, out);
  if (avx2_active()) return decode_u8_avx2(map, codes, cnt, amax, out);
  for (int i = 0; i < cnt; ++i) out[i] = map[codes[i]] * amax;
}

// Requantizes quantized state k of a block from in, against the block absmax of bit pattern max_bits.
void store_state(const TensorView& t, int k, int64_t block, int64_t lo, int cnt, uint32_t max_bits,
                 const MapIndex* index, bool gather, const float* in) {
  if (k == t.rank1_slot) return store_rank1(t, k, lo, cnt, index, gather, in);
  const float amax = absmax_from_bits(max_bits);
  t.absmax[k][block] = amax;
  if (t.stochastic) return store_stochastic(t, k, lo, cnt, amax, index, gather, in);
  if (t.bits == 4) {
    uint8_t* packed = static_cast<uint8_t*>(t.state[k]) + lo / 2;
    uint32_t tile[kTile];
    const MapSpan span{*index, gather};
    const int done = avx512_active() ? nearest_codes_u4_avx512(index->padded(), in, cnt, amax, packed)
                     : avx2_active()   ? nearest_codes_u4_avx2(*index, gather, in, cnt, amax, packed)
                                       : 0;
    for (int j = done; j < cnt; j += kTile) {
      const int m = std::min(kTile, cnt - j);
      span.encode<false>(in + j, m, amax, RngKey{0, 0}, 0, tile);
      pack_chunk(tile, m, std::integral_constant<int, 4>{}, packed + j / 2);
    }
    return;
  }
  uint8_t* codes = static_cast<uint8_t*>(t.state[k]) + lo;
  if (index->nearest_direct()) {
    if (gather && avx512_active()) return nearest_codes_u8_avx512(*index, in, cnt, amax, codes);
    if (gather) return nearest_codes_u8_avx2(*index, in, cnt, amax, codes);
    return nearest_codes_u8(*index, in, cnt, amax, codes);
  }
  uint32_t tile[kTile];
  const MapSpan span{*index};
  for (int j = 0; j < cnt; j += kTile) {
    const int m = std::min(kTile, cnt - j);
    span.encode<false>(in + j, m, amax, RngKey{0, 0}, 0, tile);
    for (int i = 0; i < m; ++i) codes[j + i] = static_cast<uint8_t>(tile[i]);
  }
}

// s[k] = the fp32 values of state k of a block: 32-bit states in place, 8-bit ones decoded into
// `decoded` (copying 32-bit states through a buffer instead costs as much as the whole update).
// Only the first kStates buffers of `decoded` are used: the others' pointers are never dereferenced.
template <int kStates>
void block_states(const OptimArgs& a, const TensorView& t, int64_t block, int64_t lo, int cnt,
                  const BytePlanes* const* planes, float (&decoded)[kMaxStates][kMaxBlock],
                  float* (&s)[kMaxStates]) {
  for (int k = 0; k < kMaxStates; ++k) {
    s[k] = decoded[k];
    if (k >= kStates) continue;
    if (t.quantized) {
      load_state(t, k, block, lo, cnt, state_map(a, k), planes[k], s[k]);
    } else {
      s[k] = static_cast<float*>(t.state[k]) + lo;
    }
  }
}

#define LB_ALWAYS_INLINE __attribute__((always_inline))

// Calls fn(std::bool_constant<first>{}, std::bool_constant<nesterov>{}) for SGD's first-step and
// Nesterov options, so that the loops fn runs see them as constants.
template <typename Fn>
LB_ALWAYS_INLINE inline void with_sgd_options(const StepHyper& h, const StepScalars& sc, Fn&& fn) {
  const bool nesterov = (h.flags & kNesterov) != 0;
  if (sc.first) {
    if (nesterov) return fn(std::true_type{}, std::true_type{});
    return fn(std::true_type{}, std::false_type{});
  }
  if (nesterov) return fn(std::false_type{}, std::true_type{});
  fn(std::false_type{}, std::false_type{});
}

// SGD with momentum over one block, its first-step and Nesterov options fixed: SGD has more
// loop-invariant options than GCC's loop unswitching resolves, and GCC does not vectorise a select on
// one that is left. The step is apply_rule's for SGD (which never decays decoupled).
template <bool kFirst, bool kNesterov, typename T>
__attribute__((always_inline)) inline void sgd_body(const StepHyper& h, const StepScalars& sc, T* __restrict param,
                                                    const T* __restrict grad, float* __restrict s1, int cnt,
                                                    uint32_t* max_bits) {
  uint32_t max1 = 0;
  for (int i = 0; i < cnt; ++i) {
    float p = to_float(param[i]);
    float buf = s1[i];
    const float u = sgd_momentum_step<kFirst, kNesterov>(h, p, effective_grad(h, sc, to_float(grad[i])), buf);
    param[i] = from_float<T>(p - sc.update_scale * u);
    s1[i] = buf;
    max1 = std::max(max1, abs_bits(buf));
  }
  max_bits[0] = max1;
  max_bits[1] = 0;
  max_bits[2] = 0;
}

// The flag bits that the rules test per element (optim_rules.h: kMaximize, kDecoupled).
constexpr int32_t kElementFlags = kMaximize | kDecoupled;

// Calls fn(std::integral_constant<int32_t, K>{}) for K = flags & kElementFlags. GCC vectorises no rule
// loop that tests these bits at run time next to a run-time weight decay (Adam8bit's step ran scalar:
// one sqrtss and two divss per element); with them constant it does.
template <typename Fn>
LB_ALWAYS_INLINE inline void with_element_flags(int32_t flags, Fn&& fn) {
  switch (flags & kElementFlags) {
    case 0:
      return fn(std::integral_constant<int32_t, 0>{});
    case kMaximize:
      return fn(std::integral_constant<int32_t, kMaximize>{});
    case kDecoupled:
      return fn(std::integral_constant<int32_t, kDecoupled>{});
    default:
      return fn(std::integral_constant<int32_t, kElementFlags>{});
  }
}

// The update of one block: everything it reads is in locals and restrict pointers so that it
// vectorises, and the flag bits of with_element_flags are the constant kFlags. Always inlined into
// the entry points below, so each is compiled for its target; the rules it calls are inlined too, and any out-of-line copy stays baseline code. With kRoot the
// states are 8-bit ones in their stored form (state_form.h): the second moment is squared on the way
// in and its root (which Adam's denominator computes anyway) stored on the way out. s3 is only touched
// by the three-state rules (kStates == 3), so the others compile to the two-state loop.
template <Rule kRule, int kStates, bool kRoot, int32_t kFlags, typename T>
__attribute__((always_inline)) inline void update_body(const StepHyper& hyper, const StepScalars& scalars,
                                                       T* __restrict param, const T* __restrict grad,
                                                       float* __restrict s1, float* __restrict s2,
                                                       float* __restrict s3, int cnt, uint32_t* max_bits) {
  StepHyper h = hyper;
  h.flags = (hyper.flags & ~kElementFlags) | kFlags;
  const StepScalars sc = scalars;
  if constexpr (kRule == Rule::SGD && kStates == 1) {
    if (h.beta1 != 0.f && !(h.flags & kDecoupled)) {
      return with_sgd_options(h, sc, [&](auto first, auto nesterov) LB_ALWAYS_INLINE {
        sgd_body<decltype(first)::value, decltype(nesterov)::value>(h, sc, param, grad, s1, cnt, max_bits);
      });
    }
  }
  constexpr bool kRoot1 = kRoot && root_slot(kRule, 0);
  constexpr bool kRoot2 = kRoot && root_slot(kRule, 1);
  constexpr bool kRoot3 = kRoot && root_slot(kRule, 2);
  uint32_t max1 = 0;
  uint32_t max2 = 0;
  uint32_t max3 = 0;
  for (int i = 0; i < cnt; ++i) {
    float p = to_float(param[i]);
    float v1 = kStates > 0 ? state_value(s1[i], kRoot1) : 0.f;
    float v2 = kStates > 1 ? state_value(s2[i], kRoot2) : 0.f;
    float v3 = kStates > 2 ? state_value(s3[i], kRoot3) : 0.f;
    apply_rule(kRule, h, sc, p, to_float(grad[i]), v1, v2, v3);
    param[i] = from_float<T>(p);
    v1 = stored_form(v1, kRoot1);
    v2 = stored_form(v2, kRoot2);
    v3 = stored_form(v3, kRoot3);
    if (kStates > 0) {
      s1[i] = v1;
      max1 = std::max(max1, abs_bits(v1));
    }
    if (kStates > 1) {
      s2[i] = v2;
      max2 = std::max(max2, abs_bits(v2));
    }
    if (kStates > 2) {
      s3[i] = v3;
      max3 = std::max(max3, abs_bits(v3));
    }
  }
  max_bits[0] = max1;
  max_bits[1] = max2;
  max_bits[2] = max3;
}

template <Rule kRule, int kStates, bool kRoot, typename T>
void update_baseline(const StepHyper& h, const StepScalars& sc, T* param, const T* grad, float* s1, float* s2,
                     float* s3, int cnt, uint32_t* max_bits) {
  with_element_flags(h.flags, [&](auto flags) LB_ALWAYS_INLINE {
    update_body<kRule, kStates, kRoot, decltype(flags)::value>(h, sc, param, grad, s1, s2, s3, cnt, max_bits);
  });
}

#if defined(__x86_64__) && defined(__GNUC__)
// 8-wide division and square root where the CPU has AVX2 (no FMA: same IEEE results as baseline).
template <Rule kRule, int kStates, bool kRoot, typename T>
__attribute__((target("avx2"))) void update_avx2(const StepHyper& h, const StepScalars& sc, T* param,
                                                 const T* grad, float* s1, float* s2, float* s3, int cnt,
                                                 uint32_t* max_bits) {
  with_element_flags(h.flags, [&](auto flags) LB_ALWAYS_INLINE {
    update_body<kRule, kStates, kRoot, decltype(flags)::value>(h, sc, param, grad, s1, s2, s3, cnt, max_bits);
  });
}

// 16-wide where the CPU has AVX-512F and avx512_active() allows it (same IEEE results again).
template <Rule kRule, int kStates, bool kRoot, typename T>
__attribute__((target("avx512f"))) void update_avx512(const StepHyper& h, const StepScalars& sc, T* param,
                                                      const T* grad, float* s1, float* s2, float* s3, int cnt,
                                                      uint32_t* max_bits) {
  with_element_flags(h.flags, [&](auto flags) LB_ALWAYS_INLINE {
    update_body<kRule, kStates, kRoot, decltype(flags)::value>(h, sc, param, grad, s1, s2, s3, cnt, max_bits);
  });
}

#endif

// The update of one block, compiled for the widest vector unit in use.
template <Rule kRule, int kStates, bool kRoot, typename T>
void update(const StepHyper& h, const StepScalars& sc, T* param, const T* grad, float* s1, float* s2, float* s3,
            int cnt, uint32_t* max_bits) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx512_active()) return update_avx512<kRule, kStates, kRoot>(h, sc, param, grad, s1, s2, s3, cnt, max_bits);
  if (avx2_active()) return update_avx2<kRule, kStates, kRoot>(h, sc, param, grad, s1, s2, s3, cnt, max_bits);
#endif
  update_baseline<kRule, kStates, kRoot>(h, sc, param, grad, s1, s2, s3, cnt, max_bits);
}

// Whether the AVX-512 fused Adam loops may divide by bias2_sqrt as divide_by_constant16 does, with the
// division's bits: for finite a >= 0 and b in [2^-60, 1]. With y = 1 / b rounded (relative error below
// 2^-24), q0 = a * y rounded is within 1.5 ulps of z = a / b. The first correction adds (a - b q0)(1 + d) y,
// |d| <= 2^-24, which leaves q0 + (z - q0)(1 + e), |e| < 2^-22.9, before its rounding: q1 is one of the two
// floats around z. Markstein's theorem then makes the residual a - b q1 exact and q1 + (a - b q1) * y round to
// z rounded. The range keeps every step exact: a <= 2^64 (a root of a float) and b >= 2^-60 leave q below
// 2^124; b <= 1 keeps q >= a, and the residual is a multiple of ulp(b) ulp(q) / 2 >= ulp(a) 2^-25 (b q is
// about a), which for a nonzero a (at least 2^-74.5) is at least 2^-123: representable. a = +0 gives +0, as
// the division does. test_adam_bias_correction_quotients_match_reference holds the loops to the division. (The
// AVX2 loop keeps the division: 8 lanes wide the divider is not what limits it, and the FMA steps were no
// faster, measured.)
inline bool reciprocal_divides(float b) { return b >= 0x1p-60f && b <= 1.f; }

// How the 8-bit states of a call are encoded and decoded: map indexes, the VBMI decoder's byte planes
// (null where it is not used) and the choice of encoder, all fixed before the parallel loop.
struct StateCoders {
  const MapIndex* index[kMaxStates] = {nullptr, nullptr, nullptr};
  const BytePlanes* planes[kMaxStates] = {nullptr, nullptr, nullptr};
  bool gather = false;
  // Adam's and LAMB's 8-bit blocks, and the 4-bit ones adam_fused takes, take adam_block (below): the AVX-512
  // gather encoder is in use for both states.
  bool adam_split = false;
  // adam_split's 8-bit loops decode the first moment by its byte planes too (vbmi_first_moment_active).
  bool planes_first = false;
  // adam_split's 4-bit loops encode by search_codes16 (search_u4_active).
  bool search_u4 = false;
  // Adam's and LAMB's 8-bit and 4-bit blocks of fp32 parameters take adam_block_avx2 (below): the AVX2 gather
  // encoder is in use (AVX-512 is not), and both maps are unit-stable.
  bool adam_avx2 = false;
};

// Starts reading the 64-byte line that holds p into L2.
LB_ALWAYS_INLINE inline void prefetch_line_l2(const void* p) {
#if defined(__x86_64__) && defined(__GNUC__)
  // prefetcht1 (into L2) as volatile asm: GCC 12 drops a loop of __builtin_prefetch when it inlines it
  // into step_block (the built module held no prefetch instruction).
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Starts reading bytes [0, bytes) at p into L2.
inline void prefetch_l2(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) prefetch_line_l2(p + off);
}

// How far ahead, in elements, the fused Adam loops read their streams (StreamAhead).
constexpr int64_t kStreamAhead = 512;

// A stream (gradients, parameters or a state's codes) that a loop over a block reads kStreamAhead elements
// ahead: at(b), for the block's byte offset b, starts reading the line at base + b into L2 when b is a multiple
// of 64 below `bytes` (what the tensor has there; nothing when bytes is 0). The loops call it for each 16 or
// 64 bytes of the stream, so the lines are requested one at a time, spread through the block's work:
// requested in four bursts per block (prefetch_ahead), they waited for fill buffers, which held 11% of the
// step's perf samples (Adam8bit, one 16M fp32 tensor).
struct StreamAhead {
  const char* base = nullptr;
  int bytes = 0;

  LB_ALWAYS_INLINE void at(int b) const {
    if (b % 64 == 0 && b < bytes) prefetch_line_l2(base + b);
  }
};

// The StreamAhead of a block's stream p of `bits` bits per element, at element lo of a tensor of n elements
// with cnt in the block.
inline StreamAhead stream_ahead(const void* p, int bits, int64_t lo, int cnt, int64_t n) {
  if (lo + kStreamAhead >= n) return {};
  const int64_t elements = std::min<int64_t>(cnt, n - lo - kStreamAhead);
  return {static_cast<const char*>(p) + kStreamAhead * bits / 8, static_cast<int>((elements * bits + 7) / 8)};
}

// The streams of a fused Adam block read ahead: the moments loop reads the gradients and both states' codes,
// the encode loop the parameters (LAMB's norm pass all four; LARS's the first two).
struct AdamAhead {
  StreamAhead grad, param, q1, q2;

  LB_ALWAYS_INLINE void codes_at(int b) const {
    q1.at(b);
    q2.at(b);
  }
};

// The AdamAhead of a block of parameters p and gradients g of type T with codes q1, q2 (element lo, cnt in it).
template <typename T>
AdamAhead adam_ahead(const TensorView& t, int64_t lo, int cnt, const T* p, const T* g, const uint8_t* q1,
                     const uint8_t* q2) {
  constexpr int kBits = 8 * sizeof(T);
  return {stream_ahead(g, kBits, lo, cnt, t.n), stream_ahead(p, kBits, lo, cnt, t.n),
          stream_ahead(q1, t.bits, lo, cnt, t.n), stream_ahead(q2, t.bits, lo, cnt, t.n)};
}

#ifdef LB_AVX512_CODES
// Adam's and LAMB's (kLamb) blocks of 8-bit states (and 4-bit ones, adam_fused) where the AVX-512 gather
// encoder requantizes them, in two passes instead of update() and then store_state(): the new moments of the
// whole block and their maxima (adam_moments or ema_moments, and the root of v, its stored form), then one
// loop that encodes both moments and steps the parameters (adam_update or lamb_update), 16 elements at a
// time. The step's two divisions and the encoder's gathers then keep different units busy at once, where the
// update loop and the encoder loops used them one after the other. The same operations on the same values as
// update_body, so the same results.
template <bool kLamb, int32_t kFlags, typename T>
__attribute__((target("avx512f"))) void adam_moments_avx512(const StepHyper& hyper, const StepScalars& sc,
                                                            const T* __restrict param, const T* __restrict grad,
                                                            float* __restrict s1, float* __restrict s2, int cnt,
                                                            uint32_t* max_bits) {
  StepHyper h = hyper;
  h.flags = (hyper.flags & ~kElementFlags) | kFlags;
  uint32_t max1 = 0;
  uint32_t max2 = 0;
  for (int i = 0; i < cnt; ++i) {
    float m = s1[i];
    float v = state_value(s2[i], true);
    const float g = effective_grad(h, sc, to_float(grad[i]));
    if constexpr (kLamb) {
      ema_moments(h, g, m, v);
    } else {
      adam_moments(h, to_float(param[i]), g, m, v);
    }
    const float root = stored_form(v, true);
    s1[i] = m;
    s2[i] = root;
    max1 = std::max(max1, abs_bits(m));
    max2 = std::max(max2, abs_bits(root));
  }
  max_bits[0] = max1;
  max_bits[1] = max2;
  max_bits[2] = 0;
}

// The parameters' step over elements [lo, hi) from the new moments m = s1 and root of v = s2 (kLamb: LAMB's);
// kDecay: decoupled weight decay applies.
template <bool kLamb, bool kDecay, typename T>
__attribute__((target("avx512f"), always_inline)) inline void adam_params(const StepHyper& hyper,
                                                                        const StepScalars& scalars,
                                                                        T* __restrict param, const float* __restrict s1,
                                                                        const float* __restrict s2, int lo, int hi) {
  // Locals, which the stores to param cannot alias (else the loop does not vectorise).
  StepHyper h = hyper;
  h.flags = kDecay ? (hyper.flags | kDecoupled) : (hyper.flags & ~kDecoupled);
  const StepScalars sc = scalars;
  // Not unrolled: GCC unrolls the 16-element loop of adam_encode_step_avx512 completely and then leaves
  // it scalar (the encoder's gathers end its straight-line vectorisation); kept a loop, it is one vector.
#pragma GCC unroll 1
  for (int i = lo; i < hi; ++i) {
    const float p = to_float(param[i]);
    const float u = kLamb ? lamb_update(h, sc, p, s1[i], s2[i]) : adam_update(sc, h.eps, s1[i], s2[i]);
    param[i] = from_float<T>(stepped(h, sc, p, u));
  }
}

template <bool kLamb, bool kDecay, typename T>
__attribute__((target("avx512f"))) void adam_params_avx512(const StepHyper& h, const StepScalars& sc, T* param,
                                                           const float* s1, const float* s2, int cnt) {
  adam_params<kLamb, kDecay>(h, sc, param, s1, s2, 0, cnt);
}

// The second pass: codes of both moments into q1, q2 and the parameters' step, 16 elements at a time; the
// last cnt % 16 by the scalar-table encoder.
template <bool kLamb, bool kExact1, bool kExact2, bool kDecay, typename T>
__attribute__((target("avx512f"))) void adam_encode_step_avx512(const StepHyper& h, const StepScalars& sc,
                                                               T* __restrict param, const float* __restrict s1,
                                                               const float* __restrict s2, int cnt,
                                                               const MapIndex* const* index, NearestBlock b1,
                                                               NearestBlock b2, uint8_t* __restrict q1,
                                                               uint8_t* __restrict q2) {
  int j = 0;
  for (; j + 16 <= cnt; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + j), nearest_codes16<kExact1>(b1, s1 + j));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + j), nearest_codes16<kExact2>(b2, s2 + j));
    adam_params<kLamb, kDecay>(h, sc, param, s1, s2, j, j + 16);
  }
  if (j < cnt) {
    nearest_codes_u8(*index[0], s1 + j, cnt - j, b1.absmax, q1 + j);
    nearest_codes_u8(*index[1], s2 + j, cnt - j, b2.absmax, q2 + j);
    adam_params<kLamb, kDecay>(h, sc, param, s1, s2, j, cnt);
  }
}

// The constants of Adam's moments in registers (adam_moments16). kSmall: torch_lerp's first form
// (|1 - beta1| < 0.5).
struct AdamMomentConstants {
  __m512 lerp_weight;
  __m512 beta2;
  __m512 one_minus_beta2;
  __m512 grad_scale;
  __m512 weight_decay;
};

template <bool kSmall>
__attribute__((target("avx512f"), always_inline)) inline AdamMomentConstants adam_moment_constants(
    const StepHyper& h, const StepScalars& sc) {
  // torch_lerp's two forms (optim_rules.h): m + w (g - m) or g + (w - 1) (g - m).
  return {_mm512_set1_ps(kSmall ? h.one_minus_beta1 : h.one_minus_beta1 - 1.f), _mm512_set1_ps(h.beta2),
          _mm512_set1_ps(h.one_minus_beta2), _mm512_set1_ps(sc.grad_scale), _mm512_set1_ps(h.weight_decay)};
}

// Adam's (and LAMB's) moments of 16 elements at i from their decoded m and root of v: effective_grad,
// adam_moments' L2 term and torch_lerp, and stored_form (optim_rules.h), operation for operation, into m_new
// and root. kL2: weight decay added to the gradient (never for LAMB, whose decay is in its step); kScaled: a
// gradient scale other than 1 (g * 1 is g: every use of g below is arithmetic, which quiets a signaling NaN as
// the product would, so leaving the product out changes no bit). Template arguments like kFlags, because as
// run-time values GCC tested them in every iteration.
template <int32_t kFlags, bool kSmall, bool kL2, bool kScaled, typename T>
__attribute__((target("avx512f"), always_inline)) inline void moments16(const AdamMomentConstants& c, __m512 m,
                                                                       __m512 root_old, const T* __restrict param,
                                                                       const T* __restrict grad, int i,
                                                                       __m512& m_new, __m512& root) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  __m512 g = load16(grad + i);
  if (kScaled) g = _mm512_mul_ps(g, c.grad_scale);
  if (kFlags & kMaximize) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
  if (kL2) g = _mm512_add_ps(g, _mm512_mul_ps(c.weight_decay, load16(param + i)));
  m_new = _mm512_add_ps(kSmall ? m : g, _mm512_mul_ps(c.lerp_weight, _mm512_sub_ps(g, m)));
  const __m512 v = _mm512_mul_ps(root_old, root_old);
  const __m512 v_new = _mm512_add_ps(_mm512_mul_ps(v, c.beta2), _mm512_mul_ps(_mm512_mul_ps(c.one_minus_beta2, g), g));
  root = _mm512_sqrt_ps(v_new);
}

// moments16, the new m and root of v stored to s1 + i and s2 + i, their magnitudes' bit patterns raising max1
// and max2.
template <int32_t kFlags, bool kSmall, bool kL2, bool kScaled, typename T>
__attribute__((target("avx512f"), always_inline)) inline void adam_moments16(
    const AdamMomentConstants& c, __m512 m, __m512 root_old, const T* __restrict param, const T* __restrict grad,
    int i, float* __restrict s1, float* __restrict s2, __m512i& max1, __m512i& max2) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 m_new, root;
  moments16<kFlags, kSmall, kL2, kScaled>(c, m, root_old, param, grad, i, m_new, root);
  _mm512_storeu_ps(s1 + i, m_new);
  _mm512_storeu_ps(s2 + i, root);
  max1 = _mm512_max_epu32(max1, _mm512_and_si512(_mm512_castps_si512(m_new), magnitude));
  max2 = _mm512_max_epu32(max2, _mm512_and_si512(_mm512_castps_si512(root), magnitude));
}

// The decode of a block's two 4-bit moments for the fused loops, 32 elements at a time (cnt a multiple of 32):
// each map's 16 values sit in one register, so a code's value is one permute. Calls body(i, m, root_old) for
// each 16 elements at i, with their decoded first moment and root of the second (load_state's values), after
// asking for the gradients ahead. p1, p2: the block's packed codes; T: the gradients' type.
template <typename T, typename Body>
__attribute__((target("avx512f"), always_inline)) inline void decode_moments_u4(
    const uint8_t* __restrict p1, const uint8_t* __restrict p2, float absmax1, float absmax2, const float* map1,
    const float* map2, int cnt, const AdamAhead& ahead, Body&& body) {
  const __m512 values1 = _mm512_loadu_ps(map1), values2 = _mm512_loadu_ps(map2);
  const __m512 scale1 = _mm512_set1_ps(absmax1), scale2 = _mm512_set1_ps(absmax2);
  for (int j = 0; j < cnt; j += 32) {
    __m512 m[2], root_old[2];
    decode_u4_32(values1, scale1, p1 + j / 2, m);
    decode_u4_32(values2, scale2, p2 + j / 2, root_old);
    ahead.codes_at(j / 2);
    for (int k = 0; k < 2; ++k) {
      ahead.grad.at(static_cast<int>((j + 16 * k) * sizeof(T)));
      body(j + 16 * k, m[k], root_old[k]);
    }
  }
}

// adam_moments_avx512 on fp32 or bf16 parameters and 4-bit states with their decode in the same loop
// (decode_moments_u4). Same values as load_state and adam_moments_avx512, so the same results; s1 and s2
// receive the new m and root of v.
template <int32_t kFlags, bool kSmall, bool kL2, bool kScaled, typename T>
__attribute__((target("avx512f"))) void adam_moments_u4(const StepHyper& h, const StepScalars& sc,
                                                        const T* __restrict param, const T* __restrict grad,
                                                        const uint8_t* __restrict p1, const uint8_t* __restrict p2,
                                                        float absmax1, float absmax2, const float* map1,
                                                        const float* map2, float* __restrict s1,
                                                        float* __restrict s2, int cnt, uint32_t* max_bits,
                                                        const AdamAhead& ahead) {
  const AdamMomentConstants c = adam_moment_constants<kSmall>(h, sc);
  __m512i max1 = _mm512_setzero_si512(), max2 = _mm512_setzero_si512();
  decode_moments_u4<T>(p1, p2, absmax1, absmax2, map1, map2, cnt, ahead,
                       [&](int i, __m512 m, __m512 root_old) __attribute__((target("avx512f"), always_inline)) {
                         adam_moments16<kFlags, kSmall, kL2, kScaled>(c, m, root_old, param, grad, i, s1, s2, max1,
                                                                      max2);
                       });
  max_bits[0] = _mm512_reduce_max_epu32(max1);
  max_bits[1] = _mm512_reduce_max_epu32(max2);
  max_bits[2] = 0;
}

#ifdef LB_VBMI_DECODE
// The decode of a block's two 8-bit moments for the fused loops, 64 elements at a time (cnt a multiple of 64):
// the first moment by gathers from its map (the load ports, idle in the moments' arithmetic), the second by the
// VBMI byte-plane permutes (port 5), while the square roots keep the divider busy. Where the decode was a pass
// of its own, each of the three waited on one unit. kPlanes1 (vbmi_first_moment_active: where gathers are slow)
// decodes the first moment by its planes too, planes1. Calls body(i, m, root_old) as decode_moments_u4 does,
// with the values of block_states (map[code] * absmax either way).
template <bool kPlanes1, typename T, typename Body>
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline void decode_moments_vbmi(
    const uint8_t* __restrict q1, const uint8_t* __restrict q2, float absmax1, float absmax2, const float* map1,
    const BytePlanes* planes1, const BytePlanes& planes2, int cnt, const AdamAhead& ahead, Body&& body) {
  const PlaneRegisters t2 = plane_registers(planes2);
  const __m512i order = _mm512_load_si512(kPlaneOrder);
  const __m512 scale1 = _mm512_set1_ps(absmax1), scale2 = _mm512_set1_ps(absmax2);
  for (int j = 0; j < cnt; j += 64) {
    __m512 root_old[4], m[4];
    ahead.codes_at(j);
    vbmi_decode64(t2, order, q2 + j, scale2, root_old);
    if constexpr (kPlanes1) vbmi_decode64(plane_registers(*planes1), order, q1 + j, scale1, m);
    for (int k = 0; k < 4; ++k) {
      const int i = j + 16 * k;
      ahead.grad.at(static_cast<int>(i * sizeof(T)));
      if constexpr (!kPlanes1) {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + i)));
        m[k] = _mm512_mul_ps(_mm512_i32gather_ps(codes, map1, 4), scale1);
      }
      body(i, m[k], root_old[k]);
    }
  }
}

// adam_moments_avx512 on fp32 or bf16 parameters with the states' decode in the same loop
// (decode_moments_vbmi). The same operations on the same values as block_states and adam_moments_avx512, so
// the same results; s1 and s2 receive the new m and root of v.
template <bool kPlanes1, int32_t kFlags, bool kSmall, bool kL2, bool kScaled, typename T>
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void adam_moments_vbmi(
    const StepHyper& h, const StepScalars& sc, const T* __restrict param, const T* __restrict grad,
    const uint8_t* __restrict q1, const uint8_t* __restrict q2, float absmax1, float absmax2, const float* map1,
    const BytePlanes* planes1, const BytePlanes& planes2, float* __restrict s1, float* __restrict s2, int cnt,
    uint32_t* max_bits, const AdamAhead& ahead) {
  const AdamMomentConstants c = adam_moment_constants<kSmall>(h, sc);
  __m512i max1 = _mm512_setzero_si512(), max2 = _mm512_setzero_si512();
  decode_moments_vbmi<kPlanes1, T>(q1, q2, absmax1, absmax2, map1, planes1, planes2, cnt, ahead,
                         [&](int i, __m512 m, __m512 root_old) __attribute__((target("avx512f"), always_inline)) {
                           adam_moments16<kFlags, kSmall, kL2, kScaled>(c, m, root_old, param, grad, i, s1, s2,
                                                                        max1, max2);
                         });
  max_bits[0] = _mm512_reduce_max_epu32(max1);
  max_bits[1] = _mm512_reduce_max_epu32(max2);
  max_bits[2] = 0;
}
#endif

// a / b for 16 finite a >= 0 and a constant b that reciprocal_divides, the same bits as the division, from
// y = 1 / b rounded and without the divider (which the square root and Adam's other division keep busy):
// q0 = a * y, then twice q + (a - b * q) * y, each residual one FMA (reciprocal_divides says why exact).
__attribute__((target("avx512f"), always_inline)) inline __m512 divide_by_constant16(__m512 a, __m512 b, __m512 y) {
  const __m512 q0 = _mm512_mul_ps(a, y);
  const __m512 q1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(b, q0, a), y, q0);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(b, q1, a), y, q1);
}

// The constants of Adam's and LAMB's step and of the encoders' normalisation in registers (adam_step16).
// bias2_recip: 1 / bias2_sqrt rounded, for divide_by_constant16.
struct AdamStepConstants {
  __m512 bias2_sqrt;
  __m512 bias2_recip;
  __m512 eps;
  __m512 step_size;
  __m512 update_scale;
  __m512 decay;
  __m512 lr;
  __m512 weight_decay;
  __m512 inv1;
  __m512 inv2;
};

__attribute__((target("avx512f"), always_inline)) inline AdamStepConstants adam_step_constants(const StepHyper& h,
                                                                                              const StepScalars& sc,
                                                                                              float inv1, float inv2) {
  return {_mm512_set1_ps(sc.bias2_sqrt), _mm512_set1_ps(1.f / sc.bias2_sqrt), _mm512_set1_ps(h.eps),
          _mm512_set1_ps(sc.step_size),  _mm512_set1_ps(sc.update_scale),     _mm512_set1_ps(h.decay),
          _mm512_set1_ps(h.lr),          _mm512_set1_ps(h.weight_decay),      _mm512_set1_ps(inv1),
          _mm512_set1_ps(inv2)};
}

// The step u of 16 elements from their new m and root of v: adam_update, or (kLamb) lamb_update with the
// parameters p before the step (optim_rules.h), operation for operation; the division by bias2_sqrt by
// divide_by_constant16 (the same bits where reciprocal_divides), whose root is finite in the step's loops.
// kInfinite: a root may be +inf (LAMB's norm pass, which takes every block: an overflowing v), where
// divide_by_constant16 gives NaN (inf - inf in its residual) and the division +inf.
template <bool kLamb, bool kInfinite = false>
__attribute__((target("avx512f"), always_inline)) inline __m512 step16(const AdamStepConstants& c, __m512 m,
                                                                      __m512 root, __m512 p) {
  __m512 scaled = divide_by_constant16(root, c.bias2_sqrt, c.bias2_recip);
  if constexpr (kInfinite) {
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    scaled = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(root, inf, _CMP_EQ_OQ), scaled, inf);
  }
  const __m512 denom = _mm512_add_ps(scaled, c.eps);
  if constexpr (kLamb) {
    const __m512 r =
        _mm512_add_ps(_mm512_div_ps(_mm512_mul_ps(m, c.step_size), denom), _mm512_mul_ps(c.weight_decay, p));
    return _mm512_mul_ps(c.lr, r);
  }
  return _mm512_div_ps(_mm512_mul_ps(c.step_size, m), denom);
}

// The parameters' step of 16 elements at i from their new m and root of v: step16 and stepped (optim_rules.h)
// operation for operation. kScaled: an update scale other than 1 (u * 1 is u, and the subtraction quiets a
// signaling NaN as the product would).
template <bool kLamb, bool kDecay, bool kScaled, typename T>
__attribute__((target("avx512f"), always_inline)) inline void adam_param16(const AdamStepConstants& c,
                                                                          T* __restrict param, __m512 m, __m512 root,
                                                                          int i) {
  __m512 p = load16(param + i);
  const __m512 u = step16<kLamb>(c, m, root, p);
  if (kDecay) p = _mm512_mul_ps(p, c.decay);
  store16(param + i, _mm512_sub_ps(p, kScaled ? _mm512_mul_ps(c.update_scale, u) : u));
}

// The nearest codes of 16 keys by an index's nearest_sums (the table less kFirstBucket): sum_codes16.
struct SumCodes {
  const int* sums;
  __attribute__((target("avx512f"), always_inline)) __m512i operator()(__m512i key) const {
    return sum_codes16(sums, key);
  }
};

// The same codes of a 16-entry map by its nearest_keys in a register: search_codes16.
struct SearchCodes {
  __m512i steps;
  __attribute__((target("avx512f"), always_inline)) __m512i operator()(__m512i key) const {
    return search_codes16(steps, key);
  }
};

// adam_encode_step_avx512's work on 16 elements at i of a block with unit-stable maps: the nearest codes of the new
// m (s1) and root of v (s2) by code1 and code2 (SumCodes or SearchCodes), the root keyed as non-negative (it is +0
// or positive: v is a sum of products of like-signed factors, its root is finite here), into c1 and c2; and the
// parameters' step (adam_param16). An inverse of 0 (absmax <= 0) gives x * 0 = +-0, keyed as +0, which is
// normalise()'s 0 for such blocks (nearest_codes16's normalisation for unit-stable maps).
template <bool kLamb, bool kDecay, bool kScaled, typename T, typename Codes1, typename Codes2>
__attribute__((target("avx512f"), always_inline)) inline void adam_step16(const AdamStepConstants& c,
                                                                         T* __restrict param,
                                                                         const float* __restrict s1,
                                                                         const float* __restrict s2, int i,
                                                                         const Codes1& code1, const Codes2& code2,
                                                                         __m512i& c1, __m512i& c2) {
  const __m512 m = _mm512_loadu_ps(s1 + i), root = _mm512_loadu_ps(s2 + i);
  c1 = code1(order_keys(_mm512_mul_ps(m, c.inv1)));
  c2 = code2(nonnegative_keys(_mm512_mul_ps(root, c.inv2)));
  adam_param16<kLamb, kDecay, kScaled>(c, param, m, root, i);
}

// adam_encode_step_avx512 for fp32 or bf16 parameters and 4-bit states, unit-stable maps and cnt a multiple of
// 16: adam_step16, and each 16 codes of a state packed to 8 bytes at q1, q2 (the block's packed codes). The codes
// by the indexes' nearest_sums (sums1, sums2) or, kSearch (search_u4_active), by a search over their
// nearest_keys (keys1, keys2). Same codes as store_state's 4-bit encoder, same parameters as adam_params.
template <bool kSearch, bool kLamb, bool kDecay, bool kScaled, typename T>
__attribute__((target("avx512f"))) void adam_encode_step_u4(const StepHyper& h, const StepScalars& sc,
                                                            T* __restrict param, const float* __restrict s1,
                                                            const float* __restrict s2, int cnt, const int* sums1,
                                                            const int* sums2, const uint32_t* keys1,
                                                            const uint32_t* keys2, float inv1, float inv2,
                                                            uint8_t* __restrict q1, uint8_t* __restrict q2,
                                                            const AdamAhead& ahead) {
  const AdamStepConstants c = adam_step_constants(h, sc, inv1, inv2);
  const auto codes = [&](const int* sums, const uint32_t* keys)
                         __attribute__((target("avx512f"), always_inline)) {
    if constexpr (kSearch) {
      return SearchCodes{_mm512_loadu_si512(keys)};
    } else {
      return SumCodes{sums};
    }
  };
  const auto code1 = codes(sums1, keys1), code2 = codes(sums2, keys2);
  for (int i = 0; i < cnt; i += 16) {
    ahead.param.at(static_cast<int>(i * sizeof(T)));
    __m512i c1, c2;
    adam_step16<kLamb, kDecay, kScaled>(c, param, s1, s2, i, code1, code2, c1, c2);
    pack_u4_16(c1, q1 + i / 2);
    pack_u4_16(c2, q2 + i / 2);
  }
}

// adam_encode_step_u4 with both states rounded stochastically, as store_stochastic rounds them: each state's floor
// code and its map values by u4_brackets (normalise as written, since a stochastic code can tell 1 - 2^-24 from
// 1), then stochastic_codes16 against the draw of the element's counter, counter0 + its index in the block,
// under its state's key (key1, key2). maps: the indexes' padded(), 16 values each; b1, b2: the blocks' absmax
// and inverse. Same codes as store_stochastic, same parameters as adam_params.
template <bool kLamb, bool kDecay, bool kScaled, typename T>
__attribute__((target("avx512f"))) void adam_encode_step_u4_stochastic(
    const StepHyper& h, const StepScalars& sc, T* __restrict param, const float* __restrict s1,
    const float* __restrict s2, int cnt, const float* map1, const float* map2, const NearestBlock& b1,
    const NearestBlock& b2, RngKey key1, RngKey key2, uint64_t counter0, uint8_t* __restrict q1,
    uint8_t* __restrict q2, const AdamAhead& ahead) {
  const AdamStepConstants c = adam_step_constants(h, sc, b1.inv, b2.inv);
  const __m512 m1 = _mm512_loadu_ps(map1), m2 = _mm512_loadu_ps(map2);
  // Copies: the stores through q1 and q2 (bytes) may alias anything, and GCC reloaded b1 and b2 after each.
  const NearestBlock n1 = b1, n2 = b2;
  for (int i = 0; i < cnt; i += 16) {
    ahead.param.at(static_cast<int>(i * sizeof(T)));
    const uint64_t counter = counter0 + static_cast<uint64_t>(i);
    const U4Brackets r1 = u4_brackets(m1, s1 + i, n1.absmax, n1.inv), r2 = u4_brackets(m2, s2 + i, n2.absmax, n2.inv);
    pack_u4_16(stochastic_codes16(r1, counter_draws16(key1, counter)), q1 + i / 2);
    pack_u4_16(stochastic_codes16(r2, counter_draws16(key2, counter)), q2 + i / 2);
    adam_param16<kLamb, kDecay, kScaled>(c, param, _mm512_loadu_ps(s1 + i), _mm512_loadu_ps(s2 + i), i);
  }
}

#ifdef LB_VBMI_DECODE
// adam_encode_step_avx512 for fp32 or bf16 parameters, 8-bit states, unit-stable maps and cnt a multiple of 64:
// adam_step16, 64 codes of each state packed per store, the step's constants held in registers (GCC had
// reloaded and broadcast them in each iteration). Same codes and parameters as adam_encode_step_avx512.
template <bool kLamb, bool kDecay, bool kScaled, typename T>
__attribute__((target("avx512f,avx512bw"))) void adam_encode_step_sums(const StepHyper& h, const StepScalars& sc,
                                                                      T* __restrict param, const float* __restrict s1,
                                                                      const float* __restrict s2, int cnt,
                                                                      const int* sums1, const int* sums2, float inv1,
                                                                      float inv2, uint8_t* __restrict q1,
                                                                      uint8_t* __restrict q2, const AdamAhead& ahead) {
  const AdamStepConstants c = adam_step_constants(h, sc, inv1, inv2);
  for (int j = 0; j < cnt; j += 64) {
    __m512i c1[4], c2[4];
    for (int k = 0; k < 4; ++k) {
      ahead.param.at(static_cast<int>((j + 16 * k) * sizeof(T)));
      adam_step16<kLamb, kDecay, kScaled>(c, param, s1, s2, j + 16 * k, SumCodes{sums1}, SumCodes{sums2}, c1[k],
                                          c2[k]);
    }
    _mm512_storeu_si512(q1 + j, pack_codes64(c1[0], c1[1], c1[2], c1[3]));
    _mm512_storeu_si512(q2 + j, pack_codes64(c2[0], c2[1], c2[2], c2[3]));
  }
}
#endif

// Calls fn(std::bool_constant<b>{}).
template <typename Fn>
LB_ALWAYS_INLINE inline void with_bool(bool b, Fn&& fn) {
  if (b) return fn(std::true_type{});
  fn(std::false_type{});
}

template <typename Fn>
LB_ALWAYS_INLINE inline void with_bools(bool a, bool b, bool c, Fn&& fn) {
  with_bool(a, [&](auto x) LB_ALWAYS_INLINE {
    with_bool(b, [&](auto y) LB_ALWAYS_INLINE { with_bool(c, [&](auto z) LB_ALWAYS_INLINE { fn(x, y, z); }); });
  });
}

// Calls fn(flags, small, l2, scaled), the template arguments of the Adam moment loops (adam_moments16) as
// constants: the element flags (with_element_flags), torch_lerp's first form (|1 - beta1| < 0.5), weight
// decay added to the gradient (Adam's L2 term; never for LAMB, kLamb), and a gradient scale other than 1.
template <bool kLamb, typename Fn>
LB_ALWAYS_INLINE inline void with_adam_moment_options(const StepHyper& h, const StepScalars& sc, Fn&& fn) {
  const bool small = fabsf(h.one_minus_beta1) < 0.5f;
  const bool l2 = !kLamb && h.weight_decay != 0.f && !(h.flags & kDecoupled);
  with_element_flags(h.flags, [&](auto flags) LB_ALWAYS_INLINE {
    with_bools(small, l2, sc.grad_scale != 1.f,
               [&](auto kSmall, auto kL2, auto kScaled) LB_ALWAYS_INLINE { fn(flags, kSmall, kL2, kScaled); });
  });
}

// The prefetch of a block ahead is issued in this many parts, spread over a block's work.
constexpr int kPrefetchParts = 4;

// Starts reading part `part` (of kPrefetchParts, by whole lines) of the parameter, gradient and first n_states
// states of the block two ahead into L2. A block reads its parameters and gradients only in its update, so
// the hardware prefetchers, which follow the demand stream, idle while the states decode and encode;
// requested two blocks early, the lines arrive in time (Adam8bit, one 16M fp32 tensor, 2 threads: 1.28-1.40x
// fused AdamW's step without, 1.10-1.16x with; one block ahead about as good, three worse). The states'
// lines, read first thing in a block, wait on memory as well, and are prefetched too. Issued all at once,
// the 40 lines of an Adam8bit block queue behind each other; a part at a time between the block's loops,
// the block loop over one 16M fp32 tensor took 12-15% less time (1 thread) than all at the start. The fused
// Adam and LAMB loops and LARS's norm pass, whose loops can take one line at a time, read ahead by StreamAhead
// instead.
template <typename T>
void prefetch_ahead(const OptimArgs& a, const TensorView& t, int64_t lo, int part, int n_states) {
  constexpr int64_t kAhead = 2;
  const int64_t from = lo + kAhead * a.block_size;
  if (from >= t.n) return;
  const int64_t count = std::min(t.n, from + a.block_size) - from;
  const auto slice = [part](const void* base, int64_t bytes) LB_ALWAYS_INLINE {
    const auto line = [](int64_t b) { return b / 64 * 64; };
    const int64_t begin = line(bytes * part / kPrefetchParts);
    const int64_t end = part + 1 == kPrefetchParts ? bytes : line(bytes * (part + 1) / kPrefetchParts);
    prefetch_l2(static_cast<const char*>(base) + begin, end - begin);
  };
  const int64_t size = static_cast<int64_t>(sizeof(T));
  slice(static_cast<const char*>(t.param) + from * size, count * size);
  slice(static_cast<const char*>(t.grad) + from * size, count * size);
  for (int k = 0; k < n_states; ++k) {
    slice(static_cast<const char*>(t.state[k]) + from * t.bits / 8, (count * t.bits + 7) / 8);
  }
}

template <typename T>
void prefetch_ahead(const OptimArgs& a, const TensorView& t, int64_t lo, int part) {
  prefetch_ahead<T>(a, t, lo, part, a.n_states);
}

// The parameter types of the fused Adam loops: fp32 and bf16 (load16, store16).
template <typename T>
constexpr bool kFusedAdamParams = std::is_same_v<T, float> || std::is_same_v<T, BFloat16>;

// Whether adam_block's block runs the fused loops: fp32 or bf16 parameters, whole groups of 64, unit-stable
// maps, a bias correction that reciprocal_divides, and for 8-bit states the VBMI decoder in use
// (adam_moments_vbmi, adam_encode_step_sums). 4-bit states need no more (adam_moments_u4,
// adam_encode_step_u4), and their blocks take adam_block only then.
template <typename T>
bool adam_fused(const TensorView& t, const StateCoders& coders, int cnt) {
  if (!kFusedAdamParams<T> || cnt % 64 != 0 || !coders.index[0]->unit_stable() ||
      !coders.index[1]->unit_stable() || !reciprocal_divides(t.scalars.bias2_sqrt)) {
    return false;
  }
  if (t.bits == 4) return true;
#ifdef LB_VBMI_DECODE
  return coders.planes[1] != nullptr;
#else
  return false;
#endif
}

// step_block's Adam (and, kLamb, LAMB) path when coders.adam_split, for a block of 8-bit states or one of 4-bit
// states that adam_fused takes: the states decoded and the new moments computed, then both encoded while the
// parameters step. A block with a non-finite moment, or whose absmax has no finite inverse, steps its
// parameters first and then takes the non-finite restart and store_state, as step_block does.
template <bool kLamb, typename T>
void adam_block(const OptimArgs& a, const TensorView& t, int64_t block, int64_t lo, int cnt,
                const StateCoders& coders, T* param, const T* grad) {
  float decoded[kMaxStates][kMaxBlock];
  float* s[kMaxStates] = {decoded[0], decoded[1], decoded[2]};
  uint32_t max_bits[kMaxStates];
  uint8_t* q1 = static_cast<uint8_t*>(t.state[0]) + lo * t.bits / 8;
  uint8_t* q2 = static_cast<uint8_t*>(t.state[1]) + lo * t.bits / 8;
  const bool fused = adam_fused<T>(t, coders, cnt);
  // The fused loops read their streams ahead themselves (ahead); the others take prefetch_ahead's parts.
  AdamAhead ahead;
  if (!fused) {
    prefetch_ahead<T>(a, t, lo, 0);
    prefetch_ahead<T>(a, t, lo, 1);
  }
  if constexpr (kFusedAdamParams<T>) {
    if (fused) {
      ahead = adam_ahead(t, lo, cnt, param, grad, q1, q2);
      const auto options = [&](auto flags, auto small, auto l2, auto scaled) LB_ALWAYS_INLINE {
        constexpr int32_t kF = decltype(flags)::value;
        constexpr bool kS = decltype(small)::value, kL = decltype(l2)::value, kG = decltype(scaled)::value;
        const float amax1 = t.absmax[0][block], amax2 = t.absmax[1][block];
        if (t.bits == 4) {
          return adam_moments_u4<kF, kS, kL, kG>(a.hyper, t.scalars, param, grad, q1, q2, amax1, amax2,
                                                 state_map(a, 0), state_map(a, 1), s[0], s[1], cnt, max_bits,
                                                 ahead);
        }
#ifdef LB_VBMI_DECODE
        with_bool(coders.planes_first, [&](auto planes1) LB_ALWAYS_INLINE {
          adam_moments_vbmi<decltype(planes1)::value, kF, kS, kL, kG>(
              a.hyper, t.scalars, param, grad, q1, q2, amax1, amax2, state_map(a, 0), coders.planes[0],
              *coders.planes[1], s[0], s[1], cnt, max_bits, ahead);
        });
#endif
      };
      with_adam_moment_options<kLamb>(a.hyper, t.scalars, options);
    }
  }
  if (!fused) {
    block_states<2>(a, t, block, lo, cnt, coders.planes, decoded, s);
    with_element_flags(a.hyper.flags, [&](auto flags) LB_ALWAYS_INLINE {
      adam_moments_avx512<kLamb, decltype(flags)::value>(a.hyper, t.scalars, param, grad, s[0], s[1], cnt, max_bits);
    });
    prefetch_ahead<T>(a, t, lo, 2);
  }
  const bool decay = a.hyper.weight_decay != 0.f && (a.hyper.flags & kDecoupled);
  const NearestBlock b1 = nearest_block(*coders.index[0], absmax_from_bits(max_bits[0]));
  const NearestBlock b2 = nearest_block(*coders.index[1], absmax_from_bits(max_bits[1]));
  const bool finite = max_bits[0] < kNonFiniteBits && max_bits[1] < kNonFiniteBits;
  // A subnormal absmax has no finite inverse (nearest_codes_u8_avx512 leaves such blocks to the scalar loop too).
  const bool subnormal = (b1.absmax > 0.f && b1.inv == 0.f) || (b2.absmax > 0.f && b2.inv == 0.f);
  if (!finite || subnormal) {
    if (!fused) prefetch_ahead<T>(a, t, lo, 3);
    if (decay) {
      adam_params_avx512<kLamb, true>(a.hyper, t.scalars, param, s[0], s[1], cnt);
    } else {
      adam_params_avx512<kLamb, false>(a.hyper, t.scalars, param, s[0], s[1], cnt);
    }
    if (!finite) restart_nonfinite3(s, 2, cnt, max_bits);
    for (int k = 0; k < 2; ++k) store_state(t, k, block, lo, cnt, max_bits[k], coders.index[k], coders.gather, s[k]);
    return;
  }
  t.absmax[0][block] = b1.absmax;
  t.absmax[1][block] = b2.absmax;
  if constexpr (kFusedAdamParams<T>) {
    if (fused) {
      const int* sums1 = reinterpret_cast<const int*>(coders.index[0]->nearest_sums()) - kFirstBucket;
      const int* sums2 = reinterpret_cast<const int*>(coders.index[1]->nearest_sums()) - kFirstBucket;
      const bool scaled = t.scalars.update_scale != 1.f;
      with_bool(decay, [&](auto kDecay) LB_ALWAYS_INLINE {
        with_bool(scaled, [&](auto kScaled) LB_ALWAYS_INLINE {
          constexpr bool kD = decltype(kDecay)::value, kG = decltype(kScaled)::value;
          if (t.stochastic) {  // 4-bit states only: step_block keeps 8-bit stochastic blocks out of adam_block
            const uint64_t counter0 = t.round_offset + static_cast<uint64_t>(lo);
            return adam_encode_step_u4_stochastic<kLamb, kD, kG>(
                a.hyper, t.scalars, param, s[0], s[1], cnt, coders.index[0]->padded(), coders.index[1]->padded(), b1,
                b2, state_stream_key(t.round_seed, 0), state_stream_key(t.round_seed, 1), counter0, q1, q2, ahead);
          }
          if (t.bits == 4) {
            return with_bool(coders.search_u4, [&](auto search) LB_ALWAYS_INLINE {
              adam_encode_step_u4<decltype(search)::value, kLamb, kD, kG>(
                  a.hyper, t.scalars, param, s[0], s[1], cnt, sums1, sums2, coders.index[0]->nearest_keys(),
                  coders.index[1]->nearest_keys(), b1.inv, b2.inv, q1, q2, ahead);
            });
          }
#ifdef LB_VBMI_DECODE
          adam_encode_step_sums<kLamb, kD, kG>(a.hyper, t.scalars, param, s[0], s[1], cnt, sums1, sums2, b1.inv,
                                               b2.inv, q1, q2, ahead);
#endif
        });
      });
      return;
    }
  }
  prefetch_ahead<T>(a, t, lo, 3);
  with_bools(!coders.index[0]->unit_stable(), !coders.index[1]->unit_stable(), decay, [&](auto e1, auto e2, auto d) {
    adam_encode_step_avx512<kLamb, decltype(e1)::value, decltype(e2)::value, decltype(d)::value>(
        a.hyper, t.scalars, param, s[0], s[1], cnt, coders.index, b1, b2, q1, q2);
  });
}

// Adds the squares of 16 floats, widened to double (exact), into the 8 lanes of acc in norm_order.h's order:
// the first 8 into lanes 0 to 7, then the last 8 (square_sums' order for a block that starts at these 16).
__attribute__((target("avx512f"), always_inline)) inline void add_squares16(__m512 x, __m512d& acc) {
  const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  acc = _mm512_add_pd(acc, _mm512_mul_pd(low, low));
  acc = _mm512_add_pd(acc, _mm512_mul_pd(high, high));
}

// The lanes of acc added in lane order (add_lanes).
__attribute__((target("avx512f"))) inline double lane_total(__m512d acc) {
  alignas(64) double lanes[kSquareLanes];
  _mm512_store_pd(lanes, acc);
  return add_lanes(lanes, kSquareLanes);
}

// LAMB's norm terms of 16 elements at i from their decoded m and root of v: moments16 and step16 (the values of
// norm_terms_body's lamb_step), p^2 and u^2 added into pp and uu by add_squares16. Nothing is stored.
template <int32_t kFlags, bool kSmall, bool kScaled, typename T>
__attribute__((target("avx512f"), always_inline)) inline void lamb_norms16(const AdamMomentConstants& mc,
                                                                          const AdamStepConstants& c, __m512 m,
                                                                          __m512 root_old, const T* __restrict param,
                                                                          const T* __restrict grad, int i,
                                                                          const AdamAhead& ahead, __m512d& pp,
                                                                          __m512d& uu) {
  __m512 m_new, root;
  moments16<kFlags, kSmall, false, kScaled>(mc, m, root_old, param, grad, i, m_new, root);
  ahead.param.at(static_cast<int>(i * sizeof(T)));
  const __m512 p = load16(param + i);
  add_squares16(p, pp);
  add_squares16(step16<true, true>(c, m_new, root, p), uu);
}

// LAMB's norm pre-pass over a block of 4-bit states that adam_fused takes: sums[0] = the sum of p^2 and sums[1]
// that of u^2 in norm_order.h's lanes, from decode_moments_u4 and lamb_norms16 in one loop. The same values in
// the same order as norm_block's loops (block_states, norm_terms_body, square_sums), so the same sums.
template <int32_t kFlags, bool kSmall, bool kScaled, typename T>
__attribute__((target("avx512f"))) void lamb_norms_u4(const StepHyper& h, const StepScalars& sc,
                                                      const T* __restrict param, const T* __restrict grad,
                                                      const uint8_t* p1, const uint8_t* p2, float absmax1,
                                                      float absmax2, const float* map1, const float* map2, int cnt,
                                                      const AdamAhead& ahead, double* sums) {
  const AdamMomentConstants mc = adam_moment_constants<kSmall>(h, sc);
  const AdamStepConstants c = adam_step_constants(h, sc, 0.f, 0.f);
  __m512d pp = _mm512_setzero_pd(), uu = _mm512_setzero_pd();
  decode_moments_u4<T>(p1, p2, absmax1, absmax2, map1, map2, cnt, ahead,
                       [&](int i, __m512 m, __m512 root_old) __attribute__((target("avx512f"), always_inline)) {
                         lamb_norms16<kFlags, kSmall, kScaled>(mc, c, m, root_old, param, grad, i, ahead, pp, uu);
                       });
  sums[0] = lane_total(pp);
  sums[1] = lane_total(uu);
}

#ifdef LB_VBMI_DECODE
// lamb_norms_u4 for 8-bit states, by decode_moments_vbmi.
template <bool kPlanes1, int32_t kFlags, bool kSmall, bool kScaled, typename T>
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void lamb_norms_vbmi(
    const StepHyper& h, const StepScalars& sc, const T* __restrict param, const T* __restrict grad,
    const uint8_t* q1, const uint8_t* q2, float absmax1, float absmax2, const float* map1, const BytePlanes* planes1,
    const BytePlanes& planes2, int cnt, const AdamAhead& ahead, double* sums) {
  const AdamMomentConstants mc = adam_moment_constants<kSmall>(h, sc);
  const AdamStepConstants c = adam_step_constants(h, sc, 0.f, 0.f);
  __m512d pp = _mm512_setzero_pd(), uu = _mm512_setzero_pd();
  decode_moments_vbmi<kPlanes1, T>(q1, q2, absmax1, absmax2, map1, planes1, planes2, cnt, ahead,
                         [&](int i, __m512 m, __m512 root_old) __attribute__((target("avx512f"), always_inline)) {
                           lamb_norms16<kFlags, kSmall, kScaled>(mc, c, m, root_old, param, grad, i, ahead, pp, uu);
                         });
  sums[0] = lane_total(pp);
  sums[1] = lane_total(uu);
}
#endif

#endif

#ifdef LB_AVX2_CODES
// The largest of 8 unsigned lanes.
__attribute__((target("avx2"))) inline uint32_t max_lane8(__m256i v) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint32_t m = 0;
  for (uint32_t x : lanes) m = std::max(m, x);
  return m;
}

// The decode of a block's two moments on the AVX2 path, 32 elements at a time (cnt a multiple of 32): 8-bit codes
// by gathers from their maps, 4-bit ones by register lookups. Calls body(i, m, root_old) for each 8 elements at
// i, with their decoded first moment and root of the second (block_states' values), after asking for the
// gradients ahead. q1, q2: the block's codes.
template <int kBits, typename Body>
__attribute__((target("avx2"), always_inline)) inline void decode_moments_avx2(
    const uint8_t* __restrict q1, const uint8_t* __restrict q2, float absmax1, float absmax2, const float* map1,
    const float* map2, int cnt, const AdamAhead& ahead, Body&& body) {
  const __m256 scale1 = _mm256_set1_ps(absmax1), scale2 = _mm256_set1_ps(absmax2);
  // At 4 bits, each map's halves in registers (lookup16); unused at 8.
  const __m256 low1 = _mm256_loadu_ps(map1), high1 = _mm256_loadu_ps(map1 + (kBits == 4 ? 8 : 0));
  const __m256 low2 = _mm256_loadu_ps(map2), high2 = _mm256_loadu_ps(map2 + (kBits == 4 ? 8 : 0));
  for (int j = 0; j < cnt; j += 32) {
    __m256 m[4], root_old[4];
    ahead.codes_at(j * kBits / 8);
    if constexpr (kBits == 4) {
      decode_u4_32x8(low1, high1, scale1, q1 + j / 2, m);
      decode_u4_32x8(low2, high2, scale2, q2 + j / 2, root_old);
    } else {
      for (int k = 0; k < 4; ++k) {
        const int i = j + 8 * k;
        const __m256i codes1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q1 + i)));
        const __m256i codes2 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q2 + i)));
        m[k] = _mm256_mul_ps(_mm256_i32gather_ps(map1, codes1, 4), scale1);
        root_old[k] = _mm256_mul_ps(_mm256_i32gather_ps(map2, codes2, 4), scale2);
      }
    }
    for (int k = 0; k < 4; ++k) {
      ahead.grad.at(static_cast<int>((j + 8 * k) * sizeof(float)));
      body(j + 8 * k, m[k], root_old[k]);
    }
  }
}

// The constants of moments8 and step8 in registers, computed once per block (as AdamMomentConstants and
// AdamStepConstants: through the references, GCC reloaded and broadcast them in each iteration).
struct Avx2Constants {
  __m256 lerp_weight;
  __m256 beta2;
  __m256 one_minus_beta2;
  __m256 grad_scale;
  __m256 weight_decay;
  __m256 bias2_sqrt;
  __m256 eps;
  __m256 step_size;
  __m256 lr;
};

// kSmall: torch_lerp's first form (|1 - beta1| < 0.5).
template <bool kSmall>
__attribute__((target("avx2"), always_inline)) inline Avx2Constants avx2_constants(const StepHyper& h,
                                                                                  const StepScalars& sc) {
  // torch_lerp's two forms (optim_rules.h): m + w (g - m) or g + (w - 1) (g - m).
  return {_mm256_set1_ps(kSmall ? h.one_minus_beta1 : h.one_minus_beta1 - 1.f),
          _mm256_set1_ps(h.beta2),
          _mm256_set1_ps(h.one_minus_beta2),
          _mm256_set1_ps(sc.grad_scale),
          _mm256_set1_ps(h.weight_decay),
          _mm256_set1_ps(sc.bias2_sqrt),
          _mm256_set1_ps(h.eps),
          _mm256_set1_ps(sc.step_size),
          _mm256_set1_ps(h.lr)};
}

// moments16 on the AVX2 path: the new m and root of v of 8 elements at i from their decoded m and root of v.
template <int32_t kFlags, bool kSmall, bool kL2, bool kScaled>
__attribute__((target("avx2"), always_inline)) inline void moments8(const Avx2Constants& c, __m256 m,
                                                                   __m256 root_old, const float* __restrict param,
                                                                   const float* __restrict grad, int i,
                                                                   __m256& m_new, __m256& root) {
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  __m256 g = _mm256_loadu_ps(grad + i);
  if (kScaled) g = _mm256_mul_ps(g, c.grad_scale);
  if (kFlags & kMaximize) g = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(g), sign));
  if (kL2) g = _mm256_add_ps(g, _mm256_mul_ps(c.weight_decay, _mm256_loadu_ps(param + i)));
  m_new = _mm256_add_ps(kSmall ? m : g, _mm256_mul_ps(c.lerp_weight, _mm256_sub_ps(g, m)));
  const __m256 v = _mm256_mul_ps(root_old, root_old);
  const __m256 v_new = _mm256_add_ps(_mm256_mul_ps(v, c.beta2), _mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, g), g));
  root = _mm256_sqrt_ps(v_new);
}

// adam_moments_vbmi's and adam_moments_u4's work on the AVX2 path (cnt a multiple of 32): decode_moments_avx2,
// then moments8, that is effective_grad, adam_moments' L2 term and torch_lerp, and stored_form (optim_rules.h),
// operation for operation. Same values as block_states and update_avx2, so the same results; s1 and s2 receive
// the new m and root of v. Template arguments as adam_moments16's.
template <int kBits, int32_t kFlags, bool kSmall, bool kL2, bool kScaled>
__attribute__((target("avx2"))) void adam_moments_avx2(const StepHyper& h, const StepScalars& sc,
                                                       const float* __restrict param, const float* __restrict grad,
                                                       const uint8_t* __restrict q1, const uint8_t* __restrict q2,
                                                       float absmax1, float absmax2, const float* map1,
                                                       const float* map2, float* __restrict s1, float* __restrict s2,
                                                       int cnt, uint32_t* max_bits, const AdamAhead& ahead) {
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  const Avx2Constants c = avx2_constants<kSmall>(h, sc);
  __m256i max1 = _mm256_setzero_si256(), max2 = _mm256_setzero_si256();
  decode_moments_avx2<kBits>(q1, q2, absmax1, absmax2, map1, map2, cnt, ahead,
                             [&](int i, __m256 m, __m256 root_old) __attribute__((target("avx2"), always_inline)) {
                               __m256 m_new, root;
                               moments8<kFlags, kSmall, kL2, kScaled>(c, m, root_old, param, grad, i, m_new, root);
                               _mm256_storeu_ps(s1 + i, m_new);
                               _mm256_storeu_ps(s2 + i, root);
                               max1 = _mm256_max_epu32(max1, _mm256_and_si256(_mm256_castps_si256(m_new), magnitude));
                               max2 = _mm256_max_epu32(max2, _mm256_and_si256(_mm256_castps_si256(root), magnitude));
                             });
  max_bits[0] = max_lane8(max1);
  max_bits[1] = max_lane8(max2);
  max_bits[2] = 0;
}

// step16 on the AVX2 path: the step u of 8 elements from their new m and root of v, adam_update or (kLamb)
// lamb_update with the parameters p before the step, operation for operation (the division by bias2_sqrt too:
// 8 lanes wide the divider is not what limits the loops, measured).
template <bool kLamb>
__attribute__((target("avx2"), always_inline)) inline __m256 step8(const Avx2Constants& c, __m256 m, __m256 root,
                                                                  __m256 p) {
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(root, c.bias2_sqrt), c.eps);
  if constexpr (kLamb) {
    const __m256 r =
        _mm256_add_ps(_mm256_div_ps(_mm256_mul_ps(m, c.step_size), denom), _mm256_mul_ps(c.weight_decay, p));
    return _mm256_mul_ps(c.lr, r);
  }
  return _mm256_div_ps(_mm256_mul_ps(c.step_size, m), denom);
}

// adam_encode_step_sums and adam_encode_step_u4 on the AVX2 path (cnt a multiple of 32): adam_step16's codes
// and step (step8) 8 lanes at a time, 32 codes of each state packed per store (into 16 bytes at 4 bits). Same
// codes and parameters.
template <int kBits, bool kLamb, bool kDecay, bool kScaled>
__attribute__((target("avx2"))) void adam_encode_step_avx2(const StepHyper& h, const StepScalars& sc,
                                                           float* __restrict param, const float* __restrict s1,
                                                           const float* __restrict s2, int cnt, const int* sums1,
                                                           const int* sums2, float inv1, float inv2,
                                                           uint8_t* __restrict q1, uint8_t* __restrict q2,
                                                           const AdamAhead& ahead) {
  const Avx2Constants c = avx2_constants<true>(h, sc);  // the moments' lerp weight, unused here, either form
  const __m256 update_scale = _mm256_set1_ps(sc.update_scale), decay = _mm256_set1_ps(h.decay);
  const __m256 scale1 = _mm256_set1_ps(inv1), scale2 = _mm256_set1_ps(inv2);
  for (int j = 0; j < cnt; j += 32) {
    __m256i c1[4], c2[4];
    for (int k = 0; k < 4; ++k) {
      const int i = j + 8 * k;
      ahead.param.at(static_cast<int>(i * sizeof(float)));
      const __m256 m = _mm256_loadu_ps(s1 + i), root = _mm256_loadu_ps(s2 + i);
      c1[k] = sum_codes8(sums1, order_keys8(_mm256_mul_ps(m, scale1)));
      c2[k] = sum_codes8(sums2, nonnegative_keys8(_mm256_mul_ps(root, scale2)));
      __m256 p = _mm256_loadu_ps(param + i);
      const __m256 u = step8<kLamb>(c, m, root, p);
      if (kDecay) p = _mm256_mul_ps(p, decay);
      _mm256_storeu_ps(param + i, _mm256_sub_ps(p, kScaled ? _mm256_mul_ps(update_scale, u) : u));
    }
    if constexpr (kBits == 4) {
      pack_u4_16x8(c1[0], c1[1], q1 + j / 2);
      pack_u4_16x8(c1[2], c1[3], q1 + j / 2 + 8);
      pack_u4_16x8(c2[0], c2[1], q2 + j / 2);
      pack_u4_16x8(c2[2], c2[3], q2 + j / 2 + 8);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q1 + j), pack_codes32(c1[0], c1[1], c1[2], c1[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q2 + j), pack_codes32(c2[0], c2[1], c2[2], c2[3]));
    }
  }
}

// Adam's (kLamb: LAMB's) block of 8-bit or 4-bit states on the AVX2 path when coders.adam_avx2 (fp32
// parameters, cnt a multiple of 32): adam_block's two fused loops, 8 lanes wide. A block with a non-finite
// moment, or whose absmax has no finite inverse, returns false before anything is written, and step_block's
// loops take it from the start.
template <bool kLamb>
bool adam_block_avx2(const OptimArgs& a, const TensorView& t, int64_t block, int64_t lo, int cnt,
                            const StateCoders& coders, float* param, const float* grad) {
  float decoded[2][kMaxBlock];
  uint32_t max_bits[kMaxStates];
  uint8_t* q1 = static_cast<uint8_t*>(t.state[0]) + lo * t.bits / 8;
  uint8_t* q2 = static_cast<uint8_t*>(t.state[1]) + lo * t.bits / 8;
  const AdamAhead ahead = adam_ahead(t, lo, cnt, param, grad, q1, q2);
  const auto options = [&](auto flags, auto small, auto l2, auto scaled) LB_ALWAYS_INLINE {
    constexpr int32_t kF = decltype(flags)::value;
    constexpr bool kS = decltype(small)::value, kL = decltype(l2)::value, kG = decltype(scaled)::value;
    const auto moments = [&](auto bits) LB_ALWAYS_INLINE {
      adam_moments_avx2<decltype(bits)::value, kF, kS, kL, kG>(a.hyper, t.scalars, param, grad, q1, q2,
                                                               t.absmax[0][block], t.absmax[1][block], state_map(a, 0),
                                                               state_map(a, 1), decoded[0], decoded[1], cnt, max_bits,
                                                               ahead);
    };
    if (t.bits == 4) return moments(std::integral_constant<int, 4>{});
    moments(std::integral_constant<int, 8>{});
  };
  with_adam_moment_options<kLamb>(a.hyper, t.scalars, options);
  const float amax1 = absmax_from_bits(max_bits[0]), amax2 = absmax_from_bits(max_bits[1]);
  const float inv1 = block_inverse(amax1), inv2 = block_inverse(amax2);
  const bool finite = max_bits[0] < kNonFiniteBits && max_bits[1] < kNonFiniteBits;
  if (!finite || (amax1 > 0.f && inv1 == 0.f) || (amax2 > 0.f && inv2 == 0.f)) return false;
  t.absmax[0][block] = amax1;
  t.absmax[1][block] = amax2;
  const int* sums1 = reinterpret_cast<const int*>(coders.index[0]->nearest_sums()) - kFirstBucket;
  const int* sums2 = reinterpret_cast<const int*>(coders.index[1]->nearest_sums()) - kFirstBucket;
  const bool decay = a.hyper.weight_decay != 0.f && (a.hyper.flags & kDecoupled);
  with_bool(decay, [&](auto kDecay) LB_ALWAYS_INLINE {
    with_bool(t.scalars.update_scale != 1.f, [&](auto kScaled) LB_ALWAYS_INLINE {
      constexpr bool kD = decltype(kDecay)::value, kG = decltype(kScaled)::value;
      if (t.bits == 4) {
        return adam_encode_step_avx2<4, kLamb, kD, kG>(a.hyper, t.scalars, param, decoded[0], decoded[1], cnt, sums1,
                                                       sums2, inv1, inv2, q1, q2, ahead);
      }
      adam_encode_step_avx2<8, kLamb, kD, kG>(a.hyper, t.scalars, param, decoded[0], decoded[1], cnt, sums1, sums2,
                                              inv1, inv2, q1, q2, ahead);
    });
  });
  return true;
}

// add_squares16 on the AVX2 path: the squares of 8 floats, widened to double, into lanes 0 to 3 (low) and 4 to 7
// (high) of norm_order.h's 8.
__attribute__((target("avx2"), always_inline)) inline void add_squares8(__m256 x, __m256d& low, __m256d& high) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  low = _mm256_add_pd(low, _mm256_mul_pd(a, a));
  high = _mm256_add_pd(high, _mm256_mul_pd(b, b));
}

// The 8 lanes of low and high added in lane order (add_lanes).
__attribute__((target("avx2"))) inline double lane_total8(__m256d low, __m256d high) {
  alignas(32) double lanes[kSquareLanes];
  _mm256_store_pd(lanes, low);
  _mm256_store_pd(lanes + 4, high);
  return add_lanes(lanes, kSquareLanes);
}

// lamb_norms_u4 and lamb_norms_vbmi on the AVX2 path (cnt a multiple of 32): decode_moments_avx2, moments8 and
// step8, p^2 and u^2 added by add_squares8. The same sums as norm_block's loops.
template <int kBits, int32_t kFlags, bool kSmall, bool kScaled>
__attribute__((target("avx2"))) void lamb_norms_avx2(const StepHyper& h, const StepScalars& sc,
                                                     const float* __restrict param, const float* __restrict grad,
                                                     const uint8_t* q1, const uint8_t* q2, float absmax1,
                                                     float absmax2, const float* map1, const float* map2, int cnt,
                                                     const AdamAhead& ahead, double* sums) {
  const Avx2Constants c = avx2_constants<kSmall>(h, sc);
  __m256d p_low = _mm256_setzero_pd(), p_high = _mm256_setzero_pd();
  __m256d u_low = _mm256_setzero_pd(), u_high = _mm256_setzero_pd();
  decode_moments_avx2<kBits>(q1, q2, absmax1, absmax2, map1, map2, cnt, ahead,
                             [&](int i, __m256 m, __m256 root_old) __attribute__((target("avx2"), always_inline)) {
                               __m256 m_new, root;
                               moments8<kFlags, kSmall, false, kScaled>(c, m, root_old, param, grad, i, m_new, root);
                               ahead.param.at(static_cast<int>(i * sizeof(float)));
                               const __m256 p = _mm256_loadu_ps(param + i);
                               add_squares8(p, p_low, p_high);
                               add_squares8(step8<true>(c, m_new, root, p), u_low, u_high);
                             });
  sums[0] = lane_total8(p_low, p_high);
  sums[1] = lane_total8(u_low, u_high);
}
#endif

// Calls fn(std::bool_constant<root>{}), root: the states are quantized ones of a rule with a second
// moment, in their stored form (only then is the root variant of the loops instantiated).
template <Rule kRule, typename Fn>
LB_ALWAYS_INLINE inline void with_root(bool quantized, Fn&& fn) {
  if constexpr (second_moment_slot(kRule) >= 0) {
    if (quantized) return fn(std::true_type{});
  }
  fn(std::false_type{});
}

template <Rule kRule, int kStates, typename T>
void step_block(const OptimArgs& a, const TensorView& t, int64_t block, const StateCoders& coders) {
  const int64_t lo = block * a.block_size;
  const int cnt = static_cast<int>(std::min(t.n - lo, a.block_size));
  T* param = static_cast<T*>(t.param) + lo;
  const T* grad = static_cast<const T*>(t.grad) + lo;
#ifdef LB_AVX2_CODES
  if constexpr ((kRule == Rule::Adam || kRule == Rule::Lamb) && kStates == 2 && std::is_same_v<T, float>) {
    if (coders.adam_avx2 && (t.bits == 8 || t.bits == 4) && !t.stochastic && t.rank1_slot < 0 && cnt % 32 == 0 &&
        adam_block_avx2<kRule == Rule::Lamb>(a, t, block, lo, cnt, coders, param, grad)) {
      return;
    }
  }
#endif
#ifdef LB_AVX512_CODES
  if constexpr ((kRule == Rule::Adam || kRule == Rule::Lamb) && kStates == 2) {
    if (coders.adam_split && t.rank1_slot < 0 &&
        ((t.bits == 8 && !t.stochastic) || (t.bits == 4 && adam_fused<T>(t, coders, cnt)))) {
      return adam_block<kRule == Rule::Lamb>(a, t, block, lo, cnt, coders, param, grad);
    }
  }
#endif
  // The prefetch in parts between the decode, the update and the encode (prefetch_ahead).
  prefetch_ahead<T>(a, t, lo, 0);
  float decoded[kMaxStates][kMaxBlock];
  float* s[kMaxStates];
  block_states<kStates>(a, t, block, lo, cnt, coders.planes, decoded, s);
  prefetch_ahead<T>(a, t, lo, 1);
  uint32_t max_bits[kMaxStates];
  with_root<kRule>(t.quantized, [&](auto root) {
    update<kRule, kStates, decltype(root)::value>(a.hyper, t.scalars, param, grad, s[0], s[1], s[2], cnt, max_bits);
  });
  prefetch_ahead<T>(a, t, lo, 2);
  if (t.quantized) {
    if (max_bits[0] >= kNonFiniteBits || max_bits[1] >= kNonFiniteBits || max_bits[2] >= kNonFiniteBits) {
      restart_nonfinite3(s, kStates, cnt, max_bits);
    }
    for (int k = 0; k < kStates; ++k) store_state(t, k, block, lo, cnt, max_bits[k], coders.index[k], coders.gather, s[k]);
  }
  prefetch_ahead<T>(a, t, lo, 3);
}

// The rank-1 statistics pass over one block (lowbit/rank1.h): step_block's update on copies of the
// parameter and the states, whose new stored second moments (after the non-finite restart) raise the
// axis maxima of stat_bits, the tensor's statistics as bit patterns.
template <Rule kRule, int kStates, typename T>
void stats_block(const OptimArgs& a, const TensorView& t, int64_t block, const StateCoders& coders,
                 uint32_t* stat_bits) {
  const int64_t lo = block * a.block_size;
  const int cnt = static_cast<int>(std::min(t.n - lo, a.block_size));
  float decoded[kMaxStates][kMaxBlock];
  float* s[kMaxStates];
  block_states<kStates>(a, t, block, lo, cnt, coders.planes, decoded, s);
  T param[kMaxBlock];
  std::copy_n(static_cast<const T*>(t.param) + lo, cnt, param);
  const T* grad = static_cast<const T*>(t.grad) + lo;
  uint32_t max_bits[kMaxStates];
  with_root<kRule>(true, [&](auto root) {
    update<kRule, kStates, decltype(root)::value>(a.hyper, t.scalars, param, grad, s[0], s[1], s[2], cnt, max_bits);
  });
  if (max_bits[0] >= kNonFiniteBits || max_bits[1] >= kNonFiniteBits || max_bits[2] >= kNonFiniteBits) {
    restart_nonfinite3(s, kStates, cnt, max_bits);
  }
  if (t.rank1_slot < 0 || t.rank1_slot >= kStates) return;
  rank1_loop<Rank1Loop::kRaise>(t.rank1, nullptr, lo, cnt, s[t.rank1_slot], stat_bits);
}

// p and the step u of the rule for one block, from copies of the states (the norm pre-pass writes
// nothing). Inlined into per-target entry points like update_body.
template <bool kFirst, bool kNesterov, typename T>
__attribute__((always_inline)) inline void sgd_norm_terms(const StepHyper& h, const StepScalars& sc,
                                                          const T* __restrict param, const T* __restrict grad,
                                                          const float* __restrict s1, int cnt, float* __restrict p_out,
                                                          float* __restrict u_out) {
  for (int i = 0; i < cnt; ++i) {
    const float p = to_float(param[i]);
    float buf = s1[i];
    p_out[i] = p;
    u_out[i] = sgd_momentum_step<kFirst, kNesterov>(h, p, effective_grad(h, sc, to_float(grad[i])), buf);
  }
}

template <Rule kRule, int kStates, bool kRoot, typename T>
__attribute__((always_inline)) inline void norm_terms_body(const StepHyper& hyper, const StepScalars& scalars,
                                                           const T* __restrict param, const T* __restrict grad,
                                                           const float* __restrict s1, const float* __restrict s2,
                                                           const float* __restrict s3, int cnt,
                                                           float* __restrict p_out, float* __restrict u_out) {
  const StepHyper h = hyper;
  const StepScalars sc = scalars;
  if constexpr (kRule == Rule::SGD && kStates == 1) {
    if (h.beta1 != 0.f) {  // as in update_body: SGD's options as template arguments
      return with_sgd_options(h, sc, [&](auto first, auto nesterov) LB_ALWAYS_INLINE {
        sgd_norm_terms<decltype(first)::value, decltype(nesterov)::value>(h, sc, param, grad, s1, cnt, p_out, u_out);
      });
    }
  }
  for (int i = 0; i < cnt; ++i) {  // as in update_body
    const float p = to_float(param[i]);
    float v1 = kStates > 0 ? state_value(s1[i], kRoot && root_slot(kRule, 0)) : 0.f;
    float v2 = kStates > 1 ? state_value(s2[i], kRoot && root_slot(kRule, 1)) : 0.f;
    float v3 = kStates > 2 ? state_value(s3[i], kRoot && root_slot(kRule, 2)) : 0.f;
    p_out[i] = p;
    u_out[i] = rule_step(kRule, h, sc, p, effective_grad(h, sc, to_float(grad[i])), v1, v2, v3);
  }
}

template <Rule kRule, int kStates, bool kRoot, typename T>
void norm_terms_baseline(const StepHyper& h, const StepScalars& sc, const T* param, const T* grad, const float* s1,
                         const float* s2, const float* s3, int cnt, float* p_out, float* u_out) {
  norm_terms_body<kRule, kStates, kRoot>(h, sc, param, grad, s1, s2, s3, cnt, p_out, u_out);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <Rule kRule, int kStates, bool kRoot, typename T>
__attribute__((target("avx2"))) void norm_terms_avx2(const StepHyper& h, const StepScalars& sc, const T* param,
                                                     const T* grad, const float* s1, const float* s2,
                                                     const float* s3, int cnt, float* p_out, float* u_out) {
  norm_terms_body<kRule, kStates, kRoot>(h, sc, param, grad, s1, s2, s3, cnt, p_out, u_out);
}

template <Rule kRule, int kStates, bool kRoot, typename T>
__attribute__((target("avx512f"))) void norm_terms_avx512(const StepHyper& h, const StepScalars& sc, const T* param,
                                                          const T* grad, const float* s1, const float* s2,
                                                          const float* s3, int cnt, float* p_out, float* u_out) {
  norm_terms_body<kRule, kStates, kRoot>(h, sc, param, grad, s1, s2, s3, cnt, p_out, u_out);
}
#endif

// Sums of p^2 and u^2 over a block in double, each in norm_order.h's lanes (element i into lane i % 8, in
// order; then the lanes from 0): a fixed order, kept on vectors of the 8 lanes, both in one loop so that the
// two chains of additions overlap (the order makes each a chain). GCC vector types, because written per lane
// GCC assembled each vector from single floats (about 20 inserts per 8 elements).
typedef float Floats8 __attribute__((vector_size(8 * sizeof(float))));
typedef double Doubles8 __attribute__((vector_size(8 * sizeof(double))));
static_assert(kSquareLanes == 8, "one vector of doubles holds the lanes");

// Out by reference: a vector returned by value trips GCC's ABI note (-Wpsabi) in the baseline clone.
template <typename T>
__attribute__((always_inline)) inline void widen8(const T* v, Doubles8& out) {
  Floats8 f;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&f, v, sizeof f);
  } else {
    for (int l = 0; l < 8; ++l) f[l] = to_float(v[l]);
  }
  out = __builtin_convertvector(f, Doubles8);
}

// The elements from i (a multiple of kSquareLanes) to cnt into their lanes of lp and lg, then the lanes' totals.
template <typename T>
inline void finish_square_sums(const T* p, const T* g, int i, int cnt, double* lp, double* lg, double* sums) {
  for (; i < cnt; ++i) {
    lp[i % kSquareLanes] += static_cast<double>(to_float(p[i])) * to_float(p[i]);
    lg[i % kSquareLanes] += static_cast<double>(to_float(g[i])) * to_float(g[i]);
  }
  sums[0] = add_lanes(lp, kSquareLanes);
  sums[1] = add_lanes(lg, kSquareLanes);
}

// ahead: the two streams read ahead (StreamAhead; empty ones for buffers already in cache).
template <typename T>
__attribute__((always_inline)) inline void square_sums_body(const T* __restrict p, const T* __restrict g, int cnt,
                                                            double* sums, const AdamAhead& ahead) {
  Doubles8 vp = {};
  Doubles8 vg = {};
  int i = 0;
  for (; i + kSquareLanes <= cnt; i += kSquareLanes) {
    ahead.param.at(static_cast<int>(i * sizeof(T)));
    ahead.grad.at(static_cast<int>(i * sizeof(T)));
    Doubles8 x;
    Doubles8 y;
    widen8(p + i, x);
    widen8(g + i, y);
    vp += x * x;
    vg += y * y;
  }
  double lp[kSquareLanes];
  double lg[kSquareLanes];
  std::memcpy(lp, &vp, sizeof lp);
  std::memcpy(lg, &vg, sizeof lg);
  finish_square_sums(p, g, i, cnt, lp, lg, sums);
}

template <typename T>
void square_sums_baseline(const T* p, const T* g, int cnt, double* sums, const AdamAhead& ahead) {
  square_sums_body(p, g, cnt, sums, ahead);
}

#if defined(__x86_64__) && defined(__GNUC__)
// 8 fp32 or bf16 elements as fp32 (bf16 widens exactly).
__attribute__((target("avx2"), always_inline)) inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
__attribute__((target("avx2"), always_inline)) inline __m256 load8(const BFloat16* v) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// square_sums_body in AVX2 registers by add_squares8 (the same lanes in the same order): with AVX2 GCC keeps
// the body's 8-double vectors on the stack, a round trip through memory per 8 elements, and LARS8bit's step on
// one 16M fp32 tensor took 21.4-22.3 ms against 13.4-14.5 ms this way (SGD8bit's 7.9-8.7; 2 threads). fp16 keeps
// the body. (AVX-512 holds the body's vectors in registers: the same loop in intrinsics there measured the same.)
template <typename T>
__attribute__((target("avx2"))) void square_sums_avx2(const T* p, const T* g, int cnt, double* sums,
                                                      const AdamAhead& ahead) {
  if constexpr (std::is_same_v<T, Half>) {
    square_sums_body(p, g, cnt, sums, ahead);
  } else {
    __m256d p_low = _mm256_setzero_pd(), p_high = p_low, g_low = p_low, g_high = p_low;
    int i = 0;
    for (; i + kSquareLanes <= cnt; i += kSquareLanes) {
      ahead.param.at(static_cast<int>(i * sizeof(T)));
      ahead.grad.at(static_cast<int>(i * sizeof(T)));
      add_squares8(load8(p + i), p_low, p_high);
      add_squares8(load8(g + i), g_low, g_high);
    }
    alignas(32) double lp[kSquareLanes];
    alignas(32) double lg[kSquareLanes];
    _mm256_store_pd(lp, p_low);
    _mm256_store_pd(lp + 4, p_high);
    _mm256_store_pd(lg, g_low);
    _mm256_store_pd(lg + 4, g_high);
    finish_square_sums(p, g, i, cnt, lp, lg, sums);
  }
}

template <typename T>
__attribute__((target("avx512f"))) void square_sums_avx512(const T* p, const T* g, int cnt, double* sums,
                                                           const AdamAhead& ahead) {
  square_sums_body(p, g, cnt, sums, ahead);
}
#endif

template <typename T>
void square_sums(const T* p, const T* g, int cnt, double* sums, const AdamAhead& ahead = {}) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx512_active()) return square_sums_avx512(p, g, cnt, sums, ahead);
  if (avx2_active()) return square_sums_avx2(p, g, cnt, sums, ahead);
#endif
  square_sums_baseline(p, g, cnt, sums, ahead);
}

// norm_block's LAMB block where the fused loops take its step (adam_block: coders.adam_split and adam_fused;
// adam_block_avx2: coders.adam_avx2, fp32 parameters, whole groups of 32), block-wise quantized states: the sums by
// lamb_norms_u4, lamb_norms_vbmi or lamb_norms_avx2, reading ahead as those blocks do. Returns false, computing
// nothing, for other blocks.
template <typename T>
bool lamb_norms_block(const OptimArgs& a, const TensorView& t, int64_t block, int64_t lo, int cnt,
                      const StateCoders& coders, const T* param, const T* grad, double* sums) {
  if (!t.quantized || t.rank1_slot >= 0 || (t.bits != 8 && t.bits != 4)) return false;
  const uint8_t* q1 = static_cast<const uint8_t*>(t.state[0]) + lo * t.bits / 8;
  const uint8_t* q2 = static_cast<const uint8_t*>(t.state[1]) + lo * t.bits / 8;
  const float amax1 = t.absmax[0][block], amax2 = t.absmax[1][block];
#ifdef LB_AVX512_CODES
  if constexpr (kFusedAdamParams<T>) {
    if (coders.adam_split && adam_fused<T>(t, coders, cnt)) {
      const AdamAhead ahead = adam_ahead(t, lo, cnt, param, grad, q1, q2);
      const auto norms = [&](auto flags, auto small, auto, auto scaled) LB_ALWAYS_INLINE {
        constexpr int32_t kF = decltype(flags)::value;
        constexpr bool kS = decltype(small)::value, kG = decltype(scaled)::value;
        if (t.bits == 4) {
          return lamb_norms_u4<kF, kS, kG>(a.hyper, t.scalars, param, grad, q1, q2, amax1, amax2, state_map(a, 0),
                                           state_map(a, 1), cnt, ahead, sums);
        }
#ifdef LB_VBMI_DECODE
        with_bool(coders.planes_first, [&](auto planes1) LB_ALWAYS_INLINE {
          lamb_norms_vbmi<decltype(planes1)::value, kF, kS, kG>(a.hyper, t.scalars, param, grad, q1, q2, amax1,
                                                                 amax2, state_map(a, 0), coders.planes[0],
                                                                 *coders.planes[1], cnt, ahead, sums);
        });
#endif
      };
      with_adam_moment_options<true>(a.hyper, t.scalars, norms);
      return true;
    }
  }
#endif
#ifdef LB_AVX2_CODES
  if constexpr (std::is_same_v<T, float>) {
    if (coders.adam_avx2 && cnt % 32 == 0) {
      const AdamAhead ahead = adam_ahead(t, lo, cnt, param, grad, q1, q2);
      const auto norms = [&](auto flags, auto small, auto, auto scaled) LB_ALWAYS_INLINE {
        constexpr int32_t kF = decltype(flags)::value;
        constexpr bool kS = decltype(small)::value, kG = decltype(scaled)::value;
        const auto width = [&](auto bits) LB_ALWAYS_INLINE {
          lamb_norms_avx2<decltype(bits)::value, kF, kS, kG>(a.hyper, t.scalars, param, grad, q1, q2, amax1, amax2,
                                                             state_map(a, 0), state_map(a, 1), cnt, ahead, sums);
        };
        if (t.bits == 4) return width(std::integral_constant<int, 4>{});
        width(std::integral_constant<int, 8>{});
      };
      with_adam_moment_options<true>(a.hyper, t.scalars, norms);
      return true;
    }
  }
#endif
  return false;
}

// Pre-pass of the norm modes: sums of p^2 (before the step) and u^2 over one block.
template <Rule kRule, int kStates, typename T>
void norm_block(const OptimArgs& a, const TensorView& t, int64_t block, const StateCoders& coders, double* sums) {
  const int64_t lo = block * a.block_size;
  const int cnt = static_cast<int>(std::min(t.n - lo, a.block_size));
  const T* param = static_cast<const T*>(t.param) + lo;
  const T* grad = static_cast<const T*>(t.grad) + lo;
  if (a.hyper.norm_mode == kNormGrad) {  // LARS: no states
    // Its own two streams only, read ahead a line at a time as the fused Adam loops read theirs (StreamAhead):
    // LARS8bit's step on one 16M fp32 tensor went from 12.2-13.8 to 11.7-12.4 ms (2 threads, alternated runs),
    // where prefetch_ahead's bursts had brought it from 14.5 to 13.4-13.7 ms.
    constexpr int kBits = 8 * sizeof(T);
    const AdamAhead ahead{stream_ahead(grad, kBits, lo, cnt, t.n), stream_ahead(param, kBits, lo, cnt, t.n), {}, {}};
    return square_sums(param, grad, cnt, sums, ahead);
  }
  if constexpr (kRule == Rule::Lamb && kStates == 2) {
    if (lamb_norms_block<T>(a, t, block, lo, cnt, coders, param, grad, sums)) return;
  }
  float p_val[kMaxBlock];
  float u_val[kMaxBlock];
  float decoded[kMaxStates][kMaxBlock];
  float* s[kMaxStates];
  prefetch_ahead<T>(a, t, lo, 0);
  prefetch_ahead<T>(a, t, lo, 1);
  block_states<kStates>(a, t, block, lo, cnt, coders.planes, decoded, s);
  prefetch_ahead<T>(a, t, lo, 2);
  prefetch_ahead<T>(a, t, lo, 3);
  with_root<kRule>(t.quantized, [&](auto root) {
    constexpr bool kRoot = decltype(root)::value;
#if defined(__x86_64__) && defined(__GNUC__)
    if (avx512_active()) {
      norm_terms_avx512<kRule, kStates, kRoot>(a.hyper, t.scalars, param, grad, s[0], s[1], s[2], cnt, p_val, u_val);
    } else if (avx2_active()) {
      norm_terms_avx2<kRule, kStates, kRoot>(a.hyper, t.scalars, param, grad, s[0], s[1], s[2], cnt, p_val, u_val);
    } else {
      norm_terms_baseline<kRule, kStates, kRoot>(a.hyper, t.scalars, param, grad, s[0], s[1], s[2], cnt, p_val, u_val);
    }
#else
    norm_terms_baseline<kRule, kStates, kRoot>(a.hyper, t.scalars, param, grad, s[0], s[1], s[2], cnt, p_val, u_val);
#endif
  });
  square_sums(p_val, u_val, cnt, sums);
}

// Calls fn(std::integral_constant<int, K>{}) for K = n_states (0 to 3), so loops see it as a constant.
// Only the three-state rules get a K = 3 instance.
template <Rule kRule, typename Fn>
void with_states(int n_states, Fn&& fn) {
  constexpr bool kThree = kRule == Rule::AdamAmsgrad || kRule == Rule::RMSpropCentered || kRule == Rule::AdEMAMix;
  switch (n_states) {
    case 0:
      return fn(std::integral_constant<int, 0>{});
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    default:
      if constexpr (kThree) return fn(std::integral_constant<int, 3>{});
      return fn(std::integral_constant<int, 2>{});
  }
}

// The statistics pass of a call (OptimArgs::stats_only): each thread raises its own copy of the maxima,
// which are then merged (an exact max, so the result does not depend on the thread count).
template <Rule kRule>
void rank1_stats(const OptimArgs& a, const std::vector<TensorView>& tensors, const StateCoders& coders, int threads,
                 bool par) {
  std::vector<int64_t> base(a.count + 1, 0);
  for (int64_t t = 0; t < a.count; ++t) {
    int64_t len = 0;
    for (int d = 0; d < tensors[t].rank1.ndim && tensors[t].rank1_slot >= 0; ++d) len += tensors[t].rank1.dims[d];
    base[t + 1] = base[t] + len;
  }
  const int64_t width = base[a.count];
  const int team = par ? threads : 1;
  std::vector<uint32_t> bits(static_cast<size_t>(team) * width, 0u);
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
  for (int64_t b = 0; b < a.total_blocks; ++b) {
    const int64_t t = tensor_of_block(a, b);
    const TensorView& tv = tensors[t];
    if (tv.rank1_slot < 0) continue;
    const int64_t block = b - a.meta[t * kMetaCols + kFirstBlock];
    uint32_t* mine = bits.data() + static_cast<int64_t>(omp_get_thread_num()) * width + base[t];
    with_states<kRule>(a.n_states, [&](auto states) {
      LB_DISPATCH_DTYPE(tv.dtype, stats_block<kRule, decltype(states)::value, scalar_t>(a, tv, block, coders, mine));
    });
  }
  for (int64_t t = 0; t < a.count; ++t) {
    for (int64_t j = 0; j < base[t + 1] - base[t]; ++j) {
      uint32_t m = abs_bits(tensors[t].rank1.new_stats[j]);  // raised, as the CUDA pass's atomic max
      for (int th = 0; th < team; ++th) m = std::max(m, bits[th * width + base[t] + j]);
      tensors[t].rank1.new_stats[j] = bits_to_float(m);
    }
  }
}


// -- Factorized second moments (lowbit/factored.h) ------------------------------------------------------------

enum class FactoredLoop { kRowBlocks, kStep };

// The operands of one factored loop: row blocks [lo, hi) of the tensor (kRowBlocks: factored.h's blocks of
// kFactoredRowBlock rows of a slice, numbered slice by slice; their column sums go to part, C floats per block);
// or the cnt = hi - lo elements from element lo, with their decoded first moments m (kStep, which returns the
// block maximum of the new m's bit patterns in *max_bits).
template <typename T>
struct FactoredLoopArgs {
  const StepHyper& h;
  const StepScalars& sc;
  const FactoredView& f;
  T* param;
  const T* grad;
  int64_t lo;
  int64_t hi;
  float* part;
  float* m;
  uint32_t* max_bits;
};

// Each row's sum of squares in factored.h's lanes and its EMA, and the block's column sums in row order: one
// read of the gradients gives both.
template <int32_t kFlags, typename T>
LB_ALWAYS_INLINE inline void factored_row_blocks(const FactoredLoopArgs<T>& a, const StepHyper& h) {
  const StepScalars sc = a.sc;
  const int64_t cols = a.f.cols;
  const int64_t blocks = (a.f.rows + kFactoredRowBlock - 1) / kFactoredRowBlock;
  for (int64_t j = a.lo; j < a.hi; ++j) {
    const int64_t b = j / blocks;
    const int64_t r0 = (j % blocks) * kFactoredRowBlock;
    const int64_t r1 = std::min<int64_t>(r0 + kFactoredRowBlock, a.f.rows);
    float* __restrict part = a.part + j * cols;
    std::fill_n(part, cols, 0.f);
    for (int64_t q = b * a.f.rows + r0; q < b * a.f.rows + r1; ++q) {
      const T* __restrict p = a.param + q * cols;
      const T* __restrict g = a.grad + q * cols;
      float lane[kFactoredLanes] = {};
      int64_t c = 0;
      for (; c + kFactoredLanes <= cols; c += kFactoredLanes) {
        for (int l = 0; l < kFactoredLanes; ++l) {
          const float x = factored_grad(h, sc, to_float(p[c + l]), to_float(g[c + l]));
          const float sq = x * x;
          lane[l] += sq;
          part[c + l] += sq;
        }
      }
      for (int l = 0; c < cols; ++c, ++l) {
        const float x = factored_grad(h, sc, to_float(p[c]), to_float(g[c]));
        const float sq = x * x;
        lane[l] += sq;
        part[c] += sq;
      }
      a.f.row[q] = factored_ema(h, a.f.row[q], factored_add_lanes(lane), cols);
    }
  }
}

template <int32_t kFlags, typename T>
LB_ALWAYS_INLINE inline void factored_step(const FactoredLoopArgs<T>& a, const StepHyper& h) {
  const StepScalars sc = a.sc;
  const int cnt = static_cast<int>(a.hi - a.lo);
  float v_hat[kMaxBlock];
  factored_v_hats(a.f, a.lo, cnt, v_hat);
  T* __restrict param = a.param + a.lo;
  const T* __restrict grad = a.grad + a.lo;
  float* __restrict m = a.m;
  uint32_t max1 = 0;
  for (int i = 0; i < cnt; ++i) {
    float p = to_float(param[i]);
    const float g = factored_grad(h, sc, p, to_float(grad[i]));
    factored_apply(h, sc, p, g, m[i], v_hat[i]);
    param[i] = from_float<T>(p);
    max1 = std::max(max1, abs_bits(m[i]));
  }
  *a.max_bits = max1;
}

// The loop kLoop with the flag bits of with_element_flags as constants (so that it vectorises, as update_body).
template <FactoredLoop kLoop, typename T>
LB_ALWAYS_INLINE inline void factored_loop_body(const FactoredLoopArgs<T>& a) {
  with_element_flags(a.h.flags, [&](auto flags) LB_ALWAYS_INLINE {
    constexpr int32_t kFlags = decltype(flags)::value;
    StepHyper h = a.h;
    h.flags = (a.h.flags & ~kElementFlags) | kFlags;
    if constexpr (kLoop == FactoredLoop::kRowBlocks) {
      factored_row_blocks<kFlags>(a, h);
    } else {
      factored_step<kFlags>(a, h);
    }
  });
}

#if defined(__x86_64__) && defined(__GNUC__)
// Compiled for the widest vector unit in use, as update(): adds, products, division and square root give the
// same IEEE results at any width (no contraction: CMakeLists.txt), and the lanes keep factored.h's order.
template <FactoredLoop kLoop, typename T>
__attribute__((target("avx2"), flatten)) void factored_loop_avx2(const FactoredLoopArgs<T>& a) {
  factored_loop_body<kLoop>(a);
}

template <FactoredLoop kLoop, typename T>
__attribute__((target("avx512f"), flatten)) void factored_loop_avx512(const FactoredLoopArgs<T>& a) {
  factored_loop_body<kLoop>(a);
}
#endif

template <FactoredLoop kLoop, typename T>
void factored_loop(const FactoredLoopArgs<T>& a) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx512_active()) return factored_loop_avx512<kLoop>(a);
  if (avx2_active()) return factored_loop_avx2<kLoop>(a);
#endif
  factored_loop_body<kLoop>(a);
}

// The factors of every factorized tensor of a call: one parallel loop over runs of factored.h's row blocks
// (about kChunk elements per item, whole blocks), which gives the rows' EMAs and each block's column sums, then
// per tensor the columns' sums (the blocks' in block order) and EMAs, and each slice's mean of its new rows.
// Each sum is one thread's, in factored.h's order, so the thread count and the dynamic schedule (which
// balances the items) change no result. Tensors whose factors the caller gives (kFacGiven) are skipped.
void factored_factors(const OptimArgs& a, const std::vector<TensorView>& tensors, int threads, bool par) {
  struct Item {
    int64_t t;
    int64_t lo;
    int64_t hi;
  };
  std::vector<Item> items;
  std::vector<int64_t> base(a.count + 1, 0);  // each tensor's offset in the blocks' column sums
  for (int64_t t = 0; t < a.count; ++t) {
    const FactoredView& f = tensors[t].factored;
    const int64_t blocks = factors_pending(f) ? f.batch * ((f.rows + kFactoredRowBlock - 1) / kFactoredRowBlock) : 0;
    const int64_t block_elements = std::max<int64_t>(1, std::min<int64_t>(f.rows, kFactoredRowBlock) * f.cols);
    const int64_t per_item = std::max<int64_t>(1, kChunk / block_elements);
    for (int64_t j = 0; j < blocks; j += per_item) items.push_back({t, j, std::min(j + per_item, blocks)});
    base[t + 1] = base[t] + blocks * f.cols;
  }
  std::vector<float> parts(static_cast<size_t>(base[a.count]));
  const auto n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (par)
  for (int64_t i = 0; i < n; ++i) {
    const TensorView& tv = tensors[items[i].t];
    LB_DISPATCH_DTYPE(tv.dtype, factored_loop<FactoredLoop::kRowBlocks, scalar_t>(
                                    {a.hyper, tv.scalars, tv.factored, static_cast<scalar_t*>(tv.param),
                                     static_cast<const scalar_t*>(tv.grad), items[i].lo, items[i].hi,
                                     parts.data() + base[items[i].t], nullptr, nullptr}));
  }
  std::vector<float> total;
  for (int64_t t = 0; t < a.count; ++t) {
    const FactoredView& f = tensors[t].factored;
    if (!factors_pending(f)) continue;
    const int64_t blocks = (f.rows + kFactoredRowBlock - 1) / kFactoredRowBlock;
    for (int64_t b = 0; b < f.batch; ++b) {
      total.assign(static_cast<size_t>(f.cols), 0.f);
      for (int64_t k = 0; k < blocks; ++k) {
        const float* part = parts.data() + base[t] + (b * blocks + k) * f.cols;
        for (int64_t c = 0; c < f.cols; ++c) total[c] += part[c];
      }
      float* col = f.col + b * f.cols;
      for (int64_t c = 0; c < f.cols; ++c) col[c] = factored_ema(a.hyper, col[c], total[c], f.rows);
      float lane[kFactoredLanes] = {};
      const float* row = f.row + b * f.rows;
      for (int64_t r = 0; r < f.rows; ++r) lane[r % kFactoredLanes] += row[r];
      f.mean[b] = factored_add_lanes(lane) / static_cast<float>(f.rows);
    }
  }
}

// The step of one block of a factorized tensor: its 4-bit first moment decoded, factored_apply per element with
// v_hat from the (already updated) factors, the non-finite restart of m (state_form.h), m re-encoded.
template <typename T>
void factored_block(const OptimArgs& a, const TensorView& t, int64_t block, const StateCoders& coders) {
  const int64_t lo = block * a.block_size;
  const int cnt = static_cast<int>(std::min(t.n - lo, a.block_size));
  float m[kMaxBlock];
  load_state(t, 0, block, lo, cnt, state_map(a, 0), coders.planes[0], m);
  uint32_t max_bits[kMaxStates] = {0, 0, 0};
  factored_loop<FactoredLoop::kStep, T>(
      {a.hyper, t.scalars, t.factored, static_cast<T*>(t.param), static_cast<const T*>(t.grad), lo, lo + cnt,
       nullptr, m, max_bits});
  if (max_bits[0] >= kNonFiniteBits) {
    float* s[kMaxStates] = {m, nullptr, nullptr};
    restart_nonfinite3(s, 1, cnt, max_bits);
  }
  store_state(t, 0, block, lo, cnt, max_bits[0], coders.index[0], coders.gather, m);
}

template <Rule kRule>
void step_all(const OptimArgs& a, int threads) {
  std::vector<TensorView> tensors;
  bool any_quantized = false;
  int64_t elements = 0;
  for (int64_t t = 0; t < a.count; ++t) {
    tensors.push_back(view(a, t));
    any_quantized |= tensors.back().quantized;
    elements += tensors.back().n;
  }
  std::shared_ptr<const MapIndex> owned[kMaxStates];
  std::unique_ptr<BytePlanes> planes[kMaxStates];
  StateCoders coders;
  // Decided (and on first use timed) here, outside the parallel region.
  coders.gather = any_quantized && gather_encode_active();
  const bool vbmi = any_quantized && a.state_bits == 8 && vbmi_decode_active();
  for (int k = 0; k < a.n_states && any_quantized; ++k) {
    const float* map = state_map(a, k);
    owned[k] = map_index(map, 1u << a.state_bits);
    coders.index[k] = owned[k].get();
    if (vbmi) {
      planes[k] = std::make_unique<BytePlanes>(map);
      coders.planes[k] = planes[k].get();
    }
  }
  coders.adam_split = (kRule == Rule::Adam || kRule == Rule::Lamb) && a.n_states == 2 && coders.gather &&
                      avx512_active() && coders.index[0]->nearest_direct() && coders.index[1]->nearest_direct();
  coders.planes_first = coders.adam_split && vbmi && vbmi_first_moment_active();
  coders.search_u4 = coders.adam_split && a.state_bits == 4 && search_u4_active();
  coders.adam_avx2 = (kRule == Rule::Adam || kRule == Rule::Lamb) && a.n_states == 2 && coders.gather &&
                     !avx512_active() && avx2_active() && coders.index[0]->nearest_direct() &&
                     coders.index[1]->nearest_direct() && coders.index[0]->unit_stable() &&
                     coders.index[1]->unit_stable();
  const bool par = run_parallel(threads, elements);
  if (a.stats_only) return rank1_stats<kRule>(a, tensors, coders, threads, par);
  if (a.hyper.norm_mode != kNormNone && a.update_scales == nullptr) {
    // Per-block partial sums (in the caller's scratch), then per-tensor sums in norm_order.h's lanes:
    // deterministic for any thread count, and the CUDA kernels' order.
    double* sums = a.block_sums;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
    for (int64_t b = 0; b < a.total_blocks; ++b) {
      const int64_t t = tensor_of_block(a, b);
      const int64_t block = b - a.meta[t * kMetaCols + kFirstBlock];
      with_states<kRule>(a.n_states, [&](auto states) {
        LB_DISPATCH_DTYPE(tensors[t].dtype,
                          norm_block<kRule, decltype(states)::value, scalar_t>(a, tensors[t], block, coders, sums + 2 * b));
      });
    }
    for (int64_t t = 0; t < a.count; ++t) {
      const int64_t first = a.meta[t * kMetaCols + kFirstBlock];
      const int64_t last = t + 1 < a.count ? a.meta[(t + 1) * kMetaCols + kFirstBlock] : a.total_blocks;
      double lanes[2][kBlockSumLanes] = {};
      for (int64_t b = first; b < last; ++b) {
        lanes[0][(b - first) % kBlockSumLanes] += sums[2 * b];
        lanes[1][(b - first) % kBlockSumLanes] += sums[2 * b + 1];
      }
      const double pp = add_lanes(lanes[0], kBlockSumLanes);
      const double uu = add_lanes(lanes[1], kBlockSumLanes);
      if (a.norm_sums != nullptr) {
        a.norm_sums[2 * t] = pp;
        a.norm_sums[2 * t + 1] = uu;
      } else {
        tensors[t].scalars.update_scale = update_scale(a.hyper, std::sqrt(pp), std::sqrt(uu));
      }
    }
    if (a.norm_sums != nullptr) return;
  }
  if (a.update_scales != nullptr) {
    for (int64_t t = 0; t < a.count; ++t) tensors[t].scalars.update_scale = a.update_scales[t];
  }
  if (a.factored != nullptr) factored_factors(a, tensors, threads, par);
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
  for (int64_t b = 0; b < a.total_blocks; ++b) {
    const int64_t t = tensor_of_block(a, b);
    const TensorView& tv = tensors[t];
    const int64_t block = b - a.meta[t * kMetaCols + kFirstBlock];
    if (tv.factored.batch > 0) {
      LB_DISPATCH_DTYPE(tv.dtype, factored_block<scalar_t>(a, tv, block, coders));
      continue;
    }
    with_states<kRule>(a.n_states, [&](auto states) {
      LB_DISPATCH_DTYPE(tv.dtype, step_block<kRule, decltype(states)::value, scalar_t>(a, tv, block, coders));
    });
  }
}

}  // namespace

void update_fp32(Rule rule, int n_states, const StepHyper& h, const StepScalars& sc, float* param, const float* grad,
                 float* s1, float* s2, int cnt, uint32_t* max_bits) {
  uint32_t maxes[kMaxStates];
  dispatch_rule(rule, [&](auto r) {
    constexpr Rule kRule = decltype(r)::value;
    with_states<kRule>(n_states, [&](auto states) {
      update<kRule, decltype(states)::value, false>(h, sc, param, grad, s1, s2, nullptr, cnt, maxes);
    });
  });
  max_bits[0] = maxes[0];
  max_bits[1] = maxes[1];
}

void optimizer_step(const OptimArgs& a, int threads) {
  dispatch_rule(a.rule, [&](auto rule) { step_all<decltype(rule)::value>(a, threads); });
}

}  // namespace lowbit::cpu
