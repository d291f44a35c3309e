// AVX-512 kernels of the activation layers: few-bit codes of 1-4 bits for fp32 and bf16 (fewbit.cpp keeps
// the portable loops and the other cases) and the inverted-activation slope for fp32, bf16 and fp16
// (invact.cpp).
//
// Few-bit. Encoding finds the number of boundaries below 16 inputs at once: where they are sorted, by a
// binary search whose compares (against boundaries permuted out of one register) give the codes' bits, which
// PDEP deposits in place (at 1 bit the compare's mask is the codes); where not, by a compare per boundary,
// each 8-code group merged into one word with per-lane shifts and an in-register OR tree. Decoding spreads a
// group word over 8 lanes with per-lane shifts and looks the levels up with one permute, the 2**bits <= 16
// levels sitting in one register. Results equal the portable loops bit for bit (the same codes, the same
// IEEE multiply; tests run both paths).
//
// Inverted activations: the branch bits of 16 elements are one mask; both branches' coefficient
// tables (16 pieces each) sit in registers and one two-table permute per power picks the piece of the
// element's branch; the operations are invact_slope's, one for one. bf16 and fp16 read their slopes
// from a table of every 16-bit y (invact.cpp), filled by the same fp32 code: one gather per 16 elements
// instead of the square root and the polynomial.
#include <cstring>

#include "lowbit/invact.h"

#include "avx512.h"
#include "avx512_convert.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LB_AVX512 1
#endif

namespace lowbit::cpu {

#ifdef LB_AVX512

#define LB_TARGET __attribute__((target("avx512f")))

namespace {

// BMI2's PDEP (every AVX-512 processor has it; a virtual machine may hide it) deposits the search's masks.
const bool kHasBmi2 = __builtin_cpu_supports("bmi2");

// Lane k of each 8-lane half holds a code's offset kBits * k within its group word.
template <int kBits>
LB_TARGET inline __m512i group_shifts() {
  return _mm512_setr_epi32(0, kBits, 2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits, 6 * kBits, 7 * kBits, 0, kBits,
                           2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits, 6 * kBits, 7 * kBits);
}

// Whether bounds[0..count) (count >= 2) are non-decreasing and free of NaN: then a binary search finds the
// number of bounds below x.
inline bool non_decreasing(const float* bounds, int count) {
  for (int i = 0; i + 1 < count; ++i) {
    if (!(bounds[i] <= bounds[i + 1])) return false;
  }
  return true;
}

// The 16 codes c (one per lane) as two kBits-bit group words, stored at out.
template <int kBits>
LB_TARGET inline void store_groups(__m512i c, __m512i shifts, uint8_t* out) {
  constexpr int kGroupBytes = kBits;  // 8 codes of kBits bits
  __m512i t = _mm512_sllv_epi32(c, shifts);
  t = _mm512_or_si512(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
  t = _mm512_or_si512(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
  t = _mm512_or_si512(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
  const uint64_t w0 = static_cast<uint32_t>(_mm512_cvtsi512_si32(t));
  const uint64_t w1 = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_extracti32x4_epi32(t, 2)));
  const uint64_t both = w0 | (w1 << (8 * kGroupBytes));
  std::memcpy(out, &both, 2 * kGroupBytes);
}

// Codes of 16 elements, one per lane: the number of bounds below each, a compare per bound (x > b is false
// for NaN, as in the portable count: NaN gets code 0).
template <int kBits>
LB_TARGET inline __m512i count_codes16(__m512 v, const __m512* b) {
  const __m512i one = _mm512_set1_epi32(1);
  __m512i c = _mm512_setzero_si512();
  for (int k = 0; k < (1 << kBits) - 1; ++k) {
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(v, b[k], _CMP_GT_OQ), c, one);
  }
  return c;
}

// The bits of 16 codes of kBits bits as packed (code k at bit kBits * k): bit j of every code.
template <int kBits>
constexpr uint64_t code_bits(int j) {
  uint64_t m = 0;
  for (int k = 0; k < 16; ++k) m |= uint64_t{1} << (kBits * k + j);
  return m;
}

// The packed codes of 16 elements for non-decreasing bounds (all: the bounds in one register), found by a
// binary search whose compare masks are the codes' bits: level j (from the top) compares with the bound that
// the code's higher bits point to, fetched by one permute, and its mask is bit j of the 16 codes, deposited at
// their places. x > b is false for NaN at every level: code 0, as the count gives.
template <int kBits>
__attribute__((target("avx512f,bmi2"), always_inline)) inline uint64_t search_codes16(__m512 v, __m512 all) {
  constexpr int kTop = kBits - 1;
  __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(_mm512_set1_epi32((1 << kTop) - 1), all), _CMP_GT_OQ);
  uint64_t word = _pdep_u64(m, code_bits<kBits>(kTop));
  __m512i c = _mm512_maskz_mov_epi32(m, _mm512_set1_epi32(1 << kTop));  // the code's bits found so far
  for (int j = kTop - 1; j >= 0; --j) {
    const __m512 bound = _mm512_permutexvar_ps(_mm512_add_epi32(c, _mm512_set1_epi32((1 << j) - 1)), all);
    m = _mm512_cmp_ps_mask(v, bound, _CMP_GT_OQ);
    word |= _pdep_u64(m, code_bits<kBits>(j));
    if (j > 0) c = _mm512_mask_add_epi32(c, m, c, _mm512_set1_epi32(1 << j));
  }
  return word;
}

template <int kBits, typename E>
__attribute__((target("avx512f,bmi2"))) void search_loop(const E* x, int cnt, const float* bounds, uint8_t* out) {
  const __m512 all = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << ((1 << kBits) - 1)) - 1u), bounds);
  for (int i = 0; i + 16 <= cnt; i += 16) {
    const uint64_t word = search_codes16<kBits>(load16(x + i), all);
    std::memcpy(out + i / 8 * kBits, &word, 2 * kBits);
  }
}

