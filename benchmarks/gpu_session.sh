#!/usr/bin/env bash
# One GPU validation of lowbit on a lent device machine (/work/.library/device/README.md), in stages:
#
#   bash benchmarks/gpu_session.sh build      # venv over the machine's torch, lowbit built with LOWBIT_CUDA=ON
#   bash benchmarks/gpu_session.sh test       # the full test suite, CUDA tests included (extra args go to pytest)
#   bash benchmarks/gpu_session.sh sanitize   # compute-sanitizer memcheck, then racecheck and synccheck, on tests/test_cuda.py
#   bash benchmarks/gpu_session.sh bench      # benchmarks/bench_gpu.py at full size
#   bash benchmarks/gpu_session.sh resources  # nvcc -Xptxas -v for the device's architecture (no GPU needed)
#   bash benchmarks/gpu_session.sh report     # benchmarks/RESULTS.md from what the stages above wrote
#   bash benchmarks/gpu_session.sh all        # every stage in turn (longer than one device command may run)
#
# The device tool runs one command for at most 10 minutes, so run each stage as its own command, in
# this order, while the machine stays warm (build outputs and logs under build/gpu-session/ persist
# between calls on a warm machine; on a fresh one, run `build` again). Each stage stays inside that
# limit: the long ones run under `timeout` and record a timeout as their result. When $OUT is set,
# each stage copies its log and Markdown there (at most 8 files per command come back), `report`
# copies RESULTS.md. Nothing is fetched from the internet: the venv uses the machine's torch, and
# packages it lacks can be carried as wheels (.whl/, see the device README).
#
#   bash benchmarks/gpu_session.sh --cpu-dry-run [STAGE]
# exercises the same logic on a CPU machine in about a minute: no CUDA build (the installed lowbit and
# the current python), tiny sizes on CPU tensors, tests/test_cuda.py (which skips), the sanitizer
# commands run without the sanitizer, and the report goes to a temporary file, not the committed one.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
if [[ "${1:-}" == "--cpu-dry-run" ]]; then
  dry_run=1
  shift
fi
stage="${1:-all}"
shift || true

if ((dry_run)); then
  work="$(mktemp -d "${TMPDIR:-/tmp}/lowbit-gpu-dry-run.XXXXXX")"
  results="$work/RESULTS.md"
  py="${PYTHON:-python}"
else
  work="build/gpu-session"
  results="benchmarks/RESULTS.md"
  py="$work/venv/bin/python"
fi
logs="$work/logs"
mkdir -p "$logs"
failures=0

# Runs "$@" with its output in $logs/$name.log, under a time limit; records the command, its exit
# status and its duration in $logs/commands.tsv. Never fails: the status is returned for the caller.
run_logged() {
  local name="$1" limit="$2"
  shift 2
  local start status
  start=$(date +%s)
  echo "gpu_session: $name: $*"
  set +e
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  status=$?
  set -e
  printf '%s\t%s\t%s\t%s\n' "$name" "$*" "$status" "$(($(date +%s) - start))" >>"$logs/commands.tsv"
  tail -n 3 "$logs/$name.log"
  if ((status == 124)); then
    echo "gpu_session: $name: stopped after ${limit}s"
  fi
  return "$status"
}

# pytest's exit status as a verdict: 0 passed; in a dry run also 5 ("no tests ran": tests/test_cuda.py
# skips as a whole on a machine without a GPU).
pytest_ok() {
  (($1 == 0)) || ((dry_run && $1 == 5))
}

# Copies the named files from $logs to $OUT, when the device tool set it.
to_out() {
  if [[ -n "${OUT:-}" ]]; then
    local f
    for f in "$@"; do
      if [[ -f "$f" ]]; then cp "$f" "$OUT/"; fi
    done
  fi
  return 0
}

