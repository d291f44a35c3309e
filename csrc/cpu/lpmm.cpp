// LPMM on the CPU (lpmm.txt Algorithm 1): OpenMP over quantization groups. A group is decoded into
// L1-resident fp32 buffers, updated, and re-encoded with stochastic rounding against its fresh absmax
// (section 5.2, dynamic quantization), so no full-precision copy of a tensor ever exists.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "avx2.h"
#include "avx512.h"
#include "encode.h"
#include "kernels.h"
#include "lpmm_avx512.h"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/optim_rules.h"
#include "lowbit/rounding.h"
#include "lowbit/state_form.h"
#include "map_index.h"
#include "parallel.h"

namespace lowbit::cpu {
namespace {

constexpr int kMaxGroup = 4096;

float linear_qmax(int bits) { return static_cast<float>((1 << (bits - 1)) - 1); }

// Decodes the cnt codes starting at element lo (a multiple of kGroup) into out, a tile at a time:
// decode(tile, m, out) turns m unpacked codes into values.
template <typename Decode>
void decode_group(const uint8_t* codes, int64_t lo, int cnt, int bits, Decode&& decode, float* out) {
  uint32_t tile[kTile];
  for (int j = 0; j < cnt; j += kTile) {
    const int m = std::min(kTile, cnt - j);
    load_codes(codes, m, bits, lo + j, tile);
    decode(tile, m, out + j);
  }
}

// The AVX-512 loops (lpmm_avx512.h) take the whole 16-element chunks of 8- and 12-bit codes straight
// from the packed bytes; the portable tile loop does the rest, which starts on a whole group.
void decode_linear(const uint8_t* codes, int64_t lo, int cnt, int bits, float absmax, float* out) {
  const float qmax = linear_qmax(bits);
  int done = 0;
  if (lpmm_avx512_width(bits) && lpmm_avx512_active()) {
    done = linear_values_avx512(codes + (lo / kGroup) * bits, cnt, bits, absmax, qmax, out);
  }
  decode_group(
      codes, lo + done, cnt - done, bits,
      [&](const uint32_t* t, int m, float* o) { linear_values(t, m, absmax, qmax, o); }, out + done);
}

// planes: the map's byte planes where 8-bit states decode with the VBMI permutes (optim.cpp's choice too).
void decode_map(const uint8_t* codes, int64_t lo, int cnt, int bits, const float* map, const BytePlanes* planes,
                float absmax, float* out) {
  if (bits == 8 && planes != nullptr) return decode_u8_vbmi(*planes, map, codes + lo, cnt, absmax, out);
  if (bits == 8 && avx512_active()) return decode_u8_avx512(map, codes + lo, cnt, absmax, out);
  if (bits == 8 && avx2_active()) return decode_u8_avx2(map, codes + lo, cnt, absmax, out);
  decode_group(
      codes, lo, cnt, bits,
      [&](const uint32_t* t, int m, float* o) {
        for (int i = 0; i < m; ++i) o[i] = map[t[i]] * absmax;
      },
      out);
}

// Encodes the cnt values `in` of the group starting at element lo; draws use counters counter0 + lo + j.
template <bool kSR, typename Span>
void encode_group(const Span& span, const float* in, int64_t lo, int cnt, int bits, float absmax, RngKey key,
                  uint64_t counter0, uint8_t* codes) {
  uint32_t tile[kTile];
  for (int j = 0; j < cnt; j += kTile) {
    const int m = std::min(kTile, cnt - j);
    span.template encode<kSR>(in + j, m, absmax, key, counter0 + static_cast<uint64_t>(lo + j), tile);
    store_codes(tile, m, bits, lo + j, codes);
  }
}

template <typename Span>
void encode_group(bool stochastic, const Span& span, const float* in, int64_t lo, int cnt, int bits, float absmax,
                  RngKey key, uint64_t counter0, uint8_t* codes) {
  if (stochastic) return encode_group<true>(span, in, lo, cnt, bits, absmax, key, counter0, codes);
  encode_group<false>(span, in, lo, cnt, bits, absmax, key, counter0, codes);
}

// encode_group for linear codes, with the AVX-512 loops where they apply (as decode_linear).
void encode_linear(bool stochastic, const float* in, int64_t lo, int cnt, int bits, float absmax, RngKey key,
                   uint64_t counter0, uint8_t* codes) {
  const float qmax = linear_qmax(bits);
  int done = 0;
  if (lpmm_avx512_width(bits) && lpmm_avx512_active()) {
    done = linear_codes_avx512(in, cnt, bits, absmax, qmax, stochastic, key, counter0 + static_cast<uint64_t>(lo),
                               codes + (lo / kGroup) * bits);
  }
  encode_group(stochastic, LinearSpan{qmax}, in + done, lo + done, cnt - done, bits, absmax, key, counter0, codes);
}

// MapSpan::encode (encode.h) for a tile of state values, with the normalisation and buckets by the
// AVX-512 loop where the tile encoders that take them apply.
template <bool kSR>
void encode_state_tile(const MapSpan& span, const float* x, int cnt, float absmax, RngKey key, uint64_t counter,
                       uint32_t* codes) {
  const MapIndex& index = span.index;
  if (!lpmm_avx512_active() || !(kSR ? index.steps() <= 1 : index.nearest_direct())) {
    return span.template encode<kSR>(x, cnt, absmax, key, counter, codes);
  }
  float xn[kTile];
  uint32_t bucket[kTile];
  const int done = normalise_buckets_avx512(x, cnt, absmax, xn, bucket);
  normalise_buckets(x + done, cnt - done, absmax, xn + done, bucket + done);
  if (kSR) {
    if (span.gather) return stochastic_tile_avx512(index, xn, bucket, key, counter, cnt, codes);
    return stochastic_tile(index, xn, bucket, key, counter, cnt, codes);
  }
  if (span.gather) return nearest_tile_avx512(index, xn, bucket, cnt, codes);
  nearest_tile(index, xn, bucket, cnt, codes);
}

// encode_group for the state maps: 8-bit codes with the gather tiles by the fused AVX-512 loop, the
// rest (and its tail) a tile at a time.
template <bool kSR>
void encode_state(const MapSpan& span, const float* in, int64_t lo, int cnt, int bits, float absmax, RngKey key,
                  uint64_t counter0, uint8_t* codes) {
  const MapIndex& index = span.index;
  int j = 0;
  if (bits == 8 && span.gather && lpmm_avx512_active() && (kSR ? index.steps() <= 1 : index.nearest_direct())) {
    j = map_codes_u8_avx512(index, in, cnt, absmax, kSR, key, counter0 + static_cast<uint64_t>(lo), codes + lo);
  }
  uint32_t tile[kTile];
  for (; j < cnt; j += kTile) {
    const int m = std::min(kTile, cnt - j);
    encode_state_tile<kSR>(span, in + j, m, absmax, key, counter0 + static_cast<uint64_t>(lo + j), tile);
    store_codes(tile, m, bits, lo + j, codes);
  }
}

template <typename T>
void accumulate_group(const LpmmAccumArgs& a, int64_t g, RngKey key) {
  const int64_t lo = g * a.group_size;
  const int cnt = static_cast<int>(std::min(a.n - lo, a.group_size));
  float v[kMaxGroup];
  const T* x = static_cast<const T*>(a.grad) + lo;
  uint32_t m = 0;
  if (a.absmax[g] == 0.f) {  // an empty accumulator (the first micro-batch): g + x = x exactly
    for (int i = 0; i < cnt; ++i) {
      v[i] = to_float(x[i]);
      m = std::max(m, abs_bits(v[i]));
    }
  } else {
    decode_linear(a.codes, lo, cnt, a.bits, a.absmax[g], v);
    for (int i = 0; i < cnt; ++i) {
      v[i] = v[i] + to_float(x[i]);
      m = std::max(m, abs_bits(v[i]));
    }
  }
  const float amax = absmax_from_bits(m);
  a.absmax[g] = amax;
  encode_linear(a.stochastic, v, lo, cnt, a.bits, amax, key, 0, a.codes);
}

template <typename T>
void accumulate_all(const LpmmAccumArgs& a, int threads) {
  const int64_t groups = (a.n + a.group_size - 1) / a.group_size;
  const RngKey key = rng_key(a.seed);
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, a.n))
  for (int64_t g = 0; g < groups; ++g) accumulate_group<T>(a, g, key);
}

