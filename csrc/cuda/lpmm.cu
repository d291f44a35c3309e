// LPMM on CUDA (lpmm.txt Algorithm 1): one thread block per quantization group, one thread per 8
// consecutive elements (which pack into exactly `bits` bytes for any width). Threads decode into
// registers, update, reduce the group's fresh absmax (section 5.2) and re-encode with stochastic
// rounding; draws and arithmetic match the CPU loops (csrc/cpu/lpmm.cpp) code for code.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/optim_rules.h"
#include "lowbit/pack.h"
#include "lowbit/qmap.h"
#include "lowbit/rounding.h"
#include "lowbit/state_form.h"
#include "reduce.cuh"

namespace lowbit::cuda {
namespace {

constexpr int kMaxWarps = 4096 / kGroup / 32;
constexpr int64_t kMaxGrid = int64_t{1} << 20;

__device__ float linear_qmax(int bits) { return static_cast<float>((1 << (bits - 1)) - 1); }

// The element count of this thread's 8-element unit starting at e0 (0 past the end).
__device__ int unit_count(int64_t n, int64_t e0) {
  return e0 >= n ? 0 : (n - e0 < kGroup ? static_cast<int>(n - e0) : kGroup);
}

__device__ void decode_linear(const uint8_t* codes, int64_t e0, int cnt, int bits, float absmax, float* v) {
  uint32_t c[kGroup];
  unpack_group(codes + (e0 / kGroup) * bits, cnt, bits, c);
  const float qmax = linear_qmax(bits);
  for (int k = 0; k < cnt; ++k) v[k] = linear_decode(c[k], absmax, qmax);
}

__device__ void decode_map(const uint8_t* codes, int64_t e0, int cnt, int bits, const float* map, float absmax,
                           float* v) {
  uint32_t c[kGroup];
  unpack_group(codes + (e0 / kGroup) * bits, cnt, bits, c);
  for (int k = 0; k < cnt; ++k) v[k] = map[c[k]] * absmax;
}

template <typename Coder>
__device__ void encode_unit(const Coder& coder, bool stochastic, const float* v, int64_t e0, int cnt, int bits,
                            float absmax, RngKey key, uint64_t counter0, uint8_t* codes) {
  uint32_t c[kGroup];
  for (int k = 0; k < cnt; ++k) {
    const uint64_t counter = counter0 + static_cast<uint64_t>(e0 + k);
    c[k] = stochastic ? coder.template encode<true>(v[k], absmax, uniform01(key, counter))
                      : coder.template encode<false>(v[k], absmax, 0.f);
  }
  pack_group(c, cnt, bits, codes + (e0 / kGroup) * bits);
}

template <typename T>
__global__ void accumulate_kernel(LpmmAccumArgs a, int64_t groups) {
  __shared__ uint32_t scratch[kMaxWarps];
  const RngKey key = rng_key(a.seed);
  const LinearCoder coder{linear_qmax(a.bits)};
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t e0 = g * a.group_size + static_cast<int64_t>(threadIdx.x) * kGroup;
    const int cnt = unit_count(a.n, e0);
    float v[kGroup];
    uint32_t m = 0;
    if (cnt > 0) {
      decode_linear(a.codes, e0, cnt, a.bits, a.absmax[g], v);
      const T* x = static_cast<const T*>(a.grad) + e0;
      for (int k = 0; k < cnt; ++k) {
        v[k] = v[k] + to_float(x[k]);
        m = max(m, abs_bits(v[k]));
      }
    }
    const float amax = absmax_from_bits(block_max(m, scratch));
    if (cnt > 0) encode_unit(coder, a.stochastic, v, e0, cnt, a.bits, amax, key, 0, a.codes);
    // Every thread has read its absmax before block_max's barriers; the write comes after them.
    if (threadIdx.x == 0) a.absmax[g] = amax;
  }
}

struct GroupTask {
  const int64_t* meta;
  int64_t g;  // group index within the tensor
  StepScalars scalars;
};

__device__ GroupTask find_group(const LpmmArgs& a, int64_t b) {
  const int64_t t = lpmm_tensor_of_group(a, b);
  const int64_t* m = a.meta + t * kLpCols;
  return GroupTask{m, b - m[kLpFirstGroup], scalars_row(a.scalars, t, 1.f, 1.f)};
}

template <typename P>
__device__ P* at(const int64_t* m, int col) {
  return reinterpret_cast<P*>(static_cast<uintptr_t>(m[col]));
}

template <Rule kRule>
__global__ void step_kernel(LpmmArgs a) {
  constexpr int kRoot = second_moment_slot(kRule);  // stored as its root: state_form.h
  __shared__ float smap[2][256];
  __shared__ uint32_t scratch[kMaxWarps];
  const uint32_t map_n = 1u << a.state_bits;
  for (int k = 0; k < a.n_states; ++k) {
    for (uint32_t i = threadIdx.x; i < map_n; i += blockDim.x) smap[k][i] = (k == 0 ? a.map1 : a.map2)[i];
  }
  __syncthreads();
  for (int64_t b = blockIdx.x; b < a.total_groups; b += gridDim.x) {
    const GroupTask task = find_group(a, b);
    const int64_t* m = task.meta;
    const int64_t g = task.g;
    const int64_t e0 = g * a.group_size + static_cast<int64_t>(threadIdx.x) * kGroup;
    const int cnt = unit_count(m[kLpNumel], e0);
    float* param_absmax = at<float>(m, kLpParamAbsmax);
    float* grad_absmax = at<float>(m, kLpGradAbsmax);
    float* absmax[2] = {at<float>(m, kLpAbsmax1), at<float>(m, kLpAbsmax2)};
    float p[kGroup];
    float s[2][kGroup] = {};
    uint32_t max_p = 0;
    uint32_t max_s[2] = {0, 0};
    if (cnt > 0) {
      float grad[kGroup];
      decode_linear(at<const uint8_t>(m, kLpParam), e0, cnt, a.param_bits, param_absmax[g], p);
      decode_linear(at<const uint8_t>(m, kLpGrad), e0, cnt, a.grad_bits, grad_absmax[g], grad);
      for (int k = 0; k < a.n_states; ++k) {
        decode_map(at<const uint8_t>(m, k == 0 ? kLpState1 : kLpState2), e0, cnt, a.state_bits, smap[k], absmax[k][g],
                   s[k]);
        for (int i = 0; i < cnt; ++i) s[k][i] = state_value(s[k][i], k == kRoot);
      }
      for (int k = 0; k < cnt; ++k) {
        apply_rule(kRule, a.hyper, task.scalars, p[k], grad[k], s[0][k], s[1][k]);
        restart_if_nonfinite(s[0][k], s[1][k]);
        max_p = max(max_p, abs_bits(p[k]));
        max_s[0] = max(max_s[0], abs_bits(s[0][k]));
        max_s[1] = max(max_s[1], abs_bits(s[1][k]));
      }
    }
    const uint64_t offset = static_cast<uint64_t>(m[kLpOffset]);
    const float amax_p = absmax_from_bits(block_max(max_p, scratch));
    if (cnt > 0) {
      encode_unit(LinearCoder{linear_qmax(a.param_bits)}, a.stochastic_param, p, e0, cnt, a.param_bits, amax_p,
                  lpmm_key(a.seed, kStreamParam), offset, at<uint8_t>(m, kLpParam));
    }
    float amax_s[2] = {0.f, 0.f};
    for (int k = 0; k < a.n_states; ++k) {
      amax_s[k] = stored_absmax(block_max(max_s[k], scratch), k == kRoot);
      if (cnt > 0) {
        for (int i = 0; i < cnt; ++i) s[k][i] = stored_form(s[k][i], k == kRoot);
        encode_unit(MapCoder{smap[k], map_n}, a.stochastic_state, s[k], e0, cnt, a.state_bits, amax_s[k],
                    lpmm_key(a.seed, k == 0 ? kStreamState1 : kStreamState2), offset,
                    at<uint8_t>(m, k == 0 ? kLpState1 : kLpState2));
      }
    }
    // The absmaxes were read by every thread before the first block_max barrier.
    if (threadIdx.x == 0) {
      param_absmax[g] = amax_p;
      for (int k = 0; k < a.n_states; ++k) absmax[k][g] = amax_s[k];
      grad_absmax[g] = 0.f;
    }
    __syncthreads();  // the next group's reductions reuse scratch
  }
}

unsigned int grid_for(int64_t groups) { return static_cast<unsigned int>(std::min(groups, kMaxGrid)); }

}  // namespace

void lpmm_accumulate(const LpmmAccumArgs& a, int device, uintptr_t stream_handle) {
  const int64_t groups = (a.n + a.group_size - 1) / a.group_size;
  const auto threads = static_cast<unsigned int>(a.group_size / kGroup);
  launch_typed(groups, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    LB_LAUNCH(grid_for(groups), threads, 0, stream, accumulate_kernel<typename decltype(type)::type>)(a, groups);
  });
}

void lpmm_step(const LpmmArgs& a, int device, uintptr_t stream_handle) {
  const auto threads = static_cast<unsigned int>(a.group_size / kGroup);
  launch_on(a.total_groups, device, stream_handle, [&](cudaStream_t stream) {
    dispatch_rule(a.rule, [&](auto rule) {
      LB_LAUNCH(grid_for(a.total_groups), threads, 0, stream, step_kernel<decltype(rule)::value>)(a);
      LB_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace lowbit::cuda
