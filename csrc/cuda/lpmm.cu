// LPMM on CUDA (lpmm.txt Algorithm 1): one thread per 8 consecutive elements (which pack into exactly
// `bits` bytes for any width), a run of group_size / 8 consecutive threads per quantization group, and
// as many groups a thread block as fill kMinThreads (small groups would otherwise make tiny blocks and
// starve the multiprocessors). Threads decode into registers, update, reduce their group's fresh absmax
// (section 5.2) and re-encode with stochastic rounding; draws and arithmetic match the CPU loops
// (csrc/cpu/lpmm.cpp) code for code. The per-thread arrays are only indexed by unrolled loops (guarded
// by the element count and the state count), so they stay in registers.
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
constexpr int kMinThreads = 128;
constexpr int64_t kMaxGrid = int64_t{1} << 20;

__device__ float linear_qmax(int bits) { return static_cast<float>((1 << (bits - 1)) - 1); }

// The element count of this thread's 8-element unit starting at e0 (0 past the end).
__device__ __forceinline__ int unit_count(int64_t n, int64_t e0) {
  return e0 >= n ? 0 : (n - e0 < kGroup ? static_cast<int>(n - e0) : kGroup);
}

__device__ __forceinline__ void decode_linear(const uint8_t* codes, int64_t e0, int cnt, int bits, float absmax,
                                              float* v) {
  uint32_t c[kGroup];
  unpack_group(codes + (e0 / kGroup) * bits, cnt, bits, c);
  const float qmax = linear_qmax(bits);
  LB_FOR_GROUP(k, cnt) v[k] = linear_decode(c[k], absmax, qmax);
}

__device__ __forceinline__ void decode_map(const uint8_t* codes, int64_t e0, int cnt, int bits, const float* map,
                                           float absmax, float* v) {
  uint32_t c[kGroup];
  unpack_group(codes + (e0 / kGroup) * bits, cnt, bits, c);
  LB_FOR_GROUP(k, cnt) v[k] = map[c[k]] * absmax;
}

template <typename Coder>
__device__ __forceinline__ void encode_unit(const Coder& coder, bool stochastic, const float* v, int64_t e0, int cnt,
                                            int bits, float absmax, RngKey key, uint64_t counter0, uint8_t* codes) {
  uint32_t c[kGroup];
  LB_FOR_GROUP(k, cnt) {
    const uint64_t counter = counter0 + static_cast<uint64_t>(e0 + k);
    c[k] = stochastic ? coder.template encode<true>(v[k], absmax, uniform01(key, counter))
                      : coder.template encode<false>(v[k], absmax, 0.f);
  }
  pack_group(c, cnt, bits, codes + (e0 / kGroup) * bits);
}

// Where a thread sits: `unit`, its 8-element unit within its group, and `slot`, its group within the
// block's run of groups. A group's units are consecutive threads, so a group of at most 32 units lies
// within one warp.
struct Place {
  int units;  // threads a group
  int per_block;  // groups a block
  int unit;
  int slot;
};

__device__ __forceinline__ Place place(int64_t group_size) {
  const int units = static_cast<int>(group_size / kGroup);
  return Place{units, static_cast<int>(blockDim.x) / units, static_cast<int>(threadIdx.x) % units,
               static_cast<int>(threadIdx.x) / units};
}

