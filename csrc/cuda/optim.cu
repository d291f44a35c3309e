// Fused optimizer step on CUDA: one launch per call (three with a norm mode), one thread block per
// quantization block of any tensor in the call. Threads dequantize their elements into registers,
// apply the rule of optim_rules.h, reduce the new block absmax, and requantize
// (8bit-optimizers.txt section 2: "8-bit to 32-bit conversion element-by-element in registers").
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/factored.h"
#include "lowbit/norm_order.h"
#include "lowbit/optim_rules.h"
#include "lowbit/qmap.h"
#include "lowbit/rank1.h"
#include "lowbit/state_form.h"
#include "lowbit/state_rounding.h"
#include "reduce.cuh"

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
  const int64_t lo = tensor_of_block(a, b);
  const int64_t* m = a.meta + lo * kMetaCols;
  const int64_t start = (b - m[kFirstBlock]) * a.block_size;
  const int64_t left = m[kNumel] - start;
  return BlockTask{lo, start, static_cast<int>(left < a.block_size ? left : a.block_size)};
}

// The code of element e of a quantized state: a byte at 8 bits, a nibble at 4 (lowbit/pack.h: element 2i
// in the low nibble).
__device__ uint32_t state_code(int64_t ptr, int64_t e, int bits) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(ptr));
  return bits == 8 ? bytes[e] : (bytes[e >> 1] >> ((e & 1) * 4)) & 15u;
}

__device__ StepScalars tensor_scalars(const OptimArgs& a, int64_t t, const float* update_scales) {
  return scalars_row(a.scalars, t, a.grad_scales != nullptr ? a.grad_scales[t] : 1.f,
                     update_scales != nullptr ? update_scales[t] : 1.f);
}

// The rank-1 scale (lowbit/rank1.h) of element e of a tensor, from `stats`.
__device__ float rank1_scale_at(const Rank1View& r, const float* stats, int64_t e) {
  int64_t idx[kMaxRank1Dims];
  rank1_index(r, e, idx);
  return rank1_scale(stats, r, idx);
}

// Norm pre-pass: per-block sums of p^2 and u^2 from copies of the states (nothing is written), in
// norm_order.h's order. Each pass over blockDim.x elements stages its squares in shared memory; then
// 2 * kSquareLanes threads add them into their lane in element order (blockDim.x is a multiple of
// kSquareLanes, so element base + j falls in lane j % kSquareLanes).
template <Rule kRule, typename T>
__device__ void norm_block(const OptimArgs& a, const BlockTask& task, const float (*maps)[256],
                           double (*squares)[kMaxThreads], double* lanes, double* sums) {
  const int64_t* m = a.meta + task.tensor * kMetaCols;
  const StepScalars scalars = tensor_scalars(a, task.tensor, nullptr);
  const bool quantized = m[kStateBits] != 32;
  const int64_t block = task.lo / a.block_size;
  const T* param = reinterpret_cast<const T*>(static_cast<uintptr_t>(m[kParam])) + task.lo;
  const T* grad = reinterpret_cast<const T*>(static_cast<uintptr_t>(m[kGrad])) + task.lo;
  const int which = static_cast<int>(threadIdx.x) / kSquareLanes;  // 0: p^2, 1: u^2 (threads that add)
  // The state slot normalised rank-1 (lowbit/rank1.h), or -1: it has no absmax, its scale is per element.
  const Rank1View r1 = rank1_row(a.rank1, task.tensor);
  const int ranked = quantized && r1.ndim > 0 ? second_moment_slot(kRule) : -1;
  double acc = 0.0;
  for (int base = 0; base < task.cnt; base += blockDim.x) {
    const int i = base + static_cast<int>(threadIdx.x);
    if (i < task.cnt) {
      float s[kMaxStates] = {0.f, 0.f, 0.f};
#pragma unroll
      for (int k = 0; k < kMaxStates; ++k) {
        if (k >= a.n_states) continue;
        const int64_t ptr = m[kState1 + k];
        const float scale = !quantized    ? 0.f
                            : k == ranked ? rank1_scale_at(r1, r1.stats, task.lo + i)
                                          : reinterpret_cast<const float*>(m[kAbsmax1 + k])[block];
        s[k] = quantized ? state_value(maps[k][state_code(ptr, task.lo + i, a.state_bits)] * scale, root_slot(kRule, k))
                         : reinterpret_cast<const float*>(ptr)[task.lo + i];
      }
      const float p = to_float(param[i]);
      // kNormGrad (LARS): the gradient as given; optimizer_norms passes no states for it.
      const float u = a.hyper.norm_mode == kNormGrad
                          ? to_float(grad[i])
                          : rule_step(kRule, a.hyper, scalars, p, effective_grad(a.hyper, scalars, to_float(grad[i])),
                                      s[0], s[1], s[2]);
      squares[0][threadIdx.x] = static_cast<double>(p) * p;
      squares[1][threadIdx.x] = static_cast<double>(u) * u;
    }
    __syncthreads();
    if (which < 2) {
      const int len = min(task.cnt - base, static_cast<int>(blockDim.x));
      for (int j = static_cast<int>(threadIdx.x) % kSquareLanes; j < len; j += kSquareLanes) acc += squares[which][j];
    }
    __syncthreads();  // the next pass overwrites the squares
  }
  if (which < 2) lanes[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    sums[0] = add_lanes(lanes, kSquareLanes);
    sums[1] = add_lanes(lanes + kSquareLanes, kSquareLanes);
  }
}

