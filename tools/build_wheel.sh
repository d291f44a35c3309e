#!/usr/bin/env bash
# Builds lowbit's wheel and repairs it into a manylinux wheel: tools/build_wheel.sh [OUT_DIR] (default dist/).
#
# CPU kernels only unless LOWBIT_CUDA=ON (tools/build_cuda_wheel.sh sets it up). The Python on PATH builds it;
# the wheel's tag is that Python's (cp311, ...). Environment:
#   LOWBIT_CUDA=OFF|ON|AUTO     CUDA kernels (default OFF here: a wheel's contents must not depend on the PATH)
#   LOWBIT_CUDA_ARCHS           CUDA architectures (CMake syntax; default "75-real;80-real;90")
#   LOWBIT_WHEEL_BUILD_DIR      CMake build directory to build in (and to reuse: only what changed recompiles)
#   LOWBIT_WHEEL_NO_ISOLATION=1 build with this environment's scikit-build-core and pybind11 instead of fresh
#                               copies in a temporary one, so that a build directory configured by
#                               `pip install --no-build-isolation -e .` is reused as it is
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${1:-$root/dist}")"
export LOWBIT_CUDA="${LOWBIT_CUDA:-OFF}"

raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
args=(--wheel --outdir "$raw")
[[ "${LOWBIT_WHEEL_NO_ISOLATION:-0}" == 1 ]] && args+=(--no-isolation)
[[ -n "${LOWBIT_WHEEL_BUILD_DIR:-}" ]] && args+=("-Cbuild-dir=$(realpath -m "$LOWBIT_WHEEL_BUILD_DIR")")
python -m build "${args[@]}" "$root"

# libgomp.so.1 stays outside the wheel: torch's wheels carry it under that name, and lowbit/__init__.py imports
# torch first, so lowbit's kernels run on torch's OpenMP runtime (one thread pool, torch.set_num_threads governs
# both). A vendored copy would be renamed by auditwheel and load as a second runtime.
mkdir -p "$out"
python -m auditwheel repair --exclude libgomp.so.1 --wheel-dir "$out" "$raw"/lowbit-*.whl
python -m auditwheel show "$out"/lowbit-*.whl
