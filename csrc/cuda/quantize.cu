// CUDA kernels for block-wise quantization. One thread owns one group of 8 consecutive elements
// (which packs into exactly `bits` bytes); the threads of a quantization block reduce its absmax
// with warp shuffles (and shared memory above 32 threads), then encode from registers, so the
// input is read from memory once. Tensor-wise blocks use an atomic-max pass first.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "check.cuh"
#include "kernels.h"
#include "launch.cuh"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/pack.h"
#include "lowbit/rounding.h"

namespace lowbit::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxMap = 256;
constexpr int kTensorwiseLog2 = 63;  // e >> 63 == 0: every element reads absmax[0]

__device__ __forceinline__ MapCoder shared_coder(const MapCoder& c, float* smap) {
  for (uint32_t i = threadIdx.x; i < c.n; i += blockDim.x) smap[i] = c.map[i];
  __syncthreads();
  return MapCoder{smap, c.n};
}
__device__ __forceinline__ LinearCoder shared_coder(const LinearCoder& c, float*) { return c; }

// The 16-bit types move as one 16-byte word; their halves are taken apart with shifts, not read through a
// uint16_t pointer into the word (undefined in C++: g++ -O2 miscompiles it in the host emulation). Element
// 2j is the low half of word j: CUDA devices and the emulation's hosts are little-endian.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* v) {
  const uint4 r = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = to_float(T{static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)))});
}
template <>
__device__ __forceinline__ void load8<float>(const float* p, float* v) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* v) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = from_float<T>(v[2 * j]).bits | (static_cast<uint32_t>(from_float<T>(v[2 * j + 1]).bits) << 16);
  }
  *reinterpret_cast<uint4*>(p) = uint4{w[0], w[1], w[2], w[3]};
}
template <>
__device__ __forceinline__ void store8<float>(float* p, const float* v) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Loads the group at element e0 (zeros past n); vec says pointers are 16-byte aligned.
template <typename T>
__device__ __forceinline__ int load_group(const T* x, int64_t e0, int64_t n, bool vec, float* v) {
  const int cnt = group_count(n, e0);
  if (cnt == kGroup && vec) {
    load8(x + e0, v);
  } else {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) v[k] = k < cnt ? to_float(x[e0 + k]) : 0.f;
  }
  return cnt;
}

__device__ __forceinline__ void store_codes(const uint32_t* c, int cnt, int bits, uint8_t* out, int64_t g,
                                            bool vec) {
  if (bits == 8 && cnt == kGroup && vec) {
    uint2 w;
    w.x = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
    w.y = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
    *reinterpret_cast<uint2*>(out + g * kGroup) = w;
    return;
  }
  pack_group(c, cnt, bits, out + g * bits);
}

__device__ __forceinline__ void load_codes(const uint8_t* in, int cnt, int bits, int64_t g, bool vec, uint32_t* c) {
  if (bits == 8 && cnt == kGroup && vec) {
    const uint2 w = *reinterpret_cast<const uint2*>(in + g * kGroup);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c[k] = (w.x >> (8 * k)) & 0xFFu;
      c[k + 4] = (w.y >> (8 * k)) & 0xFFu;
    }
    return;
  }
  unpack_group(in + g * bits, cnt, bits, c);
}

// Tensor-wise pass 1: absmax bits of the whole tensor into *amax_bits (zeroed by the launcher).
template <typename T>
__global__ void absmax_tensor_kernel(const T* x, int64_t n, bool vec, unsigned int* amax_bits) {
  const int64_t ngroups = (n + kGroup - 1) / kGroup;
  uint32_t m = 0;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < ngroups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[kGroup];
    load_group(x, g * kGroup, n, vec, v);
#pragma unroll
    for (int k = 0; k < kGroup; ++k) m = max(m, abs_bits(v[k]));
  }
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, m);
}

