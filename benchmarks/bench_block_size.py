"""Quality/overhead trade-off of the 8-bit state block size: the data behind the default of 256.

    python benchmarks/bench_block_size.py [--steps 100] [--seeds 3] [--numel 20000]

For each block size, Adam8bit and torch.optim.Adam (fp32 states) take the same steps on the same
gradients (scales varying along the tensor, so blocks differ); the table gives the state bytes per
parameter and the relative L2 distance between the two parameter trajectories after ``--steps``
steps, as a fraction of how far torch moved the parameters (mean over seeds).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import lowbit.optim as O

BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


def drift(block_size: int, steps: int, seed: int, numel: int) -> float:
    """Relative distance of Adam8bit's parameters from torch Adam's after ``steps`` steps."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(numel, generator=gen) * 0.1
    a, b = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    ours = O.Adam8bit([a], lr=1e-3, block_size=block_size)
    ref = torch.optim.Adam([b], lr=1e-3, foreach=False)
    scale = 1 + 0.5 * torch.sin(torch.arange(numel) / 50.0)
    for _ in range(steps):
        a.grad = b.grad = torch.randn(numel, generator=gen) * scale
        ours.step()
        ref.step()
    return float((a.detach() - b.detach()).norm() / (b.detach() - p0).norm())


def main() -> None:
    """Print bytes/param and trajectory drift for every block size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--numel", type=int, default=20000)
    args = parser.parse_args()
    print(f"Adam8bit vs torch Adam, {args.numel} params, {args.steps} steps, mean of {args.seeds} seeds")
    print("block size  state bytes/param  relative drift")
    for bs in BLOCK_SIZES:
        mean = sum(drift(bs, args.steps, s, args.numel) for s in range(args.seeds)) / args.seeds
        # Two uint8 states plus one fp32 absmax per block for each.
        print(f"{bs:10d}  {2 + 8 / bs:17.4f}  {mean:14.4f}")


if __name__ == "__main__":
    main()