// The rank-1 statistics pass over one block: the step's new states from copies (nothing else is
// written), and each element's new stored second moment raised into the axis maxima with an atomic max
// on the bit patterns (non-negative floats order like them; the pass's caller zeroes the maxima).
template <Rule kRule, typename T>
__device__ void stats_block(const OptimArgs& a, const BlockTask& task, const float (*maps)[256]) {
  constexpr int kSlot = second_moment_slot(kRule);
  const Rank1View r1 = rank1_row(a.rank1, task.tensor);
  if (kSlot < 0 || kSlot >= a.n_states || r1.ndim == 0) return;
  const int64_t* m = a.meta + task.tensor * kMetaCols;
  const StepScalars scalars = tensor_scalars(a, task.tensor, nullptr);
  const int64_t block = task.lo / a.block_size;
  const T* param = reinterpret_cast<const T*>(static_cast<uintptr_t>(m[kParam])) + task.lo;
  const T* grad = reinterpret_cast<const T*>(static_cast<uintptr_t>(m[kGrad])) + task.lo;
  for (int i = threadIdx.x; i < task.cnt; i += blockDim.x) {
    float s[kMaxStates] = {0.f, 0.f, 0.f};
    for (int k = 0; k < a.n_states; ++k) {
      const float scale = k == kSlot ? rank1_scale_at(r1, r1.stats, task.lo + i)
                                     : reinterpret_cast<const float*>(m[kAbsmax1 + k])[block];
      s[k] = state_value(maps[k][state_code(m[kState1 + k], task.lo + i, a.state_bits)] * scale, root_slot(kRule, k));
    }
    float p = to_float(param[i]);
    apply_rule(kRule, a.hyper, scalars, p, to_float(grad[i]), s[0], s[1], s[2]);
    restart_if_nonfinite(s[0], s[1], s[2]);
    const uint32_t w = abs_bits(stored_form(s[kSlot], true));
    int64_t idx[kMaxRank1Dims];
    rank1_index(r1, task.lo + i, idx);
    int64_t base = 0;
    for (int ax = 0; ax < r1.ndim; ++ax) {
      atomicMax(reinterpret_cast<unsigned int*>(r1.new_stats) + base + idx[ax], w);
      base += r1.dims[ax];
    }
  }
}

