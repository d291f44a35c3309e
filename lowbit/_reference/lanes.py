"""Sums in the fixed orders of the native loops (include/lowbit/factored.h's rows, norm_order.h's norms), written
with element-wise tensor additions, which round as the native additions do."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["lane_sum"]


def lane_sum(x: Tensor, lanes: int) -> Tensor:
    """The sum of ``x`` over its last axis in lane order: value i added into lane i % ``lanes``, in index order
    from 0, then the lanes added in lane order from 0."""
    n = x.shape[-1]
    acc = torch.zeros(*x.shape[:-1], lanes, dtype=x.dtype, device=x.device)
    for start in range(0, n, lanes):
        chunk = x[..., start : start + lanes]
        acc[..., : chunk.shape[-1]] = acc[..., : chunk.shape[-1]] + chunk
    total = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for lane in range(lanes):
        total = total + acc[..., lane]
    return total