template <int kBits, typename E>
LB_TARGET void count_loop(const E* x, int cnt, const float* bounds, uint8_t* out) {
  constexpr int kBounds = (1 << kBits) - 1;
  __m512 b[kBounds];
  for (int i = 0; i < kBounds; ++i) b[i] = _mm512_set1_ps(bounds[i]);
  const __m512i shifts = group_shifts<kBits>();
  for (int i = 0; i + 16 <= cnt; i += 16) {
    store_groups<kBits>(count_codes16<kBits>(load16(x + i), b), shifts, out + i / 8 * kBits);
  }
}

template <int kBits, typename E>
LB_TARGET void encode_tile(const E* x, int cnt, const float* bounds, uint8_t* out) {
  static_assert(kBits >= 1 && kBits <= 4, "16 codes must fit one 64-bit word");
  if constexpr (kBits == 1) {
    // One bound: lane k's code is bit k of the compare's mask, which is the two groups' bytes.
    const __m512 b = _mm512_set1_ps(bounds[0]);
    for (int i = 0; i + 16 <= cnt; i += 16) {
      const uint16_t mask = _mm512_cmp_ps_mask(load16(x + i), b, _CMP_GT_OQ);
      std::memcpy(out + i / 8, &mask, 2);
    }
  } else if (kHasBmi2 && non_decreasing(bounds, (1 << kBits) - 1)) {
    search_loop<kBits>(x, cnt, bounds, out);
  } else {
    count_loop<kBits>(x, cnt, bounds, out);
  }
}

template <int kBits, typename E>
LB_TARGET void grad_tile(const E* grad, const uint8_t* in, const float* levels, int cnt, E* out) {
  static_assert(kBits >= 1 && kBits <= 4, "8 codes must fit one 32-bit lane");
  constexpr int kGroupBytes = kBits;
  constexpr uint32_t kWordMask = kBits == 4 ? 0xFFFFFFFFu : (1u << (8 * kBits)) - 1u;
  const __m512 lv = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (1 << kBits)) - 1u), levels);
  const __m512i shifts = group_shifts<kBits>();
  const __m512i mask = _mm512_set1_epi32((1 << kBits) - 1);
  // Two groups are 2 * kBits bytes. Reading them as one 8-byte load (then masking) avoids a failed
  // store-to-load forward: copying 2, 4 or 6 bytes into a zeroed word and reading the word back stalls
  // every iteration (about 2.5x the whole loop's time, measured). The load may read only inside the
  // codes of these cnt elements, so the last iterations copy their bytes alone. The bytes read past the
  // two groups reach no lane: the high word's lanes shift by at most 7 * kBits and keep kBits bits.
  const int64_t last_wide = static_cast<int64_t>(cnt) / 8 * kGroupBytes - 8;
  for (int i = 0; i + 16 <= cnt; i += 16) {
    const int64_t at = static_cast<int64_t>(i) / 8 * kGroupBytes;
    uint64_t both = 0;
    if (at <= last_wide) {
      std::memcpy(&both, in + at, 8);
    } else {
      std::memcpy(&both, in + at, 2 * kGroupBytes);
    }
    const __m512i words = _mm512_mask_blend_epi32(static_cast<__mmask16>(0xFF00),
                                                  _mm512_set1_epi32(static_cast<int>(both & kWordMask)),
                                                  _mm512_set1_epi32(static_cast<int>(both >> (8 * kGroupBytes))));
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), mask);
    store16(out + i, _mm512_mul_ps(load16(grad + i), _mm512_permutexvar_ps(codes, lv)));
  }
}