struct LpTensor {
  uint8_t* param;
  float* param_absmax;
  const uint8_t* grad;
  float* grad_absmax;
  uint8_t* state[2];
  float* absmax[2];
  int64_t n;
  uint64_t offset;
  StepScalars scalars;
};

LpTensor lp_tensor(const LpmmArgs& a, int64_t t) {
  const int64_t* m = a.meta + t * kLpCols;
  return LpTensor{static_cast<uint8_t*>(cell_address(m[kLpParam])),
                  static_cast<float*>(cell_address(m[kLpParamAbsmax])),
                  static_cast<const uint8_t*>(cell_address(m[kLpGrad])),
                  static_cast<float*>(cell_address(m[kLpGradAbsmax])),
                  {static_cast<uint8_t*>(cell_address(m[kLpState1])),
                   static_cast<uint8_t*>(cell_address(m[kLpState2]))},
                  {static_cast<float*>(cell_address(m[kLpAbsmax1])), static_cast<float*>(cell_address(m[kLpAbsmax2]))},
                  m[kLpNumel],
                  static_cast<uint64_t>(m[kLpOffset]),
                  scalars_row(a.scalars, t, 1.f, 1.f)};
}

// Map indexes (and byte planes, where vbmi_decode_active) of the state maps, built once per call outside the
// parallel loop.
struct LpCoders {
  std::shared_ptr<const MapIndex> index[2];
  std::unique_ptr<BytePlanes> planes[2];
  bool gather = false;
};

