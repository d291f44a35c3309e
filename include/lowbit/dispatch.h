// Storage dtypes, bit-exact conversions shared by CPU and CUDA, and the one dtype switch.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define LB_HD __host__ __device__ __forceinline__
#else
#define LB_HD inline
#endif

// Forced inline on the host too, for what the CPU loops call per element: GCC's inliner left such calls out of
// line in some of csrc/cpu/optim.cpp's many loops, which then ran scalar (AdamW32bit's step took 3x as long, and
// SGD8bit's on bf16 parameters, a call of from_float per element, 2.7x fused AdamW's).
#define LB_HD_ALWAYS LB_HD __attribute__((always_inline))

namespace lowbit {

// The dtype codes the Python op layer sends; exported to it as _C.DTYPE_CODES (csrc/bindings.cpp).
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

LB_HD float bits_to_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

LB_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}

LB_HD_ALWAYS float to_float(float v) { return v; }
LB_HD_ALWAYS float to_float(BFloat16 v) { return bits_to_float(static_cast<uint32_t>(v.bits) << 16); }

LB_HD_ALWAYS float to_float(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1Fu;
  uint32_t man = h.bits & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return bits_to_float(sign);
  // Subnormal half: normalise the mantissa into an fp32 normal.
  uint32_t e = 113;
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return bits_to_float(sign | (e << 23) | ((man & 0x3FFu) << 13));
}

template <typename T>
LB_HD_ALWAYS T from_float(float f);

template <>
LB_HD_ALWAYS float from_float<float>(float f) {
  return f;
}

// Round to nearest even; NaN becomes 0x7FC0 (torch's c10::BFloat16 does the same).
template <>
LB_HD_ALWAYS BFloat16 from_float<BFloat16>(float f) {
  const uint32_t b = float_to_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return BFloat16{0x7FC0};
  return BFloat16{static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)};
}

// Round to nearest even with subnormals and overflow to inf; NaN becomes 0x7E00 | sign, as torch.
template <>
LB_HD_ALWAYS Half from_float<Half>(float f) {
  const uint32_t b = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return Half{static_cast<uint16_t>(sign | 0x7E00u)};
  if (a >= 0x477FF000u) return Half{static_cast<uint16_t>(sign | 0x7C00u)};  // rounds to >= 65520
  if (a >= 0x38800000u) {  // normal half (|f| >= 2^-14)
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
    return Half{static_cast<uint16_t>(sign | (r >> 13))};
  }
  if (a < 0x33000000u) return Half{sign};  // below half the smallest subnormal: rounds to zero
  const uint32_t e = a >> 23;
  const uint32_t man = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24: bits dropped to land on the 2^-24 grid
  const uint32_t half_ulp = 1u << (shift - 1);
  uint32_t q = man >> shift;
  const uint32_t rest = man & ((1u << shift) - 1u);
  if (rest > half_ulp || (rest == half_ulp && (q & 1u))) ++q;
  return Half{static_cast<uint16_t>(sign | q)};
}

inline DType dtype_from_code(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("lowbit: unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

// The storage type T as a value, for the functors of visit_dtype.
template <typename T>
struct DTypeTag {
  using type = T;
};

// The dtype switch of device code, which reads dtype codes from tables and cannot throw: calls
// fn(DTypeTag<T>{}) with T the storage type of `code`. The host checked every code (dtype_from_code),
// so any code other than F32 and F16 is BF16.
template <typename Fn>
LB_HD void visit_dtype(int code, Fn&& fn) {
  switch (code) {
    case static_cast<int>(DType::F32):
      fn(DTypeTag<float>{});
      break;
    case static_cast<int>(DType::F16):
      fn(DTypeTag<Half>{});
      break;
    default:
      fn(DTypeTag<BFloat16>{});
      break;
  }
}

// The host dtype switch: runs BODY with `scalar_t` bound to the storage type of `code`.
#define LB_DISPATCH_DTYPE(code, ...)                         \
  switch (::lowbit::dtype_from_code(code)) {                 \
    case ::lowbit::DType::F32: {                             \
      using scalar_t = float;                                \
      __VA_ARGS__;                                           \
      break;                                                 \
    }                                                        \
    case ::lowbit::DType::F16: {                             \
      using scalar_t = ::lowbit::Half;                       \
      __VA_ARGS__;                                           \
      break;                                                 \
    }                                                        \
    case ::lowbit::DType::BF16: {                            \
      using scalar_t = ::lowbit::BFloat16;                   \
      __VA_ARGS__;                                           \
      break;                                                 \
    }                                                        \
  }

}  // namespace lowbit
