"""AdEMAMix (Pagliardini, Ablin, Grangier 2024): Adam with a second, slow EMA of the gradient.

The three states (fast EMA ``exp_avg_fast``, second moment ``exp_avg_sq``, slow EMA ``exp_avg_slow``) are
stepped by the ``ademamix`` rule of the block-wise fused step (include/lowbit/optim_rules.h:
ademamix_step), one native call per param group. At 8 and 4 bits both EMAs are on the signed map and the
second moment is stored as its root on the zero-free unsigned map, as Adam's (include/lowbit/state_form.h).
The warm-up schedules of ``alpha`` and ``beta3`` are bitsandbytes' (its ``AdEMAMix``), computed here on
the host per step number.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from lowbit._checks import is_finite_number
from lowbit._ops import StepHyper
from lowbit.optim.hyperparams import check_options
from lowbit.optim.optimizer import FLAG_DECOUPLED, LowbitOptimizer, Params, decay_factor

__all__ = ["AdEMAMix", "alpha_schedule", "beta3_schedule"]


def alpha_schedule(alpha: float, t_alpha: Optional[int], step: int) -> float:
    """The slow EMA's weight at ``step``: a linear warm-up from 0 to ``alpha`` over ``t_alpha`` steps
    (AdEMAMix paper, Algorithm 1's scheduler; no warm-up if ``t_alpha`` is 0 or None)."""
    if not t_alpha:
        return alpha
    return min(step * alpha / t_alpha, alpha)


def _inverse_log(beta: float) -> float:
    """1 / ln(beta), 0 for beta = 0 (the limit: ln 0 = -inf)."""
    return 0.0 if beta == 0.0 else 1.0 / math.log(beta)


def beta3_schedule(beta1: float, beta3: float, t_beta3: Optional[int], step: int) -> float:
    """The slow EMA's decay at ``step``: its half-life grows from ``beta1``'s to ``beta3``'s over
    ``t_beta3`` steps (AdEMAMix paper, section 3: ``exp(ln b1 ln b3 / ((1 - a) ln b3 + a ln b1))`` with
    ``a = step / t_beta3``, capped at ``beta3``; no warm-up if ``t_beta3`` is 0 or None).

    It is computed as ``1 / ln(beta_t) = (1 - a) / ln(b1) + a / ln(b3)``, the same expression, which stays
    defined when a beta is 0 (there the paper's form divides infinities).
    """
    if not t_beta3:
        return beta3
    a = min(step / t_beta3, 1.0)
    inverse = (1.0 - a) * _inverse_log(beta1) + a * _inverse_log(beta3)
    scheduled = math.exp(1.0 / inverse) if inverse != 0.0 else 0.0
    return min(scheduled, beta3)


def _is_warmup(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _is_three_betas(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list)) and len(value) == 3 and all(is_finite_number(b) and 0 <= b < 1 for b in value)
    )


