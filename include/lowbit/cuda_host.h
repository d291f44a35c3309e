// A host emulation of the CUDA execution model, so g++ compiles the unchanged kernels of csrc/cuda/*.cu
// into lowbit._C_cuda_emu (CMake option LOWBIT_CUDA_EMULATION) and CI runs them on CPU tensors. Never
// part of a real build: the emulated module reaches this header through a generated <cuda_runtime.h>,
// so no CUDA header is ever included (they would turn __shared__ into an attribute g++ ignores, giving
// each thread a private copy).
//
// Model: the blocks of a grid run one after another; the threads of a block run concurrently as fibers
// (ucontext), one per CUDA thread, so __syncthreads and warp shuffles really wait for the other threads
// and a missing barrier changes results. A block's warps run in turn, each as far as it can (to its
// next block barrier or its end): a warp that should wait at a barrier it lacks runs ahead of the
// others, as it may on a GPU. __shared__ variables are static storage, filled with 0xFF bytes (NaN as
// float) before every block, since shared memory starts undefined. Shuffles follow CUDA's rules for masks
// and widths; a shuffle whose mask names an exited or absent lane, or reads a lane outside its mask, and
// a barrier that can never complete, fail the launch (cudaGetLastError reports it).
//
// Not seen here: races between blocks, implicit warp synchronicity, occupancy, stream asynchrony.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One section for every __shared__ variable, so a block can start with all of them poisoned.
#define __shared__ static __attribute__((section("lowbit_emu_shared")))

struct uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
};

inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// CUDA's integer and floating max/min overloads (the kernels call them unqualified).
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }

// The built-in variables of the running CUDA thread; the block scheduler sets them before it resumes one.
inline uint3 threadIdx{0, 0, 0};
inline uint3 blockIdx{0, 0, 0};
inline dim3 blockDim{1, 1, 1};
inline dim3 gridDim{1, 1, 1};

// ---- runtime API: host memory, one device, errors kept as CUDA keeps them ----

// CUDA's values of the errors the launchers and this emulation name.
enum cudaError_t : int {
  cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2, cudaErrorInvalidConfiguration = 9,
  cudaErrorInsufficientDriver = 35, cudaErrorInvalidDevice = 101, cudaErrorNoKernelImageForDevice = 209,
  cudaErrorUnsupportedPtxVersion = 222, cudaErrorLaunchFailure = 719,
};
enum cudaDeviceAttr : int { cudaDevAttrMultiProcessorCount = 16 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace lowbit::emu {

// Two multiprocessors: launchers that size grids by them (grid-stride kernels) then launch few blocks,
// so the tests cover the stride loops with small inputs.
constexpr int kMultiprocessors = 2;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr int kWarp = 32;

struct RuntimeState {
  cudaError_t last_error = cudaSuccess;
  std::string failure;  // what made the last launch fail
  int device = 0;
};
inline RuntimeState& runtime() {
  static RuntimeState state;
  return state;
}
inline cudaError_t fail(cudaError_t err, std::string what) {
  runtime().last_error = err;
  runtime().failure = std::move(what);
  return err;
}

}  // namespace lowbit::emu

inline cudaError_t cudaGetLastError() {
  const cudaError_t err = lowbit::emu::runtime().last_error;
  lowbit::emu::runtime().last_error = cudaSuccess;
  return err;
}
inline const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorLaunchFailure:
      return lowbit::emu::runtime().failure.c_str();
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    default:
      return "emulated CUDA error";
  }
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = lowbit::emu::runtime().device;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  if (device != 0) return lowbit::emu::fail(cudaErrorInvalidDevice, "emulation has one device, 0");
  lowbit::emu::runtime().device = device;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = lowbit::emu::kMultiprocessors;
  return cudaSuccess;
}
// 0: no real runtime or driver is involved.
inline cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDriverGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}
// Stream-ordered calls complete at once: the emulated launches are synchronous.
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