// nibbles: one 4-bit code per element of the block, staged so that a thread writes whole bytes of codes.
template <Rule kRule, typename T>
__device__ void step_block(const OptimArgs& a, const BlockTask& task, const float (*maps)[256], uint32_t* scratch,
                           uint8_t* nibbles, const float* update_scales) {
  const int64_t* m = a.meta + task.tensor * kMetaCols;
  const StepScalars scalars = tensor_scalars(a, task.tensor, update_scales);
  const bool quantized = m[kStateBits] != 32;
  const int64_t block = task.lo / a.block_size;
  T* param = reinterpret_cast<T*>(static_cast<uintptr_t>(m[kParam])) + task.lo;
  const T* grad = reinterpret_cast<const T*>(static_cast<uintptr_t>(m[kGrad])) + task.lo;
  void* state[kMaxStates];
  float* absmax[kMaxStates];
  for (int k = 0; k < kMaxStates; ++k) {
    state[k] = reinterpret_cast<void*>(static_cast<uintptr_t>(m[kState1 + k]));
    absmax[k] = reinterpret_cast<float*>(static_cast<uintptr_t>(m[kAbsmax1 + k]));
  }

  // The state slot normalised rank-1 (lowbit/rank1.h), or -1: it has no absmax.
  const Rank1View r1 = rank1_row(a.rank1, task.tensor);
  const int ranked = quantized && r1.ndim > 0 ? second_moment_slot(kRule) : -1;
  // Stochastic rounding (lowbit/state_rounding.h): the tensor's step seed and counter offset.
  const bool stochastic = a.rounding != nullptr;
  const int64_t* round = stochastic ? a.rounding + task.tensor * kRoundCols : nullptr;
  float s[kMaxStates][kMaxPerThread];
  uint32_t max_bits[kMaxStates] = {0, 0, 0};
  const int per = (task.cnt + blockDim.x - 1) / blockDim.x;
  for (int k = 0; k < a.n_states; ++k) {
    const float amax = quantized && k != ranked ? absmax[k][block] : 0.f;
    for (int j = 0; j < per; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < task.cnt) {
        const float scale = k == ranked ? rank1_scale_at(r1, r1.stats, task.lo + i) : amax;
        s[k][j] = quantized ? state_value(maps[k][state_code(m[kState1 + k], task.lo + i, a.state_bits)] * scale,
                                          root_slot(kRule, k))
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
      float& s3 = a.n_states > 2 ? s[2][j] : unused;
      apply_rule(kRule, a.hyper, scalars, p, to_float(grad[i]), s1, s2, s3);
      param[i] = from_float<T>(p);
      if (quantized) restart_if_nonfinite(s1, s2, s3);
      max_bits[0] = max(max_bits[0], abs_bits(s1));
      max_bits[1] = max(max_bits[1], abs_bits(s2));
      max_bits[2] = max(max_bits[2], abs_bits(s3));
    }
  }
  for (int k = 0; k < a.n_states; ++k) {
    if (!quantized) {
      for (int j = 0; j < per; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < task.cnt) static_cast<float*>(state[k])[task.lo + i] = s[k][j];
      }
      continue;
    }
    const bool root = root_slot(kRule, k);
    const float amax = stored_absmax(block_max(max_bits[k], scratch), root);
    if (threadIdx.x == 0 && k != ranked) absmax[k][block] = amax;
    const uint32_t map_n = 1u << a.state_bits;
    uint8_t* codes = static_cast<uint8_t*>(state[k]) + (a.state_bits == 8 ? task.lo : task.lo / 2);
    const RngKey key = stochastic ? state_stream_key(static_cast<uint64_t>(round[kRoundSeed]), k) : RngKey{0, 0};
    for (int j = 0; j < per; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < task.cnt) {
        const float scale = k == ranked ? rank1_scale_at(r1, r1.new_stats, task.lo + i) : amax;
        const uint64_t counter = stochastic ? static_cast<uint64_t>(round[kRoundOffset] + task.lo + i) : 0;
        const auto code = static_cast<uint8_t>(
            state_encode(maps[k], map_n, normalise(stored_form(s[k][j], root), scale), stochastic, key, counter));
        if (a.state_bits == 8) {
          codes[i] = code;
        } else {
          nibbles[i] = code;
        }
      }
    }
    if (a.state_bits == 4) {
      __syncthreads();
      for (int b = threadIdx.x; 2 * b < task.cnt; b += blockDim.x) {
        const uint32_t high = 2 * b + 1 < task.cnt ? nibbles[2 * b + 1] : 0u;
        codes[b] = static_cast<uint8_t>(nibbles[2 * b] | (high << 4));
      }
      __syncthreads();  // the next state overwrites the nibbles
    }
  }
}


// -- Factorized second moments (lowbit/factored.h) --------------------------------------------------------------
// Three passes before the step, each a grid-stride loop over every factorized tensor of the call: the rows'
// EMAs (a warp per row, a thread per lane of factored.h), the columns' (a thread per column, its blocks of
// rows in order), then each slice's mean of its new rows (a warp per slice). The step's blocks of such a tensor run
// factored_block instead of step_block.
static_assert(kFactoredLanes == 32, "a row's lanes are the threads of one warp");

// The parameter and gradient of tensor t, as T.
template <typename T>
__device__ const T* tensor_ptr(const OptimArgs& a, int64_t t, int col) {
  return reinterpret_cast<const T*>(static_cast<uintptr_t>(a.meta[t * kMetaCols + col]));
}