// One thread per group of 8. Block-wise: groups_per_block = blocksize / 8 consecutive threads
// share one quantization block. Tensor-wise: absmax[0] already holds the absmax bit pattern.
template <bool kSR, bool kTensorwise, typename T, typename Coder>
__global__ void quantize_kernel(const T* x, int64_t n, Coder coder, int bits, int log2_bs, int groups_per_block,
                                RngKey key, uint64_t offset, bool vec, uint8_t* out, float* absmax) {
  __shared__ float smap[kMaxMap];
  __shared__ uint32_t warp_max[32];
  const Coder c = shared_coder(coder, smap);
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t e0 = g * kGroup;
  float v[kGroup];
  const int cnt = e0 < n ? load_group(x, e0, n, vec, v) : 0;

  float amax;
  if (kTensorwise) {
    amax = absmax_from_bits(float_to_bits(absmax[0]));  // a bit cast: pass 1 stored bits into the float
    if (g == 0) absmax[0] = amax;  // canonical NaN for poisoned tensors; readers map both patterns alike
  } else {
    uint32_t m = 0;
    LB_FOR_GROUP(k, cnt) m = max(m, abs_bits(v[k]));
    const int width = min(groups_per_block, 32);
    for (int off = width / 2; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (groups_per_block > 32) {
      const int warp = threadIdx.x >> 5;
      if ((threadIdx.x & 31) == 0) warp_max[warp] = m;
      __syncthreads();
      const int per_block = groups_per_block >> 5;
      const int first = (warp / per_block) * per_block;
      m = 0;
      for (int k = 0; k < per_block; ++k) m = max(m, warp_max[first + k]);
    }
    amax = absmax_from_bits(m);
    if (cnt > 0 && (threadIdx.x & (groups_per_block - 1)) == 0) absmax[e0 >> log2_bs] = amax;
  }
  if (cnt == 0) return;

  uint32_t codes[kGroup];
  LB_FOR_GROUP(k, cnt) {
    const float u = kSR ? uniform01(key, offset + static_cast<uint64_t>(e0 + k)) : 0.f;
    codes[k] = c.template encode<kSR>(v[k], amax, u);
  }
  store_codes(codes, cnt, bits, out, g, vec);
}

template <typename T, typename Coder>
__global__ void dequantize_kernel(const uint8_t* in, const float* absmax, int64_t n, Coder coder, int bits,
                                  int log2_bs, bool vec, T* out) {
  __shared__ float smap[kMaxMap];
  const Coder c = shared_coder(coder, smap);
  const auto [g, e0, cnt] = thread_group(n);
  if (cnt == 0) return;
  uint32_t codes[kGroup];
  load_codes(in, cnt, bits, g, vec, codes);
  const float amax = absmax[e0 >> log2_bs];
  float v[kGroup];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) v[k] = k < cnt ? c.decode(codes[k], amax) : 0.f;
  if (cnt == kGroup && vec) {
    store8(out + e0, v);
  } else {
    LB_FOR_GROUP(k, cnt) out[e0 + k] = from_float<T>(v[k]);
  }
}

__global__ void pack_kernel(const uint8_t* in, uint8_t* out, int64_t n, int bits) {
  const auto [g, e0, cnt] = thread_group(n);
  if (cnt == 0) return;
  uint32_t codes[kGroup];
  LB_FOR_GROUP(k, cnt) codes[k] = in[e0 + k] & ((1u << bits) - 1u);
  store_codes(codes, cnt, bits, out, g, false);
}

