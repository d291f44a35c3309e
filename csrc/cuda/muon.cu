// Muon's momentum step on CUDA (lowbit/momentum_rule.h). 8-bit buffers: one thread block per
// quantization block (grid-stride over blocks); each thread decodes its elements into registers,
// updates them and writes their update, the block reduces the new absmax, and the threads requantize
// (8bit-optimizers.txt section 2). fp32 buffers: a grid-stride loop, one element a thread.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/momentum_rule.h"
#include "lowbit/qmap.h"
#include "lowbit/state_form.h"
#include "reduce.cuh"

namespace lowbit::cuda {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxPerThread = 4096 / kMaxThreads;  // block sizes up to 4096

template <typename T>
__global__ void muon_fp32_kernel(const T* grad, float* buf, float* update, int64_t n, MuonHyper h) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float m = buf[i];
    update[i] = muon_momentum(m, to_float(grad[i]), h);
    buf[i] = m;
  }
}

template <typename T>
__global__ void muon_8bit_kernel(const T* grad, uint8_t* codes, float* absmax, const float* map, float* update,
                                 int64_t n, int64_t block_size, MuonHyper h) {
  __shared__ float smap[256];
  __shared__ uint32_t scratch[kMaxThreads / 32];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) smap[i] = map[i];
  __syncthreads();
  const int per = static_cast<int>(block_size / blockDim.x);
  const int64_t nblocks = (n + block_size - 1) / block_size;
  for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const int64_t lo = b * block_size;
    const int cnt = static_cast<int>(n - lo < block_size ? n - lo : block_size);
    const float old_absmax = absmax[b];
    float m[kMaxPerThread];
    uint32_t max_bits = 0;
    for (int j = 0; j < per; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < cnt) {
        float v = smap[codes[lo + i]] * old_absmax;
        update[lo + i] = muon_momentum(v, to_float(grad[lo + i]), h);
        v = state_finite(v) ? v : 0.f;  // state_form.h's restart policy, as on the CPU
        m[j] = v;
        max_bits = max(max_bits, abs_bits(v));
      }
    }
    // block_max synchronises before it writes scratch, so this block's old absmax was read by all.
    const float amax = absmax_from_bits(block_max(max_bits, scratch));
    const float inv = block_inverse(amax);
    for (int j = 0; j < per; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < cnt) codes[lo + i] = static_cast<uint8_t>(map_encode_nearest(smap, 256, normalise(m[j], amax, inv)));
    }
    if (threadIdx.x == 0) absmax[b] = amax;
  }
}

}  // namespace

void muon_momentum(const MuonArgs& a, int device, uintptr_t stream_handle) {
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    const T* grad = static_cast<const T*>(a.grad);
    if (a.state_bits == 8) {
      const int threads = static_cast<int>(std::min<int64_t>(a.block_size, kMaxThreads));
      const int64_t nblocks = (a.n + a.block_size - 1) / a.block_size;
      const auto grid = static_cast<unsigned int>(std::min<int64_t>(nblocks, int64_t{1} << 20));
      LB_LAUNCH(grid, threads, 0, stream, muon_8bit_kernel<T>)(grad, static_cast<uint8_t*>(a.state), a.absmax,
                                                               a.map, a.update, a.n, a.block_size, a.hyper);
    } else {
      LB_LAUNCH(stride_blocks(a.n, kMaxThreads, device), kMaxThreads, 0, stream, muon_fp32_kernel<T>)(
          grad, static_cast<float*>(a.state), a.update, a.n, a.hyper);
    }
  });
}

}  // namespace lowbit::cuda
