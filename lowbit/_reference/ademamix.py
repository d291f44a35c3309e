"""AdEMAMix as a plain torch.optim optimizer: the test oracle of lowbit.optim.AdEMAMix.

Written from the update of Pagliardini, Ablin, Grangier 2024 (Algorithm 1) with bitsandbytes'
arguments and schedulers (its ``_ReferenceAdEMAMix``), in the paper's form and order and in fp32 states,
independently of the native rule: the fast EMA is bias-corrected by dividing it, the slow one is not,
and weight decay is added to the update (``p -= lr * (u + weight_decay * p)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
from torch import Tensor


class ReferenceAdEMAMix(torch.optim.Optimizer):
    """AdEMAMix with fp32 states per parameter, in torch.optim's conventions: a float32 tensor ``step`` and
    the state names and group options of lowbit.optim.AdEMAMix (``exp_avg_fast`` m1, ``exp_avg_sq`` nu,
    ``exp_avg_slow`` m2), so that state dicts go from one to the other. ``foreach`` is accepted and ignored
    (one loop, as torch.optim's single-tensor path)."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: Optional[int] = None,
        t_beta3: Optional[int] = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        foreach: Optional[bool] = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, (b1, b2, b3_final), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
            alpha_final, t_alpha, t_beta3 = group["alpha"], group["t_alpha"], group["t_beta3"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in ("exp_avg_fast", "exp_avg_sq", "exp_avg_slow"):
                        state[name] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = int(state["step"])
                alpha = min(t * alpha_final / t_alpha, alpha_final) if t_alpha else alpha_final
                if t_beta3:
                    ln1, ln3 = math.log(b1), math.log(b3_final)
                    a = t / t_beta3
                    b3 = min(math.exp(ln1 * ln3 / ((1 - a) * ln3 + a * ln1)), b3_final)
                else:
                    b3 = b3_final
                g = p.grad.float()
                m1, m2, nu = state["exp_avg_fast"], state["exp_avg_slow"], state["exp_avg_sq"]
                m1.mul_(b1).add_(g, alpha=1 - b1)
                m2.mul_(b3).add_(g, alpha=1 - b3)
                nu.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (nu.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
                update = (m1 / (1 - b1**t) + alpha * m2) / denom
                update.add_(p.float(), alpha=wd)
                p.add_((-lr * update).to(p.dtype))
