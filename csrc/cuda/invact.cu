// CUDA kernel of the inverted-activation backward (lowbit/invact.h): one thread per element on a
// grid-stride loop with 64-bit indices; the coefficient table (192 floats) is staged in shared memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.cuh"
#include "kernels.h"
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
  if (a.n == 0) return;
  const DeviceGuard device_guard(device);
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  int sms = 0;
  LB_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t wanted = (a.n + kThreads - 1) / kThreads;
  const auto blocks = static_cast<unsigned int>(std::min<int64_t>(wanted, static_cast<int64_t>(sms) * 8));
  LB_DISPATCH_DTYPE(a.dtype, {
    invact_grad_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(a.grad), static_cast<const scalar_t*>(a.y), a.bits, a.n, a.coeffs, a.params,
        static_cast<scalar_t*>(a.out));
    LB_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace lowbit::cuda
