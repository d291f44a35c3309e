// Inverted-activation backward on the CPU (lowbit/invact.h): OpenMP over chunks of whole bytes of
// the branch bits; fp32 takes the AVX-512 kernel where the CPU has it.
//
// A 16-bit y has 65536 values, so bf16 and fp16 read invact_slope from a table of all of them on both
// branches (512 KB, filled once per coefficient set and dtype by the fp32 code) instead of evaluating the
// square root and the polynomial per element: the same slope bits, the same product. The tables in use stay
// cached (at most kSlopeTables).
#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "avx512.h"
#include "kernels.h"
#include "lowbit/dispatch.h"
#include "lowbit/invact.h"
#include "parallel.h"

namespace lowbit::cpu {
namespace {

constexpr int kPatterns = 1 << 16;     // values of a 16-bit y
constexpr int kSlopes = 2 * kPatterns;  // index: branch bit << 16 | bits of y
constexpr size_t kSlopeTables = 8;      // per dtype, 4 MB at most

using SlopeTable = std::vector<float>;

// Bit for bit: a NaN coefficient equals itself, and -0 differs from +0.
struct SlopeKey {
  std::array<float, kInvactCoeffs + kInvactParams> values;

  bool operator==(const SlopeKey& o) const { return std::memcmp(values.data(), o.values.data(), sizeof(values)) == 0; }
};

template <typename T>
SlopeTable fill_slopes(const float* coeffs, const float* params) {
  std::vector<float> y(kSlopes);
  for (int k = 0; k < kSlopes; ++k) y[k] = to_float(T{static_cast<uint16_t>(k & (kPatterns - 1))});
  std::vector<uint8_t> bits(kSlopes / 8, 0);
  std::memset(bits.data() + kPatterns / 8, 0xFF, kPatterns / 8);  // the second half: the right branch
  SlopeTable table(kSlopes);
  int done = 0;
  if (avx512_active()) {
    done = kSlopes;
    invact_slopes_avx512(y.data(), bits.data(), coeffs, params, kSlopes, table.data());
  }
  for (int k = done; k < kSlopes; ++k) table[k] = invact_slope(y[k], k >> 16, coeffs, params);
  return table;
}

// The slope table of (coeffs, params) for dtype T, from T's cache or filled now.
template <typename T>
std::shared_ptr<const SlopeTable> slope_table(const float* coeffs, const float* params) {
  static std::mutex lock;
  static std::vector<std::pair<SlopeKey, std::shared_ptr<const SlopeTable>>> cache;
  SlopeKey key{};
  std::memcpy(key.values.data(), coeffs, kInvactCoeffs * sizeof(float));
  std::memcpy(key.values.data() + kInvactCoeffs, params, kInvactParams * sizeof(float));
  const std::lock_guard<std::mutex> guard(lock);
  for (const auto& [k, table] : cache) {
    if (k == key) return table;
  }
  if (cache.size() == kSlopeTables) cache.erase(cache.begin());  // a call still reading it keeps its copy
  cache.emplace_back(key, std::make_shared<const SlopeTable>(fill_slopes<T>(coeffs, params)));
  return cache.back().second;
}

inline int branch(const uint8_t* bits, int j) { return (bits[j >> 3] >> (j & 7)) & 1; }

template <typename T>
void invact_chunk(const T* grad, const T* y, const uint8_t* bits, const float* coeffs, const float* params, int cnt,
                  T* out) {
  for (int j = 0; j < cnt; ++j) {
    out[j] = from_float<T>(to_float(grad[j]) * invact_slope(to_float(y[j]), branch(bits, j), coeffs, params));
  }
}

template <typename T>
void table_chunk(const T* grad, const T* y, const uint8_t* bits, const float* table, int cnt, T* out) {
  for (int j = 0; j < cnt; ++j) out[j] = from_float<T>(to_float(grad[j]) * table[branch(bits, j) << 16 | y[j].bits]);
}

template <typename T>
void invact_impl(const InvactGradArgs& a, int threads) {
  const T* grad = static_cast<const T*>(a.grad);
  const T* y = static_cast<const T*>(a.y);
  T* out = static_cast<T*>(a.out);
  if constexpr (std::is_same_v<T, float>) {
    parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
      const uint8_t* bits = a.bits + lo / 8;
      const int done = avx512_active() ? cnt - cnt % 16 : 0;
      if (done > 0) invact_grad_avx512(grad + lo, y + lo, bits, a.coeffs, a.params, done, out + lo);
      invact_chunk(grad + lo + done, y + lo + done, bits + done / 8, a.coeffs, a.params, cnt - done, out + lo + done);
    });
  } else {
    if (a.n == 0) return;
    const std::shared_ptr<const SlopeTable> held = slope_table<T>(a.coeffs, a.params);
    const float* table = held->data();
    parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
      const uint8_t* bits = a.bits + lo / 8;
      const int done = avx512_active() ? cnt - cnt % 16 : 0;
      if (done > 0) invact_grad_table_avx512(grad + lo, y + lo, bits, table, done, out + lo);
      table_chunk(grad + lo + done, y + lo + done, bits + done / 8, table, cnt - done, out + lo + done);
    });
  }
}

}  // namespace

void invact_grad(const InvactGradArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, (invact_impl<scalar_t>(a, threads)));
}

}  // namespace lowbit::cpu