// invact_slope (lowbit/invact.h) of 16 lanes: both branches' coefficient tables in registers, one two-table
// permute per power picking the piece of each lane's branch (r: the lanes on the right branch).
class InvactSlope16 {
 public:
  LB_TARGET InvactSlope16(const float* coeffs, const float* params) {
    for (int k = 0; k < kPowers; ++k) {
      left_[k] = _mm512_loadu_ps(coeffs + k * kInvactPieces);
      right_[k] = _mm512_loadu_ps(coeffs + (kPowers + k) * kInvactPieces);
    }
    y0_ = _mm512_set1_ps(params[0]);
    scale_l_ = _mm512_set1_ps(params[1]);
    scale_r_ = _mm512_set1_ps(params[2]);
    tail_l_ = _mm512_set1_ps(params[3]);
    tail_r_ = _mm512_set1_ps(params[4]);
  }

  LB_TARGET inline __m512 operator()(__m512 y, __mmask16 r) const {
    const __m512 pieces = _mm512_set1_ps(static_cast<float>(kInvactPieces));
    // max(0, d) returns d when d is NaN, as 0 > d ? 0 : d does.
    const __m512 d = _mm512_max_ps(_mm512_setzero_ps(), _mm512_sub_ps(y, y0_));
    const __m512 u = _mm512_mul_ps(_mm512_sqrt_ps(d), _mm512_mask_blend_ps(r, scale_l_, scale_r_));
    // For u in [0, 16) truncation is the scalar cast; other lanes (the tail, NaN) are replaced below
    // or turn NaN through z, whatever piece they read.
    const __m512i piece = _mm512_and_si512(_mm512_cvttps_epi32(u), _mm512_set1_epi32(15));
    const __m512 z = _mm512_sub_ps(u, _mm512_cvtepi32_ps(piece));
    const __m512i idx = _mm512_mask_or_epi32(piece, r, piece, _mm512_set1_epi32(16));
    __m512 p = _mm512_permutex2var_ps(left_[kInvactDegree], idx, right_[kInvactDegree]);
    for (int k = kInvactDegree - 1; k >= 0; --k) {
      p = _mm512_add_ps(_mm512_mul_ps(p, z), _mm512_permutex2var_ps(left_[k], idx, right_[k]));
    }
    const __mmask16 tail = _mm512_cmp_ps_mask(u, pieces, _CMP_GE_OQ);
    return _mm512_mask_blend_ps(tail, p, _mm512_mask_blend_ps(r, tail_l_, tail_r_));
  }

 private:
  static constexpr int kPowers = kInvactDegree + 1;
  static_assert(kInvactPieces == 16, "one register per branch and power");
  __m512 left_[kPowers], right_[kPowers];
  __m512 y0_, scale_l_, scale_r_, tail_l_, tail_r_;
};

// The branch bits of elements i..i+15 as a mask.
inline __mmask16 branch_mask(const uint8_t* bits, int i) {
  uint16_t m16 = 0;
  std::memcpy(&m16, bits + i / 8, 2);
  return m16;
}

// grad * invact_slope(y, bit) for fp32.
LB_TARGET void invact_tile(const float* grad, const float* y, const uint8_t* bits, const float* coeffs,
                           const float* params, int cnt, float* out) {
  const InvactSlope16 slope(coeffs, params);
  for (int i = 0; i + 16 <= cnt; i += 16) {
    const __m512 p = slope(_mm512_loadu_ps(y + i), branch_mask(bits, i));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(grad + i), p));
  }
}

