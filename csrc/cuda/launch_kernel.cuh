// LB_LAUNCH, the one way a launcher starts a kernel:
//   LB_LAUNCH(grid, threads, shared_bytes, stream, kernel)(arguments...);
// In a CUDA build it is the triple-chevron launch. In the host emulation (LOWBIT_CUDA_EMULATION,
// lowbit/cuda_host.h) it runs the grid on the host, so both builds run the same launcher code, grid
// arithmetic included. The kernel comes last so that one given with some of its template arguments
// (the rest deduced from the arguments) passes through the macro whole.
#pragma once

#include <cuda_runtime.h>

#ifdef LOWBIT_CUDA_EMULATION
#define LB_LAUNCH(grid, threads, shared_bytes, stream, ...) \
  ::lowbit::emu::Launch((grid), (threads), (shared_bytes), (stream), [&](auto&... lb_args) { __VA_ARGS__(lb_args...); })
#else
#define LB_LAUNCH(grid, threads, shared_bytes, stream, ...) __VA_ARGS__<<<(grid), (threads), (shared_bytes), (stream)>>>
#endif
