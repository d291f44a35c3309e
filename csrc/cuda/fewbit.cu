// CUDA kernels of few-bit backward (lowbit/fewbit.h). One thread owns one group of 8 consecutive
// elements, which packs into exactly `bits` bytes; boundaries and levels (at most 256 floats) are
// staged in shared memory.
#include <cuda_runtime.h>

#include <cstdint>

#include "check.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "lowbit/dispatch.h"
#include "lowbit/fewbit.h"
#include "lowbit/pack.h"

namespace lowbit::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxTable = 1 << kMaxFewbitBits;

template <typename T>
__global__ void fewbit_encode_kernel(const T* x, int64_t n, const float* bounds, int bits, uint8_t* packed) {
  __shared__ float sb[kMaxTable];
  const int nb = (1 << bits) - 1;
  for (int i = threadIdx.x; i < nb; i += blockDim.x) sb[i] = bounds[i];
  __syncthreads();
  const auto [g, e0, cnt] = thread_group(n);
  if (cnt == 0) return;
  uint32_t codes[kGroup] = {};
  for (int k = 0; k < cnt; ++k) codes[k] = interval_code(to_float(x[e0 + k]), sb, bits);
  if (cnt == kGroup) {
    const uint64_t acc = pack8(codes, bits);
    for (int b = 0; b < bits; ++b) packed[g * bits + b] = static_cast<uint8_t>(acc >> (8 * b));
  } else {
    pack_group(codes, cnt, bits, packed + g * bits);
  }
}

template <typename T>
__global__ void fewbit_grad_kernel(const T* grad, const uint8_t* packed, int64_t n, const float* levels, int bits,
                                   T* out) {
  __shared__ float sl[kMaxTable];
  for (int i = threadIdx.x; i < (1 << bits); i += blockDim.x) sl[i] = levels[i];
  __syncthreads();
  const auto [g, e0, cnt] = thread_group(n);
  if (cnt == 0) return;
  uint32_t codes[kGroup];
  unpack_group(packed + g * bits, cnt, bits, codes);
  for (int k = 0; k < cnt; ++k) out[e0 + k] = from_float<T>(to_float(grad[e0 + k]) * sl[codes[k]]);
}

}  // namespace

void fewbit_encode(const FewbitEncodeArgs& a, int device, uintptr_t stream_handle) {
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    LB_LAUNCH(group_grid(a.n, kThreads), kThreads, 0, stream, fewbit_encode_kernel<T>)(
        static_cast<const T*>(a.x), a.n, a.bounds, a.bits, a.packed);
  });
}

void fewbit_grad(const FewbitGradArgs& a, int device, uintptr_t stream_handle) {
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    LB_LAUNCH(group_grid(a.n, kThreads), kThreads, 0, stream, fewbit_grad_kernel<T>)(
        static_cast<const T*>(a.grad), a.packed, a.n, a.levels, a.bits, static_cast<T*>(a.out));
  });
}

}  // namespace lowbit::cuda
