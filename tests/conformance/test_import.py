"""A bare ``import lowbit`` gives every public subpackage, in a fresh interpreter (pytest's own imports
of the test modules would hide a missing one)."""

from __future__ import annotations

import subprocess
import sys


def test_bare_import_gives_the_subpackages():
    code = (
        "import torch, lowbit\n"
        "p = torch.nn.Parameter(torch.zeros(3))\n"
        "lowbit.optim.Adam8bit([p])\n"
        "assert callable(lowbit.lpmm.convert) and callable(lowbit.nn.compress_activations)\n"
        "assert callable(lowbit.functional.quantize_blockwise) and callable(lowbit.memory.saved_tensor_bytes)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