__global__ void unpack_kernel(const uint8_t* in, uint8_t* out, int64_t n, int bits) {
  const auto [g, e0, cnt] = thread_group(n);
  if (cnt == 0) return;
  uint32_t codes[kGroup];
  unpack_group(in + g * bits, cnt, bits, codes);
  LB_FOR_GROUP(k, cnt) out[e0 + k] = static_cast<uint8_t>(codes[k]);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int log2_exact(int64_t v) {
  int k = 0;
  while ((int64_t{1} << k) < v) ++k;
  return k;
}

template <typename Fn>
void with_coder(const float* map, int64_t map_n, int bits, Fn&& fn) {
  if (map_n > 0) {
    fn(MapCoder{map, static_cast<uint32_t>(map_n)});
  } else {
    fn(LinearCoder{static_cast<float>((1 << (bits - 1)) - 1)});
  }
}

// The caller checks the last launch (launch_typed).
template <bool kSR, typename T, typename Coder>
void launch_quantize(const QuantizeArgs& a, const Coder& coder, cudaStream_t stream) {
  const T* x = static_cast<const T*>(a.x);
  const bool vec = aligned16(a.x) && aligned16(a.out);
  const RngKey key = rng_key(a.seed);
  if (a.blocksize > 0) {
    const int groups_per_block = static_cast<int>(a.blocksize / kGroup);
    const int threads = std::max(kThreads, groups_per_block);
    LB_LAUNCH(group_grid(a.n, threads), threads, 0, stream, quantize_kernel<kSR, false, T>)(
        x, a.n, coder, a.bits, log2_exact(a.blocksize), groups_per_block, key, a.offset, vec, a.out, a.absmax);
    return;
  }
  LB_CUDA_CHECK(cudaMemsetAsync(a.absmax, 0, sizeof(float), stream));
  int sms = 0;
  int dev = 0;
  LB_CUDA_CHECK(cudaGetDevice(&dev));
  LB_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const dim3 reduce_grid(std::min<unsigned int>(group_grid(a.n, kThreads).x, static_cast<unsigned int>(4 * sms)));
  LB_LAUNCH(reduce_grid, kThreads, 0, stream, absmax_tensor_kernel<T>)(x, a.n, vec,
                                                                       reinterpret_cast<unsigned int*>(a.absmax));
  LB_CUDA_LAUNCH_CHECK();
  LB_LAUNCH(group_grid(a.n, kThreads), kThreads, 0, stream, quantize_kernel<kSR, true, T>)(
      x, a.n, coder, a.bits, kTensorwiseLog2, 0, key, a.offset, vec, a.out, a.absmax);
}

// One launch of a packing kernel (pack_kernel or unpack_kernel) over a.n codes.
void launch_packing(void (*kernel)(const uint8_t*, uint8_t*, int64_t, int), const PackArgs& a, int device,
                    uintptr_t stream_handle) {
  launch_on(a.n, device, stream_handle, [&](cudaStream_t stream) {
    LB_LAUNCH(group_grid(a.n, kThreads), kThreads, 0, stream, kernel)(a.in, a.out, a.n, a.bits);
    LB_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace

void quantize(const QuantizeArgs& a, int device, uintptr_t stream_handle) {
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    with_coder(a.map, a.map_n, a.bits, [&](const auto& coder) {
      if (a.stochastic) {
        launch_quantize<true, T>(a, coder, stream);
      } else {
        launch_quantize<false, T>(a, coder, stream);
      }
    });
  });
}

void dequantize(const DequantizeArgs& a, int device, uintptr_t stream_handle) {
  const bool vec = aligned16(a.in) && aligned16(a.out);
  const int log2_bs = a.blocksize > 0 ? log2_exact(a.blocksize) : kTensorwiseLog2;
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    with_coder(a.map, a.map_n, a.bits, [&](const auto& coder) {
      LB_LAUNCH(group_grid(a.n, kThreads), kThreads, 0, stream, dequantize_kernel<T>)(
          a.in, a.absmax, a.n, coder, a.bits, log2_bs, vec, static_cast<T*>(a.out));
    });
  });
}

void pack_bits(const PackArgs& a, int device, uintptr_t stream_handle) {
  launch_packing(pack_kernel, a, device, stream_handle);
}

void unpack_bits(const PackArgs& a, int device, uintptr_t stream_handle) {
  launch_packing(unpack_kernel, a, device, stream_handle);
}

const char* runtime_version() {
  static std::string version = [] {
    int v = 0;
    if (cudaRuntimeGetVersion(&v) != cudaSuccess) return std::string("unknown");
    return version_text(v);
  }();
  return version.c_str();
}

}  // namespace lowbit::cuda