// ---- the execution model ----

namespace lowbit::emu {

// The bounds of the section that holds every __shared__ variable, defined by the linker.
extern "C" char __start_lowbit_emu_shared[];
extern "C" char __stop_lowbit_emu_shared[];

#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStackBytes = size_t{512} << 10;  // instrumented frames are larger
#else
constexpr size_t kStackBytes = size_t{128} << 10;
#endif

enum class FiberState { Runnable, AtBarrier, AtShuffle, Done };

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  FiberState state = FiberState::Runnable;
  unsigned int shuffle_mask = 0;
  int shuffle_lane_mask = 0;
  int shuffle_width = kWarp;
  uint64_t shuffle_value = 0;  // the value offered, then the value received
};

// The block being run: its fibers, the kernel call every fiber makes, and the scheduler's context.
struct Block {
  std::vector<Fiber> fibers;
  unsigned int threads = 0;
  Fiber* current = nullptr;
  ucontext_t scheduler;
  void (*body)(void*) = nullptr;
  void* call = nullptr;
  std::string failure;
#if defined(__SANITIZE_ADDRESS__)
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_bytes = 0;
#endif
};
inline Block& block() {
  static Block b;
  return b;
}

// Shared memory starts undefined on a GPU: poison it, so a read before the writes it waits for shows.
__attribute__((no_sanitize_address)) inline void poison_shared() {
  for (volatile char* p = __start_lowbit_emu_shared; p < __stop_lowbit_emu_shared; ++p) *p = '\xff';
}

inline void switch_to_scheduler(Fiber& f) {
  Block& b = block();
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(f.state == FiberState::Done ? nullptr : &fake_stack, b.scheduler_stack,
                                 b.scheduler_stack_bytes);
  swapcontext(&f.context, &b.scheduler);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  swapcontext(&f.context, &b.scheduler);
#endif
}

inline void resume(Fiber& f, unsigned int index) {
  Block& b = block();
  b.current = &f;
  threadIdx = uint3{index % blockDim.x, (index / blockDim.x) % blockDim.y, index / (blockDim.x * blockDim.y)};
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, f.stack.data(), f.stack.size());
  swapcontext(&b.scheduler, &f.context);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  swapcontext(&b.scheduler, &f.context);
#endif
}

inline void fiber_main() {
  Block& b = block();
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack, &b.scheduler_stack_bytes);
#endif
  b.body(b.call);
  Fiber& f = *b.current;
  f.state = FiberState::Done;
  switch_to_scheduler(f);
}

// A thread waits at a synchronisation point until the scheduler releases it.
inline void wait_as(FiberState state) {
  Fiber& f = *block().current;
  f.state = state;
  switch_to_scheduler(f);
}

inline unsigned int lane_count(unsigned int warp) {
  const unsigned int first = warp * kWarp;
  return block().threads - first < kWarp ? block().threads - first : kWarp;
}

