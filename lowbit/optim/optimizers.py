"""The public optimizers: thin classes with torch.optim's defaults and argument checks.

``X8bit`` keeps 8-bit block-wise states, ``X32bit`` fp32 states, and the generic ``X`` takes
``optim_bits=8|32`` (default 32). Every argument has torch.optim's meaning, ``amsgrad=True`` and
``centered=True`` included (their extra states are 8-bit too in the 8-bit optimizers).
"""

from __future__ import annotations

import math
from typing import Any

from lowbit._ops import StepHyper
from lowbit.optim.optimizer import (
    FLAG_DECOUPLED,
    FLAG_MAXIMIZE,
    FLAG_NESTEROV,
    RULE_CODES,
    LowbitOptimizer,
    Params,
    decay_factor,
)

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Lion", "RMSprop"]


def step_flags(config: dict[str, Any], decoupled: bool = False, nesterov: bool = False) -> int:
    """The native step's flag bits (maximize, decoupled weight decay, Nesterov) for a group's options."""
    return (
        (FLAG_MAXIMIZE if config["maximize"] else 0)
        | (FLAG_DECOUPLED if decoupled else 0)
        | (FLAG_NESTEROV if nesterov else 0)
    )


class Adam(LowbitOptimizer):
    """Adam (Kingma & Ba) with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: L2 penalty (coupled: added to the gradient).
        amsgrad: keep the running maximum of the second moment (state ``max_exp_avg_sq``) and divide
            by it (Reddi et al. 2018), as torch.optim does. At 8 bits it is stored like the second
            moment, as its square root on the zero-free map, and the step divides by the larger of
            the decoded maximum and the current second moment, so the denominator is never below
            Adam's.
        maximize: maximize the objective instead of minimizing.
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``factored``, ``max_unorm``, ``percentile_clipping``: see
            :class:`~lowbit.optim.LowbitOptimizer`.
    """

    _rule = "adam"
    _state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _state_signed = (True, False, False)
    _factorable = True

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad), maximize=bool(maximize)
        )
        super().__init__(params, defaults, **options)

    def _n_states(self, config: dict[str, Any]) -> int:
        return 3 if config["amsgrad"] else 2

    def _rule_code(self, config: dict[str, Any]) -> int:
        return RULE_CODES["adam_amsgrad" if config["amsgrad"] else "adam"]

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        lr, wd = config["lr"], config["weight_decay"]
        hyper = StepHyper.with_betas(
            lr, config["betas"], eps=config["eps"], weight_decay=wd, decay=decay_factor(lr, wd)
        )
        return hyper, step_flags(config, decoupled=self._decoupled)

    def _step_scalars(self, config: dict[str, Any], step: int) -> tuple[float, float, float]:
        b1, b2 = config["betas"]
        return config["lr"] / (1.0 - b1**step), math.sqrt(1.0 - b2**step), float(step == 1)


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter): Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Same arguments as :class:`Adam`; ``weight_decay`` (default 1e-2) multiplies the parameter by
    ``1 - lr * weight_decay`` before the update.
    """

    _decoupled = True

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            **options,
        )


class SGD(LowbitOptimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        momentum: momentum factor (0 keeps no state).
        dampening: dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        maximize: maximize the objective instead of minimizing.
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``max_unorm``, ``percentile_clipping``: see :class:`~lowbit.optim.LowbitOptimizer`.
    """

    _rule = "sgd"
    _state_names = ("momentum_buffer",)
    _state_signed = (True,)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=bool(nesterov),
            maximize=bool(maximize),
        )
        super().__init__(params, defaults, **options)

    def _n_states(self, config: dict[str, Any]) -> int:
        return 1 if config["momentum"] != 0 else 0

    def _check_config(self, config: dict[str, Any], where: str) -> None:
        super()._check_config(config, where)
        if config["nesterov"] and (config["momentum"] <= 0 or config["dampening"] != 0):
            raise ValueError(f"lowbit: {where}: Nesterov momentum requires a momentum and zero dampening")

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        hyper = StepHyper(
            lr=config["lr"],
            beta1=config["momentum"],
            one_minus_beta1=1.0 - config["dampening"],
            weight_decay=config["weight_decay"],
        )
        return hyper, step_flags(config, nesterov=config["nesterov"])


