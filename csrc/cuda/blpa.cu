// CUDA kernels of the approximate-activation blocks (lowbit/blpa.h). Encode and decode: one thread per
// group of 8 consecutive elements (exactly `bits` bytes of codes), 64-bit indices. Backward: one block
// per channel reduces sum(mask * g) and sum(mask * g * a1) in double through shared memory (a fixed
// order, so results are deterministic), then a grid-stride pass writes dL/dx.
#include <cuda_runtime.h>

#include <cstdint>

#include "check.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "lowbit/blpa.h"
#include "lowbit/dispatch.h"
#include "lowbit/pack.h"

namespace lowbit::cuda {
namespace {

constexpr int kThreads = 256;

struct GridPtrs {
  const float* t;
  const float* o;
  const float* h;
  const float* side;
};

GridPtrs grid_ptrs(const BlpaArgs& a) {
  return GridPtrs{a.grid, a.grid + a.channels, a.grid + 2 * a.channels, a.grid + 3 * a.channels};
}

template <typename T>
__global__ void encode_kernel(const T* x, const T* a2, int64_t n, int64_t channels, int64_t inner, const float* mean,
                              const float* invstd, GridPtrs g, int bits, uint8_t* packed) {
  const auto [grp, e0, cnt] = thread_group(n);
  if (cnt == 0) return;
  uint32_t codes[kGroup] = {};
  for (int k = 0; k < cnt; ++k) {
    const int64_t i = e0 + k;
    const int64_t c = (i / inner) % channels;
    const float a1 = (to_float(x[i]) - mean[c]) * invstd[c];
    codes[k] = blpa_code(a1, to_float(a2[i]) > 0.0f, g.t[c], g.o[c], g.h[c], g.side[c], bits);
  }
  pack_group(codes, cnt, bits, packed + grp * bits);
}

template <typename T>
__global__ void decode_kernel(const uint8_t* packed, int64_t n, int64_t channels, int64_t inner, GridPtrs g,
                              const float* gamma, const float* beta, int bits, T* out) {
  const auto [grp, e0, cnt] = thread_group(n);
  if (cnt == 0) return;
  uint32_t codes[kGroup];
  unpack_group(packed + grp * bits, cnt, bits, codes);
  for (int k = 0; k < cnt; ++k) {
    const int64_t i = e0 + k;
    const int64_t c = (i / inner) % channels;
    out[i] = from_float<T>(blpa_relu_value(codes[k], g.t[c], g.o[c], g.h[c], g.side[c], gamma[c], beta[c]));
  }
}

template <typename T>
__global__ void reduce_kernel(const uint8_t* packed, const T* grad, int64_t rows, int64_t channels, int64_t inner,
                              GridPtrs g, const float* beta, int bits, int64_t nbytes, float* g_gamma, float* g_beta) {
  __shared__ double s1s[kThreads];
  __shared__ double s2s[kThreads];
  const int64_t c = blockIdx.x;
  const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], b = beta[c];
  double s1 = 0.0, s2 = 0.0;
  const int64_t per_channel = rows * inner;
  for (int64_t j = threadIdx.x; j < per_channel; j += blockDim.x) {
    const int64_t i = ((j / inner) * channels + c) * inner + j % inner;
    const uint32_t code = read_code(packed, i, bits, nbytes);
    if (!blpa_mask(code, o, side, b)) continue;
    const double gv = to_float(grad[i]);
    s1 += gv;
    s2 += gv * blpa_value(code, t, o, h);
  }
  s1s[threadIdx.x] = s1;
  s2s[threadIdx.x] = s2;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      s1s[threadIdx.x] += s1s[threadIdx.x + stride];
      s2s[threadIdx.x] += s2s[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    g_beta[c] = static_cast<float>(s1s[0]);
    g_gamma[c] = static_cast<float>(s2s[0]);
  }
}

template <typename T>
__global__ void grad_kernel(const uint8_t* packed, const T* grad, int64_t n, int64_t channels, int64_t inner,
                            GridPtrs g, const float* gamma, const float* beta, const float* invstd, int bits,
                            int64_t nbytes, int batch_stats, const float* g_gamma, const float* g_beta, T* out) {
  const double m = static_cast<double>(n / channels);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const int64_t c = (i / inner) % channels;
    const float gm = gamma[c];
    // The same float values as the CPU: gamma * s / m rounded once from double.
    const float k1 = batch_stats ? static_cast<float>(gm * static_cast<double>(g_beta[c]) / m) : 0.0f;
    const float k2 = batch_stats ? static_cast<float>(gm * static_cast<double>(g_gamma[c]) / m) : 0.0f;
    const uint32_t code = read_code(packed, i, bits, nbytes);
    const float ga1 = blpa_mask(code, g.o[c], g.side[c], beta[c]) ? gm * to_float(grad[i]) : 0.0f;
    out[i] = from_float<T>(invstd[c] * ((ga1 - k1) - blpa_value(code, g.t[c], g.o[c], g.h[c]) * k2));
  }
}

}  // namespace

void blpa_encode(const BlpaArgs& a, int device, uintptr_t stream_handle) {
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    LB_LAUNCH(group_grid(a.n, kThreads), kThreads, 0, stream, encode_kernel<T>)(
        static_cast<const T*>(a.x), static_cast<const T*>(a.a2), a.n, a.channels, a.inner, a.mean, a.invstd,
        grid_ptrs(a), a.bits, a.codes_out);
  });
}

void blpa_decode(const BlpaArgs& a, int device, uintptr_t stream_handle) {
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    LB_LAUNCH(group_grid(a.n, kThreads), kThreads, 0, stream, decode_kernel<T>)(
        a.codes_in, a.n, a.channels, a.inner, grid_ptrs(a), a.gamma, a.beta, a.bits, static_cast<T*>(a.out));
  });
}

void blpa_backward(const BlpaArgs& a, int device, uintptr_t stream_handle) {
  const int64_t nbytes = packed_bytes(a.n, a.bits);
  const int64_t rows = a.n / (a.channels * a.inner);
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    const unsigned int blocks = stride_blocks(a.n, kThreads, device);
    const auto* grad = static_cast<const T*>(a.grad);
    LB_LAUNCH(static_cast<unsigned int>(a.channels), kThreads, 0, stream, reduce_kernel<T>)(
        a.codes_in, grad, rows, a.channels, a.inner, grid_ptrs(a), a.beta, a.bits, nbytes, a.g_gamma, a.g_beta);
    LB_CUDA_LAUNCH_CHECK();
    LB_LAUNCH(blocks, kThreads, 0, stream, grad_kernel<T>)(a.codes_in, grad, a.n, a.channels, a.inner, grid_ptrs(a),
                                                           a.gamma, a.beta, a.invstd, a.bits, nbytes, a.batch_stats,
                                                           a.g_gamma, a.g_beta, static_cast<T*>(a.out));
  });
}

}  // namespace lowbit::cuda
