"""Every script in examples/ runs and does what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_quantize_state_dict_shrinks_weights_about_fourfold():
    out = run("quantize_state_dict.py", "--bits", "8")
    fp32, packed = (int(v.replace(",", "")) for v in re.findall(r"([\d,]+) bytes", out))
    assert 3.8 < fp32 / packed < 4.0  # 1 byte per weight plus one fp32 absmax per 256
    assert float(re.search(r"relative output change: (\S+)", out).group(1)) < 0.02
