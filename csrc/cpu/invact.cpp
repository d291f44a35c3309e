// Inverted-activation backward on the CPU (lowbit/invact.h): OpenMP over chunks of whole bytes of
// the branch bits; fp32 takes the AVX-512 kernel where the CPU has it.
#include <type_traits>

#include "avx512.h"
#include "kernels.h"
#include "lowbit/dispatch.h"
#include "lowbit/invact.h"
#include "parallel.h"

namespace lowbit::cpu {
namespace {

template <typename T>
void invact_chunk(const T* grad, const T* y, const uint8_t* bits, const float* coeffs, const float* params, int cnt,
                  T* out) {
  for (int j = 0; j < cnt; ++j) {
    const int right = (bits[j >> 3] >> (j & 7)) & 1;
    out[j] = from_float<T>(to_float(grad[j]) * invact_slope(to_float(y[j]), right, coeffs, params));
  }
}

template <typename T>
void invact_impl(const InvactGradArgs& a, int threads) {
  const T* grad = static_cast<const T*>(a.grad);
  const T* y = static_cast<const T*>(a.y);
  T* out = static_cast<T*>(a.out);
  parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
    const uint8_t* bits = a.bits + lo / 8;
    int done = 0;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>) {
      if (avx512_active()) {
        done = cnt - cnt % 16;
        invact_grad_avx512(grad + lo, y + lo, bits, a.coeffs, a.params, done, out + lo);
      }
    }
    invact_chunk(grad + lo + done, y + lo + done, bits + done / 8, a.coeffs, a.params, cnt - done, out + lo + done);
  });
}

}  // namespace

void invact_grad(const InvactGradArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, (invact_impl<scalar_t>(a, threads)));
}

}  // namespace lowbit::cpu
