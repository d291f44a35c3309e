"""Factorized second moments of the 4-bit Adam optimizers (``factored=True``; Shazeer & Stern 2018,
Adafactor, section 3 and algorithm 4; Li, Chen, Zhu 2023, "4-bit Factor").

For a parameter of 2 or more axes the second moment v is not stored element by element: two fp32 EMAs of
the squared gradient are kept instead, ``row{k+1}`` (the mean over the last axis, shape ``shape[:-1]``)
and ``col{k+1}`` (the mean over axis -2, shape ``shape[:-2] + shape[-1:]``), in place of
``state{k+1}``/``absmax{k+1}``, so that a matrix's v costs ``(R + C) * 4`` bytes. The step divides by
``v_hat = (row / mean(row over its last axis)) (outer) col``; a zero ``mean(row)`` (every squared gradient
so far was 0) gives ``v_hat = 0``, as the unfactored v would be. The first moment stays 4-bit block-wise.

The step runs here in fp32 PyTorch, one parameter at a time (the native fused step has no factored
path yet: README, Limitations); the first moment is decoded and re-encoded with the native block-wise
coders, as the fused step codes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lowbit import _ops

__all__ = ["FactoredItem", "factored_applies", "factored_step", "project", "reconstruct"]


def factored_applies(p: Tensor) -> bool:
    """Whether a factored layout stores the second moment of ``p``: 2 or more axes."""
    return p.dim() >= 2


def check_not_sharded(p: Tensor, where: str) -> None:
    """Refuse an FSDP2 parameter: its row and column means would need sums over the shards, which the
    factored step does not do."""
    if isinstance(p, DTensor) and factored_applies(p):
        raise NotImplementedError(
            f"lowbit: {where}: factored=True does not support FSDP2 (DTensor) parameters of 2 or more axes; "
            "use factored=False"
        )


def project(v: Tensor) -> tuple[Tensor, Tensor]:
    """(row, col) of a full second moment ``v`` (fp32, 2 or more axes): its means over the last axis and
    over axis -2, Adafactor's factors of v (section 3: the row and column sums, here divided by the
    counts, which ``reconstruct`` cancels)."""
    return v.mean(dim=-1), v.mean(dim=-2)


def reconstruct(row: Tensor, col: Tensor) -> Tensor:
    """``v_hat = (row / mean(row over its last axis)) (outer) col``, 0 where ``mean(row)`` is 0."""
    mean = row.mean(dim=-1, keepdim=True)
    # `mean == 0`, not `mean > 0`: a NaN mean (a non-finite gradient) must stay NaN, not become v_hat = 0.
    zero = mean == 0
    scaled = torch.where(zero, torch.zeros_like(row), row / torch.where(zero, torch.ones_like(mean), mean))
    return scaled.unsqueeze(-1) * col.unsqueeze(-2)


class FactoredItem:
    """One parameter of a factored step: its (local, contiguous) tensor, gradient, state and scalars."""

    def __init__(self, param: Tensor, grad: Tensor, state: dict[str, Any], step_size: float, bias2_sqrt: float):
        self.param, self.grad, self.state = param, grad, state
        self.step_size, self.bias2_sqrt = step_size, bias2_sqrt


def _lerp(m: Tensor, g: Tensor, w: float) -> Tensor:
    """optim_rules.h's torch_lerp (ATen's lerp formula, which switches form at |w| = 0.5), op by op, in one
    new tensor (the sums' operands swapped, which IEEE addition gives the same bits for)."""
    w32 = float(torch.tensor(w, dtype=torch.float32))
    d = g - m
    if abs(w32) < 0.5:
        return d.mul_(w32).add_(m)  # m + w (g - m)
    return d.mul_(w32 - 1.0).add_(g)  # g + (w - 1) (g - m); w32 - 1 is exact for w32 in [0.5, 1]


def factored_step(
    items: list[FactoredItem], hyper: dict[str, Any], decoupled: bool, m_map: Tensor, block_size: int
) -> None:
    """One Adam step of each factored parameter of ``items``, in place: with g the gradient (negated to
    maximize; plus ``weight_decay * p`` for Adam's coupled decay), t the step number and ``v_hat`` from
    the updated factors,

        m <- beta1 m + (1 - beta1) g             (4-bit block-wise, decoded and re-encoded)
        row <- beta2 row + (1 - beta2) mean(g^2, -1),   col <- beta2 col + (1 - beta2) mean(g^2, -2)
        p <- p (1 - lr wd)                        (AdamW's decoupled decay)
        p <- p - lr / (1 - beta1^t) * m / (sqrt(v_hat) / sqrt(1 - beta2^t) + eps)

    torch.optim.Adam's arithmetic with v replaced by v_hat. ``hyper`` holds ``betas``, ``eps``,
    ``weight_decay``, ``maximize`` and ``lr`` (a param group's config); ``decoupled`` is AdamW's decay."""
    beta1, beta2 = hyper["betas"]
    eps, wd, lr = hyper["eps"], hyper["weight_decay"], hyper["lr"]
    for it in items:
        # Contiguous fp32 copies: the means then add in the same order whatever the parameter's strides
        # (channels_last, transposed), so strided parameters step bit for bit like contiguous ones. A
        # contiguous fp32 parameter is its own copy: it is updated in place, last.
        p32 = it.param.float().contiguous()
        g = it.grad.float().contiguous()
        if hyper["maximize"]:
            g = -g
        if wd != 0 and not decoupled:
            g = g + wd * p32
        state = it.state
        n = it.param.numel()
        m = _ops.dequantize_blockwise(state["state1"], state["absmax1"], m_map, 4, block_size, n, torch.float32)
        m = _lerp(m.view(it.param.shape), g, 1.0 - beta1)
        square = g * g
        row = state["row2"] * beta2 + square.mean(dim=-1) * (1.0 - beta2)
        col = state["col2"] * beta2 + square.mean(dim=-2) * (1.0 - beta2)
        del square
        # optim_rules.h's adam_step order: u = step_size * m / denom, subtracted after the decay.
        u = reconstruct(row, col).sqrt_().div_(it.bias2_sqrt).add_(eps)
        u = torch.mul(m, it.step_size).div_(u)
        codes, absmax = _ops.quantize_blockwise(m, m_map, 4, block_size, False, 0, 0)
        if wd != 0 and decoupled:
            p32.mul_(1.0 - lr * wd)
        p32.sub_(u)
        if p32.data_ptr() != it.param.data_ptr():
            it.param.copy_(p32)
        state["state1"], state["absmax1"], state["row2"], state["col2"] = codes, absmax, row, col