class AdEMAMix(LowbitOptimizer):
    """AdEMAMix (Pagliardini, Ablin, Grangier 2024) with bitsandbytes' arguments and update:

    ``m1 = b1 m1 + (1 - b1) g``, ``m2 = b3 m2 + (1 - b3) g``, ``nu = b2 nu + (1 - b2) g^2`` and
    ``p -= lr * ((m1 / (1 - b1^t) + alpha m2) / (sqrt(nu / (1 - b2^t)) + eps) + weight_decay * p)``.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: ``(b1, b2, b3)``: the decays of the fast EMA, the second moment and the slow EMA.
        alpha: the slow EMA's weight in the update.
        t_alpha: steps of the linear warm-up of ``alpha`` from 0 (0 or None: none).
        t_beta3: steps of the warm-up of ``b3`` from ``b1`` (linear in the half-life; 0 or None: none).
        eps: added to the denominator.
        weight_decay: decoupled weight decay (``p *= 1 - lr * weight_decay``, as AdamW).
        **options: ``optim_bits`` (4, 8 or 32, default 32), ``block_size``, ``min_8bit_size``, ``min_4bit_size``,
            ``rank1_normalization``, ``max_unorm``, ``percentile_clipping``: see :class:`~lowbit.optim.LowbitOptimizer`.

    States: ``exp_avg_fast`` (m1), ``exp_avg_sq`` (nu) and ``exp_avg_slow`` (m2). With a warm-up, the
    parameters of a group that are at different step numbers are stepped in one fused call per step number.
    ``lowbit.optim.override`` does not take ``betas`` for AdEMAMix (it checks them as a pair).
    """

    _rule = "ademamix"
    _state_names = ("exp_avg_fast", "exp_avg_sq", "exp_avg_slow")
    _state_signed = (True, False, True)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: Optional[int] = None,
        t_beta3: Optional[int] = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            alpha=alpha,
            t_alpha=t_alpha,
            t_beta3=t_beta3,
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults, **options)

    def _check_config(self, config: dict[str, Any], where: str) -> None:
        # betas is a triple here; every other option has its shared rule (lowbit.optim.hyperparams).
        check_options({k: v for k, v in config.items() if k != "betas"}, where)
        betas = config.get("betas")
        if not _is_three_betas(betas):
            raise ValueError(
                f"lowbit: {where}: invalid beta parameters (betas={betas!r}); expected three numbers in [0, 1)"
            )
        for name in ("t_alpha", "t_beta3"):
            if not _is_warmup(config.get(name)):
                value = config.get(name)
                raise ValueError(f"lowbit: {where}: invalid {name} ({name}={value!r}); expected None or an int >= 0")

    def _schedule(self, config: dict[str, Any]) -> tuple[float, float]:
        """(alpha, beta3) of the step number ``config["step_number"]`` (set by :meth:`_prepare_step` when a
        warm-up is on)."""
        b1, _, b3 = config["betas"]
        step = config.get("step_number")
        if step is None:
            return config["alpha"], b3
        return alpha_schedule(config["alpha"], config["t_alpha"], step), beta3_schedule(b1, b3, config["t_beta3"], step)

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        lr, wd = config["lr"], config["weight_decay"]
        b1, b2, _ = config["betas"]
        alpha, beta3 = self._schedule(config)
        hyper = StepHyper.with_betas(
            lr,
            (b1, b2),
            eps=config["eps"],
            weight_decay=wd,
            decay=decay_factor(lr, wd),
            one_minus_beta3=1.0 - beta3,
            slow_step_size=lr * alpha,
        )
        return hyper, FLAG_DECOUPLED

    def _step_scalars(self, config: dict[str, Any], step: int) -> tuple[float, float, float]:
        b1, b2, _ = config["betas"]
        return config["lr"] / (1.0 - b1**step), math.sqrt(1.0 - b2**step), float(step == 1)

    def _prepare_step(
        self,
        config: dict[str, Any],
        batch: list[tuple[torch.Tensor, dict[str, Any]]],
        places: list[str],
        positions: list[int],
    ) -> Callable[[], None]:
        if not (config["t_alpha"] or config["t_beta3"]):
            return super()._prepare_step(config, batch, places, positions)
        # alpha and beta3 depend on the step number, and a fused call takes one of each.
        steps = [int(s) + 1 for s in torch.stack([state["step"] for _, state in batch]).tolist()]
        parts: dict[int, tuple[list[tuple[torch.Tensor, dict[str, Any]]], list[str], list[int]]] = {}
        for item, place, position, step in zip(batch, places, positions, steps, strict=True):
            items, where, at = parts.setdefault(step, ([], [], []))
            items.append(item)
            where.append(place)
            at.append(position)
        runs = [super(AdEMAMix, self)._prepare_step({**config, "step_number": s}, *part) for s, part in parts.items()]

        def run() -> None:
            for step_part in runs:
                step_part()

        return run
