"""Argument checks shared by lowbit's public API and its op layer: block and group sizes, bit widths,
rounding modes, finite non-negative numbers and beta pairs. Nothing here imports the rest of lowbit,
so every module can use it."""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "MAX_LINEAR_BITS",
    "MIN_BITS",
    "ROUNDING_MODES",
    "check_bits",
    "check_group_size",
    "check_rounding",
    "is_betas",
    "is_block_size",
    "is_finite_nonneg",
    "is_finite_number",
    "is_int_in",
]

ROUNDING_MODES = ("nearest", "stochastic")
# The widest linear code the native quantizers take (include/lowbit/qmap.h).
MAX_LINEAR_BITS = 16
# The narrowest low-precision parameter or gradient accumulator (lpmm.txt section 4).
MIN_BITS = 4


def is_int_in(value: Any, low: int, high: int) -> bool:
    """``value`` is an int (not a bool) in ``low..high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_block_size(value: Any) -> bool:
    """``value`` is a power of two in 64..4096: the block and group sizes the native loops support."""
    return is_int_in(value, 64, 4096) and value & (value - 1) == 0


def is_finite_number(value: Any) -> bool:
    """``value`` is a finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_finite_nonneg(value: Any) -> bool:
    """``value`` is a finite number >= 0."""
    return is_finite_number(value) and value >= 0


def is_betas(value: Any) -> bool:
    """``value`` is a pair of numbers in [0, 1)."""
    return (
        isinstance(value, (tuple, list)) and len(value) == 2 and all(is_finite_number(b) and 0 <= b < 1 for b in value)
    )


def check_bits(name: str, bits: object) -> int:
    """``bits`` if it is an int in ``MIN_BITS..MAX_LINEAR_BITS``; raises ValueError naming ``name`` otherwise."""
    if not is_int_in(bits, MIN_BITS, MAX_LINEAR_BITS):
        raise ValueError(f"lowbit.lpmm: {name} must be an int in {MIN_BITS}..{MAX_LINEAR_BITS}, got {bits!r}")
    return bits  # type: ignore[return-value]


def check_group_size(group_size: object) -> int:
    """``group_size`` if it is a power of two in 64..4096; raises ValueError otherwise."""
    if not is_block_size(group_size):
        raise ValueError(f"lowbit.lpmm: group_size must be a power of two in 64..4096, got {group_size!r}")
    return group_size  # type: ignore[return-value]


def check_rounding(rounding: object) -> str:
    """``rounding`` if it is 'stochastic' or 'nearest'; raises ValueError otherwise."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"lowbit.lpmm: rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    return str(rounding)