// A warp-per-item loop: fn(item, lane) for each of n items; every thread of the block makes the same number of
// trips, so that the warps may share barriers. fn adds into lanes[threadIdx.x]; done(item, lanes of its warp)
// runs on the warp's first thread once they are all in.
template <typename Add, typename Done>
__device__ void warp_items(int64_t n, float* lanes, Add&& add, Done&& done) {
  const int warps = static_cast<int>(blockDim.x) / kFactoredLanes;
  const int warp = static_cast<int>(threadIdx.x) / kFactoredLanes;
  const int lane = static_cast<int>(threadIdx.x) % kFactoredLanes;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * warps; base < n; base += static_cast<int64_t>(gridDim.x) * warps) {
    const int64_t item = base + warp;
    lanes[threadIdx.x] = item < n ? add(item, lane) : 0.f;
    __syncthreads();
    if (lane == 0 && item < n) done(item, lanes + warp * kFactoredLanes);
    __syncthreads();  // the next trip overwrites the lanes
  }
}

// fn(f, sc, param, grad) for each factorized tensor of the call whose factors the step updates (not those the
// caller gives: kFacGiven): its factors, scalars, and parameter and gradient as their element type.
template <typename Fn>
__device__ void for_factored_tensors(const OptimArgs& a, Fn&& fn) {
  for (int64_t t = 0; t < a.count; ++t) {
    const FactoredView f = factored_row(a.factored, t);
    if (!factors_pending(f)) continue;
    const StepScalars sc = tensor_scalars(a, t, nullptr);
    visit_dtype(static_cast<int>(a.meta[t * kMetaCols + kDtype]), [&](auto dtype) {
      using T = typename decltype(dtype)::type;
      fn(f, sc, tensor_ptr<T>(a, t, kParam), tensor_ptr<T>(a, t, kGrad));
    });
  }
}

__global__ void factored_rows_kernel(OptimArgs a) {
  __shared__ float lanes[kMaxThreads];
  for_factored_tensors(a, [&](const FactoredView& f, const StepScalars& sc, const auto* param, const auto* grad) {
    warp_items(
        f.batch * f.rows, lanes,
        [&](int64_t q, int lane) {
          float acc = 0.f;
          for (int64_t c = lane; c < f.cols; c += kFactoredLanes) {
            const float x = factored_grad(a.hyper, sc, to_float(param[q * f.cols + c]), to_float(grad[q * f.cols + c]));
            acc += x * x;
          }
          return acc;
        },
        [&](int64_t q, const float* row_lanes) {
          f.row[q] = factored_ema(a.hyper, f.row[q], factored_add_lanes(row_lanes), f.cols);
        });
  });
}

__global__ void factored_cols_kernel(OptimArgs a) {
  for_factored_tensors(a, [&](const FactoredView& f, const StepScalars& sc, const auto* param, const auto* grad) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < f.batch * f.cols; i += stride) {
      const int64_t b = i / f.cols;
      const int64_t c = i % f.cols;
      float acc = 0.f;
      for (int64_t r0 = 0; r0 < f.rows; r0 += kFactoredRowBlock) {
        const int64_t r1 = r0 + kFactoredRowBlock < f.rows ? r0 + kFactoredRowBlock : f.rows;
        float part = 0.f;
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t e = (b * f.rows + r) * f.cols + c;
          const float x = factored_grad(a.hyper, sc, to_float(param[e]), to_float(grad[e]));
          part += x * x;
        }
        acc += part;
      }
      f.col[i] = factored_ema(a.hyper, f.col[i], acc, f.rows);
    }
  });
}

__global__ void factored_mean_kernel(OptimArgs a) {
  __shared__ float lanes[kMaxThreads];
  for (int64_t t = 0; t < a.count; ++t) {
    const FactoredView f = factored_row(a.factored, t);
    if (!factors_pending(f)) continue;  // kFacGiven: the caller wrote the means
    warp_items(
        f.batch, lanes,
        [&](int64_t b, int lane) {
          float acc = 0.f;
          for (int64_t r = lane; r < f.rows; r += kFactoredLanes) acc += f.row[b * f.rows + r];
          return acc;
        },
        [&](int64_t b, const float* slice_lanes) {
          f.mean[b] = factored_add_lanes(slice_lanes) / static_cast<float>(f.rows);
        });
  }
}

