// AVX-512 kernels of the optimizer step (avx512.cpp, and the AVX-512 entry of the update loop in
// optim.cpp) and of the few-bit activations (activations_avx512.cpp), chosen at run time where the CPU
// has AVX-512F; they return the same results as the portable loops.
#pragma once

#include <cstdint>

#include "lowbit/dispatch.h"
#include "lowbit/rounding.h"

namespace lowbit::cpu {

// True when the CPU has AVX-512F and set_avx512_enabled has not turned the kernels off.
bool avx512_active();

// Turns the AVX-512 kernels on or off (tests compare both paths); returns whether the CPU has them.
bool set_avx512_enabled(bool enabled);

// Whether the optimizer's state encode uses a gather encoder: the AVX-512 one where AVX-512 is active,
// else the AVX2 one (avx2.h) where AVX2 is, and a timing at first use found it faster than the
// scalar-table encoder on this CPU.
bool gather_encode_active();

// Forces the choice for both encoders (tests run them all): 1 gather, 0 scalar table, -1 time it again.
void set_gather_encode(int mode);

class MapIndex;

// nearest_codes_u8 (encode.h) with the step word of 16 elements fetched by one gather; same codes.
void nearest_codes_u8_avx512(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out);

// nearest_tile and stochastic_tile (encode.h) with gathers for the table loads; same codes. The
// quantizers use them where gather_encode_active().
void nearest_tile_avx512(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes);
void stochastic_tile_avx512(const MapIndex& index, const float* xn, const uint32_t* b, RngKey key, uint64_t counter0,
                            int cnt, uint32_t* codes);

// Whether 8-bit states decode with decode_u8_vbmi: AVX-512 is active, the CPU has AVX512-VBMI and
// set_vbmi_decode has not turned it off.
bool vbmi_decode_active();

// Turns the VBMI decoder on or off (tests compare it with lookup256); returns whether the CPU has it.
bool set_vbmi_decode(bool enabled);

// Whether the fused Adam and LAMB loops (optim.cpp) decode the first 8-bit moment by the VBMI byte planes as they
// do the second, not by gathers: vbmi_decode_active(), and a timing at first use found a gather decode over twice
// as slow as the planes' on this CPU (Zen 4 gathers about one element per cycle, Intel's cores several). Both
// give the same values, so the choice affects speed only.
bool vbmi_first_moment_active();

// Forces that choice (tests run both): 1 planes, 0 gathers, -1 time it again.
void set_vbmi_first_moment(int mode);

// Whether the fused Adam and LAMB loops encode 4-bit states by search_codes16 (avx512_codes.h), not by
// sum_codes16's gathers: AVX-512 is active and a timing at first use found the search faster on this CPU.
bool search_u4_active();

// Forces that choice (tests run both): 1 search, 0 gathers, -1 time it again.
void set_search_u4(int mode);

// A 256-entry map as four byte planes: p[k][i] is byte k of map[i].
struct BytePlanes {
  alignas(64) uint8_t p[4][256];
  explicit BytePlanes(const float* map);
};

// decode_u8_avx512 by byte-plane table permutes, 64 codes at a time (AVX512-VBMI); same results.
void decode_u8_vbmi(const BytePlanes& planes, const float* map, const uint8_t* codes, int cnt, float scale,
                    float* out);

// out[i] = map[codes[i]] * scale for a 256-entry map.
void decode_u8_avx512(const float* map, const uint8_t* codes, int cnt, float scale, float* out);

// The 4-bit optimizer states (16-entry maps, codes packed two a byte as in pack.h): out[i] =
// map[code i] * scale, and the nearest codes (qmap.h: map_encode_nearest) of normalise(x[i], absmax)
// (blockwise.h), packed. The whole map is one register, so a lookup is one permute and the binary
// search of map_encode_nearest four; same results as the portable loops. Both handle the first
// cnt - cnt % 32 (decode) or cnt - cnt % 16 (encode) elements and return that count: the rest start on a
// whole group (pack.h) and are left to the caller. The encoder handles nothing (returns 0) for a
// subnormal absmax, whose reciprocal is not finite.
int decode_u4_avx512(const float* map, const uint8_t* packed, int cnt, float scale, float* out);
int nearest_codes_u4_avx512(const float* map, const float* x, int cnt, float absmax, uint8_t* packed);
// The stochastic codes (qmap.h: map_encode_stochastic) of the same values, element i drawing u[i]: the floor
// code as above, then the code above it when u[i] * gap < xn - map[floor]. Same results as the portable loop.
int stochastic_codes_u4_avx512(const float* map, const float* x, int cnt, float absmax, const float* u,
                               uint8_t* packed);

// Few-bit codes (fewbit.h) of bits = 1..4 bits of fp32 or bf16 x, packed to out, for the first
// cnt - cnt % 16 elements (activations_avx512.cpp); the caller does the rest.
void fewbit_encode_avx512(int bits, const float* x, int cnt, const float* bounds, uint8_t* out);
void fewbit_encode_avx512(int bits, const BFloat16* x, int cnt, const float* bounds, uint8_t* out);

// out = grad * levels[code] for bits = 1..4, for the first cnt - cnt % 16 elements.
void fewbit_grad_avx512(int bits, const float* grad, const uint8_t* in, const float* levels, int cnt, float* out);
void fewbit_grad_avx512(int bits, const BFloat16* grad, const uint8_t* in, const float* levels, int cnt,
                        BFloat16* out);

// out = grad * invact_slope(y, bit) (lowbit/invact.h) for the first cnt - cnt % 16 elements.
void invact_grad_avx512(const float* grad, const float* y, const uint8_t* bits, const float* coeffs,
                        const float* params, int cnt, float* out);
// out = invact_slope(y, bit) for the first cnt - cnt % 16 elements.
void invact_slopes_avx512(const float* y, const uint8_t* bits, const float* coeffs, const float* params, int cnt,
                          float* out);
// out = grad * table[bit << 16 | bits of y] (invact.cpp's slope table) for the first cnt - cnt % 16 elements.
void invact_grad_table_avx512(const BFloat16* grad, const BFloat16* y, const uint8_t* bits, const float* table,
                              int cnt, BFloat16* out);
void invact_grad_table_avx512(const Half* grad, const Half* y, const uint8_t* bits, const float* table, int cnt,
                              Half* out);

}  // namespace lowbit::cpu
