#!/usr/bin/env bash
# Builds lowbit's CUDA wheel: tools/build_cuda_wheel.sh [OUT_DIR] (default dist/cuda/).
#
# The kernels for architectures 75 (T4), 80 (A100) and 90 (H100/H200, with PTX for newer GPUs) unless
# LOWBIT_CUDA_ARCHS names others (CMake syntax, e.g. "86-real;89-real"). The CUDA runtime is linked statically
# (CMakeLists.txt), so the wheel imports and runs its CPU kernels on machines without a GPU driver, and needs a
# driver that supports the toolkit's CUDA version only when a CUDA tensor arrives. The nvcc on PATH (or CUDACXX)
# must have the CUDA major of the installed torch (torch.version.cuda): a driver new enough for torch is then
# new enough for lowbit. LOWBIT_ALLOW_CUDA_MISMATCH=1 builds anyway (for a CPU-only torch, it must be set).
# Other settings as in tools/build_wheel.sh, which this calls.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
nvcc="${CUDACXX:-$(command -v nvcc || true)}"
if [[ -z "$nvcc" ]]; then
  echo "build_cuda_wheel: no nvcc on PATH and CUDACXX unset; install the CUDA toolkit of your torch's CUDA major" >&2
  exit 1
fi
nvcc_version="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
torch_cuda="$(python -c 'import torch; print(torch.version.cuda or "")')"
if [[ "${nvcc_version%%.*}" != "${torch_cuda%%.*}" ]]; then
  msg="nvcc is CUDA $nvcc_version but the installed torch $(python -c 'import torch; print(torch.__version__)')"
  msg+=" is built for CUDA ${torch_cuda:-none (a CPU-only torch)}"
  if [[ "${LOWBIT_ALLOW_CUDA_MISMATCH:-0}" != 1 ]]; then
    want="the nvcc of CUDA ${torch_cuda%%.*}.x"
    [[ -z "$torch_cuda" ]] && want="a CUDA build of torch (https://pytorch.org/get-started/locally/)"
    echo "build_cuda_wheel: $msg. Install $want, or set LOWBIT_ALLOW_CUDA_MISMATCH=1 to build anyway:" \
      "the wheel then needs a driver that supports CUDA $nvcc_version." >&2
    exit 1
  fi
  echo "build_cuda_wheel: warning: $msg (LOWBIT_ALLOW_CUDA_MISMATCH=1)" >&2
fi
export CUDACXX="$nvcc" LOWBIT_CUDA=ON LOWBIT_CUDA_ARCHS="${LOWBIT_CUDA_ARCHS:-75-real;80-real;90}"
echo "build_cuda_wheel: CUDA $nvcc_version, architectures $LOWBIT_CUDA_ARCHS, static CUDA runtime"
exec "$root/tools/build_wheel.sh" "${1:-$root/dist/cuda}"
