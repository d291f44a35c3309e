"""Pure-PyTorch twin of Muon's fused momentum step (include/lowbit/momentum_rule.h): the 8-bit buffer decoded,
updated with ATen's own lerp (a fused multiply-add, as the native step computes it), requantized."""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit._reference.quantize import dequantize_blockwise, quantize_blockwise


def muon_momentum_(
    grad: Tensor,
    state: Tensor,
    absmax: Tensor,
    code: Tensor,
    update: Tensor,
    momentum: float,
    nesterov: bool,
    block_size: int,
) -> None:
    """Twin of ``lowbit::muon_momentum_``: updates ``state``, ``absmax`` and ``update`` in place."""
    n = grad.numel()
    g = grad.reshape(-1).float()
    eight_bit = state.dtype == torch.uint8
    if eight_bit:
        m = dequantize_blockwise(state.reshape(-1), absmax, code, 8, block_size, n, torch.float32)
    else:
        m = state.reshape(-1).clone()
    m = torch.lerp(m, g, 1.0 - momentum)
    u = torch.lerp(g, m, momentum) if nesterov else m
    update.view(-1).copy_(u)
    if not eight_bit:
        state.view(-1).copy_(m)
        return
    m = torch.where(m.isfinite(), m, torch.zeros_like(m))
    codes, amax = quantize_blockwise(m, code, 8, block_size, False, 0, 0)
    state.view(-1).copy_(codes)
    absmax.copy_(amax)
