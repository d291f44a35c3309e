"""Validation of optimizer options wherever they enter: constructors, ``add_param_group``,
``lowbit.optim.override``, direct ``param_groups`` edits (checked when ``step()`` reads them) and loaded
state dicts.

Each option has one rule here, so that a value refused by a constructor is refused by every other
entry too: ``override(p, lr=-1)`` or ``opt.param_groups[0]["optim_bits"] = 16`` raise instead of being
used. Messages say where the value came from as the user knows it (``param_groups[1]``,
``lowbit.optim.override``) and what was expected. The learning rate may be a one-element floating-point
tensor, as in torch.optim; the step reads its value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lowbit._checks import ROUNDING_MODES, is_betas, is_block_size, is_finite_nonneg, is_finite_number, is_int_in

__all__ = ["GNORM_HISTORY", "LAYOUT_OPTIONS", "check_option", "check_options", "plain_lr"]

#: Options that decide how states are stored: an optimizer keeps its own when it loads a state dict.
LAYOUT_OPTIONS = ("optim_bits", "block_size", "min_8bit_size", "min_4bit_size", "rank1_normalization", "factored")

#: How many past gradient norms ``percentile_clipping`` ranks.
GNORM_HISTORY = 100


def _lr(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and value.is_floating_point() and is_finite_nonneg(float(value.detach().cpu()))
    return is_finite_nonneg(value)


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


# option -> (torch.optim's name for it, the rule, what the rule expects).
_RULES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "lr": ("learning rate", _lr, "a finite number >= 0, or a one-element floating-point tensor holding one"),
    "eps": ("epsilon value", is_finite_nonneg, "a finite number >= 0"),
    "weight_decay": ("weight_decay value", is_finite_nonneg, "a finite number >= 0"),
    "betas": ("beta parameters", is_betas, "a pair of numbers in [0, 1)"),
    "momentum": ("momentum value", is_finite_nonneg, "a finite number >= 0"),
    "dampening": ("dampening value", is_finite_number, "a finite number"),
    "alpha": ("alpha value", is_finite_nonneg, "a finite number >= 0"),
    "lr_decay": ("lr_decay value", is_finite_nonneg, "a finite number >= 0"),
    "initial_accumulator_value": ("initial_accumulator_value", is_finite_nonneg, "a finite number >= 0"),
    "trust_coefficient": ("trust_coefficient", is_finite_nonneg, "a finite number >= 0"),
    "max_unorm": ("max_unorm", is_finite_nonneg, "a finite number >= 0"),
    "percentile_clipping": ("percentile_clipping", lambda v: is_int_in(v, 1, 100), "an int in 1..100"),
    "optim_bits": ("optim_bits", lambda v: type(v) is int and v in (4, 8, 32), "4, 8 or 32"),
    "block_size": ("block_size", is_block_size, "a power of two in 64..4096"),
    "min_8bit_size": ("min_8bit_size", lambda v: is_int_in(v, 0, 2**63 - 1), "a non-negative int"),
    "min_4bit_size": ("min_4bit_size", lambda v: is_int_in(v, 0, 2**63 - 1), "a non-negative int"),
    "rank1_normalization": ("rank1_normalization", _flag, "a bool"),
    "factored": ("factored", _flag, "a bool"),
    "maximize": ("maximize", _flag, "a bool"),
    "nesterov": ("nesterov", _flag, "a bool"),
    "amsgrad": ("amsgrad", _flag, "a bool"),
    "centered": ("centered", _flag, "a bool"),
    "momentum_bits": ("momentum_bits", lambda v: is_int_in(v, 1, 8), "an int in 1..8"),
    "rounding": ("rounding", lambda v: v in ROUNDING_MODES, f"one of {sorted(ROUNDING_MODES)}"),
    "rounding_seed": ("rounding_seed", lambda v: is_int_in(v, 0, 2**62 - 1), "an int in [0, 2**62)"),
}


def check_option(name: str, value: Any, where: str) -> None:
    """Raise ValueError if ``value`` is not a valid ``name``; ``where`` says where it was given
    (e.g. ``"AdamW8bit param_groups[1]"``). Options without a rule here are not checked."""
    rule = _RULES.get(name)
    if rule is not None and not rule[1](value):
        raise ValueError(f"lowbit: {where}: invalid {rule[0]} ({name}={value!r}); expected {rule[2]}")


def check_options(options: Mapping[str, Any], where: str) -> None:
    """:func:`check_option` for every entry of ``options``."""
    for name, value in options.items():
        check_option(name, value, where)


def plain_lr(value: Any) -> float:
    """The learning rate as a Python float (a tensor learning rate is read; on CUDA this synchronizes)."""
    return float(value.detach().cpu()) if isinstance(value, torch.Tensor) else float(value)
