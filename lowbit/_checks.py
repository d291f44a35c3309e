"""Argument checks shared by lowbit's public API."""

from __future__ import annotations

from lowbit import _ops
from lowbit.functional import ROUNDING_MODES

__all__ = ["MAX_BITS", "MIN_BITS", "check_bits", "check_group_size", "check_rounding"]

# Bits per element of low-precision parameters and gradient accumulators (linear codes).
MIN_BITS = 4
MAX_BITS = _ops.MAX_LINEAR_BITS


def check_bits(name: str, bits: object) -> int:
    """``bits`` if it is an int in ``MIN_BITS..MAX_BITS``; raises ValueError naming ``name`` otherwise."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"lowbit.lpmm: {name} must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    return bits


def check_group_size(group_size: object) -> int:
    """``group_size`` if it is a power of two in 64..4096; raises ValueError otherwise."""
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or not (64 <= group_size <= 4096 and group_size & (group_size - 1) == 0)
    ):
        raise ValueError(f"lowbit.lpmm: group_size must be a power of two in 64..4096, got {group_size!r}")
    return group_size


def check_rounding(rounding: object) -> str:
    """``rounding`` if it is 'stochastic' or 'nearest'; raises ValueError otherwise."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"lowbit.lpmm: rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    return str(rounding)
