"""Factorized second moments of the 4-bit Adam optimizers (``factored=True``; Shazeer & Stern 2018,
Adafactor, section 3 and algorithm 4; Li, Chen, Zhu 2023, "4-bit Factor").

For a parameter of 2 or more axes the second moment v is not stored element by element: two fp32 EMAs of
the squared gradient are kept instead, ``row{k+1}`` (the mean over the last axis, shape ``shape[:-1]``)
and ``col{k+1}`` (the mean over axis -2, shape ``shape[:-2] + shape[-1:]``), in place of
``state{k+1}``/``absmax{k+1}``, so that a matrix's v costs ``(R + C) * 4`` bytes. The step divides by
``v_hat = (row / mean(row over its last axis)) (outer) col``; a zero ``mean(row)`` (every squared gradient
so far was 0) gives ``v_hat = 0``, as the unfactored v would be. The first moment stays 4-bit block-wise.

The step is native (include/lowbit/factored.h; csrc/cpu/optim.cpp, csrc/cuda/optim.cu), in the fused call of the
parameter's group with the other parameters: the op takes the factors of every factorized parameter of the call
(lowbit/_ops/optim.py: StepArgs). Here are the conversions of whole states outside the step (layout changes,
loaded state dicts, ``dequantized_state``), with ``mean(row)`` summed in the step's fixed order so that a
reconstructed v is the step's v_hat bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lowbit._C import FACTORED_LANES

__all__ = ["factored_applies", "project", "reconstruct", "row_mean"]


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


def row_mean(row: Tensor) -> Tensor:
    """The mean of ``row`` over its last axis (keeping it), summed in include/lowbit/factored.h's order: value i
    into lane i % FACTORED_LANES in index order, the lanes then in lane order, from 0 (zero padding adds +0,
    which changes no sum of non-negative values), divided by the count."""
    n = row.shape[-1]
    padded = torch.nn.functional.pad(row, (0, -n % FACTORED_LANES))
    lanes = padded.unflatten(-1, (-1, FACTORED_LANES))
    acc = torch.zeros_like(lanes[..., 0, :])
    for j in range(lanes.shape[-2]):
        acc += lanes[..., j, :]
    total = torch.zeros_like(acc[..., :1])
    for lane in range(FACTORED_LANES):
        total += acc[..., lane : lane + 1]
    return total / torch.tensor(n, dtype=torch.float32, device=row.device)  # a true division on CUDA too


def reconstruct(row: Tensor, col: Tensor) -> Tensor:
    """``v_hat = (row / mean(row over its last axis)) (outer) col``, 0 where ``mean(row)`` is 0."""
    mean = row_mean(row)
    # `mean == 0`, not `mean > 0`: a NaN mean (a non-finite gradient) must stay NaN, not become v_hat = 0.
    zero = mean == 0
    scaled = torch.where(zero, torch.zeros_like(row), row / torch.where(zero, torch.ones_like(mean), mean))
    return scaled.unsqueeze(-1) * col.unsqueeze(-2)