// Completes the shuffle that the lowest waiting lane of `warp` is in, if every lane of its mask has
// reached it; false when no lane of the warp waits at a shuffle. A mask that cannot complete fails the block.
inline bool complete_shuffle(unsigned int warp) {
  Block& b = block();
  Fiber* lanes = b.fibers.data() + warp * kWarp;
  const unsigned int n = lane_count(warp);
  unsigned int first = 0;
  while (first < n && lanes[first].state != FiberState::AtShuffle) ++first;
  if (first == n) return false;
  const unsigned int mask = lanes[first].shuffle_mask;
  for (unsigned int l = 0; l < kWarp; ++l) {
    if ((mask >> l & 1u) == 0) continue;
    if (l >= n || lanes[l].state != FiberState::AtShuffle || lanes[l].shuffle_mask != mask) {
      b.failure = "warp shuffle with mask " + std::to_string(mask) + " in warp " + std::to_string(warp) +
                  ": lane " + std::to_string(l) + (l >= n ? " does not exist" : " never reaches it");
      return false;
    }
  }
  uint64_t received[kWarp];
  for (unsigned int l = 0; l < kWarp; ++l) {
    if ((mask >> l & 1u) == 0) continue;
    const int width = lanes[l].shuffle_width;
    const unsigned int src = l ^ static_cast<unsigned int>(lanes[l].shuffle_lane_mask);
    // CUDA: a lane whose source lies in a later group of `width` lanes keeps its own value.
    if ((src & ~static_cast<unsigned int>(width - 1)) > (l & ~static_cast<unsigned int>(width - 1)) || src >= kWarp) {
      received[l] = lanes[l].shuffle_value;
    } else if ((mask >> src & 1u) == 0) {
      b.failure = "warp shuffle in warp " + std::to_string(warp) + ": lane " + std::to_string(l) + " reads lane " +
                  std::to_string(src) + ", outside the mask " + std::to_string(mask);
      return false;
    } else {
      received[l] = lanes[src].shuffle_value;
    }
  }
  for (unsigned int l = 0; l < kWarp; ++l) {
    if ((mask >> l & 1u) == 0) continue;
    lanes[l].shuffle_value = received[l];
    lanes[l].state = FiberState::Runnable;
  }
  return true;
}

// Runs one block to its end: each warp in turn as far as it gets, then the block barrier, again and again.
inline bool run_block() {
  Block& b = block();
  for (unsigned int t = 0; t < b.threads; ++t) {
    Fiber& f = b.fibers[t];
    if (f.stack.empty()) f.stack.resize(kStackBytes);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
#if defined(__SANITIZE_ADDRESS__)
    // ASan's swapcontext interceptor clears the shadow of a context's whole stack before and after every switch
    // into it when the context names its stack: an mmap and a madvise of 64 KiB of shadow per resume, most of
    // the emulation's time under ASan, and it also wipes the redzones of a suspended fiber's live frames. No
    // clearing is needed: a fiber starts where the last one on its stack ended (that one's kernel frames all
    // returned; its fiber_main frame is the new one's), and a failed block unpoisons the stacks it abandons.
    f.context.uc_stack.ss_size = 0;
#endif
    f.state = FiberState::Runnable;
  }
  const unsigned int warps = (b.threads + kWarp - 1) / kWarp;
  for (;;) {
    for (unsigned int w = 0; w < warps; ++w) {
      do {
        for (unsigned int t = w * kWarp; t < w * kWarp + lane_count(w); ++t) {
          if (b.fibers[t].state == FiberState::Runnable) resume(b.fibers[t], t);
        }
      } while (complete_shuffle(w));
      if (!b.failure.empty()) return false;
    }
    unsigned int live = 0;
    unsigned int waiting = 0;
    for (unsigned int t = 0; t < b.threads; ++t) {
      live += b.fibers[t].state != FiberState::Done;
      waiting += b.fibers[t].state == FiberState::AtBarrier;
    }
    if (live == 0) return true;
    if (waiting != live) {
      b.failure = "deadlock: " + std::to_string(waiting) + " of " + std::to_string(live) +
                  " live threads wait at __syncthreads, the others at a warp shuffle";
      return false;
    }
    for (unsigned int t = 0; t < b.threads; ++t) {
      if (b.fibers[t].state == FiberState::AtBarrier) b.fibers[t].state = FiberState::Runnable;
    }
  }
}

