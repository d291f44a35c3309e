"""Approximate-activation backprop (approx-activations-blpa.txt): pre-activation blocks
BatchNorm -> ReLU -> Conv2d/Linear whose forward pass is exact and whose backward pass uses a K-bit copy
of the batch-normalised activation.

A plain ``nn.Sequential(BatchNorm, ReLU, Conv2d)`` saves the BatchNorm input and the ReLU output, two
full tensors. These blocks save only a K-bit (4 or 8, any of 1..8) code per element of the normalised
activation ``A1 = (x - mean) / std`` and the per-channel ``1 / std`` (section 3.2), plus, in eval mode,
the batch's per-channel mean and spread of ``A1`` (the quantisation range, see below); the batch-norm
parameters and the weight are parameters, kept anyway.

Codes follow eqs. 9-10 in the normalised domain: the range ``[-3, 3]`` (the paper's ``beta +- 3 gamma`` for
``A2 = gamma A1 + beta``) is cut into ``2**K`` intervals of width ``6 / 2**K``, shifted so that the ReLU
threshold ``A1 = -beta / gamma`` falls on a cut, and decoded to interval midpoints. In eval mode the
running statistics need not normalise the batch, so the range is the batch's mean +- 3 std of ``A1``.
The approximation is sign-preserving (section 3.2) by construction: each element's code lies on the
side of the cut that its exact ``A2 > 0`` decides (clipped to that side), so the ReLU mask in backward
is exactly torch's, also at ``A2 == 0``, for outliers beyond the clipping range and for ``gamma <= 0``.
Hence, as section 3.3 shows, the gradients to the block's input flow exactly through the linear map,
the ReLU and the scale and bias; only ``grad W``, ``grad gamma`` and the variance term of the batch-norm
backward (eq. 8) see the approximation.

The blocks hold ordinary ``bn`` and ``conv`` / ``linear`` submodules, so their state dicts are those of the
three-layer sequence and running statistics update exactly as in torch.
"""

from __future__ import annotations

from typing import Any, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowbit import _ops

__all__ = ["ApproxBNReLUConv2d", "ApproxBNReLULinear"]

_RANGE = 6.0  # width of the quantised range of A1, in standard deviations (eq. 9: 6 * gamma for A2)


def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"lowbit: bits must be an int in 1..8, got {bits!r}")
    return bits


def _grid(gamma: Tensor, beta: Tensor, bits: int, span: Optional[Tensor]) -> Tensor:
    """fp32 [4, C]: per channel the cut t (the ReLU threshold in A1, 0 when gamma == 0), the code o of
    the first interval above it (1..2**bits - 1, so both sides have codes), the interval width h and the
    sign of gamma (include/lowbit/blpa.h).

    ``span`` is None with batch statistics: A1 then has mean 0 and variance 1 and the range is [-3, 3]
    (eq. 9). With running statistics it holds the batch's (mean, std) of A1 per channel, and the range is
    mean +- 3 std."""
    g, b = gamma.detach().float(), beta.detach().float()
    t = torch.where(g != 0, -b / torch.where(g != 0, g, torch.ones_like(g)), torch.zeros_like(g))
    t = torch.where(torch.isfinite(t), t, torch.zeros_like(t))
    if span is None:
        lower, h = torch.full_like(t, -_RANGE / 2), torch.full_like(t, _RANGE / 2**bits)
    else:
        std = span[1].clamp_min(1e-12)
        lower, h = span[0] - std * (_RANGE / 2), std * (_RANGE / 2**bits)
    o = torch.clamp(torch.round((t - lower) / h), 1, 2**bits - 1)
    return torch.stack([t, o, h, torch.sign(g)]).contiguous()


def _requested(
    needs: tuple[bool, ...],
    g_x: Tensor,
    g_gamma: Tensor,
    g_beta: Tensor,
    g_w: Optional[Tensor],
    g_bias: Optional[Tensor],
) -> tuple[Optional[Tensor], ...]:
    """A block function's backward result: the gradients of (x, gamma, beta), each None where ``needs``
    (``ctx.needs_input_grad``) says autograd did not ask for it, then those of the weight and bias (already
    None where not asked for) and None for the block argument."""
    return (g_x if needs[0] else None, g_gamma if needs[1] else None, g_beta if needs[2] else None, g_w, g_bias, None)


def _bcast(v: Tensor, dim: int) -> Tensor:
    """A per-channel vector shaped to broadcast over an input of ``dim`` dims (channels at dim 1)."""
    return v.reshape((1, -1) + (1,) * (dim - 2))


