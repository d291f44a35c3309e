// Muon's momentum step on the CPU (lowbit/momentum_rule.h): OpenMP over quantization blocks for 8-bit
// buffers, each decoded, updated and requantized while in L1 (with the optimizers' table-driven nearest
// encoder, encode.h); over fixed chunks for fp32 buffers.
#include <algorithm>
#include <cstdint>

#include "avx2.h"
#include "avx512.h"
#include "encode.h"
#include "kernels.h"
#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/momentum_rule.h"
#include "lowbit/qmap.h"
#include "lowbit/state_form.h"
#include "map_index.h"
#include "parallel.h"

namespace lowbit::cpu {
namespace {

constexpr int kMaxBlock = 4096;  // the largest block size the op layer accepts

template <typename T>
void muon_fp32(const MuonArgs& a, int threads) {
  const T* grad = static_cast<const T*>(a.grad);
  float* buf = static_cast<float*>(a.state);
  parallel_chunks(a.n, threads, [&](int64_t lo, int cnt) {
    for (int j = 0; j < cnt; ++j) {
      float m = buf[lo + j];
      a.update[lo + j] = muon_momentum(m, to_float(grad[lo + j]), a.hyper);
      buf[lo + j] = m;
    }
  });
}

template <typename T>
void muon_8bit(const MuonArgs& a, int threads) {
  const T* grad = static_cast<const T*>(a.grad);
  uint8_t* codes = static_cast<uint8_t*>(a.state);
  const MapCoder coder{a.map, 256};
  // Decided (and on first use timed) here, outside the parallel region, as the optimizer step does.
  const std::shared_ptr<const MapIndex> index = map_index(a.map, 256);
  const bool direct = index->nearest_direct();
  const bool gather = direct && gather_encode_active();
  const int64_t bs = a.block_size;
  const int64_t nblocks = (a.n + bs - 1) / bs;
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, a.n))
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * bs;
    const int cnt = static_cast<int>(std::min(a.n - lo, bs));
    float m[kMaxBlock];
    const float old_absmax = a.absmax[b];
    uint32_t max_bits = 0;
    for (int j = 0; j < cnt; ++j) {
      float v = coder.decode(codes[lo + j], old_absmax);
      a.update[lo + j] = muon_momentum(v, to_float(grad[lo + j]), a.hyper);
      // One non-finite buffer element would become its block's scale: it restarts from zero instead
      // (state_form.h's policy), while its update carries the NaN/Inf to the parameter, as in torch.
      v = state_finite(v) ? v : 0.f;
      m[j] = v;
      max_bits = std::max(max_bits, abs_bits(v));
    }
    const float amax = absmax_from_bits(max_bits);
    a.absmax[b] = amax;
    if (gather && avx512_active()) {
      nearest_codes_u8_avx512(*index, m, cnt, amax, codes + lo);
    } else if (gather) {
      nearest_codes_u8_avx2(*index, m, cnt, amax, codes + lo);
    } else if (direct) {
      nearest_codes_u8(*index, m, cnt, amax, codes + lo);
    } else {  // a map whose index needs refinement steps: the exact search
      const float inv = block_inverse(amax);
      for (int j = 0; j < cnt; ++j) {
        codes[lo + j] = static_cast<uint8_t>(map_encode_nearest(a.map, 256, normalise(m[j], amax, inv)));
      }
    }
  }
}

}  // namespace

void muon_momentum(const MuonArgs& a, int threads) {
  LB_DISPATCH_DTYPE(a.dtype, {
    if (a.state_bits == 8) {
      muon_8bit<scalar_t>(a, threads);
    } else {
      muon_fp32<scalar_t>(a, threads);
    }
  });
}

}  // namespace lowbit::cpu
