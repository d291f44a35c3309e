// AVX-512 decoding of 8-bit codes, used where the CPU has AVX-512F. The whole 256-entry map lives in
// 16 registers, so a lookup is a few in-register permutes instead of one scalar load per element.
// Results are identical to the portable loop: the same map values and the same IEEE multiply
// (tests compare both paths). Encoding stays with the bucket table of map_index.h: a register
// binary search over the 255 step keys measured slower than it.
#include "avx512.h"

#include "avx2.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "avx512_codes.h"
#include "encode.h"
#include "map_index.h"
#include "vbmi_decode.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LB_AVX512 1
#endif

namespace lowbit::cpu {
namespace {

#ifdef LB_AVX512
const bool kHasAvx512 = __builtin_cpu_supports("avx512f");
const bool kHasVbmi = kHasAvx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
#else
const bool kHasAvx512 = false;
const bool kHasVbmi = false;
#endif

// LOWBIT_CPU_AVX512=0 starts with the AVX-512 kernels off, so that a benchmark can time the AVX2 and
// portable loops on an AVX-512 CPU (the compiler's target clones in encode.cpp still pick AVX-512).
bool enabled_by_environment() {
  const char* v = std::getenv("LOWBIT_CPU_AVX512");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

std::atomic<bool> g_enabled{enabled_by_environment()};
std::atomic<bool> g_vbmi{true};
// The gather encoder's choice for the AVX-512 and the AVX2 encoders; -1: not yet calibrated.
std::atomic<int> g_gather{-1};
std::atomic<int> g_gather_avx2{-1};
// vbmi_first_moment_active's choice; -1: not yet timed.
std::atomic<int> g_planes_first{-1};
// search_u4_active's choice; -1: not yet timed.
std::atomic<int> g_search_u4{-1};

bool calibrate_gather(bool wide);
bool calibrate_planes();
bool calibrate_search_u4();

// A timed choice: its stored value, or on first use (-1) calibrate()'s answer, stored.
template <typename Calibrate>
bool timed_choice(std::atomic<int>& choice, Calibrate&& calibrate) {
  int v = choice.load(std::memory_order_relaxed);
  if (v < 0) {
    v = calibrate() ? 1 : 0;
    choice.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// A test hook's mode as a stored choice: 1 on, 0 off, -1 time it again.
int choice_of_mode(int mode) { return mode < 0 ? -1 : (mode > 0 ? 1 : 0); }

}  // namespace

bool avx512_active() { return kHasAvx512 && g_enabled.load(std::memory_order_relaxed); }

bool set_avx512_enabled(bool enabled) {
  g_enabled.store(enabled, std::memory_order_relaxed);
  return kHasAvx512;
}

bool gather_encode_active() {
  const bool wide = avx512_active();
  if (!wide && !avx2_active()) return false;
  return timed_choice(wide ? g_gather : g_gather_avx2, [wide] { return calibrate_gather(wide); });
}

BytePlanes::BytePlanes(const float* map) {
  for (int i = 0; i < 256; ++i) {
    uint32_t bits;
    std::memcpy(&bits, map + i, 4);
    for (int k = 0; k < 4; ++k) p[k][i] = static_cast<uint8_t>(bits >> (8 * k));
  }
}

bool vbmi_decode_active() { return kHasVbmi && avx512_active() && g_vbmi.load(std::memory_order_relaxed); }

bool set_vbmi_decode(bool enabled) {
  g_vbmi.store(enabled, std::memory_order_relaxed);
  return kHasVbmi;
}

bool vbmi_first_moment_active() { return vbmi_decode_active() && timed_choice(g_planes_first, calibrate_planes); }

void set_vbmi_first_moment(int mode) { g_planes_first.store(choice_of_mode(mode), std::memory_order_relaxed); }

bool search_u4_active() { return avx512_active() && timed_choice(g_search_u4, calibrate_search_u4); }

void set_search_u4(int mode) { g_search_u4.store(choice_of_mode(mode), std::memory_order_relaxed); }

void set_gather_encode(int mode) {
  const int v = choice_of_mode(mode);
  g_gather.store(v, std::memory_order_relaxed);
  g_gather_avx2.store(v, std::memory_order_relaxed);
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

// The planes in four registers each (vbmi_decode.h), 64 codes at a time.
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void decode_u8_vbmi(const BytePlanes& planes, const float* map,
                                                                           const uint8_t* codes, int cnt, float scale,
                                                                           float* out) {
  const PlaneRegisters r = plane_registers(planes);
  const __m512i order = _mm512_load_si512(kPlaneOrder);
  const __m512 s = _mm512_set1_ps(scale);
  int i = 0;
  for (; i + 64 <= cnt; i += 64) {
    __m512 v[4];
    vbmi_decode64(r, order, codes + i, s, v);
    for (int m = 0; m < 4; ++m) _mm512_storeu_ps(out + i + 16 * m, v[m]);
  }
  if (i < cnt) decode_u8_avx512(map, codes + i, cnt - i, scale, out + i);
}

namespace {

// The same for normalised xn whose buckets b are already known.
LB_TARGET inline __m512i step_codes16(const int* table, const float* xn, const uint32_t* b) {
  return cpu::step_codes16(table, order_keys(_mm512_loadu_ps(xn)), _mm512_loadu_si512(b));
}

// The nearest codes of a block, 16 at a time (avx512_codes.h), the rest by the scalar-table loop.
template <bool kExactUnit>
LB_TARGET void gather_codes(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out) {
  const NearestBlock block = nearest_block(index, absmax);
  int j = 0;
  for (; j + 16 <= cnt; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), nearest_codes16<kExactUnit>(block, x + j));
  }
  if (j < cnt) nearest_codes_u8(index, x + j, cnt - j, absmax, out + j);
}

}  // namespace

LB_TARGET int decode_u4_avx512(const float* map, const uint8_t* packed, int cnt, float scale, float* out) {
  const __m512 m = _mm512_loadu_ps(map);
  const __m512 s = _mm512_set1_ps(scale);
  const int vec = cnt - cnt % 32;
  for (int i = 0; i < vec; i += 32) {
    __m512 values[2];
    decode_u4_32(m, s, packed + i / 2, values);
    _mm512_storeu_ps(out + i, values[0]);
    _mm512_storeu_ps(out + i + 16, values[1]);
  }
  return vec;
}

namespace {

// The 4-bit encoders' loop: for each whole group of 16, the brackets, then the rounding rule of qmap.h
// (nearest_up, or stochastic_up with element i drawing u[i]), packed. Returns the count handled (0 for a
// subnormal absmax, whose reciprocal is not finite).
template <bool kStochastic>
LB_TARGET inline int codes_u4(const float* map, const float* x, int cnt, float absmax, const float* u,
                              uint8_t* packed) {
  const float inv = block_inverse(absmax);
  if (absmax > 0.f && inv == 0.f) return 0;
  const __m512 m = _mm512_loadu_ps(map);
  const int vec = cnt - cnt % 16;
  for (int j = 0; j < vec; j += 16) {
    const U4Brackets b = u4_brackets(m, x + j, absmax, inv);
    if constexpr (kStochastic) {
      pack_u4_16(stochastic_codes16(b, _mm512_loadu_ps(u + j)), packed + j / 2);
    } else {
      // nearest_up: hi - x < x - lo.
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(b.hi_value, b.xn), _mm512_sub_ps(b.xn, b.lo_value),
                                              _CMP_LT_OQ);
      pack_u4_16(_mm512_mask_mov_epi32(b.lo, up, b.hi), packed + j / 2);
    }
  }
  return vec;
}

}  // namespace

LB_TARGET int nearest_codes_u4_avx512(const float* map, const float* x, int cnt, float absmax, uint8_t* packed) {
  return codes_u4<false>(map, x, cnt, absmax, nullptr, packed);
}

LB_TARGET int stochastic_codes_u4_avx512(const float* map, const float* x, int cnt, float absmax, const float* u,
                                         uint8_t* packed) {
  return codes_u4<true>(map, x, cnt, absmax, u, packed);
}

void nearest_codes_u8_avx512(const MapIndex& index, const float* x, int cnt, float absmax, uint8_t* out) {
  // A subnormal absmax (no finite reciprocal) is rare enough for the scalar path.
  if (absmax > 0.f && block_inverse(absmax) == 0.f) return nearest_codes_u8(index, x, cnt, absmax, out);
  if (index.unit_stable()) return gather_codes<false>(index, x, cnt, absmax, out);
  gather_codes<true>(index, x, cnt, absmax, out);
}

LB_TARGET void nearest_tile_avx512(const MapIndex& index, const float* xn, const uint32_t* b, int cnt, uint32_t* codes) {
  const int* table = reinterpret_cast<const int*>(index.nearest_steps()) - kFirstBucket;
  int j = 0;
  for (; j + 16 <= cnt; j += 16) _mm512_storeu_si512(codes + j, step_codes16(table, xn + j, b + j));
  if (j < cnt) nearest_tile(index, xn + j, b + j, cnt - j, codes + j);
}

LB_TARGET void stochastic_tile_avx512(const MapIndex& index, const float* xn, const uint32_t* b, RngKey key,
                                      uint64_t counter0, int cnt, uint32_t* codes) {
  // stochastic_tile's steps: the floor code from its bucket's step word, then up by one when
  // u * gap < xn - map[floor], with map[floor] and the gap fetched by gathers.
  const int* table = reinterpret_cast<const int*>(index.floor_steps()) - kFirstBucket;
  const float* low_gap = index.low_gap();
  float u[kTile];
  const int vec = cnt - cnt % 16;
  uniform_tile(key, counter0, vec, u);
  for (int j = 0; j < vec; j += 16) {
    const __m512i floor = step_codes16(table, xn + j, b + j);
    const __m512i pair = _mm512_slli_epi32(floor, 1);
    const __m512 value = _mm512_i32gather_ps(pair, low_gap, 4);
    const __m512 gap = _mm512_i32gather_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(1)), low_gap, 4);
    const __m512 lhs = _mm512_mul_ps(_mm512_loadu_ps(u + j), gap);
    const __mmask16 up = _mm512_cmp_ps_mask(lhs, _mm512_sub_ps(_mm512_loadu_ps(xn + j), value), _CMP_LT_OQ);
    _mm512_storeu_si512(codes + j, _mm512_mask_add_epi32(floor, up, floor, _mm512_set1_epi32(1)));
  }
  if (vec < cnt) stochastic_tile(index, xn + vec, b + vec, key, counter0 + vec, cnt - vec, codes + vec);
}