stage_build() {
  if ((dry_run)); then
    run_logged build 120 "$py" -c "import lowbit; print(lowbit._C.build_info())" || failures=$((failures + 1))
  else
    local archs
    # The machine's python3 is itself a venv, which --system-site-packages would not see through: a .pth
    # file puts its packages (torch, pytest, scikit-build-core, ...) on the new venv's path instead.
    python3 -m venv "$work/venv"
    python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
      >"$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/device_python.pth"
    # The device's own architecture only: the defaults (README, Build) are compile-checked in CI.
    archs="${LOWBIT_CUDA_ARCHS:-$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')}"
    run_logged build 560 env LOWBIT_CUDA=ON LOWBIT_CUDA_ARCHS="$archs" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$py" -m pip install --no-build-isolation --no-deps --no-index -v -e . || failures=$((failures + 1))
  fi
  {
    echo "## Build"
    echo
    echo '```'
    "$py" - <<'PY' 2>&1 || true
import lowbit, torch
print("lowbit", lowbit.__version__, lowbit._C.build_info())
print("lowbit CUDA versions (runtime built with, driver found):", lowbit._C.cuda_versions())
print("torch", torch.__version__, "CUDA", torch.version.cuda)
PY
    echo '```'
  } >"$logs/build.md"
  to_out "$logs/build.log" "$logs/build.md"
}

