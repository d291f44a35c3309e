"""The layer-wise trust-ratio optimizers: LAMB and LARS scale each tensor's update by a ratio of norms
computed over the whole tensor."""

from __future__ import annotations

import math
from typing import Any, Optional, cast

import torch
from torch import Tensor

from lowbit import _C, _ops
from lowbit._ops import StepArgs, StepHyper
from lowbit.optim.optimizer import NORM_TRUST, LowbitOptimizer, Params
from lowbit.optim.optimizers import SGD, step_flags
from lowbit.optim.sharded_norms import sum_over_shards
from lowbit.optim.state_storage import optimizer_state_map

__all__ = ["LAMB", "LARS"]


class LAMB(LowbitOptimizer):
    """LAMB (You et al. 2020, Algorithm 2): Adam's direction plus weight decay, scaled per tensor by
    the trust ratio ``||p|| / ||r||``, with ``r = m_hat / (sqrt(v_hat) + eps) + weight_decay * p``.

    The ratio comes from a pre-pass over the whole tensor in the same native call (bitsandbytes'
    LAMB8bit accepts the option but applies no trust ratio).

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: weight decay, part of the direction the trust ratio scales.
        maximize: maximize the objective instead of minimizing.
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``percentile_clipping``: see :class:`~lowbit.optim.LowbitOptimizer`.
    """

    _rule = "lamb"
    _state_names = ("exp_avg", "exp_avg_sq")
    _state_signed = (True, False)
    _norm_mode = NORM_TRUST

    def _check_config(self, config: dict[str, Any], where: str) -> None:
        super()._check_config(config, where)
        if config["max_unorm"]:
            raise ValueError(f"lowbit: {where}: LAMB scales its update by the trust ratio; max_unorm must be 0")

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=bool(maximize))
        super().__init__(params, defaults, **options)

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        lr, wd = config["lr"], config["weight_decay"]
        hyper = StepHyper.with_betas(lr, config["betas"], eps=config["eps"], weight_decay=wd)
        return hyper, step_flags(config)

    def _step_scalars(self, config: dict[str, Any], step: int) -> tuple[float, float, float]:
        b1, b2 = config["betas"]
        return 1.0 / (1.0 - b1**step), math.sqrt(1.0 - b2**step), float(step == 1)


class LARS(SGD):
    """LARS (You et al. 2017): SGD with momentum where each tensor's gradient plus weight decay is
    scaled by its local learning rate ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)``
    (1 when ``p`` or ``g`` is zero) before it enters the momentum buffer.

    Args:
        params: parameters or param groups.
        lr: global learning rate.
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty, inside the trust-scaled gradient.
        nesterov: Nesterov momentum.
        trust_coefficient: the paper's eta.
        eps: added to the denominator of the local learning rate.
        maximize: maximize the objective instead of minimizing.
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``max_unorm``, ``percentile_clipping``: see :class:`~lowbit.optim.LowbitOptimizer`.
    """

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        trust_coefficient: float = 1e-3,
        eps: float = 1e-8,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        self._lars_defaults = dict(trust_coefficient=trust_coefficient, eps=eps)
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize, **options)
        self.defaults.update(self._lars_defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's ``add_param_group``, with LARS's own options' defaults filled in."""
        super().add_param_group({**self._lars_defaults, **param_group})

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        hyper, flags = super()._hyper(config)
        # Weight decay is folded into the trust-scaled gradient by _adjust_grads.
        return hyper._replace(weight_decay=0.0), flags

    def _adjust_grads(
        self,
        config: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        scales: Optional[Tensor],
        originals: list[Tensor],
    ) -> tuple[list[Tensor], Optional[Tensor]]:
        wd, eta, eps = config["weight_decay"], config["trust_coefficient"], config["eps"]
        p_norm, g_norm = _parameter_and_gradient_norms(params, grads, originals, config["block_size"])
        local = eta * p_norm / (g_norm + wd * p_norm + eps)
        local = torch.where((p_norm > 0) & (g_norm > 0), local, torch.ones_like(local))
        # A NaN norm makes the tensor's update NaN, not a silent local rate of 1 (1/eta times too large).
        local = torch.where(p_norm.isnan() | g_norm.isnan(), p_norm + g_norm, local)
        if wd != 0:
            grads = cast(list[Tensor], torch._foreach_add(grads, params, alpha=wd))  # a list at run time
        return grads, local if scales is None else local * scales


def _parameter_and_gradient_norms(
    params: list[Tensor], grads: list[Tensor], originals: list[Tensor], block_size: int
) -> tuple[Tensor, Tensor]:
    """Each tensor's ||p|| and ||g|| (fp32), from the native norm pre-pass with the gradient in the update's
    place (norm mode NORM_GRAD): one parallel pass over every parameter and gradient, summing squares in
    float64 in include/lowbit/norm_order.h's order (the same bits for any thread count, on CPU and CUDA);
    the sums of FSDP2 shards are added over their ranks."""
    device = params[0].device
    count = len(params)
    maps = optimizer_state_map(True, device, 8)
    args = StepArgs(
        params=params,
        grads=grads,
        state1=[],
        state2=[],
        state3=[],
        absmax1=[],
        absmax2=[],
        absmax3=[],
        scalars=[0.0, 1.0, 1.0] * count,
        grad_scales=None,
        map1=maps,
        map2=maps,
        map3=maps,
        rule=_C.RULES["sgd"],
        hyper=StepHyper(lr=0.0).values(),
        flags=0,
        norm_mode=_C.NORM_GRAD,
        n_states=0,
        block_size=block_size,
        state_bits=8,
    )
    sums = sum_over_shards(_ops.optimizer_norms_eager(args), originals)
    p_norm, g_norm = sums.sqrt().float().unbind(1)
    return p_norm, g_norm
