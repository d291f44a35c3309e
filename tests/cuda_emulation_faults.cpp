// Kernels with planted faults, run by the host emulation of CUDA (include/lowbit/cuda_host.h) under
// AddressSanitizer: tests/test_cuda_emulation_faults.py builds this file and checks that ASan reports each
// fault in the kernel that makes it, and that a block that fails leaves nothing behind that the next launches
// trip over. CI's sanitizer run of tests/test_cuda_emulation.py can only catch a faulty kernel if this holds.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

// Lane 0 reaches a warp shuffle that no other lane reaches, eight calls deep, each frame with a local array
// between redzones: the emulation fails the block with that fiber suspended mid-kernel, its frames' redzones
// poisoned.
__attribute__((noinline)) int shuffle_at_depth(int depth) {
  volatile int frame[64];
  frame[depth] = depth;
  if (depth > 0) return shuffle_at_depth(depth - 1) + frame[depth];
  return __shfl_xor_sync(0xffffffffu, frame[0], 1);
}

__global__ void abandoned_shuffle(int* out) {
  if (threadIdx.x == 0) out[0] = shuffle_at_depth(8);
}

// Each thread sums a local array across barriers, so every fiber is suspended with a live frame, and reads
// its neighbour's sum from shared memory.
__global__ void frames_across_barriers(int* out, int offset) {
  __shared__ int sums[32];
  volatile int frame[8];
  for (int i = 0; i < 8; ++i) frame[i] = static_cast<int>(threadIdx.x) + i;
  __syncthreads();
  int sum = 0;
  for (int i = 0; i < 8; ++i) sum += frame[i];
  sums[threadIdx.x] = sum;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = sums[(threadIdx.x + 1) % blockDim.x] + offset;
}

// A read through a pointer of unknown extent: UBSan's bounds checks would stop an indexed array first.
__attribute__((noinline)) int element(volatile int* array, int i) { return array[i]; }

// Thread 5 reads one past the end of its local array, after a barrier (its fiber was suspended and resumed).
__global__ void stack_overflow(int* out, int past_end) {
  volatile int frame[8];
  for (int i = 0; i < 8; ++i) frame[i] = i;
  __syncthreads();
  out[threadIdx.x] = element(frame, threadIdx.x == 5 ? past_end : 0);
}

// The last thread writes one element past the end of the output.
__global__ void heap_overflow(int* out, int n) { out[threadIdx.x + (threadIdx.x + 1 == blockDim.x ? n : 0)] = 1; }

int main(int argc, char** argv) {
  constexpr int kBlocks = 64;
  constexpr int kThreads = 32;
  int* out = new int[kBlocks * kThreads];
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "recover") == 0) {
    lowbit::emu::Launch(dim3(3), dim3(kThreads), 0, nullptr, abandoned_shuffle)(out);
    std::printf("failed launch: %s\n", cudaGetErrorString(cudaGetLastError()));
    for (int r = 0; r < 100; ++r) {
      lowbit::emu::Launch(dim3(kBlocks), dim3(kThreads), 0, nullptr, frames_across_barriers)(out, r);
    }
    // The last thread of the last launch reads thread 0's sum, 0 + 1 + ... + 7 = 28, plus 99.
    std::printf("last: %d %s\n", out[kBlocks * kThreads - 1], cudaGetErrorString(cudaGetLastError()));
  } else if (std::strcmp(mode, "stack") == 0) {
    lowbit::emu::Launch(dim3(1), dim3(kThreads), 0, nullptr, stack_overflow)(out, 8);
  } else if (std::strcmp(mode, "heap") == 0) {
    lowbit::emu::Launch(dim3(kBlocks), dim3(kThreads), 0, nullptr, heap_overflow)(out, kBlocks * kThreads);
  } else {
    return 2;
  }
  delete[] out;
  return 0;
}
