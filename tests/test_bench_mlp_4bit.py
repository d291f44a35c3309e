"""The CI smoke of benchmarks/bench_mlp_4bit.py: a few steps on a tiny set, run as a script (a fresh process,
as a user runs it), whose table must have its rows and report the losses that independent runs give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_mlp_4bit as bench  # noqa: E402

STEPS, N = 3, 64

# Every row but torchao's (importing torchao costs seconds): "4-bit" selects the decomposition rows.
ROWS = [
    "torch AdamW",
    "lowbit AdamW8bit",
    "lowbit AdamW4bit (block-wise)",
    "lowbit AdamW4bit (rank-1)",
    "lowbit AdamW4bit (factored)",
    "lowbit AdamW4bit (stochastic)",
    "twin AdamW4bit (block-wise)",
    "twin AdamW4bit (rank-1)",
    "twin AdamW4bit (stochastic)",
    "AdamW, m 4-bit",
    "AdamW, sqrt(v) 4-bit",
    "AdamW, m and sqrt(v) 4-bit",
    "AdamW, sqrt(v) 4-bit with a zero code",
    "AdamW, v factored, m 4-bit",
]


def _torch_adamw_loss(seed: int) -> float:
    """The final loss of torch.optim.AdamW on the benchmark's set, trained here (the bench's defaults)."""
    x, y = bench.data(seed, N, 0.3)
    net = bench.model(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, eps=1e-8, weight_decay=1e-2)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(net(x), y))


def test_tiny_run_prints_every_row_and_exits_0():
    argv = ["--steps", str(STEPS), "--seeds", "0", "1", "--n", str(N), "--rows", "lowbit", "twin", "4-bit"]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_mlp_4bit.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    table = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, rows = table[0], {row[0].lstrip("| "): row[1:] for row in table[1:]}
    assert header[0] == "| optimizer"
    assert list(rows) == ROWS
    losses = {name: [float(x) for x in row[0].split()] for name, row in rows.items()}
    # torch's row is torch.optim.AdamW's loss, printed to 5 significant digits (relative rounding <= 5e-5).
    want = [_torch_adamw_loss(seed) for seed in (0, 1)]
    for got, ref in zip(losses["torch AdamW"], want, strict=True):
        assert abs(got - ref) <= 5e-5 * ref, (got, ref)
    # The native steps equal their pure-PyTorch twins bit for bit, so they print the same digits.
    for kind in ("block-wise", "rank-1", "stochastic"):
        assert losses[f"lowbit AdamW4bit ({kind})"] == losses[f"twin AdamW4bit ({kind})"], kind
    # Each ratio is the row's loss over torch's, to 3 decimals (the losses printed to 5 digits: the ratio of
    # the printed values is within 1e-4 of the true one, below the 3rd decimal's half unit 5e-4 + that).
    for name, row in rows.items():
        for ratio, got, base in zip(row[1].split(), losses[name], losses["torch AdamW"], strict=True):
            assert abs(float(ratio) - got / base) <= 5e-4 + 1e-4, (name, ratio)
        assert float(row[2].rstrip(" |")) > 0
    assert rows["torch AdamW"][1].split() == ["1.000", "1.000"]
