// AVX-512 loops of LPMM's linear codes (lpmm_avx512.cpp): 8- and 12-bit parameter and gradient codes
// unpacked, decoded, encoded (with the stochastic-rounding draws, 16 lanes at a time) and packed
// with byte permutes. They return the same codes and values as the portable loops of encode.h,
// which lpmm.cpp runs where they are off and for the tails they leave.
#pragma once

#include <cstdint>

#include "lowbit/rounding.h"

namespace lowbit::cpu {

// True where avx512_active() (avx512.h; LOWBIT_CPU_AVX512=0 turns it off) and the CPU has AVX512-BW
// and AVX512-VBMI for the byte permutes and AVX512-DQ.
bool lpmm_avx512_active();

// Whether the loops below handle codes of this width (8 or 12 bits).
constexpr bool lpmm_avx512_width(int bits) { return bits == 8 || bits == 12; }

// out[i] = linear_decode(code i, absmax, qmax) (lowbit/blockwise.h) for the codes packed (pack.h) from
// `packed`, the first byte of a group of 8. Handles the first cnt - cnt % 16 elements and returns that
// count; the rest start on a whole group and are left to the caller.
int linear_values_avx512(const uint8_t* packed, int cnt, int bits, float absmax, float qmax, float* out);

// The linear codes of x (encode.h: linear_codes) against absmax, packed from `packed`, the first byte
// of a group of 8; element j draws with counter counter0 + j. Same contract as linear_values_avx512.
int linear_codes_avx512(const float* x, int cnt, int bits, float absmax, float qmax, bool stochastic, RngKey key,
                        uint64_t counter0, uint8_t* packed);

// xn[i] = normalise(x[i], absmax) (lowbit/blockwise.h) and bucket[i] = bucket16(xn[i]) (map_index.h),
// the input of the state maps' tile encoders (encode.h: normalise_buckets). Same contract as
// linear_values_avx512: handles the first cnt - cnt % 16 elements and returns that count.
int normalise_buckets_avx512(const float* x, int cnt, float absmax, float* xn, uint32_t* bucket);

class MapIndex;

// The 8-bit state codes that MapSpan::encode (encode.h) with the gather tiles gives x against absmax,
// one byte each from out: normalise, bucket, step word, (stochastic: the draw of counter counter0 + j
// and the map value and gap of the floor code), all in registers. Needs index.steps() <= 1 when
// stochastic, else index.nearest_direct(). Same contract as linear_values_avx512.
int map_codes_u8_avx512(const MapIndex& index, const float* x, int cnt, float absmax, bool stochastic, RngKey key,
                        uint64_t counter0, uint8_t* out);

// The largest abs_bits(x[i]) (lowbit/blockwise.h) over the whole 16-element chunks of x[0, cnt), in
// max_bits; returns how many elements it covered (the rest is the caller's). Same contract as
// linear_values_avx512: call only where lpmm_avx512_active().
int max_abs_bits_avx512(const float* x, int cnt, uint32_t* max_bits);

}  // namespace lowbit::cpu
