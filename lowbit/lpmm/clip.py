"""Gradient clipping for converted parameters: ``torch.nn.utils.clip_grad_norm_`` and
``clip_grad_value_`` applied to the low-precision gradient accumulators."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lowbit.lpmm.parameter import LowPrecisionParameter

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def _storages(model_or_params: nn.Module | Tensor | Any) -> list[LowPrecisionParameter]:
    """The distinct storages of a converted model, or of the handles among ``model_or_params``; ordinary
    parameters are refused (their gradients are clipped by torch.nn.utils)."""
    if isinstance(model_or_params, nn.Module):
        params: list[Any] = list(model_or_params.parameters())
    elif isinstance(model_or_params, Tensor):
        params = [model_or_params]
    else:
        params = list(model_or_params)
    out: dict[int, LowPrecisionParameter] = {}
    for i, p in enumerate(params):
        lp = getattr(p, "_lpmm", None)
        if not isinstance(lp, LowPrecisionParameter):
            raise TypeError(
                f"lowbit.lpmm: parameter {i} ({type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}) is not a "
                "converted parameter; clip ordinary parameters with torch.nn.utils"
            )
        out.setdefault(id(lp), lp)
    return list(out.values())


@torch.no_grad()
def clip_grad_norm_(
    model_or_params: nn.Module | Tensor | Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for the gradient accumulators of converted parameters.

    The total norm is torch's: the ``norm_type`` norm of the per-parameter norms of the accumulated (fp32,
    dequantized) gradients; under FSDP2 the sharded accumulators' contributions are all-reduced over
    their mesh, so every rank gets the global norm (every rank must call it). Each accumulator is then
    multiplied by ``min(max_norm / (total + 1e-6), 1)``: the factor multiplies its group absmaxes (fp32,
    round to nearest) and the codes stay, so the clipped gradient equals torch's clip of the dequantized
    one within 4 fp32 roundoffs relative (no element is re-rounded, stochastic rounding is not needed).
    ``torch.nn.utils.clip_grad_norm_`` on the handles of an unsharded model does the same.

    Args:
        model_or_params: a converted model, or handles of converted parameters (``model.parameters()``).
        max_norm: maximum norm of the gradients.
        norm_type: order of the norm (``math.inf`` for the max norm); sharded storage needs ``> 0``.
        error_if_nonfinite: raise if the total norm is NaN or infinite (the accumulators are left as they are).
        foreach: accepted for torch's signature; the accumulators are scaled per parameter either way.

    Returns:
        The total norm of the gradients, a 0-dim fp32 tensor.
    """
    if foreach not in (None, True, False):
        raise TypeError(f"lowbit.lpmm: foreach must be a bool or None, got {foreach!r}")
    max_norm, norm_type = float(max_norm), float(norm_type)
    lps = _storages(model_or_params)
    if not lps:
        return torch.tensor(0.0)
    device = lps[0].device
    whole: list[Tensor] = []
    sharded: dict[Any, list[Tensor]] = {}
    for lp in lps:
        g = lp.grad
        if lp.shards is not None:
            local = torch.zeros(0, device=lp.device) if g is None else g
            sharded.setdefault(lp.shards.group, []).append(torch.linalg.vector_norm(local, norm_type))
        elif g is not None:
            whole.append(torch.linalg.vector_norm(g, norm_type))
    if sharded and not norm_type > 0:
        raise ValueError(f"lowbit.lpmm: norm_type must be > 0 for sharded storage, got {norm_type}")
    norms = [n.to(device) for n in whole]
    for group, parts in sharded.items():
        local = torch.linalg.vector_norm(torch.stack(parts), norm_type)
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            norms.append(local.to(device))
        else:
            local = local.pow(norm_type)
            dist.all_reduce(local, group=group)
            norms.append(local.pow(1.0 / norm_type).to(device))
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"lowbit.lpmm: the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
            "clipped; to scale the gradients by the non-finite norm anyway, set error_if_nonfinite=False"
        )
    # torch.nn.utils.clip_grads_with_norm_'s factor, computed the same way.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for lp in lps:
        if lp.has_grad:
            lp.scale_grad_(coef)
    return total


@torch.no_grad()
def clip_grad_value_(
    model_or_params: nn.Module | Tensor | Any, clip_value: float, foreach: Optional[bool] = None
) -> None:
    """``torch.nn.utils.clip_grad_value_`` for the gradient accumulators of converted parameters.

    Each accumulated gradient is dequantized, clamped to ``[-clip_value, clip_value]`` and re-encoded
    against the clamped groups' absmaxes (at most ``clip_value``) with the parameter's rounding:
    stochastic (unbiased) or nearest, within one (stochastic) or half a (nearest) quantization step
    ``absmax / (2**(grad_bits - 1) - 1)`` of torch's clamp of the dequantized gradient. Elements
    clamped to the bound are exact. Local to each rank under FSDP2.

    Args:
        model_or_params: a converted model, or handles of converted parameters (``model.parameters()``).
        clip_value: maximum absolute value of the gradients (non-negative).
        foreach: accepted for torch's signature.
    """
    if foreach not in (None, True, False):
        raise TypeError(f"lowbit.lpmm: foreach must be a bool or None, got {foreach!r}")
    clip_value = float(clip_value)
    if not clip_value >= 0:
        raise ValueError(f"lowbit.lpmm: clip_value must be >= 0, got {clip_value}")
    for lp in _storages(model_or_params):
        lp.clamp_grad_(clip_value)
