// Fused optimizer step on CUDA: one launch per call, one thread block per quantization block of any
// tensor in the call. Threads dequantize their elements into registers, apply the rule of
// optim_rules.h, reduce the new block absmax, and requantize (8bit-optimizers.txt section 2:
// "8-bit to 32-bit conversion element-by-element in registers").
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.cuh"
#include "kernels.h"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/optim_rules.h"
#include "lowbit/qmap.h"

namespace lowbit::cuda {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxPerThread = 4096 / kMaxThreads;

struct BlockTask {
  int64_t tensor;
  int64_t lo;
  int cnt;
};

__device__ BlockTask find_block(const OptimArgs& a, int64_t b) {
  int64_t lo = 0;
  int64_t hi = a.count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (a.meta[mid * kMetaCols + kFirstBlock] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t* m = a.meta + lo * kMetaCols;
  const int64_t start = (b - m[kFirstBlock]) * a.block_size;
  const int64_t left = m[kNumel] - start;
  return BlockTask{lo, start, static_cast<int>(left < a.block_size ? left : a.block_size)};
}

// Max over the thread block of one value per thread.
__device__ uint32_t block_max(uint32_t v, uint32_t* scratch) {
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  const int warps = (blockDim.x + 31) / 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  uint32_t m = 0;
  for (int w = 0; w < warps; ++w) m = max(m, scratch[w]);
  return m;
}

template <Rule kRule, typename T>
__device__ void step_block(const OptimArgs& a, const BlockTask& task, const float* smap1, const float* smap2,
                           uint32_t* scratch) {
  const int64_t* m = a.meta + task.tensor * kMetaCols;
  const float* sc = a.scalars + task.tensor * kScalarCols;
  const StepScalars scalars{sc[kStepSize], sc[kBias2Sqrt], sc[kFirst] != 0.f};
  const bool eight_bit = m[kStateBits] == 8;
  const int64_t block = task.lo / a.block_size;
  T* param = reinterpret_cast<T*>(static_cast<uintptr_t>(m[kParam])) + task.lo;
  const T* grad = reinterpret_cast<const T*>(static_cast<uintptr_t>(m[kGrad])) + task.lo;
  void* state[2] = {reinterpret_cast<void*>(static_cast<uintptr_t>(m[kState1])),
                    reinterpret_cast<void*>(static_cast<uintptr_t>(m[kState2]))};
  float* absmax[2] = {reinterpret_cast<float*>(static_cast<uintptr_t>(m[kAbsmax1])),
                      reinterpret_cast<float*>(static_cast<uintptr_t>(m[kAbsmax2]))};
  const float* maps[2] = {smap1, smap2};

  float s[2][kMaxPerThread];
  uint32_t max_bits[2] = {0, 0};
  const int per = (task.cnt + blockDim.x - 1) / blockDim.x;
  for (int k = 0; k < a.n_states; ++k) {
    const float amax = eight_bit ? absmax[k][block] : 0.f;
    for (int j = 0; j < per; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < task.cnt) {
        s[k][j] = eight_bit ? maps[k][static_cast<const uint8_t*>(state[k])[task.lo + i]] * amax
                            : static_cast<const float*>(state[k])[task.lo + i];
      }
    }
  }
  float unused = 0.f;
  for (int j = 0; j < per; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < task.cnt) {
      float p = to_float(param[i]);
      float& s1 = a.n_states > 0 ? s[0][j] : unused;
      float& s2 = a.n_states > 1 ? s[1][j] : unused;
      apply_rule(kRule, a.hyper, scalars, p, to_float(grad[i]), s1, s2);
      param[i] = from_float<T>(p);
      max_bits[0] = max(max_bits[0], abs_bits(s1));
      max_bits[1] = max(max_bits[1], abs_bits(s2));
    }
  }
  for (int k = 0; k < a.n_states; ++k) {
    if (!eight_bit) {
      for (int j = 0; j < per; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < task.cnt) static_cast<float*>(state[k])[task.lo + i] = s[k][j];
      }
      continue;
    }
    const float amax = absmax_from_bits(block_max(max_bits[k], scratch));
    if (threadIdx.x == 0) absmax[k][block] = amax;
    uint8_t* codes = static_cast<uint8_t*>(state[k]) + task.lo;
    for (int j = 0; j < per; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < task.cnt) codes[i] = static_cast<uint8_t>(map_encode_nearest(maps[k], 256, normalise(s[k][j], amax)));
    }
  }
}

template <Rule kRule>
__global__ void optimizer_kernel(OptimArgs a) {
  __shared__ float smap[2][256];
  __shared__ uint32_t scratch[kMaxThreads / 32];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    smap[0][i] = a.map1[i];
    smap[1][i] = a.map2[i];
  }
  __syncthreads();
  for (int64_t b = blockIdx.x; b < a.total_blocks; b += gridDim.x) {
    const BlockTask task = find_block(a, b);
    switch (static_cast<int>(a.meta[task.tensor * kMetaCols + kDtype])) {
      case static_cast<int>(DType::F32):
        step_block<kRule, float>(a, task, smap[0], smap[1], scratch);
        break;
      case static_cast<int>(DType::F16):
        step_block<kRule, Half>(a, task, smap[0], smap[1], scratch);
        break;
      default:
        step_block<kRule, BFloat16>(a, task, smap[0], smap[1], scratch);
        break;
    }
  }
}

template <Rule kRule>
void launch(const OptimArgs& a, cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<int64_t>(a.block_size, kMaxThreads));
  // Grid-stride loop over quantization blocks, so a capped grid covers any number of them.
  const int64_t grid = std::min<int64_t>(a.total_blocks, int64_t{1} << 20);
  optimizer_kernel<kRule><<<static_cast<unsigned int>(grid), threads, 0, stream>>>(a);
  LB_CUDA_LAUNCH_CHECK();
}

}  // namespace

void optimizer_step(const OptimArgs& a, int device, uintptr_t stream_handle) {
  if (a.total_blocks == 0) return;
  LB_CUDA_CHECK(cudaSetDevice(device));
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (a.rule) {
    case Rule::Adam:
      return launch<Rule::Adam>(a, stream);
    case Rule::SGD:
      return launch<Rule::SGD>(a, stream);
    case Rule::Lion:
      return launch<Rule::Lion>(a, stream);
    case Rule::RMSprop:
      return launch<Rule::RMSprop>(a, stream);
    case Rule::Adagrad:
      return launch<Rule::Adagrad>(a, stream);
  }
}

}  // namespace lowbit::cuda
