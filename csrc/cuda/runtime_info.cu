// Which CUDA runtime lowbit carries (linked statically: the toolkit that built it) and which CUDA
// version the installed driver supports. Neither call needs a GPU, and with no driver installed
// cudaDriverGetVersion reports 0 rather than failing.
#include <cuda_runtime.h>

#include "runtime_info.h"

namespace lowbit::cuda {

CudaVersions cuda_versions() {
  CudaVersions v{0, 0};
  if (cudaRuntimeGetVersion(&v.runtime) != cudaSuccess) v.runtime = 0;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  return v;
}

}  // namespace lowbit::cuda
