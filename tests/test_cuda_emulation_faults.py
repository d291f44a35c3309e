"""The host emulation of CUDA under AddressSanitizer reports faulty kernels, and recovers from a failed block.

CI runs tests/test_cuda_emulation.py against lowbit._C_cuda_emu built with ASan/UBSan, so that an out-of-bounds
access in a kernel aborts the run. That run can only fail if ASan sees through the emulation: its threads run as
fibers on stacks of their own (include/lowbit/cuda_host.h), whose shadow the emulation manages. This file builds
tests/cuda_emulation_faults.cpp (kernels with planted faults) with g++ and ASan, runs each fault in its own
process and checks the report names the fault and the kernel; and checks that a block that fails with its fibers
suspended mid-kernel leaves no poisoned stack behind for the launches after it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulation")


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/cuda_emulation_faults.cpp built with ASan and UBSan, as CI builds lowbit._C_cuda_emu."""
    out = tmp_path_factory.mktemp("emulation_faults")
    # The kernels' `#include <cuda_runtime.h>` finds the emulation, as CMake's wrapper directory arranges.
    (out / "cuda_runtime.h").write_text('#include "lowbit/cuda_host.h"\n')
    exe = out / "faults"
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
         "-fno-omit-frame-pointer", f"-I{out}", f"-I{ROOT / 'include'}",
         str(ROOT / "tests" / "cuda_emulation_faults.cpp"), "-o", str(exe)],
        check=True,
    )  # fmt: skip
    return exe


def run(exe: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(exe), mode], capture_output=True, text=True, timeout=120, env={"ASAN_OPTIONS": "detect_leaks=0"}
    )


@pytest.mark.parametrize(
    ("mode", "report", "kernel"),
    [("stack", "stack-buffer-overflow", "stack_overflow"), ("heap", "heap-buffer-overflow", "heap_overflow")],
)
def test_asan_reports_a_kernel_overflow(faults: Path, mode: str, report: str, kernel: str) -> None:
    result = run(faults, mode)
    assert result.returncode != 0
    assert f"ERROR: AddressSanitizer: {report}" in result.stderr, result.stderr[-2000:]
    assert kernel in result.stderr


def test_launches_after_a_failed_block_run_clean(faults: Path) -> None:
    # The failed block's fiber is suspended eight calls deep, so its frames' redzones lie where the next launches'
    # frames are: unless the emulation unpoisons abandoned stacks, ASan reports a stack-buffer-overflow in
    # frames_across_barriers that is not there.
    result = run(faults, "recover")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("failed launch: unspecified launch failure"), lines
    assert "lane 1 never reaches it" in lines[0]
    assert lines[1] == "last: 127 no error", lines
