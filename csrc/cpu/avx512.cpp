// AVX-512 decoding of 8-bit codes, used where the CPU has AVX-512F. The whole 256-entry map lives in
// 16 registers, so a lookup is a few in-register permutes instead of one scalar load per element.
// Results are identical to the portable loop: the same map values and the same IEEE multiply
// (tests compare both paths). Encoding stays with the bucket table of map_index.h: a register
// binary search over the 255 step keys measured slower than it.
#include "avx512.h"

#include <atomic>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LB_AVX512 1
#endif

namespace lowbit::cpu {
namespace {

#ifdef LB_AVX512
const bool kHasAvx512 = __builtin_cpu_supports("avx512f");
#else
const bool kHasAvx512 = false;
#endif

std::atomic<bool> g_enabled{true};

}  // namespace

bool avx512_active() { return kHasAvx512 && g_enabled.load(std::memory_order_relaxed); }

bool set_avx512_enabled(bool enabled) {
  g_enabled.store(enabled, std::memory_order_relaxed);
  return kHasAvx512;
}

#ifdef LB_AVX512

#define LB_TARGET __attribute__((target("avx512f")))

namespace {

// t[c] for 16 codes c in 0..255, from the table held in r[0..15] (16 entries each): vpermt2ps
// picks within each 32-entry pair by the low 5 bits, then bits 5-7 select the pair.
LB_TARGET inline __m512 lookup256(const __m512 (&r)[16], __m512i c) {
  __m512 p[8];
  for (int i = 0; i < 8; ++i) p[i] = _mm512_permutex2var_ps(r[2 * i], c, r[2 * i + 1]);
  const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
  for (int i = 0; i < 4; ++i) p[i] = _mm512_mask_blend_ps(b5, p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 2; ++i) p[i] = _mm512_mask_blend_ps(b6, p[2 * i], p[2 * i + 1]);
  return _mm512_mask_blend_ps(b7, p[0], p[1]);
}

}  // namespace

LB_TARGET void decode_u8_avx512(const float* map, const uint8_t* codes, int cnt, float scale, float* out) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(map + 16 * i);
  const __m512 s = _mm512_set1_ps(scale);
  int i = 0;
  for (; i + 16 <= cnt; i += 16) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(lookup256(r, c), s));
  }
  for (; i < cnt; ++i) out[i] = map[codes[i]] * scale;
}

#else

void decode_u8_avx512(const float*, const uint8_t*, int, float, float*) {}

#endif

}  // namespace lowbit::cpu