namespace {

// The best times (seconds) of 16 alternated runs of first() and second(): a busy host slows both alike, and the
// best of each is what the code can do.
template <typename First, typename Second>
std::array<double, 2> best_alternated(First&& first, Second&& second) {
  std::array<double, 2> best = {1e30, 1e30};
  for (int rep = 0; rep < 16; ++rep) {
    for (int which = 0; which < 2; ++which) {
      const auto t0 = std::chrono::steady_clock::now();
      if (which == 0) {
        first();
      } else {
        second();
      }
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      best[which] = std::min(best[which], dt.count());
    }
  }
  return best;
}

// The calibrations' data: n words of a fixed linear congruential sequence.
std::vector<uint32_t> calibration_words(int n) {
  std::vector<uint32_t> words(n);
  uint32_t state = 12345u;
  for (auto& w : words) {
    state = state * 1664525u + 1013904223u;
    w = state;
  }
  return words;
}

// Those words as floats in [-1, 1).
std::vector<float> calibration_values(int n) {
  std::vector<float> x;
  for (const uint32_t w : calibration_words(n)) x.push_back(static_cast<float>(static_cast<int32_t>(w)) * 0x1p-31f);
  return x;
}

constexpr int kCalibrationSize = 4096;

// Whether the gather encoder (AVX-512 where wide, else AVX2) beats the scalar-table one on this CPU:
// gathers are fast on some x86 cores and slow on others (microcode mitigations, AMD's split gathers),
// and only timing tells. Both return the same codes, so the choice affects speed only. Timed on an
// L1-resident tile, once per process and encoder.
bool calibrate_gather(bool wide) {
  std::vector<float> map(256);
  for (int i = 0; i < 256; ++i) map[i] = -1.f + 2.f * static_cast<float>(i) / 255.f;
  const auto index = map_index(map.data(), 256);
  if (!index->nearest_direct()) return false;
  const std::vector<float> x = calibration_values(kCalibrationSize);
  std::vector<uint8_t> out(kCalibrationSize);
  const auto best = best_alternated([&] { nearest_codes_u8(*index, x.data(), kCalibrationSize, 1.f, out.data()); },
                                    [&] {
                                      if (wide) {
                                        nearest_codes_u8_avx512(*index, x.data(), kCalibrationSize, 1.f, out.data());
                                      } else {
                                        nearest_codes_u8_avx2(*index, x.data(), kCalibrationSize, 1.f, out.data());
                                      }
                                    });
  return best[1] < best[0];
}

// Whether the gather decode of 8-bit codes (decode_u8_avx512) takes over twice as long as the byte planes'
// (decode_u8_vbmi) on this CPU, on an L1-resident tile. Twice, because the fused Adam loops gain from the
// gathers where they are about as fast: they keep the load ports busy while the planes' permutes and the
// arithmetic share the vector ones (decode_moments_vbmi's split, chosen on an Intel Xeon).
bool calibrate_planes() {
  std::vector<float> map(256);
  for (int i = 0; i < 256; ++i) map[i] = -1.f + 2.f * static_cast<float>(i) / 255.f;
  const BytePlanes planes(map.data());
  std::vector<uint8_t> codes;
  for (const uint32_t w : calibration_words(kCalibrationSize)) codes.push_back(static_cast<uint8_t>(w >> 24));
  std::vector<float> out(kCalibrationSize);
  const auto best =
      best_alternated([&] { decode_u8_avx512(map.data(), codes.data(), kCalibrationSize, 1.f, out.data()); },
                      [&] { decode_u8_vbmi(planes, map.data(), codes.data(), kCalibrationSize, 1.f, out.data()); });
  return best[0] > 2 * best[1];
}

// The 4-bit codes of x[0..n) by sum_codes16 (kSearch false) or search_codes16 over steps, packed to out.
template <bool kSearch>
LB_TARGET void calibration_codes_u4(const int* sums, const uint32_t* steps, const float* x, int n, uint8_t* out) {
  const __m512i keys = _mm512_loadu_si512(steps);
  for (int i = 0; i < n; i += 16) {
    const __m512i key = order_keys(_mm512_loadu_ps(x + i));
    pack_u4_16(kSearch ? search_codes16(keys, key) : sum_codes16(sums, key), out + i / 2);
  }
}

// Whether search_codes16 encodes 4-bit states faster than sum_codes16 on this CPU, on an L1-resident tile of
// a 16-entry map's keys. The same codes either way.
bool calibrate_search_u4() {
  float map[16];
  for (int i = 0; i < 16; ++i) map[i] = -1.f + 2.f * static_cast<float>(i) / 15.f;
  const auto index = map_index(map, 16);
  if (!index->nearest_direct()) return false;
  const int* sums = reinterpret_cast<const int*>(index->nearest_sums()) - kFirstBucket;
  const uint32_t* steps = index->nearest_keys();
  const std::vector<float> x = calibration_values(kCalibrationSize);
  std::vector<uint8_t> out(kCalibrationSize / 2);
  const auto best =
      best_alternated([&] { calibration_codes_u4<false>(sums, steps, x.data(), kCalibrationSize, out.data()); },
                      [&] { calibration_codes_u4<true>(sums, steps, x.data(), kCalibrationSize, out.data()); });
  return best[1] < best[0];
}

}  // namespace

#else

void decode_u8_avx512(const float*, const uint8_t*, int, float, float*) {}
void decode_u8_vbmi(const BytePlanes&, const float*, const uint8_t*, int, float, float*) {}
void nearest_codes_u8_avx512(const MapIndex&, const float*, int, float, uint8_t*) {}
void nearest_tile_avx512(const MapIndex&, const float*, const uint32_t*, int, uint32_t*) {}
void stochastic_tile_avx512(const MapIndex&, const float*, const uint32_t*, RngKey, uint64_t, int, uint32_t*) {}
int decode_u4_avx512(const float*, const uint8_t*, int, float, float*) { return 0; }
int nearest_codes_u4_avx512(const float*, const float*, int, float, uint8_t*) { return 0; }
int stochastic_codes_u4_avx512(const float*, const float*, int, float, const float*, uint8_t*) { return 0; }

namespace {
bool calibrate_gather(bool) { return false; }
bool calibrate_planes() { return false; }
bool calibrate_search_u4() { return false; }
}  // namespace

#endif

}  // namespace lowbit::cpu
