"""Per-block quantities that tests' bounds are stated in."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lowbit.optim.state_storage import optimizer_state_map, state_map


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """The largest |x| over each block of ``block`` elements of flat ``x``, repeated for every element of
    its block (any float dtype)."""
    flat = x.reshape(-1).abs()
    n = flat.numel()
    padded = torch.cat([flat, flat.new_zeros(-n % block)])
    return padded.view(-1, block).amax(1).repeat_interleave(block)[:n]


def half_code_gap(signed: bool, bits: int = 8) -> float:
    """The most nearest rounding moves a value normalised by its block's absmax (in [-1, 1] signed, [0, 1]
    unsigned) on a ``bits``-bit optimizer state map (signed: first moments and momentum; unsigned: second
    moments, stored as roots): half the largest gap between adjacent codes, or the distance from an end of
    the range to the map's nearest code where that is larger (the 4-bit root map's floor, 1/16)."""
    code = optimizer_state_map(signed, torch.device("cpu"), bits).double()
    low = -1.0 if signed else 0.0
    return max(0.5 * float(code.diff().max()), float(code[0]) - low, 1.0 - float(code[-1]))


def two_gradient_block(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], steps: int = 2) -> torch.Tensor:
    """The parameter after ``steps`` steps of ``make([p])`` on a 4096-element p whose first gradient is
    10 and 1e-4 in one block (zeros elsewhere), then zeros: the zero-point case of 8-bit states."""
    p = nn.Parameter(torch.zeros(4096))
    opt = make([p])
    g = torch.zeros(4096)
    g[0], g[1] = 10.0, 1e-4
    for grad in [g] + [torch.zeros(4096)] * (steps - 1):
        p.grad = grad.clone()
        opt.step()
    return p.detach()


def adjacent_code_ratio(low: float, high: float) -> float:
    """The largest ratio of adjacent magnitudes of either 8-bit state map between ``low`` and ``high``:
    nearest rounding keeps a value there within this factor."""
    ratios = []
    for signed in (True, False):
        code = state_map(signed, torch.device("cpu")).abs().unique()
        near = code[(code > low) & (code < high)]
        ratios.append(float((near[1:] / near[:-1]).max()))
    return max(ratios)