def _normalize(bn: nn.modules.batchnorm._BatchNorm, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], bool]:
    """``bn(x)`` exactly as the module computes it (running statistics updated alike), with what the codes
    need: (a2, the per-channel mean and fp32 ``1 / std`` that normalised ``x``, the quantisation span of
    :func:`_grid` or None, whether batch statistics were used). Call without grad."""
    dims = [0] + list(range(2, x.dim()))
    batch_stats = bn.training or not bn.track_running_stats
    span = None
    if bn.training and bn.track_running_stats and bn.momentum is not None and x.device.type == "cpu":
        # What nn.BatchNorm's forward does in this case (F.batch_norm runs this kernel on the CPU),
        # keeping the batch statistics it computes rather than computing them a second time.
        cast(Tensor, bn.num_batches_tracked).add_(1)  # a tensor with track_running_stats
        a2, mean, invstd = torch.ops.aten._native_batch_norm_legit(
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, bn.momentum, bn.eps
        )
    else:
        a2 = nn.modules.batchnorm._BatchNorm.forward(bn, x)  # the module's own computation and update
        if batch_stats:
            var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
        else:
            # Tensors here: a module without running statistics runs on batch statistics.
            mean, var = cast(Tensor, bn.running_mean).float(), cast(Tensor, bn.running_var).float()
            # Running statistics need not fit the batch: the range follows the batch's own spread of A1.
            a1 = (x.float() - _bcast(mean, x.dim())) * _bcast(torch.rsqrt(var + bn.eps), x.dim())
            std_a1, mean_a1 = torch.std_mean(a1, dim=dims, correction=0)
            span = torch.stack([mean_a1, std_a1])
        invstd = torch.rsqrt(var + bn.eps)
    return a2, mean.float().contiguous(), invstd.float().contiguous(), span, batch_stats


class _ApproxFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, bn_weight: Tensor, bn_bias: Tensor, weight: Tensor, bias: Optional[Tensor], block: Any
    ) -> Tensor:
        a2, mean, invstd, span, batch_stats = _normalize(block.bn, x)
        out = block._linear(F.relu(a2), weight, bias)
        grid = _grid(bn_weight, bn_bias, block.bits, span)
        packed = _ops.blpa_encode(x.contiguous(), a2.contiguous(), mean, invstd, grid, block.bits)
        ctx.save_for_backward(packed, invstd, bn_weight, bn_bias, weight, bias, span)
        ctx.shape, ctx.dtype, ctx.batch_stats, ctx.block = list(x.shape), x.dtype, batch_stats, block
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        packed, invstd, gamma, beta, weight, bias, span = ctx.saved_tensors
        block = ctx.block
        # Only the gradients autograd asks for, as torch's own layers do: with a frozen linear map no A3 is
        # decoded and no grad W computed, and without grads for x, gamma and beta no batch-norm backward.
        need_x, need_gamma, need_beta, need_w, need_bias = ctx.needs_input_grad[:5]
        need_a3 = need_x or need_gamma or need_beta
        grid = _grid(gamma, beta, block.bits, span)
        g32, b32 = gamma.detach().float().contiguous(), beta.detach().float().contiguous()
        if need_w:
            a3 = _ops.blpa_decode(packed, grid, g32, b32, ctx.shape, block.bits, ctx.dtype)
        else:  # the linear backward reads only its shape and layout
            a3 = grad.new_empty(ctx.shape, dtype=ctx.dtype)
        # Eq. 5: grad A3 does not depend on A3; grad W uses the approximation.
        g_a3, g_w, g_bias = block._linear_backward(grad, a3, weight, (need_a3, need_w, need_bias and bias is not None))
        if not need_a3:
            return None, None, None, g_w, g_bias, None
        # Eqs. 6-8 in one native pass: the ReLU mask is exact, A1 comes from the codes.
        g_x, g_gamma, g_beta = _ops.blpa_backward(
            packed, g_a3.contiguous(), grid, g32, b32, invstd, block.bits, ctx.batch_stats
        )
        return _requested(ctx.needs_input_grad, g_x, g_gamma.to(gamma.dtype), g_beta.to(beta.dtype), g_w, g_bias)