// grad * table[bit << 16 | bits of y] for the 16-bit types: the slope by one gather.
template <typename E>
LB_TARGET void invact_table_tile(const E* grad, const E* y, const uint8_t* bits, const float* table, int cnt, E* out) {
  const __m512i right = _mm512_set1_epi32(1 << 16);
  for (int i = 0; i + 16 <= cnt; i += 16) {
    const __m512i pattern = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + i)));
    const __m512i index = _mm512_mask_or_epi32(pattern, branch_mask(bits, i), pattern, right);
    store16(out + i, _mm512_mul_ps(load16(grad + i), _mm512_i32gather_ps(index, table, 4)));
  }
}

template <typename E>
void fewbit_encode_any(int bits, const E* x, int cnt, const float* bounds, uint8_t* out) {
  switch (bits) {
    case 1:
      return encode_tile<1>(x, cnt, bounds, out);
    case 2:
      return encode_tile<2>(x, cnt, bounds, out);
    case 3:
      return encode_tile<3>(x, cnt, bounds, out);
    default:
      return encode_tile<4>(x, cnt, bounds, out);
  }
}

template <typename E>
void fewbit_grad_any(int bits, const E* grad, const uint8_t* in, const float* levels, int cnt, E* out) {
  switch (bits) {
    case 1:
      return grad_tile<1>(grad, in, levels, cnt, out);
    case 2:
      return grad_tile<2>(grad, in, levels, cnt, out);
    case 3:
      return grad_tile<3>(grad, in, levels, cnt, out);
    default:
      return grad_tile<4>(grad, in, levels, cnt, out);
  }
}

}  // namespace

void invact_grad_avx512(const float* grad, const float* y, const uint8_t* bits, const float* coeffs,
                        const float* params, int cnt, float* out) {
  invact_tile(grad, y, bits, coeffs, params, cnt, out);
}
LB_TARGET void invact_slopes_avx512(const float* y, const uint8_t* bits, const float* coeffs, const float* params,
                                    int cnt, float* out) {
  const InvactSlope16 slope(coeffs, params);
  for (int i = 0; i + 16 <= cnt; i += 16) {
    _mm512_storeu_ps(out + i, slope(_mm512_loadu_ps(y + i), branch_mask(bits, i)));
  }
}
void invact_grad_table_avx512(const BFloat16* grad, const BFloat16* y, const uint8_t* bits, const float* table,
                              int cnt, BFloat16* out) {
  invact_table_tile(grad, y, bits, table, cnt, out);
}
void invact_grad_table_avx512(const Half* grad, const Half* y, const uint8_t* bits, const float* table, int cnt,
                              Half* out) {
  invact_table_tile(grad, y, bits, table, cnt, out);
}
void fewbit_encode_avx512(int bits, const float* x, int cnt, const float* bounds, uint8_t* out) {
  fewbit_encode_any(bits, x, cnt, bounds, out);
}
void fewbit_encode_avx512(int bits, const BFloat16* x, int cnt, const float* bounds, uint8_t* out) {
  fewbit_encode_any(bits, x, cnt, bounds, out);
}
void fewbit_grad_avx512(int bits, const float* grad, const uint8_t* in, const float* levels, int cnt, float* out) {
  fewbit_grad_any(bits, grad, in, levels, cnt, out);
}
void fewbit_grad_avx512(int bits, const BFloat16* grad, const uint8_t* in, const float* levels, int cnt,
                        BFloat16* out) {
  fewbit_grad_any(bits, grad, in, levels, cnt, out);
}

#else

void invact_grad_avx512(const float*, const float*, const uint8_t*, const float*, const float*, int, float*) {}
void invact_slopes_avx512(const float*, const uint8_t*, const float*, const float*, int, float*) {}
void invact_grad_table_avx512(const BFloat16*, const BFloat16*, const uint8_t*, const float*, int, BFloat16*) {}
void invact_grad_table_avx512(const Half*, const Half*, const uint8_t*, const float*, int, Half*) {}
void fewbit_encode_avx512(int, const float*, int, const float*, uint8_t*) {}
void fewbit_encode_avx512(int, const BFloat16*, int, const float*, uint8_t*) {}
void fewbit_grad_avx512(int, const float*, const uint8_t*, const float*, int, float*) {}
void fewbit_grad_avx512(int, const BFloat16*, const uint8_t*, const float*, int, BFloat16*) {}

#endif

}  // namespace lowbit::cpu
