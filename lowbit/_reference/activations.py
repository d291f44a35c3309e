"""Pure-PyTorch twins of the activation-compression ops: few-bit codes and gradients, inverted
activations, approximate-activation blocks (include/lowbit/fewbit.h, invact.h, blpa.h)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from lowbit._reference.quantize import _sqrt32, pack_bits, unpack_bits


def fewbit_encode(x: Tensor, boundaries: Tensor, bits: int) -> Tensor:
    """Twin of ``lowbit::fewbit_encode``: the number of boundaries < x (NaN: 0), bit-packed."""
    xf = x.reshape(-1).float()
    codes = torch.bucketize(xf, boundaries)
    codes = torch.where(torch.isnan(xf), torch.zeros_like(codes), codes)
    return pack_bits(codes, bits)


def fewbit_grad(grad: Tensor, packed: Tensor, levels: Tensor, bits: int) -> Tensor:
    """Twin of ``lowbit::fewbit_grad``: ``grad * levels[code]`` in fp32, rounded to grad's dtype."""
    codes = unpack_bits(packed, bits, grad.numel())
    return (grad.reshape(-1).float() * levels[codes]).to(grad.dtype).reshape(grad.shape)


def invact_grad(grad: Tensor, y: Tensor, bits: Tensor, coeffs: Tensor, params: Tensor) -> Tensor:
    """Twin of ``lowbit::invact_grad``: invact.h's invact_slope, one fp32 torch op per C++ operation."""
    n = grad.numel()
    right = unpack_bits(bits, 1, n).long()
    c = coeffs.reshape(2, -1, 16)
    d0 = y.reshape(-1).float() - params[0]
    d = torch.where(d0 < 0, torch.zeros_like(d0), d0)
    u = _sqrt32(d) * params[1 + right]
    inside = u < 16
    piece = torch.where(inside, u, torch.full_like(u, 15.0)).floor()
    z = u - piece
    idx = piece.long()
    p = c[right, -1, idx]
    for k in range(c.shape[1] - 2, -1, -1):
        p = p * z + c[right, k, idx]
    q = torch.where(u >= 16, params[3 + right], p)
    return (grad.reshape(-1).float() * q).to(grad.dtype).reshape(grad.shape)


def _blpa_split(grid: Tensor, shape: Sequence[int]) -> tuple[Tensor, ...]:
    view = (1, -1) + (1,) * (len(shape) - 2)
    return tuple(row.reshape(view) for row in grid)


def blpa_encode(x: Tensor, a2: Tensor, mean: Tensor, invstd: Tensor, grid: Tensor, bits: int) -> Tensor:
    """Twin of ``lowbit::blpa_encode`` (include/lowbit/blpa.h: blpa_code), one fp32 op per C++ operation."""
    t, o, h, side = _blpa_split(grid, x.shape)
    view = t.shape
    a1 = (x.float() - mean.reshape(view)) * invstd.reshape(view)
    raw = torch.ceil((a1 - t) / h) - 1 + o
    raw = torch.where(torch.isnan(raw), torch.zeros_like(raw), raw)
    upper = (a2.float() > 0) ^ (side < 0)
    lo = torch.where(side == 0, 0.0, torch.where(upper, o, 0.0))
    hi = torch.where(side == 0, float(2**bits - 1), torch.where(upper, float(2**bits - 1), o - 1))
    codes = torch.minimum(torch.maximum(raw, lo), hi)
    return pack_bits(codes.to(torch.uint8).reshape(-1), bits)


def _blpa_codes(packed: Tensor, grid: Tensor, beta: Tensor, shape: Sequence[int], bits: int) -> tuple[Tensor, Tensor]:
    t, o, h, side = _blpa_split(grid, shape)
    codes = unpack_bits(packed, bits, math.prod(shape)).reshape(shape).float()
    a1 = t + ((codes - o) + 0.5) * h
    mask = torch.where(side == 0, beta.reshape(t.shape) > 0, (codes >= o) ^ (side < 0))
    return a1, mask


