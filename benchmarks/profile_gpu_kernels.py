"""The workloads that Nsight Compute profiles in a GPU session: one launch each of lowbit's slowest kernels in
benchmarks/RESULTS.md, at a size that fills the chip, so their counters say whether each is bound by memory,
by instructions or by latency.

Run under ncu from the repository root (benchmarks/gpu_session.sh's `profile` stage does)::

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --kernel-name regex:'optimizer_kernel|quantize_kernel|fewbit_' \\
        python benchmarks/profile_gpu_kernels.py

Without a GPU (``--cpu-dry-run``) it runs the same calls on small CPU tensors, to check the script itself.
The workloads, in launch order: an AdamW8bit step (the first step allocates the states, the second is the
one to read), 8-bit block-wise quantization of fp32 data, and a FewBitGELU forward and backward.
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch

import lowbit.optim
from lowbit import functional
from lowbit.nn.activations import FewBitGELU

# 64M elements: 16 waves of a 132-SM chip even at 8-element blocks, so the counters show steady state.
NUMEL = 1 << 26
SIDE = 4096
TINY_NUMEL = 1 << 14
TINY_SIDE = 64


def run(numel: int, side: int, device: torch.device) -> None:
    """The workloads of the module docstring, in that order, then a device synchronization."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(max(1, numel // (side * side))):
        p = torch.randn(side, side, generator=gen, device=device).requires_grad_()
        p.grad = torch.randn(side, side, generator=gen, device=device)
        params.append(p)
    opt = lowbit.optim.AdamW8bit(params, lr=1e-3)
    opt.step()
    opt.step()
    x = torch.randn(numel, generator=gen, device=device)
    functional.quantize_blockwise(x, blocksize=256)
    x.requires_grad_()
    FewBitGELU(3).to(device)(x).backward(torch.randn(numel, generator=gen, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Optional[list[str]] = None) -> None:
    """Parse the options and run the workloads."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="small CPU tensors, no GPU needed")
    args = p.parse_args(argv)
    if args.cpu_dry_run:
        run(TINY_NUMEL, TINY_SIDE, torch.device("cpu"))
    else:
        run(NUMEL, SIDE, torch.device("cuda"))
    print("profile_gpu_kernels: done")


if __name__ == "__main__":
    main()
