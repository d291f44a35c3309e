// CUDA kernel of the inverted-activation backward (lowbit/invact.h): one thread per element on a
// grid-stride loop with 64-bit indices; the coefficient table (192 floats) is staged in shared memory.
#include <cuda_runtime.h>

#include <cstdint>

#include "check.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "lowbit/dispatch.h"
#include "lowbit/invact.h"

namespace lowbit::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void invact_grad_kernel(const T* grad, const T* y, const uint8_t* bits, int64_t n, const float* coeffs,
                                   const float* params, T* out) {
  __shared__ float sc[kInvactCoeffs];
  __shared__ float sp[kInvactParams];
  for (int i = threadIdx.x; i < kInvactCoeffs; i += blockDim.x) sc[i] = coeffs[i];
  if (threadIdx.x < kInvactParams) sp[threadIdx.x] = params[threadIdx.x];
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const int right = (bits[i >> 3] >> (i & 7)) & 1;
    out[i] = from_float<T>(to_float(grad[i]) * invact_slope(to_float(y[i]), right, sc, sp));
  }
}

}  // namespace

void invact_grad(const InvactGradArgs& a, int device, uintptr_t stream_handle) {
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    LB_LAUNCH(stride_blocks(a.n, kThreads, device), kThreads, 0, stream, invact_grad_kernel<T>)(
        static_cast<const T*>(a.grad), static_cast<const T*>(a.y), a.bits, a.n, a.coeffs, a.params,
        static_cast<T*>(a.out));
  });
}

}  // namespace lowbit::cuda
