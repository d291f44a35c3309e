// What the CUDA entry points share around their kernels: the launch frame (nothing for an empty call,
// the tensor's device selected for the launcher's scope, torch's stream) and the geometry of the
// kernels: one thread per group of kGroup consecutive elements (lowbit/pack.h), or grid-stride loops.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.cuh"
#include "launch_kernel.cuh"
#include "lowbit/dispatch.h"
#include "lowbit/pack.h"

namespace lowbit::cuda {

// Calls launch(stream) with `device` current, unless the call has no work; launch checks its kernels.
template <typename Launch>
void launch_on(int64_t work, int device, uintptr_t stream_handle, Launch&& launch) {
  if (work == 0) return;
  const DeviceGuard device_guard(device);
  launch(reinterpret_cast<cudaStream_t>(stream_handle));
}

// launch_on for kernels templated on a storage dtype: calls launch(DTypeTag<T>{}, stream) with T the
// type of `dtype`, then checks its last kernel launch.
template <typename Launch>
void launch_typed(int64_t work, int dtype, int device, uintptr_t stream_handle, Launch&& launch) {
  launch_on(work, device, stream_handle, [&](cudaStream_t stream) {
    LB_DISPATCH_DTYPE(dtype, {
      launch(DTypeTag<scalar_t>{}, stream);
      LB_CUDA_LAUNCH_CHECK();
    });
  });
}

// The elements of the group starting at element e0 of n: kGroup, fewer for the tensor's last group.
__host__ __device__ __forceinline__ int group_count(int64_t n, int64_t e0) {
  return n - e0 < kGroup ? static_cast<int>(n - e0) : kGroup;
}

// The group a thread of a one-thread-per-group kernel handles: its index (its packed codes start at byte
// index * bits), its first element, and its element count (kGroup, fewer for the tensor's last group, 0
// for a thread past the end, which returns).
struct ThreadGroup {
  int64_t index;
  int64_t first;
  int count;
};

__device__ __forceinline__ ThreadGroup thread_group(int64_t n) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t e0 = g * kGroup;
  return {g, e0, e0 < n ? group_count(n, e0) : 0};
}

// The grid of a kernel with one thread per group of n elements, `threads` threads a block.
inline dim3 group_grid(int64_t n, int threads) {
  const int64_t groups = (n + kGroup - 1) / kGroup;
  return dim3(static_cast<unsigned int>((groups + threads - 1) / threads));
}

// The blocks of a grid-stride kernel over n elements on `device`: one element a thread, capped at 8
// blocks a multiprocessor (enough to keep it busy).
inline unsigned int stride_blocks(int64_t n, int threads, int device) {
  int sms = 0;
  LB_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<unsigned int>(std::min<int64_t>((n + threads - 1) / threads, static_cast<int64_t>(sms) * 8));
}

}  // namespace lowbit::cuda
