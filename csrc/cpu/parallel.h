// How the CPU loops split their work between OpenMP threads: fixed chunks of elements, and no
// parallel region for small tensors.
#pragma once

#include <algorithm>
#include <cstdint>

namespace lowbit::cpu {

// Below this many elements a parallel region costs more than it saves: waking the thread team and
// the barrier at its end outweigh the loop itself.
constexpr int64_t kParallelMin = 1 << 15;

// Whether a loop over n elements should start `threads` OpenMP threads (its `if` clause).
inline bool run_parallel(int threads, int64_t n) { return threads > 1 && n >= kParallelMin; }

// Elements per work item. A multiple of kGroup (lowbit/pack.h), so a chunk starts on a whole byte
// of any packed code stream and owns its bytes; small enough that a chunk's unpacked codes stay in
// L1. The chunking does not depend on the thread count, so neither do the results.
constexpr int kChunk = 4096;

inline int64_t chunks_of(int64_t n) { return (n + kChunk - 1) / kChunk; }

// The length of the chunk that starts at element lo of n.
inline int chunk_length(int64_t n, int64_t lo) { return static_cast<int>(std::min<int64_t>(n - lo, kChunk)); }

// Calls fn(lo, cnt) for each chunk [lo, lo + cnt) of [0, n), on up to `threads` threads.
template <typename Fn>
void parallel_chunks(int64_t n, int threads, Fn&& fn) {
  const int64_t nchunks = chunks_of(n);
#pragma omp parallel for schedule(static) num_threads(threads) if (run_parallel(threads, n))
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * kChunk;
    fn(lo, chunk_length(n, lo));
  }
}

}  // namespace lowbit::cpu
