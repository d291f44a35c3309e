#!/usr/bin/env bash
# One GPU validation of lowbit on a lent device machine (/work/.library/device/README.md), in stages:
#
#   bash benchmarks/gpu_session.sh build      # venv over the machine's torch, lowbit built with LOWBIT_CUDA=ON
#   bash benchmarks/gpu_session.sh test       # the full test suite, CUDA tests included (extra args go to pytest)
#   bash benchmarks/gpu_session.sh sanitize   # compute-sanitizer memcheck, then racecheck and synccheck, on tests/test_cuda.py
#   bash benchmarks/gpu_session.sh demo       # python -m lowbit (self-check) and the demo with --device cuda
#   bash benchmarks/gpu_session.sh bench      # benchmarks/bench_gpu.py at full size
#   bash benchmarks/gpu_session.sh memory     # every demo configuration at 1B parameters (bench_demo_memory.py)
#   bash benchmarks/gpu_session.sh profile    # Nsight Compute on benchmarks/profile_gpu_kernels.py
#   bash benchmarks/gpu_session.sh resources  # nvcc -Xptxas -v for the device's architecture (no GPU needed)
#   bash benchmarks/gpu_session.sh report     # benchmarks/RESULTS.md from what the stages above wrote
#   bash benchmarks/gpu_session.sh all        # every stage in turn (longer than one device command may run)
#   bash benchmarks/gpu_session.sh device     # the stages in one device command, inside a time budget
#
# `device` is the one-call check: build (or LOWBIT_PREBUILT=1: the lowbit/_C module carried along), the
# CUDA tests of the suite (`-k cuda`), compute-sanitizer memcheck, the self-check and the demo on CUDA, the
# benchmarks, the profile, then racecheck and synccheck with the time left, the resource report alongside
# and RESULTS.md. Every stage's limit is clamped to a deadline LOWBIT_GPU_BUDGET_S seconds (default 450)
# after it starts, so the command ends with its report inside the device tool's 10 minutes; a stage cut
# short records status 124. It packs the logs into $OUT/gpu-session-logs.tar.gz beside RESULTS.md and
# bench_gpu.json.
#
# Otherwise run each stage as its own command, in this order, while the machine stays warm (build outputs
# and logs under build/gpu-session/ persist between calls on a warm machine; on a fresh one, run `build`
# again). Each stage stays inside that limit: the long ones run under `timeout` and record a timeout as
# their result. When $OUT is set,
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
# Epoch seconds after which no stage runs (0: none); the `device` stage sets it.
deadline=0
# Set by the `device` stage: logs travel to $OUT as one archive at the end instead of stage by stage.
pack_outputs=0