// Runs a whole grid, block after block; each thread runs body(call). Fails as a GPU would on a bad
// configuration, and with the scheduler's finding when a block cannot complete.
inline void run_grid(dim3 grid, dim3 threads, size_t shared_bytes, void (*body)(void*), void* call) {
  static std::mutex one_launch_at_a_time;  // the built-in variables and __shared__ storage are global
  const std::lock_guard<std::mutex> lock(one_launch_at_a_time);
  const uint64_t block_threads = uint64_t{threads.x} * threads.y * threads.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block_threads == 0 || block_threads > kMaxThreadsPerBlock ||
      shared_bytes != 0) {
    fail(cudaErrorInvalidConfiguration,
         "invalid configuration argument (grid " + std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" +
             std::to_string(grid.z) + ", " + std::to_string(block_threads) + " threads a block, " +
             std::to_string(shared_bytes) + " bytes of dynamic shared memory)");
    return;
  }
  Block& b = block();
  b.threads = static_cast<unsigned int>(block_threads);
  if (b.fibers.size() < b.threads) b.fibers.resize(b.threads);
  b.body = body;
  b.call = call;
  b.failure.clear();
  gridDim = grid;
  blockDim = threads;
  for (unsigned int z = 0; z < grid.z; ++z) {
    for (unsigned int y = 0; y < grid.y; ++y) {
      for (unsigned int x = 0; x < grid.x; ++x) {
        blockIdx = uint3{x, y, z};
        poison_shared();
        if (!run_block()) {
#if defined(__SANITIZE_ADDRESS__)
          for (Fiber& f : b.fibers) ASAN_UNPOISON_MEMORY_REGION(f.stack.data(), f.stack.size());
#endif
          fail(cudaErrorLaunchFailure, "unspecified launch failure (emulated: block " + std::to_string(x) + ", " +
                                           b.failure + ")");
          return;
        }
      }
    }
  }
}

// What LB_LAUNCH builds: the configuration and a callable that calls the kernel with given arguments.
// The arguments are copied once, as CUDA copies kernel parameters, and every thread gets its own copy.
template <typename Kernel>
class Launch {
 public:
  Launch(dim3 grid, dim3 threads, size_t shared_bytes, cudaStream_t, Kernel kernel)
      : grid_(grid), threads_(threads), shared_bytes_(shared_bytes), kernel_(kernel) {}

  template <typename... Args>
  void operator()(Args... args) {
    auto call = [&] {
      auto copies = std::make_tuple(args...);
      std::apply(kernel_, copies);
    };
    using Call = decltype(call);
    run_grid(grid_, threads_, shared_bytes_, [](void* c) { (*static_cast<Call*>(c))(); }, &call);
  }

 private:
  dim3 grid_;
  dim3 threads_;
  size_t shared_bytes_;
  Kernel kernel_;
};

// The shuffle of the running thread: it waits until every lane of the mask has reached a shuffle.
template <typename T>
T shuffle_xor(unsigned int mask, T value, int lane_mask, int width) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffled values are at most 8 bytes");
  Fiber& f = *block().current;
  f.shuffle_mask = mask;
  f.shuffle_lane_mask = lane_mask;
  f.shuffle_width = width;
  f.shuffle_value = 0;
  std::memcpy(&f.shuffle_value, &value, sizeof(T));
  const unsigned int lane = static_cast<unsigned int>(&f - block().fibers.data()) % kWarp;
  if ((mask >> lane & 1u) == 0) {
    block().failure = "warp shuffle by lane " + std::to_string(lane) + " outside its own mask";
  }
  wait_as(FiberState::AtShuffle);
  T out;
  std::memcpy(&out, &f.shuffle_value, sizeof(T));
  return out;
}

}  // namespace lowbit::emu

inline void __syncthreads() { lowbit::emu::wait_as(lowbit::emu::FiberState::AtBarrier); }

template <typename T>
T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = lowbit::emu::kWarp) {
  return lowbit::emu::shuffle_xor(mask, value, lane_mask, width);
}

// Blocks run one at a time and their threads as fibers of one OS thread, so a plain read-modify-write
// is atomic here; memcpy keeps it free of type punning (callers pass float storage as unsigned int).
inline unsigned int atomicMax(unsigned int* address, unsigned int value) {
  unsigned int old;
  std::memcpy(&old, address, sizeof old);
  if (value > old) std::memcpy(address, &value, sizeof value);
  return old;
}
