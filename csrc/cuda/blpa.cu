// CUDA kernels of the approximate-activation blocks (lowbit/blpa.h). Encode and decode: one thread per
// group of 8 consecutive elements (exactly `bits` bytes of codes), 64-bit indices. Backward: one block
// per channel reduces sum(mask * g) and sum(mask * g * a1) in double, in the CPU's order (lowbit/blpa.h:
// per chunk and run, then the chunk partials in chunk order), so the results are the CPU's bit for bit;
// then a grid-stride pass writes dL/dx.
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
  LB_FOR_GROUP(k, cnt) {
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
  LB_FOR_GROUP(k, cnt) {
    const int64_t i = e0 + k;
    const int64_t c = (i / inner) % channels;
    out[i] = from_float<T>(blpa_relu_value(blpa_code_float(codes[k]), g.t[c], g.o[c], g.h[c], g.side[c], gamma[c], beta[c]));
  }
}

// The chunks of the backward sums (lowbit/blpa.h) that hold elements of channel c, as candidates 0..count
// that a block hands out to its threads; chunk(k) is the k-th candidate's chunk, in increasing order, or -1
// where a candidate is none. When the channels' period channels * inner fits in a chunk, every chunk from
// the one of the channel's first element to the one of its last holds the channel (a chunk between them
// covers a whole period), so the candidates are those chunks. Otherwise they go per row of the channel:
// per_row candidates from the chunk where the row's run starts (the most chunks a run of inner elements
// can touch); those past the run's last chunk, and the chunk where the previous row's run ended (whose
// candidate owns it), are none. Either way there are few candidates per chunk that holds the channel.
struct ChannelChunks {
  int64_t c, channels, inner, rows, per_row;

  __device__ ChannelChunks(int64_t c_, int64_t channels_, int64_t inner_, int64_t rows_)
      : c(c_), channels(channels_), inner(inner_), rows(rows_),
        per_row(channels_ * inner_ <= kBlpaSumChunk ? 0 : (inner_ + kBlpaSumChunk - 2) / kBlpaSumChunk + 1) {}

  __device__ int64_t chunk_of(int64_t i) const { return i / kBlpaSumChunk; }

  __device__ int64_t count() const {
    if (per_row > 0) return rows * per_row;
    return chunk_of((((rows - 1) * channels + c + 1) * inner) - 1) - chunk_of(c * inner) + 1;
  }

  __device__ int64_t chunk(int64_t k) const {
    if (per_row == 0) return chunk_of(c * inner) + k;
    const int64_t r = k / per_row;
    const int64_t b = r * channels + c;
    const int64_t ch = chunk_of(b * inner) + k % per_row;
    if (ch > chunk_of((b + 1) * inner - 1)) return -1;
    if (r > 0 && ch == chunk_of((b - channels + 1) * inner - 1)) return -1;
    return ch;
  }
};

// Adds channel c's partial sums in chunk ch to p: one run for each of the channel's blocks of inner
// elements (block b holds channel b % channels) that meets the chunk, in order, as the CPU's loop.
template <typename T>
__device__ void add_chunk(int64_t ch, int64_t c, const uint8_t* packed, const T* grad, int64_t n, int64_t channels,
                          int64_t inner, float t, float o, float h, float side, float beta, int bits, int64_t nbytes,
                          double* p) {
  const int64_t lo = ch * kBlpaSumChunk;
  const int64_t hi = n - lo < kBlpaSumChunk ? n : lo + kBlpaSumChunk;
  int64_t b = lo / inner;
  b += (c - b % channels + channels) % channels;
  const auto code = [&](int64_t i) { return read_code(packed, i, bits, nbytes); };
  const auto gv = [&](int64_t i) { return to_float(grad[i]); };
  for (; b * inner < hi; b += channels) {
    const int64_t start = b * inner;
    blpa_add_run(start > lo ? start : lo, start + inner < hi ? start + inner : hi, code, gv, t, o, h, side, beta, p);
  }
}

// One block per channel: its threads each take a candidate chunk (ChannelChunks) and compute the
// channel's partial sums there, sequentially as the CPU does; thread 0 then adds the block's partials in
// chunk order, a wave of blockDim.x chunks at a time. A candidate that is no chunk adds +0.0, which
// changes nothing (lowbit/blpa.h), so the sums are the CPU's bit for bit.
template <typename T>
__global__ void reduce_kernel(const uint8_t* packed, const T* grad, int64_t n, int64_t channels, int64_t inner,
                              GridPtrs g, const float* beta, int bits, int64_t nbytes, float* g_gamma, float* g_beta) {
  __shared__ double s1s[kThreads];
  __shared__ double s2s[kThreads];
  const int64_t c = blockIdx.x;
  const float t = g.t[c], o = g.o[c], h = g.h[c], side = g.side[c], b = beta[c];
  const ChannelChunks chunks(c, channels, inner, n / (channels * inner));
  const int64_t count = chunks.count();
  double s1 = 0.0, s2 = 0.0;  // thread 0's running sums
  for (int64_t k0 = 0; k0 < count; k0 += blockDim.x) {
    double p[2] = {0.0, 0.0};
    const int64_t k = k0 + threadIdx.x;
    const int64_t ch = k < count ? chunks.chunk(k) : -1;
    if (ch >= 0) add_chunk(ch, c, packed, grad, n, channels, inner, t, o, h, side, b, bits, nbytes, p);
    s1s[threadIdx.x] = p[0];
    s2s[threadIdx.x] = p[1];
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t wave = count - k0 < blockDim.x ? count - k0 : blockDim.x;
      for (int64_t j = 0; j < wave; ++j) {
        s1 += s1s[j];
        s2 += s2s[j];
      }
    }
    __syncthreads();  // the next wave overwrites s1s and s2s
  }
  if (threadIdx.x == 0) {
    g_beta[c] = static_cast<float>(s1);
    g_gamma[c] = static_cast<float>(s2);
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
    const float k1 = batch_stats ? blpa_mean_term(gm, g_beta[c], m) : 0.0f;
    const float k2 = batch_stats ? blpa_mean_term(gm, g_gamma[c], m) : 0.0f;
    const float q = blpa_code_float(read_code(packed, i, bits, nbytes));
    out[i] = from_float<T>(
        blpa_input_grad(q, to_float(grad[i]), g.t[c], g.o[c], g.h[c], g.side[c], gm, beta[c], invstd[c], k1, k2));
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
  launch_typed(a.n, a.dtype, device, stream_handle, [&](auto type, cudaStream_t stream) {
    using T = typename decltype(type)::type;
    const unsigned int blocks = stride_blocks(a.n, kThreads, device);
    const auto* grad = static_cast<const T*>(a.grad);
    LB_LAUNCH(static_cast<unsigned int>(a.channels), kThreads, 0, stream, reduce_kernel<T>)(
        a.codes_in, grad, a.n, a.channels, a.inner, grid_ptrs(a), a.beta, a.bits, nbytes, a.g_gamma, a.g_beta);
    LB_CUDA_LAUNCH_CHECK();
    LB_LAUNCH(blocks, kThreads, 0, stream, grad_kernel<T>)(a.codes_in, grad, a.n, a.channels, a.inner, grid_ptrs(a),
                                                           a.gamma, a.beta, a.invstd, a.bits, nbytes, a.batch_stats,
                                                           a.g_gamma, a.g_beta, static_cast<T*>(a.out));
  });
}

}  // namespace lowbit::cuda
