"""Pure-PyTorch twin of the factored 4-bit Adam step (lowbit/optim/factored.py; Shazeer & Stern 2018,
Adafactor, algorithm 4; Li, Chen, Zhu 2023, "4-bit Factor"): the same fp32 operations in the same order,
with the first moment coded by the block-wise twins of lowbit._reference.quantize, so that results agree
bit for bit with the optimizer's native step (include/lowbit/factored.h). The sums of g^2 and of the rows are
added in that header's fixed order, written here with element-wise tensor additions (which round as the
native additions do): a row's values into 32 lanes in index order, the lanes in lane order; a column's
values in blocks of 64 rows, row by row, the blocks' sums in block order."""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit._reference.lanes import lane_sum
from lowbit._reference.optim import _torch_lerp
from lowbit._reference.quantize import _sqrt32, dequantize_blockwise, quantize_blockwise

__all__ = ["column_sum", "factored_adam_step_", "factored_v_hat"]

# include/lowbit/factored.h: kFactoredLanes and kFactoredRowBlock (tests/test_native_constants.py checks the copies).
_LANES = 32
_ROW_BLOCK = 64


def column_sum(x: Tensor) -> Tensor:
    """The sum of ``x`` over axis -2 in factored.h's column order: each block of 64 rows row by row from 0, then
    the blocks' sums block by block from 0."""
    rows = x.shape[-2]
    total = torch.zeros(*x.shape[:-2], x.shape[-1], dtype=x.dtype, device=x.device)
    for start in range(0, rows, _ROW_BLOCK):
        part = torch.zeros_like(total)
        for r in range(start, min(start + _ROW_BLOCK, rows)):
            part = part + x[..., r, :]
        total = total + part
    return total


def _div(x: Tensor, d: float) -> Tensor:
    """x / d in fp32, as the native division: by a tensor, since torch on CUDA divides by a Python number as a
    multiplication by its reciprocal."""
    return x / torch.tensor(d, dtype=torch.float32, device=x.device)


def factored_v_hat(row: Tensor, col: Tensor) -> Tensor:
    """``(row / mean(row over its last axis)) (outer) col``, 0 where that mean is 0."""
    mean = _div(lane_sum(row, _LANES), row.shape[-1]).unsqueeze(-1)
    safe = torch.where(mean == 0, torch.ones_like(mean), mean)
    return torch.where(mean == 0, torch.zeros_like(row), row / safe).unsqueeze(-1) * col.unsqueeze(-2)


def factored_adam_step_(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    m_map: Tensor,
    block_size: int,
) -> None:
    """Step ``param`` (2 or more axes) and its factored state ``state`` (``state1``/``absmax1``: 4-bit
    block-wise m; ``row2``/``col2``: the factors of v) in place, as step number ``step``."""
    beta1, beta2 = betas
    n = param.numel()
    p32, g = param.float(), grad.float()
    if maximize:
        g = -g
    if weight_decay != 0 and not decoupled:
        g = g + weight_decay * p32
    m = dequantize_blockwise(state["state1"], state["absmax1"], m_map, 4, block_size, n, torch.float32)
    m = _torch_lerp(m.view(param.shape), g, 1.0 - beta1)
    square = g * g
    row = state["row2"] * beta2 + _div(lane_sum(square, _LANES), square.shape[-1]) * (1.0 - beta2)
    col = state["col2"] * beta2 + _div(column_sum(square), square.shape[-2]) * (1.0 - beta2)
    bias2_sqrt = (1.0 - beta2**step) ** 0.5
    denom = _div(_sqrt32(factored_v_hat(row, col)), bias2_sqrt) + eps  # sqrtf's rounding, which torch's can miss
    if weight_decay != 0 and decoupled:
        p32 = p32 * (1.0 - lr * weight_decay)
    p32 = p32 - (lr / (1.0 - beta1**step)) * m / denom
    codes, absmax = quantize_blockwise(m, m_map, 4, block_size, False, 0, 0)
    param.copy_(p32)
    state.update(state1=codes, absmax1=absmax, row2=row, col2=col)