# Runs "$@" with its output in $logs/$name.log, under a time limit; records the command, its exit
# status and its duration in $logs/commands.tsv. Never fails: the status is returned for the caller.
run_logged() {
  local name="$1" limit="$2"
  shift 2
  local start status
  start=$(date +%s)
  if ((deadline)); then
    if ((deadline - start < limit)); then limit=$((deadline - start)); fi
    if ((limit < 10)); then
      echo "gpu_session: $name: not run, the deadline has passed" | tee "$logs/$name.log"
      printf '%s\t%s\t%s\t%s\n' "$name" "$*" "124 (no time left)" 0 >>"$logs/commands.tsv"
      return 124
    fi
  fi
  echo "gpu_session: $name: $* (limit ${limit}s)"
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
  if [[ -n "${OUT:-}" ]] && ((!pack_outputs)); then
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
    # LOWBIT_PREBUILT=1: a lowbit/_C module built elsewhere for this python and carried along saves the build,
    # if it imports with its CUDA kernels; the sources' directory goes on the path (the benchmarks run from
    # benchmarks/). Otherwise it is removed, so that the editable install's module is the one imported.
    if [[ "${LOWBIT_PREBUILT:-0}" == 1 ]] && run_logged build-prebuilt 60 env PYTHONPATH="$PWD:${PYTHONPATH:-}" \
      "$py" -c "import lowbit; assert lowbit._C.build_info()['cuda'], 'no CUDA kernels'; print(lowbit._C.build_info())"; then
      export PYTHONPATH="$PWD:${PYTHONPATH:-}"
      cp "$logs/build-prebuilt.log" "$logs/build.log"
    else
      rm -f lowbit/_C.cpython-*.so
      # The device's own architecture only: the defaults (README, Build) are compile-checked in CI.
      archs="${LOWBIT_CUDA_ARCHS:-$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')}"
      run_logged build "${limit_build:-560}" env LOWBIT_CUDA=ON LOWBIT_CUDA_ARCHS="$archs" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$py" -m pip install --no-build-isolation --no-deps --no-index -v -e . ||
        failures=$((failures + 1))
    fi
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
  else
    run_logged test "${limit_test:-570}" "$py" -m pytest -q "$@" || status=$?
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

# Runs the named compute-sanitizer tools (default: memcheck, racecheck, synccheck) over tests/test_cuda.py, or
# the part of it that LOWBIT_SANITIZE_K selects (a pytest -k expression), adding a row per tool to sanitize.md.
stage_sanitize() {
  local tool status limit
  local -a wrap select=()
  local tools=("$@")
  if ((${#tools[@]} == 0)); then tools=(memcheck racecheck synccheck); fi
  if [[ -n "${LOWBIT_SANITIZE_K:-}" ]]; then select=(-k "$LOWBIT_SANITIZE_K"); fi
  if [[ ! -f "$logs/sanitize.md" ]]; then
    {
      echo "## compute-sanitizer on tests/test_cuda.py"
      echo
      echo "PYTORCH_NO_CUDA_MEMORY_CACHING=1, so each tensor is its own allocation and out-of-bounds accesses"
      echo "are not hidden inside torch's cached blocks. Tests selected: ${LOWBIT_SANITIZE_K:-all}."
      echo
      echo "| tool | exit status | summary |"
      echo "|---|---|---|"
    } >"$logs/sanitize.md"
  fi
  for tool in "${tools[@]}"; do
    # memcheck is the one that matters most; the other two get what is left of the 10 minutes.
    if [[ "$tool" == memcheck ]]; then limit="${limit_memcheck:-300}"; else limit="${limit_sanitize_other:-130}"; fi
    if ((dry_run)); then
      wrap=(env)
      limit=60
    else
      wrap=(compute-sanitizer --tool "$tool" --error-exitcode 97 --target-processes all)
    fi
    status=0
    run_logged "sanitize-$tool" "$limit" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${wrap[@]}" \
      "$py" -m pytest -q -x tests/test_cuda.py "${select[@]}" || status=$?
    pytest_ok "$status" || failures=$((failures + 1))
    echo "| $tool | $status | $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|skipped|not run" "$logs/sanitize-$tool.log" |
      tail -n 2 | tr '\n' ' ' | tr '|' '/') |" >>"$logs/sanitize.md"
  done
  if ((dry_run)); then echo >>"$logs/sanitize.md" && echo "(dry run: the commands ran without the sanitizer)" >>"$logs/sanitize.md"; fi
  to_out "$logs/sanitize-memcheck.log" "$logs/sanitize-racecheck.log" "$logs/sanitize-synccheck.log" "$logs/sanitize.md"
}

# `python -m lowbit` (the build, the devices and its CUDA self-check) and the demo on the device: every config
# trains from the same weights and batches, so its table says whether CUDA training matches the CPU's figures.
stage_demo() {
  local status=0 device=cuda steps=300
  if ((dry_run)); then device=cpu steps=2; fi
  run_logged selfcheck 120 "$py" -m lowbit || status=$?
  run_logged demo "${limit_demo:-300}" "$py" -m lowbit demo --device "$device" --steps "$steps" --out "$work/demo" ||
    status=$?
  ((status == 0)) || failures=$((failures + 1))
  {
    echo "## python -m lowbit and the demo on the device (exit status $status)"
    echo
    echo '```'
    cat "$logs/selfcheck.log"
    echo
    grep -v "it/s\|s/it" "$logs/demo.log" || true
    echo '```'
  } >"$logs/demo.md"
  to_out "$logs/selfcheck.log" "$logs/demo.log" "$logs/demo.md"
}

# Every configuration of the demo on a GPT of about 1B parameters (LOWBIT_MEMORY_PARAMS), a few steps each:
# bytes per parameter from storage, their peak during the step and torch.cuda.max_memory_allocated. Not part
# of `device` (its budget is spent); run it as its own command on a warm machine after `build`.
stage_memory() {
  local status=0
  local -a size=(--device cuda --params "${LOWBIT_MEMORY_PARAMS:-1e9}")
  if ((dry_run)); then size=(--device cpu --params 1e5 --steps 2); fi
  run_logged memory "${limit_memory:-540}" "$py" benchmarks/bench_demo_memory.py "${size[@]}" \
    --json "$logs/demo_memory.json" || status=$?
  ((status == 0)) || failures=$((failures + 1))
  {
    echo "## Every demo configuration at scale (benchmarks/bench_demo_memory.py ${size[*]}, exit status $status)"
    echo
    echo '```'
    # The table and the header, without the progress lines; the Markdown rows go below the block.
    grep -v '\] [0-9]*/[0-9]*  loss\|^|\|^wrote ' "$logs/memory.log" || true
    echo '```'
    echo
    grep '^|' "$logs/memory.log" || true
  } >"$logs/memory.md"
  to_out "$logs/memory.log" "$logs/memory.md" "$logs/demo_memory.json"
}

stage_bench() {
  local status=0
  local -a mode=()
  if ((dry_run)); then mode=(--cpu-dry-run); fi
  run_logged bench "${limit_bench:-570}" "$py" benchmarks/bench_gpu.py "${mode[@]}" --json "$logs/bench_gpu.json" || status=$?
  ((status == 0)) || failures=$((failures + 1))
  {
    echo "## Benchmarks (benchmarks/bench_gpu.py, exit status $status)"
    echo
    grep -v "^wrote " "$logs/bench.log"
  } >"$logs/bench.md"
  to_out "$logs/bench.log" "$logs/bench.md" "$logs/bench_gpu.json"
}

# Nsight Compute's counters for one launch of each of lowbit's slowest kernels (benchmarks/profile_gpu_kernels.py):
# the full report in profile.log, the lines that say what binds each kernel in profile.md. The card's clocks are
# left as they are (--clock-control none).
stage_profile() {
  local status=0
  if ((dry_run)); then
    run_logged profile 120 "$py" benchmarks/profile_gpu_kernels.py --cpu-dry-run || status=$?
  else
    run_logged profile "${limit_profile:-300}" ncu --clock-control none --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --kernel-name regex:'optimizer_kernel|quantize_kernel|fewbit_' \
      --launch-count 16 "$py" benchmarks/profile_gpu_kernels.py || status=$?
  fi
  ((status == 0)) || failures=$((failures + 1))
  {
    echo "## Nsight Compute: what binds the slowest kernels (exit status $status)"
    echo
    echo "One launch each of the workloads in \`benchmarks/profile_gpu_kernels.py\`; the full report is profile.log."
    echo
    echo '```'
    grep -E "\)x\(|Duration|Memory Throughput|Compute \(SM\) Throughput|Registers Per Thread|Theoretical Occupancy|Achieved Occupancy|Warp Cycles Per Issued|Local Memory|Block Limit Registers|Block Limit Shared" \
      "$logs/profile.log" | grep -v "^ *----" || true
    echo '```'
  } >"$logs/profile.md"
  to_out "$logs/profile.log" "$logs/profile.md"
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
  local -a files=(quantize optim fewbit invact blpa lpmm)
  # One log per file while they compile in parallel, joined in order after: a shared log would interleave
  # their reports under the wrong file's header.
  for f in "${files[@]}"; do
    nvcc -std=c++17 -O3 --fmad=false -arch="$arch" -Xptxas -v -Iinclude -Icsrc -DLOWBIT_WITH_CUDA -c "csrc/cuda/$f.cu" \
      -o /dev/null >"$logs/ptxas-$f.log" 2>&1 &
  done
  wait
  for f in "${files[@]}"; do
    echo "== $f.cu"
    cat "$logs/ptxas-$f.log"
    rm "$logs/ptxas-$f.log"
  done >"$logs/ptxas.log"
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
    for part in build test sanitize demo bench memory profile resources; do
      if [[ -f "$logs/$part.md" ]]; then
        echo
        cat "$logs/$part.md"
      fi
    done
  } >"$results"
  echo "gpu_session: wrote $results"
  to_out "$results"
}

# Every check in one device command, inside LOWBIT_GPU_BUDGET_S seconds (see the header).
stage_device() {
  local -a parallel=()
  deadline=$(($(date +%s) + ${LOWBIT_GPU_BUDGET_S:-450}))
  pack_outputs=1
  limit_build=240 limit_test=150 limit_memcheck=120 limit_demo=90 limit_bench=150 limit_profile=90
  limit_sanitize_other=60
  # The CPU dry run checks this script's logic, not the device's speed: its demo trains each configuration in a
  # fresh process (torch imported eight times), which a loaded 2-core CI machine cannot do in the device's 90 s.
  if ((dry_run)); then limit_demo=240; fi
  # pytest-xdist spreads the tests over the device machine's cores; the dry run's venv may lack it.
  if ((!dry_run)); then parallel=(-n 8); fi
  stage_build
  stage_resources &
  stage_test -k cuda --ignore=tests/test_cuda_emulation.py --continue-on-collection-errors "${parallel[@]}"
  stage_sanitize memcheck
  stage_demo
  stage_bench
  stage_profile
  stage_sanitize racecheck synccheck
  wait
  stage_report
  if [[ -n "${OUT:-}" ]]; then
    tar czf "$OUT/gpu-session-logs.tar.gz" -C "$work" logs
    cp "$results" "$OUT/"
    if [[ -f "$logs/bench_gpu.json" ]]; then cp "$logs/bench_gpu.json" "$OUT/"; fi
  fi
}

case "$stage" in
  build | test | sanitize | demo | bench | memory | profile | resources | report | device) "stage_$stage" "$@" ;;
  all)
    for s in build test sanitize demo bench memory profile resources report; do "stage_$s"; done
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh [--cpu-dry-run] [build|test|sanitize|demo|bench|memory|profile|resources|report|all|device]" >&2
    exit 2
    ;;
esac
if ((dry_run)); then
  if [[ "$stage" == all || "$stage" == device ]]; then
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