def blpa_decode(
    packed: Tensor, grid: Tensor, gamma: Tensor, beta: Tensor, shape: Sequence[int], bits: int, dtype: torch.dtype
) -> Tensor:
    """Twin of ``lowbit::blpa_decode``: relu(gamma * a1 + beta) where the exact mask is set, else 0."""
    a1, mask = _blpa_codes(packed, grid, beta, shape, bits)
    view = (1, -1) + (1,) * (len(shape) - 2)
    v = (gamma.reshape(view) * a1 + beta.reshape(view)).clamp_min(0)
    return torch.where(mask, v, torch.zeros_like(v)).to(dtype)


def blpa_backward(
    packed: Tensor,
    grad: Tensor,
    grid: Tensor,
    gamma: Tensor,
    beta: Tensor,
    invstd: Tensor,
    bits: int,
    batch_stats: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Twin of ``lowbit::blpa_backward`` (eqs. 6-8) in float64 sums; equal to the kernel to fp32 rounding."""
    shape = grad.shape
    a1, mask = _blpa_codes(packed, grid, beta, shape, bits)
    dims = [0] + list(range(2, len(shape)))
    view = (1, -1) + (1,) * (len(shape) - 2)
    g_a2 = torch.where(mask, grad.double(), torch.zeros_like(a1, dtype=torch.float64))
    g_beta = g_a2.sum(dims)
    g_gamma = (a1.double() * g_a2).sum(dims)
    g_a1 = gamma.double().reshape(view) * g_a2
    if batch_stats:
        g_a1 = g_a1 - g_a1.mean(dims, keepdim=True) - a1.double() * (a1.double() * g_a1).mean(dims, keepdim=True)
    g_x = invstd.double().reshape(view) * g_a1
    return g_x.to(grad.dtype), g_gamma.float(), g_beta.float()


def blpa_unit_backward(
    x: Tensor,
    a2: Tensor,
    grad: Tensor,
    gamma: Tensor,
    beta: Tensor,
    weight: Tensor,
    conv: dict[str, Any],
    bits: int,
    relu6: bool,
    pad: Sequence[int],
    batch_stats: bool,
    eps: float,
) -> tuple[Tensor, ...]:
    """Twin of a converted unit's backward (lowbit/nn/blpa_convert.py): BatchNorm2d -> ReLU or ReLU6 ->
    zero pad -> ``F.conv2d(**conv)`` with batch statistics of ``x`` (``batch_stats``) or a fresh module's running ones,
    from the twins' ``bits``-bit codes and, for ReLU6, its clip bit. Returns the gradients of x, gamma,
    beta, weight and the convolution's bias."""
    from lowbit.nn.blpa import _grid  # the grid is Python arithmetic shared with the blocks, not a kernel

    dims = [0, 2, 3]
    span = None
    if batch_stats:
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
    else:  # a fresh BatchNorm's running statistics; the codes' range is the batch's spread of a1
        var, mean = torch.ones(x.shape[1]), torch.zeros(x.shape[1])
        std_a1, mean_a1 = torch.std_mean(
            x.float() * torch.rsqrt(var + eps).reshape(1, -1, 1, 1), dim=dims, correction=0
        )
        span = torch.stack([mean_a1, std_a1])
    invstd = torch.rsqrt(var + eps)
    grid = _grid(gamma, beta, bits, span)
    packed = blpa_encode(x, a2, mean, invstd, grid, bits)
    a3 = blpa_decode(packed, grid, gamma.float(), beta.float(), x.shape, bits, x.dtype)
    below = a2 < 6.0
    if relu6:
        a3 = torch.where(below, a3.clamp_max(6.0), torch.full_like(a3, 6.0))
    a3 = torch.nn.functional.pad(a3, list(pad)).requires_grad_()
    w = weight.detach().requires_grad_()
    b = torch.zeros(weight.shape[0], requires_grad=True)
    torch.nn.functional.conv2d(a3, w, b, **conv).backward(grad)
    g_a3 = cast(Tensor, a3.grad)[:, :, pad[2] : a3.shape[2] - pad[3], pad[0] : a3.shape[3] - pad[1]]
    if relu6:
        g_a3 = torch.where(below, g_a3, torch.zeros_like(g_a3))
    g_x, g_gamma, g_beta = blpa_backward(packed, g_a3, grid, gamma.float(), beta.float(), invstd, bits, batch_stats)
    return g_x, g_gamma, g_beta, cast(Tensor, w.grad), cast(Tensor, b.grad)  # leaves of the backward above
