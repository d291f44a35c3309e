// The AVX512-VBMI decoder of 8-bit codes, 64 at a time, inline so that a loop in another file can decode
// into registers and compute on the values at once: avx512.cpp's decode_u8_vbmi stores them, the
// optimizer's Adam pass (optim.cpp) updates the moments from them while its square roots keep the divider
// busy. A map is held as its four byte planes (BytePlanes of avx512.h) in 16 registers.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>

#include "avx512.h"

#define LB_VBMI_DECODE 1
#define LB_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline

namespace lowbit::cpu {

// Element order of the byte planes such that the lane-wise unpacks of vbmi_decode64 produce floats in
// order: plane position 16 L + 4 m + j holds element 16 m + 4 L + j.
alignas(64) inline constexpr uint8_t kPlaneOrder[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,  5,  6,  7,  20, 21,
    22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
    56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

// A map's byte planes in registers: t[k][q] holds bytes k of entries 64 q .. 64 q + 63.
struct PlaneRegisters {
  __m512i t[4][4];
};

LB_VBMI_TARGET PlaneRegisters plane_registers(const BytePlanes& planes) {
  PlaneRegisters r;
  for (int k = 0; k < 4; ++k) {
    for (int q = 0; q < 4; ++q) r.t[k][q] = _mm512_load_si512(planes.p[k] + 64 * q);
  }
  return r;
}

// out[m] = map[codes[16 m + i]] * scale for the 64 codes at `codes`: two-table byte permutes look up each
// plane, the unpacks reassemble the floats exactly. order: kPlaneOrder, loaded.
LB_VBMI_TARGET void vbmi_decode64(const PlaneRegisters& r, __m512i order, const uint8_t* codes, __m512 scale,
                                  __m512 (&out)[4]) {
  const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes));
  const __mmask64 high = _mm512_movepi8_mask(c);
  __m512i p[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i lo = _mm512_permutex2var_epi8(r.t[k][0], c, r.t[k][1]);
    const __m512i hi = _mm512_permutex2var_epi8(r.t[k][2], c, r.t[k][3]);
    p[k] = _mm512_mask_blend_epi8(high, lo, hi);
  }
  const __m512i b01_lo = _mm512_unpacklo_epi8(p[0], p[1]), b01_hi = _mm512_unpackhi_epi8(p[0], p[1]);
  const __m512i b23_lo = _mm512_unpacklo_epi8(p[2], p[3]), b23_hi = _mm512_unpackhi_epi8(p[2], p[3]);
  out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_lo, b23_lo)), scale);
  out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_lo, b23_lo)), scale);
  out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_hi, b23_hi)), scale);
  out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_hi, b23_hi)), scale);
}

}  // namespace lowbit::cpu

#endif