// Threads of groups past the last one (in a block's last run) have no elements, but still take part in
// the reductions, whose shuffles and barriers involve the whole warp or block.
template <typename T>
__global__ void accumulate_kernel(LpmmAccumArgs a, int64_t groups) {
  __shared__ uint32_t scratch[kMaxWarps];
  const RngKey key = rng_key(a.seed);
  const LinearCoder coder{linear_qmax(a.bits)};
  const Place me = place(a.group_size);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * me.per_block; first < groups;
       first += static_cast<int64_t>(gridDim.x) * me.per_block) {
    const int64_t g = first + me.slot;
    const int64_t e0 = g * a.group_size + static_cast<int64_t>(me.unit) * kGroup;
    const int cnt = unit_count(a.n, e0);
    float v[kGroup];
    uint32_t m = 0;
    if (cnt > 0) {
      decode_linear(a.codes, e0, cnt, a.bits, a.absmax[g], v);
      const T* x = static_cast<const T*>(a.grad) + e0;
      LB_FOR_GROUP(k, cnt) {
        v[k] = v[k] + to_float(x[k]);
        m = max(m, abs_bits(v[k]));
      }
    }
    const float amax = absmax_from_bits(group_max(m, me.units, scratch));
    if (cnt > 0) encode_unit(coder, a.stochastic, v, e0, cnt, a.bits, amax, key, 0, a.codes);
    // Every thread of the group read its absmax before the reduction, which it needed to complete.
    if (me.unit == 0 && cnt > 0) a.absmax[g] = amax;
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
  const Place me = place(a.group_size);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * me.per_block; first < a.total_groups;
       first += static_cast<int64_t>(gridDim.x) * me.per_block) {
    // A thread past the last group (as in accumulate_kernel) takes the last group's task with no elements.
    const int64_t b = first + me.slot;
    const GroupTask task = find_group(a, b < a.total_groups ? b : a.total_groups - 1);
    const int64_t* m = task.meta;
    const int64_t g = task.g;
    const int64_t e0 = g * a.group_size + static_cast<int64_t>(me.unit) * kGroup;
    const int cnt = b < a.total_groups ? unit_count(m[kLpNumel], e0) : 0;
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
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (k < a.n_states) {
          decode_map(at<const uint8_t>(m, k == 0 ? kLpState1 : kLpState2), e0, cnt, a.state_bits, smap[k],
                     absmax[k][g], s[k]);
          LB_FOR_GROUP(i, cnt) s[k][i] = state_value(s[k][i], k == kRoot);
        }
      }
      LB_FOR_GROUP(k, cnt) {
        apply_rule(kRule, a.hyper, task.scalars, p[k], grad[k], s[0][k], s[1][k]);
        restart_if_nonfinite(s[0][k], s[1][k]);
        max_p = max(max_p, abs_bits(p[k]));
        max_s[0] = max(max_s[0], abs_bits(s[0][k]));
        max_s[1] = max(max_s[1], abs_bits(s[1][k]));
      }
    }
    const uint64_t offset = static_cast<uint64_t>(m[kLpOffset]);
    const float amax_p = absmax_from_bits(group_max(max_p, me.units, scratch));
    if (cnt > 0) {
      encode_unit(LinearCoder{linear_qmax(a.param_bits)}, a.stochastic_param, p, e0, cnt, a.param_bits, amax_p,
                  lpmm_key(a.seed, kStreamParam), offset, at<uint8_t>(m, kLpParam));
    }
    float amax_s[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (k < a.n_states) {
        amax_s[k] = stored_absmax(group_max(max_s[k], me.units, scratch), k == kRoot);
        if (cnt > 0) {
          LB_FOR_GROUP(i, cnt) s[k][i] = stored_form(s[k][i], k == kRoot);
          encode_unit(MapCoder{smap[k], map_n}, a.stochastic_state, s[k], e0, cnt, a.state_bits, amax_s[k],
                      lpmm_key(a.seed, k == 0 ? kStreamState1 : kStreamState2), offset,
                      at<uint8_t>(m, k == 0 ? kLpState1 : kLpState2));
        }
      }
    }
    // Every thread of the group read the absmaxes before the first reduction, which it needed to complete.
    if (me.unit == 0 && cnt > 0) {
      param_absmax[g] = amax_p;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (k < a.n_states) absmax[k][g] = amax_s[k];
      }
      grad_absmax[g] = 0.f;
    }
  }
}

// Threads a block: a group's group_size / 8 threads, or enough whole groups (all sizes are powers of
// two) to fill kMinThreads.
unsigned int block_threads(int64_t group_size) {
  return static_cast<unsigned int>(std::max<int64_t>(group_size / kGroup, kMinThreads));
}

// Blocks for `groups` groups: one per block's run of groups, capped (the kernels stride over the rest).
unsigned int grid_for(int64_t groups, int64_t group_size) {
  const int64_t per_block = block_threads(group_size) / (group_size / kGroup);
  return static_cast<unsigned int>(std::min((groups + per_block - 1) / per_block, kMaxGrid));
}

}  // namespace

void lpmm_accumulate(const LpmmAccumArgs& a, int device, uintptr_t stream_handle) {
  const int64_t groups = (a.n + a.group_size - 1) / a.group_size;
  const unsigned int threads = block_threads(a.group_size);
  launch_typed(groups, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    LB_LAUNCH(grid_for(groups, a.group_size), threads, 0, stream,
              accumulate_kernel<typename decltype(type)::type>)(a, groups);
  });
}

void lpmm_step(const LpmmArgs& a, int device, uintptr_t stream_handle) {
  const unsigned int threads = block_threads(a.group_size);
  launch_on(a.total_groups, device, stream_handle, [&](cudaStream_t stream) {
    dispatch_rule(a.rule, [&](auto rule) {
      LB_LAUNCH(grid_for(a.total_groups, a.group_size), threads, 0, stream, step_kernel<decltype(rule)::value>)(a);
      LB_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace lowbit::cuda