template <Rule kRule, int kStates>
void step_group(const LpmmArgs& a, const LpTensor& t, int64_t g, const LpCoders& coders) {
  const int64_t lo = g * a.group_size;
  const int cnt = static_cast<int>(std::min(t.n - lo, a.group_size));
  float p[kMaxGroup];
  float grad[kMaxGroup];
  float s[2][kMaxGroup];
  decode_linear(t.param, lo, cnt, a.param_bits, t.param_absmax[g], p);
  decode_linear(t.grad, lo, cnt, a.grad_bits, t.grad_absmax[g], grad);
  constexpr int kRoot = second_moment_slot(kRule);  // stored as its root: state_form.h
  for (int k = 0; k < kStates; ++k) {
    decode_map(t.state[k], lo, cnt, a.state_bits, k == 0 ? a.map1 : a.map2, coders.planes[k].get(), t.absmax[k][g],
               s[k]);
    if (k == kRoot) {
      for (int i = 0; i < cnt; ++i) s[k][i] = state_value(s[k][i], true);
    }
  }
  uint32_t max_s[2];
  update_fp32(kRule, kStates, a.hyper, t.scalars, p, grad, s[0], s[1], cnt, max_s);
  if (max_s[0] >= kNonFiniteBits || max_s[1] >= kNonFiniteBits) restart_nonfinite(s[0], s[1], kStates, cnt, max_s);
  uint32_t max_p = 0;
  const int vec = lpmm_avx512_active() ? max_abs_bits_avx512(p, cnt, &max_p) : 0;
  for (int i = vec; i < cnt; ++i) max_p = std::max(max_p, abs_bits(p[i]));
  const float amax_p = absmax_from_bits(max_p);
  t.param_absmax[g] = amax_p;
  encode_linear(a.stochastic_param, p, lo, cnt, a.param_bits, amax_p, lpmm_key(a.seed, kStreamParam), t.offset,
                t.param);
  for (int k = 0; k < kStates; ++k) {
    const float amax = stored_absmax(max_s[k], k == kRoot);
    t.absmax[k][g] = amax;
    if (k == kRoot) {
      for (int i = 0; i < cnt; ++i) s[k][i] = stored_form(s[k][i], true);
    }
    const MapSpan span{*coders.index[k], coders.gather};
    const RngKey key = lpmm_key(a.seed, k == 0 ? kStreamState1 : kStreamState2);
    if (a.stochastic_state) {
      encode_state<true>(span, s[k], lo, cnt, a.state_bits, amax, key, t.offset, t.state[k]);
    } else {
      encode_state<false>(span, s[k], lo, cnt, a.state_bits, amax, key, t.offset, t.state[k]);
    }
  }
  t.grad_absmax[g] = 0.f;
}

template <Rule kRule>
void step_all(const LpmmArgs& a, int threads) {
  std::vector<LpTensor> tensors;
  int64_t elements = 0;
  for (int64_t t = 0; t < a.count; ++t) {
    tensors.push_back(lp_tensor(a, t));
    elements += tensors.back().n;
  }
  LpCoders coders;
  const uint32_t map_n = 1u << a.state_bits;
  const bool vbmi = a.n_states > 0 && a.state_bits == 8 && vbmi_decode_active();
  for (int k = 0; k < a.n_states; ++k) {
    coders.index[k] = map_index(k == 0 ? a.map1 : a.map2, map_n);
    if (vbmi) coders.planes[k] = std::make_unique<BytePlanes>(k == 0 ? a.map1 : a.map2);
  }
  // Decided (and on first use timed) here, outside the parallel region.
  coders.gather = a.n_states > 0 && gather_encode_active();
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, elements))
  for (int64_t b = 0; b < a.total_groups; ++b) {
    const int64_t t = lpmm_tensor_of_group(a, b);
    const int64_t g = b - a.meta[t * kLpCols + kLpFirstGroup];
    switch (a.n_states) {
      case 0:
        step_group<kRule, 0>(a, tensors[t], g, coders);
        break;
      case 1:
        step_group<kRule, 1>(a, tensors[t], g, coders);
        break;
      default:
        step_group<kRule, 2>(a, tensors[t], g, coders);
    }
  }
}

}  // namespace

void lpmm_accumulate(const LpmmAccumArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, accumulate_all<scalar_t>(a, threads));
}

void lpmm_step(const LpmmArgs& a, int threads) {
  dispatch_rule(a.rule, [&](auto rule) { step_all<decltype(rule)::value>(a, threads); });
}

}  // namespace lowbit::cpu