// The step of one block of a factorized tensor: m (state 1, 4-bit block-wise) decoded, factored_apply with v_hat
// from the updated factors, the non-finite restart of m (state_form.h), m re-encoded against its new absmax.
template <typename T>
__device__ void factored_block(const OptimArgs& a, const BlockTask& task, const FactoredView& f,
                               const float (*maps)[256], uint32_t* scratch, uint8_t* nibbles) {
  const int64_t* meta = a.meta + task.tensor * kMetaCols;
  const StepScalars sc = tensor_scalars(a, task.tensor, nullptr);
  const int64_t block = task.lo / a.block_size;
  T* param = reinterpret_cast<T*>(static_cast<uintptr_t>(meta[kParam])) + task.lo;
  const T* grad = reinterpret_cast<const T*>(static_cast<uintptr_t>(meta[kGrad])) + task.lo;
  float* absmax = reinterpret_cast<float*>(static_cast<uintptr_t>(meta[kAbsmax1]));
  const float amax = absmax[block];
  float m[kMaxPerThread];
  uint32_t max_bits = 0;
  const int per = (task.cnt + blockDim.x - 1) / blockDim.x;
  for (int j = 0; j < per; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < task.cnt) {
      float v_hat;
      factored_v_hats(f, task.lo + i, 1, &v_hat);
      float mv = maps[0][state_code(meta[kState1], task.lo + i, 4)] * amax;
      float p = to_float(param[i]);
      factored_apply(a.hyper, sc, p, factored_grad(a.hyper, sc, p, to_float(grad[i])), mv, v_hat);
      param[i] = from_float<T>(p);
      m[j] = state_finite(mv) ? mv : 0.f;
      max_bits = max(max_bits, abs_bits(m[j]));
    }
  }
  const float new_amax = stored_absmax(block_max(max_bits, scratch), false);
  if (threadIdx.x == 0) absmax[block] = new_amax;
  for (int j = 0; j < per; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < task.cnt) nibbles[i] = static_cast<uint8_t>(map_encode_nearest(maps[0], 16u, normalise(m[j], new_amax)));
  }
  __syncthreads();
  uint8_t* codes = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(meta[kState1])) + task.lo / 2;
  for (int b = threadIdx.x; 2 * b < task.cnt; b += blockDim.x) {
    const uint32_t high = 2 * b + 1 < task.cnt ? nibbles[2 * b + 1] : 0u;
    codes[b] = static_cast<uint8_t>(nibbles[2 * b] | (high << 4));
  }
  __syncthreads();  // the next block overwrites the nibbles
}

__device__ void load_maps(const OptimArgs& a, float (*smap)[256]) {
  for (int k = 0; k < kMaxStates; ++k) {
    const float* map = state_map(a, k);
    if (map == nullptr) continue;  // map3 of a caller that passes none: never read
    for (int i = threadIdx.x; i < (1 << a.state_bits); i += blockDim.x) smap[k][i] = map[i];
  }
  __syncthreads();
}

template <Rule kRule>
__global__ void norm_kernel(OptimArgs a, double* sums) {
  __shared__ float smap[kMaxStates][256];
  __shared__ double squares[2][kMaxThreads];
  __shared__ double lanes[2 * kSquareLanes];
  load_maps(a, smap);
  for (int64_t b = blockIdx.x; b < a.total_blocks; b += gridDim.x) {
    const BlockTask task = find_block(a, b);
    visit_dtype(static_cast<int>(a.meta[task.tensor * kMetaCols + kDtype]), [&](auto dtype) {
      norm_block<kRule, typename decltype(dtype)::type>(a, task, smap, squares, lanes, sums + 2 * b);
    });
  }
}

// One warp per tensor, a thread per lane of norm_order.h: its block sums, then the update scale (or,
// with a.norm_sums set, the tensor's sums themselves).
__global__ void scale_kernel(OptimArgs a, const double* sums, float* update_scales) {
  __shared__ double lanes[2][kBlockSumLanes];
  for (int64_t t = blockIdx.x; t < a.count; t += gridDim.x) {
    const int64_t first = a.meta[t * kMetaCols + kFirstBlock];
    const int64_t last = t + 1 < a.count ? a.meta[(t + 1) * kMetaCols + kFirstBlock] : a.total_blocks;
    double pp = 0.0;
    double uu = 0.0;
    for (int64_t b = first + threadIdx.x; b < last; b += kBlockSumLanes) {
      pp += sums[2 * b];
      uu += sums[2 * b + 1];
    }
    lanes[0][threadIdx.x] = pp;
    lanes[1][threadIdx.x] = uu;
    __syncthreads();
    pp = add_lanes(lanes[0], kBlockSumLanes);
    uu = add_lanes(lanes[1], kBlockSumLanes);
    __syncthreads();  // the next tensor overwrites the lanes
    if (threadIdx.x == 0) {
      if (a.norm_sums != nullptr) {
        a.norm_sums[2 * t] = pp;
        a.norm_sums[2 * t + 1] = uu;
      } else {
        update_scales[t] = update_scale(a.hyper, sqrt(pp), sqrt(uu));
      }
    }
  }
}

