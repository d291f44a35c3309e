"""``python -m lowbit``: diagnostics print, the self-check passes, and it fails when results differ."""

import subprocess
import sys

import pytest
import torch

import lowbit
from lowbit import _C, _ops, _reference
from lowbit.__main__ import main


def _cuda_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("CUDA kernels"))


@pytest.mark.parametrize("args", [[], ["info"]], ids=["default", "info"])
def test_cli_prints_info_and_self_check_passes(args):
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"lowbit        {lowbit.__version__}" in proc.stdout
    assert "self-check: ok" in proc.stdout
    assert ("not built" in _cuda_line(proc.stdout)) == (not _C.cuda_built())


def test_self_check_fails_when_reference_disagrees(monkeypatch, capsys):
    real = _reference.quantize_blockwise

    def corrupted(*args):
        packed, absmax = real(*args)
        packed = packed.clone()
        packed[0] ^= 1
        return packed, absmax

    monkeypatch.setattr(_reference, "quantize_blockwise", corrupted)
    assert main([]) == 1
    out = capsys.readouterr().out
    assert "self-check: FAILED (16 of 32 cases)" in out
    assert "codes differ from _reference" in out
    # Only the map quantizer's twin was corrupted, so the linear groups still pass.
    assert all(line.endswith("ok") for line in out.splitlines() if "quantize_linear " in line)


def test_gpu_without_cuda_kernels_prints_rebuild_hint(monkeypatch, capsys):
    cpu_only = {**_C.build_info(), "cuda": False, "cuda_archs": "", "cuda_runtime": ""}
    monkeypatch.setattr(_C, "build_info", lambda: cpu_only)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "not built" in _cuda_line(out)
    assert "cuda:0 Fake GPU (capability 9.0)" in out
    assert _ops.CUDA_NOT_BUILT in out
    assert "  cuda:0 " not in out.split("self-check:", 1)[1]