class _ApproxBlock(nn.Module):
    """BatchNorm -> ReLU -> a linear map, its backward from K-bit codes; subclasses give the linear map."""

    bn: Union[nn.BatchNorm1d, nn.BatchNorm2d]
    bits: int

    def __init__(
        self,
        norm: type[Union[nn.BatchNorm1d, nn.BatchNorm2d]],
        features: int,
        bits: int,
        *,
        eps: float,
        momentum: Optional[float],
        device: Optional[torch.device],
        dtype: Optional[torch.dtype],
    ) -> None:
        super().__init__()
        self.bits = _check_bits(bits)
        self.bn = norm(features, eps=eps, momentum=momentum, device=device, dtype=dtype)

    def _linear(self, a3: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def _linear_backward(
        self, grad: Tensor, a3: Tensor, weight: Tensor, mask: tuple[bool, bool, bool]
    ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """(grad A3, grad W, grad bias) of the linear map, each only where ``mask`` asks for it."""
        raise NotImplementedError

    def _layer(self) -> Union[nn.Linear, nn.Conv2d]:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """BatchNorm -> ReLU -> the linear map of ``x``, exactly; backward from the K-bit codes."""
        if not isinstance(x, Tensor):
            raise TypeError(f"lowbit: x must be a torch.Tensor, got {type(x).__name__}")
        want = 2 if isinstance(self, ApproxBNReLULinear) else 4
        if x.dim() != want:
            raise ValueError(
                f"lowbit: {type(self).__name__} takes {want}-d input (N, C, ...), got shape {tuple(x.shape)}"
            )
        layer = self._layer()
        if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return layer(F.relu(self.bn(x)))
        return _ApproxFunction.apply(x, self.bn.weight, self.bn.bias, layer.weight, layer.bias, self)

    def extra_repr(self) -> str:
        """The code width."""
        return f"bits={self.bits}"


class ApproxBNReLULinear(_ApproxBlock):
    """``BatchNorm1d(in_features) -> ReLU -> Linear(in_features, out_features)`` saving K bits per
    element for backward (see the module docstring).

    Args:
        in_features: as ``nn.Linear``.
        out_features: as ``nn.Linear``.
        bias: as ``nn.Linear``.
        bits: code width K, 1..8 (the paper uses 4 and 8).
        eps: as ``nn.BatchNorm1d`` (affine, tracking running statistics).
        momentum: as ``nn.BatchNorm1d`` (affine, tracking running statistics).
        device: factory argument of the parameters.
        dtype: factory argument of the parameters.

    Inputs are ``(N, in_features)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int = 8,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(nn.BatchNorm1d, in_features, bits, eps=eps, momentum=momentum, device=device, dtype=dtype)
        self.linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def _layer(self) -> nn.Linear:
        return self.linear

    def _linear(self, a3: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        return F.linear(a3, weight, bias)

    def _linear_backward(
        self, grad: Tensor, a3: Tensor, weight: Tensor, mask: tuple[bool, bool, bool]
    ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        return (
            grad @ weight if mask[0] else None,
            grad.t() @ a3 if mask[1] else None,
            grad.sum(0) if mask[2] else None,
        )


class ApproxBNReLUConv2d(_ApproxBlock):
    """``BatchNorm2d(in_channels) -> ReLU -> Conv2d(in_channels, out_channels, ...)`` saving K bits per
    element for backward: the pre-activation unit of a pre-activation ResNet (paper section 3.4).

    Args:
        in_channels: as ``nn.Conv2d`` (zero padding).
        out_channels: as ``nn.Conv2d`` (zero padding).
        kernel_size: as ``nn.Conv2d`` (zero padding).
        stride: as ``nn.Conv2d`` (zero padding).
        padding: as ``nn.Conv2d`` (zero padding).
        dilation: as ``nn.Conv2d`` (zero padding).
        groups: as ``nn.Conv2d`` (zero padding).
        bias: as ``nn.Conv2d`` (zero padding).
        bits: code width K, 1..8 (the paper uses 4 and 8).
        eps: as ``nn.BatchNorm2d`` (affine, tracking running statistics).
        momentum: as ``nn.BatchNorm2d`` (affine, tracking running statistics).
        device: factory argument of the parameters.
        dtype: factory argument of the parameters.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Union[int, tuple[int, int]],
        stride: Union[int, tuple[int, int]] = 1,
        padding: Union[int, tuple[int, int]] = 0,
        dilation: Union[int, tuple[int, int]] = 1,
        groups: int = 1,
        bias: bool = True,
        bits: int = 8,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(nn.BatchNorm2d, in_channels, bits, eps=eps, momentum=momentum, device=device, dtype=dtype)
        self.conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, device=device, dtype=dtype
        )

    def _layer(self) -> nn.Conv2d:
        return self.conv

    def _linear(self, a3: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        c = self.conv
        return F.conv2d(a3, weight, bias, c.stride, c.padding, c.dilation, c.groups)

    def _linear_backward(
        self, grad: Tensor, a3: Tensor, weight: Tensor, mask: tuple[bool, bool, bool]
    ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        c = self.conv
        bias_sizes = [weight.shape[0]] if mask[2] else None
        return torch.ops.aten.convolution_backward(
            grad,
            a3,
            weight,
            bias_sizes,
            c.stride,
            c.padding,
            c.dilation,
            False,
            [0, 0],
            c.groups,
            list(mask),
        )
