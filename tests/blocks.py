"""Per-block quantities that tests' bounds are stated in."""

from __future__ import annotations

import torch


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """The largest |x| over each block of ``block`` elements of flat ``x``, repeated for every element of
    its block (any float dtype)."""
    flat = x.reshape(-1).abs()
    n = flat.numel()
    padded = torch.cat([flat, flat.new_zeros(-n % block)])
    return padded.view(-1, block).amax(1).repeat_interleave(block)[:n]
