// Every CUDA runtime call and kernel launch goes through LB_CUDA_CHECK: errors become C++
// exceptions, which pybind11 turns into Python RuntimeError with the failing call named.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define LB_CUDA_CHECK(expr)                                                                           \
  do {                                                                                                \
    const cudaError_t lb_err_ = (expr);                                                               \
    if (lb_err_ != cudaSuccess) {                                                                     \
      throw std::runtime_error(std::string("lowbit CUDA error: ") + cudaGetErrorString(lb_err_) +     \
                               " in " #expr " at " __FILE__ ":" + std::to_string(__LINE__));          \
    }                                                                                                 \
  } while (0)

// Our CUDA runtime is linked statically, so its current device is separate from torch's: every
// launcher selects the tensor's device itself and launches on the stream torch handed down.
#define LB_CUDA_LAUNCH_CHECK() LB_CUDA_CHECK(cudaGetLastError())
