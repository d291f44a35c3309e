// Thread-block reductions shared by the CUDA kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace lowbit::cuda {

// Max over the thread block of one value per thread; every thread gets the result. scratch holds one
// entry per warp. Blocks of fewer than 32 threads (a power of two) shuffle among those lanes only.
__device__ inline uint32_t block_max(uint32_t v, uint32_t* scratch) {
  const unsigned lanes = blockDim.x < 32 ? blockDim.x : 32u;
  const unsigned mask = lanes == 32 ? 0xFFFFFFFFu : (1u << lanes) - 1u;
  for (unsigned off = lanes >> 1; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(mask, v, off));
  const int warps = (blockDim.x + 31) / 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  uint32_t m = 0;
  for (int w = 0; w < warps; ++w) m = max(m, scratch[w]);
  return m;
}

// Max over each run of `width` consecutive threads (a power of two) of one value per thread; every thread
// gets its run's result. The block's size is a multiple of both 32 and width, and every thread of the
// block calls it alike. Runs of up to 32 threads shuffle within their warp; wider runs also go through
// scratch, one entry per warp.
__device__ inline uint32_t group_max(uint32_t v, int width, uint32_t* scratch) {
  for (int off = (width < 32 ? width : 32) >> 1; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if (width <= 32) return v;
  __syncthreads();  // scratch may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  const int warps = width >> 5;
  const int first = static_cast<int>(threadIdx.x >> 5) & ~(warps - 1);
  uint32_t m = 0;
  for (int w = 0; w < warps; ++w) m = max(m, scratch[first + w]);
  return m;
}

}  // namespace lowbit::cuda
