// The CUDA runtime and driver versions, for diagnostics and for error messages. Plain C++ (no CUDA
// headers), so bindings.cpp can include it.
#pragma once

namespace lowbit::cuda {

// CUDA versions as the runtime reports them (1000 * major + 10 * minor); driver 0 when no driver.
struct CudaVersions {
  int runtime;
  int driver;
};

CudaVersions cuda_versions();

}  // namespace lowbit::cuda