class Lion(LowbitOptimizer):
    """Lion (Chen et al. 2023): sign of the interpolated momentum, decoupled weight decay.

    Args:
        params: parameters or param groups.
        lr: learning rate (typically 3-10x smaller than AdamW's).
        betas: interpolation coefficient of the update and decay of the momentum.
        weight_decay: decoupled weight decay.
        maximize: maximize the objective instead of minimizing.
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``max_unorm``, ``percentile_clipping``: see :class:`~lowbit.optim.LowbitOptimizer`.
    """

    _rule = "lion"
    _state_names = ("exp_avg",)
    _state_signed = (True,)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=bool(maximize))
        super().__init__(params, defaults, **options)

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        lr, wd = config["lr"], config["weight_decay"]
        hyper = StepHyper.with_betas(lr, config["betas"], weight_decay=wd, decay=decay_factor(lr, wd))
        return hyper, step_flags(config, decoupled=True)


class RMSprop(LowbitOptimizer):
    """RMSprop as ``torch.optim.RMSprop``.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        alpha: smoothing constant of the squared-gradient average.
        eps: added to the denominator.
        weight_decay: L2 penalty.
        momentum: momentum factor (adds a momentum buffer state when > 0).
        centered: normalise by the variance estimate ``square_avg - grad_avg**2`` (state ``grad_avg``,
            on the signed map at 8 bits), as torch.optim does. A negative rounding residue of the
            variance reads as 0 (where torch.optim takes the square root of it: NaN).
        maximize: maximize the objective instead of minimizing.
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``max_unorm``, ``percentile_clipping``: see :class:`~lowbit.optim.LowbitOptimizer`.
    """

    _rule = "rmsprop"
    _state_names = ("square_avg", "momentum_buffer", "grad_avg")
    _state_signed = (False, True, True)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=bool(centered),
            maximize=bool(maximize),
        )
        super().__init__(params, defaults, **options)

    def _slots(self, config: dict[str, Any]) -> tuple[int, ...]:
        # optim_rules.h: rmsprop_step (square_avg, momentum_buffer), rmsprop_centered_step (square_avg,
        # grad_avg, momentum_buffer); momentum_buffer only with a momentum.
        momentum = (1,) if config["momentum"] > 0 else ()
        return (0, 2, *momentum) if config["centered"] else (0, *momentum)

    def _rule_code(self, config: dict[str, Any]) -> int:
        return RULE_CODES["rmsprop_centered" if config["centered"] else "rmsprop"]

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        alpha = config["alpha"]
        hyper = StepHyper(
            lr=config["lr"],
            beta1=config["momentum"],
            beta2=alpha,
            one_minus_beta2=1.0 - alpha,
            eps=config["eps"],
            weight_decay=config["weight_decay"],
        )
        return hyper, step_flags(config)


class Adagrad(LowbitOptimizer):
    """Adagrad as ``torch.optim.Adagrad``.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        lr_decay: learning-rate decay per step.
        weight_decay: L2 penalty.
        initial_accumulator_value: starting value of the squared-gradient sum.
        eps: added to the denominator.
        maximize: maximize the objective instead of minimizing.
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``max_unorm``, ``percentile_clipping``: see :class:`~lowbit.optim.LowbitOptimizer`.
    """

    _rule = "adagrad"
    _state_names = ("sum",)
    _state_signed = (False,)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            maximize=bool(maximize),
        )
        super().__init__(params, defaults, **options)

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        return StepHyper(lr=config["lr"], eps=config["eps"], weight_decay=config["weight_decay"]), step_flags(config)

    def _step_scalars(self, config: dict[str, Any], step: int) -> tuple[float, float, float]:
        return config["lr"] / (1.0 + (step - 1) * config["lr_decay"]), 1.0, float(step == 1)

    def _init_value(self, k: int, config: dict[str, Any]) -> float:
        return float(config["initial_accumulator_value"])
