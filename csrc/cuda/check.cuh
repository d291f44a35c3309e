// Every CUDA runtime call and kernel launch goes through LB_CUDA_CHECK: errors become C++
// exceptions, which pybind11 turns into Python RuntimeError with the failing call named.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "runtime_info.h"

namespace lowbit::cuda {

inline std::string version_text(int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); }

// The runtime is linked statically, so it is the toolkit that built lowbit, not the one torch
// ships: an older driver can run torch and still refuse lowbit. Name both versions and the way out.
inline std::string error_hint(cudaError_t err) {
  if (err == cudaErrorInsufficientDriver) {
    const CudaVersions v = cuda_versions();
    const std::string found = v.driver > 0 ? "the installed driver supports only CUDA " + version_text(v.driver)
                                           : std::string("no NVIDIA driver was found");
    return "; lowbit's kernels were built with CUDA runtime " + version_text(v.runtime) + ", but " + found +
           ". Update the NVIDIA driver, or rebuild lowbit from source with an nvcc of your torch's CUDA major "
           "(torch.version.cuda) on PATH";
  }
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorUnsupportedPtxVersion) {
    return "; this GPU's architecture is not among lowbit's built ones (python -m lowbit lists them): rebuild with "
           "LOWBIT_CUDA_ARCHS naming its compute capability, e.g. LOWBIT_CUDA_ARCHS=\"75-real;80-real;90\"";
  }
  return "";
}

}  // namespace lowbit::cuda

#define LB_CUDA_CHECK(expr)                                                                           \
  do {                                                                                                \
    const cudaError_t lb_err_ = (expr);                                                               \
    if (lb_err_ != cudaSuccess) {                                                                     \
      throw std::runtime_error(std::string("lowbit CUDA error: ") + cudaGetErrorString(lb_err_) +     \
                               " in " #expr " at " __FILE__ ":" + std::to_string(__LINE__) +          \
                               ::lowbit::cuda::error_hint(lb_err_));                                  \
    }                                                                                                 \
  } while (0)

#define LB_CUDA_LAUNCH_CHECK() LB_CUDA_CHECK(cudaGetLastError())

namespace lowbit::cuda {

// Our CUDA runtime is linked statically, but it binds the same per-thread driver context as torch's,
// so a launcher that selected a tensor's device and left it selected would move torch's current
// device too. The guard selects the device for the launcher's scope and restores the previous one;
// when the device is already current (the common case) it makes no call at all.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    LB_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) LB_CUDA_CHECK(cudaSetDevice(device_));
  }
  // Best effort: a destructor must not throw, and setting back a device that was current a moment ago
  // fails only if the context itself is broken, which the next checked call reports.
  ~DeviceGuard() {
    if (previous_ != device_) static_cast<void>(cudaSetDevice(previous_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

}  // namespace lowbit::cuda