stage_test() {
  local status=0
  if ((dry_run)); then
    run_logged test 120 "$py" -m pytest -q tests/test_cuda.py "$@" || status=$?
  elif (($#)); then
    run_logged test 570 "$py" -m pytest -q "$@" || status=$?
  else
    run_logged test 570 "$py" -m pytest -q || status=$?
  fi
  pytest_ok "$status" || failures=$((failures + 1))
  {
    echo "## Tests"
    echo
    echo "exit status $status; pytest's summary:"
    echo
    echo '```'
    grep -E "passed|failed|error|skipped" "$logs/test.log" | tail -n 5 || true
    echo '```'
  } >"$logs/test.md"
  to_out "$logs/test.log" "$logs/test.md"
}

stage_sanitize() {
  local tool status limit
  local -a wrap
  {
    echo "## compute-sanitizer on tests/test_cuda.py"
    echo
    echo "PYTORCH_NO_CUDA_MEMORY_CACHING=1, so each tensor is its own allocation and out-of-bounds accesses"
    echo "are not hidden inside torch's cached blocks."
    echo
    echo "| tool | exit status | summary |"
    echo "|---|---|---|"
  } >"$logs/sanitize.md"
  for tool in memcheck racecheck synccheck; do
    # memcheck is the one that matters most; the other two get what is left of the 10 minutes.
    if [[ "$tool" == memcheck ]]; then limit=300; else limit=130; fi
    if ((dry_run)); then
      wrap=(env)
      limit=60
    else
      wrap=(compute-sanitizer --tool "$tool" --error-exitcode 97 --target-processes all)
    fi
    status=0
    run_logged "sanitize-$tool" "$limit" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${wrap[@]}" \
      "$py" -m pytest -q -x tests/test_cuda.py || status=$?
    pytest_ok "$status" || failures=$((failures + 1))
    echo "| $tool | $status | $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|skipped" "$logs/sanitize-$tool.log" |
      tail -n 2 | tr '\n' ' ' | tr '|' '/') |" >>"$logs/sanitize.md"
  done
  if ((dry_run)); then echo >>"$logs/sanitize.md" && echo "(dry run: the commands ran without the sanitizer)" >>"$logs/sanitize.md"; fi
  to_out "$logs/sanitize-memcheck.log" "$logs/sanitize-racecheck.log" "$logs/sanitize-synccheck.log" "$logs/sanitize.md"
}

stage_bench() {
  local status=0
  local -a mode=()
  if ((dry_run)); then mode=(--cpu-dry-run); fi
  run_logged bench 570 "$py" benchmarks/bench_gpu.py "${mode[@]}" --json "$logs/bench_gpu.json" || status=$?
  ((status == 0)) || failures=$((failures + 1))
  {
    echo "## Benchmarks (benchmarks/bench_gpu.py, exit status $status)"
    echo
    grep -v "^wrote " "$logs/bench.log"
  } >"$logs/bench.md"
  to_out "$logs/bench.log" "$logs/bench.md" "$logs/bench_gpu.json"
}

stage_resources() {
  local arch f title
  if ((dry_run)); then
    echo "## Compile-time resource report" >"$logs/resources.md"
    echo >>"$logs/resources.md"
    echo "(dry run: not compiled)" >>"$logs/resources.md"
    return 0
  fi
  arch="${LOWBIT_PTXAS_ARCH:-sm_90}"
  : >"$logs/ptxas.log"
  for f in csrc/cuda/quantize.cu csrc/cuda/optim.cu csrc/cuda/fewbit.cu csrc/cuda/invact.cu csrc/cuda/blpa.cu \
    csrc/cuda/lpmm.cu; do
    echo "== $(basename "$f")" >>"$logs/ptxas.log"
    nvcc -std=c++17 -O3 --fmad=false -arch="$arch" -Xptxas -v -Iinclude -Icsrc -DLOWBIT_WITH_CUDA -c "$f" \
      -o /dev/null >>"$logs/ptxas.log" 2>&1 &
  done
  wait
  title="${LOWBIT_RESOURCES_TITLE:-Compile-time resource report ($arch)}"
  {
    echo "## $title"
    echo
    echo "Command, per file: \`nvcc -std=c++17 -O3 --fmad=false -arch=$arch -Xptxas -v -Iinclude -Icsrc"
    echo "-DLOWBIT_WITH_CUDA -c csrc/cuda/FILE.cu\`, summarized by \`benchmarks/ptxas_report.py\` (ranges over a"
    echo "kernel's instantiations). A stack frame is local memory: runtime-indexed per-thread arrays."
    echo
    python3 benchmarks/ptxas_report.py "$logs/ptxas.log"
  } >"$logs/resources.md"
  to_out "$logs/ptxas.log" "$logs/resources.md"
}

stage_report() {
  local part
  {
    echo "# GPU session results"
    echo
    echo "Written by \`bash benchmarks/gpu_session.sh report\` on $(date -u +%Y-%m-%dT%H:%MZ)."
    echo
    echo "## Device"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "no nvidia-smi"
    if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "no nvcc"; fi
    echo '```'
    echo
    echo "## Commands"
    echo
    echo "| stage | command | exit status | seconds |"
    echo "|---|---|---|---|"
    if [[ -f "$logs/commands.tsv" ]]; then
      awk -F'\t' '{gsub(/\|/, "/", $2); printf "| %s | `%s` | %s | %s |\n", $1, $2, $3, $4}' "$logs/commands.tsv"
    fi
    for part in build test sanitize bench resources; do
      if [[ -f "$logs/$part.md" ]]; then
        echo
        cat "$logs/$part.md"
      fi
    done
  } >"$results"
  echo "gpu_session: wrote $results"
  to_out "$results"
}

case "$stage" in
  build | test | sanitize | bench | resources | report) "stage_$stage" "$@" ;;
  all)
    for s in build test sanitize bench resources report; do "stage_$s"; done
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh [--cpu-dry-run] [build|test|sanitize|bench|resources|report|all]" >&2
    exit 2
    ;;
esac
if ((dry_run)); then
  if [[ "$stage" == all ]]; then
    grep -q "^## Benchmarks" "$results" || {
      echo "gpu_session: dry run: $results lacks the benchmark section" >&2
      failures=$((failures + 1))
    }
  fi
  echo "gpu_session: dry run: $(grep -c '^## ' "$results" 2>/dev/null || echo 0) sections in $results (removed)"
  rm -rf "$work"
fi
if ((failures)); then
  echo "gpu_session: $failures command(s) failed; see the logs" >&2
  exit 1
fi
