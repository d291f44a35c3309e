"""Per-parameter optimizer configuration: param-group options plus weakly held overrides.

``override(module_or_params, optim_bits=32)`` records options for individual parameters (an
embedding's weight, say) that take precedence over their param group's. The records live in a
dictionary keyed by weak references to the parameters (by identity): they disappear with the
parameter and keep nothing alive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from lowbit.optim.hyperparams import check_options

__all__ = ["OVERRIDABLE", "clear_override", "get_override", "override", "overrides_version"]

#: Options that can be overridden per parameter. Hyperparameters must also exist in the optimizer's
#: param groups; the optimizer rejects an override it does not know when it steps.
OVERRIDABLE = frozenset(
    {
        "optim_bits",
        "block_size",
        "min_8bit_size",
        "min_4bit_size",
        "rank1_normalization",
        "factored",
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "momentum",
        "dampening",
        "alpha",
        "lr_decay",
        "max_unorm",
        "percentile_clipping",
        "trust_coefficient",
    }
)

_OVERRIDES: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Counts the calls that changed overrides: an optimizer's prepared steps (lowbit/optim/step_plan.py) are
# reused only while it is unchanged.
_version = 0

Target = Union[nn.Module, Tensor, Iterable[Tensor]]


def _params(target: Target) -> list[Tensor]:
    if isinstance(target, nn.Module):
        return list(target.parameters())
    if isinstance(target, Tensor):
        return [target]
    params = list(target)
    if not all(isinstance(p, Tensor) for p in params):
        raise TypeError("lowbit: override targets must be a module, a tensor or an iterable of tensors")
    return params


def override(target: Target, **options: Any) -> None:
    """Set optimizer options for the parameters of ``target``, taking precedence over param groups.

    Args:
        target: a module (all its parameters), a parameter, or an iterable of parameters.
        **options: any of :data:`OVERRIDABLE`, e.g. ``optim_bits=32`` to keep 32-bit state; each is
            validated as the optimizers' own arguments are, and a failed call changes no override.
    """
    unknown = sorted(set(options) - OVERRIDABLE)
    if unknown:
        raise ValueError(f"lowbit: cannot override {unknown}; overridable options: {sorted(OVERRIDABLE)}")
    check_options(options, "lowbit.optim.override")
    global _version
    params = _params(target)
    _version += 1
    for p in params:
        _OVERRIDES.setdefault(p, {}).update(options)


def clear_override(target: Target) -> None:
    """Remove every override of the parameters of ``target``."""
    global _version
    params = _params(target)
    _version += 1
    for p in params:
        _OVERRIDES.pop(p, None)


def overrides_version() -> int:
    """A number that changes whenever :func:`override` or :func:`clear_override` is called."""
    return _version


def get_override(param: Tensor) -> dict[str, Any]:
    """The options overridden for ``param`` (a copy; empty if none)."""
    return dict(_OVERRIDES.get(param, {}))
