// AVX2 kernels of the optimizer's state coders and of the quantizer's map encoders (avx2.cpp), used
// where the CPU has AVX2 but avx512_active() is false: 8-wide gathers and register lookups in place of
// the AVX-512 ones (avx512.h). They return the same results as the portable loops.
#pragma once

#include <cstdint>

#include "lowbit/rounding.h"

namespace lowbit::cpu {

// True when the CPU has AVX2 and set_avx2_enabled has not turned the kernels off (LOWBIT_CPU_AVX2=0
// starts with them off, so that a benchmark can time the portable loops).
bool avx2_active();

// Turns the AVX2 kernels on or off (tests compare them with the portable loops); returns whether the
// CPU has AVX2.
bool set_avx2_enabled(bool enabled);

class MapIndex;

// out[i] = map[codes[i]] * scale for a 256-entry map, the map values fetched by 8-wide gathers.
void decode_u8_avx2(const float* map, const uint8_t* codes, int cnt, float scale, float* out);

// nearest_codes_u8 (encode.h) with the step word of 8 elements fetched by one gather; same codes.
void nearest_codes_u8_avx2(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out);

// nearest_tile and stochastic_tile (encode.h) with gathers for the table loads; same codes.
void nearest_tile_avx2(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes);
void stochastic_tile_avx2(const MapIndex& index, const float* xn, const uint32_t* b, RngKey key, uint64_t counter0,
                          int cnt, uint32_t* codes);

// decode_u4_avx512 and nearest_codes_u4_avx512 (avx512.h) 8 lanes wide: the 16-entry map is two
// registers, a lookup two permutes and a blend. Same results and the same contract: they handle the
// first cnt - cnt % 32 (decode) or cnt - cnt % 16 (encode) elements and return that count; the encoder
// returns 0 for a subnormal absmax. With gathers in use (the calibrated encoder) and a nearest_direct()
// index, the encoder takes each code from its bucket's sum word (sum_codes8) by one gather per 8 elements
// instead of a register binary search over the map.
int decode_u4_avx2(const float* map, const uint8_t* packed, int cnt, float scale, float* out);
int nearest_codes_u4_avx2(const MapIndex& index, bool gather, const float* x, int cnt, float absmax,
                          uint8_t* packed);
// stochastic_codes_u4_avx512 (avx512.h) 8 lanes wide, u the draws of the elements: the same contract.
int stochastic_codes_u4_avx2(const MapIndex& index, const float* x, int cnt, float absmax, const float* u,
                             uint8_t* packed);

}  // namespace lowbit::cpu