template <Rule kRule>
__global__ void stats_kernel(OptimArgs a) {
  __shared__ float smap[kMaxStates][256];
  load_maps(a, smap);
  for (int64_t b = blockIdx.x; b < a.total_blocks; b += gridDim.x) {
    const BlockTask task = find_block(a, b);
    visit_dtype(static_cast<int>(a.meta[task.tensor * kMetaCols + kDtype]),
                [&](auto dtype) { stats_block<kRule, typename decltype(dtype)::type>(a, task, smap); });
  }
}

template <Rule kRule>
__global__ void optimizer_kernel(OptimArgs a, const float* update_scales) {
  __shared__ float smap[kMaxStates][256];
  __shared__ uint32_t scratch[kMaxThreads / 32];
  __shared__ uint8_t nibbles[kMaxThreads * kMaxPerThread];
  load_maps(a, smap);
  for (int64_t b = blockIdx.x; b < a.total_blocks; b += gridDim.x) {
    const BlockTask task = find_block(a, b);
    const FactoredView f = factored_row(a.factored, task.tensor);
    visit_dtype(static_cast<int>(a.meta[task.tensor * kMetaCols + kDtype]), [&](auto dtype) {
      if (f.batch > 0) {
        factored_block<typename decltype(dtype)::type>(a, task, f, smap, scratch, nibbles);
      } else {
        step_block<kRule, typename decltype(dtype)::type>(a, task, smap, scratch, nibbles, update_scales);
      }
    });
  }
}

template <Rule kRule>
void launch(const OptimArgs& a, cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<int64_t>(a.block_size, kMaxThreads));
  // Grid-stride loop over quantization blocks, so a capped grid covers any number of them.
  const auto grid = static_cast<unsigned int>(std::min<int64_t>(a.total_blocks, int64_t{1} << 20));
  if (a.stats_only) {
    LB_LAUNCH(grid, threads, 0, stream, stats_kernel<kRule>)(a);
    LB_CUDA_LAUNCH_CHECK();
    return;
  }
  const float* update_scales = a.update_scales;
  if (a.hyper.norm_mode != kNormNone && a.update_scales == nullptr) {
    // The pre-pass writes the caller's scratch (OptimArgs::block_sums, tensor_scales), which torch's
    // allocator gave on this stream, so it is reused only after these launches.
    LB_LAUNCH(grid, threads, 0, stream, norm_kernel<kRule>)(a, a.block_sums);
    LB_CUDA_LAUNCH_CHECK();
    const auto tensors = static_cast<unsigned int>(std::min<int64_t>(a.count, int64_t{1} << 16));
    LB_LAUNCH(tensors, kBlockSumLanes, 0, stream, scale_kernel)(a, a.block_sums, a.tensor_scales);
    LB_CUDA_LAUNCH_CHECK();
    update_scales = a.tensor_scales;
  }
  if (a.factored != nullptr && a.norm_sums == nullptr) {
    // The factors first (their passes read the gradients, which the step leaves as they are), each pass after
    // the one before it on the stream: the means read the rows' new EMAs, the step all of them.
    // Grid-stride loops: a few blocks per SM cover any size (each block walks the call's table once).
    const auto passes = std::min(grid, 2048u);
    LB_LAUNCH(passes, kMaxThreads, 0, stream, factored_rows_kernel)(a);
    LB_CUDA_LAUNCH_CHECK();
    LB_LAUNCH(passes, kMaxThreads, 0, stream, factored_cols_kernel)(a);
    LB_CUDA_LAUNCH_CHECK();
    LB_LAUNCH(passes, kMaxThreads, 0, stream, factored_mean_kernel)(a);
    LB_CUDA_LAUNCH_CHECK();
  }
  if (a.norm_sums == nullptr) {
    LB_LAUNCH(grid, threads, 0, stream, optimizer_kernel<kRule>)(a, update_scales);
    LB_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace

void optimizer_step(const OptimArgs& a, int device, uintptr_t stream_handle) {
  launch_on(a.total_blocks, device, stream_handle,
            [&](cudaStream_t stream) { dispatch_rule(a.rule, [&](auto rule) { launch<decltype(rule)::value>(a, stream); }); });
}

}  // namespace lowbit::cuda
