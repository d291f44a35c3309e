"""The few-bit table type, :class:`FewBitTable`, and the tables shipped with lowbit.

The shipped tables (``lowbit/nn/fewbit_tables.json``, written by ``python -m lowbit.nn._fewbit_gen``) cover
every activation in :data:`lowbit.nn.fewbit.ACTIVATIONS` at bits 1..8 on [-10, 10], with both weights;
``relu`` and ``leaky_relu`` only at 1 bit, where they are exact.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

from lowbit.nn._registry import TWO_VALUED, check_activation, registered, two_values

__all__ = [
    "MAX_BITS",
    "TABLE_FILE",
    "TABLE_GRID_CELLS",
    "TABLE_INTERVAL",
    "WEIGHTS",
    "FewBitTable",
    "table",
    "table_bits",
]

MAX_BITS = 8
WEIGHTS = ("normal", "uniform")
TABLE_FILE = "fewbit_tables.json"
TABLE_INTERVAL = (-10.0, 10.0)
TABLE_GRID_CELLS = 1 << 16


def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"lowbit: bits must be an int, got {type(bits).__name__}")
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"lowbit: bits must be in 1..{MAX_BITS}, got {bits}")
    return int(bits)


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"lowbit: {name} must contain real numbers, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"lowbit: {name} must be finite, got {value}")
    return float(value)


def _check_interval(interval: object) -> tuple[float, float]:
    if not isinstance(interval, (tuple, list)) or len(interval) != 2:
        raise TypeError(f"lowbit: interval must be a pair (lo, hi), got {interval!r}")
    lo, hi = (_check_real("interval", v) for v in interval)
    if not lo < hi:
        raise ValueError(f"lowbit: interval must have lo < hi, got {interval!r}")
    return lo, hi


@dataclass(frozen=True, eq=False)
class FewBitTable:
    """A piecewise-constant approximation ``q(x | s, y)`` (eq. 2) of an activation's derivative.

    ``x`` falls in interval ``i = torch.bucketize(x, boundaries)`` (``boundaries[i-1] < x <= boundaries[i]``)
    and ``q(x) = levels[i]``; the backward pass multiplies the incoming gradient by it. Treat the tensors
    as read-only.

    Attributes:
        boundaries: the ``2**bits - 1`` interval boundaries ``s``, fp32, non-decreasing.
        levels: the ``2**bits`` levels ``y``, fp32; not sorted in general (GELU's derivative is not monotone).
        bits: bits per saved element.
        error: the weighted L2 error ``L(s, y)`` of eq. 3 that these fp32 values achieve on ``interval``,
            computed by :func:`~lowbit.nn.fewbit.approximation_error`.
        weight: ``"normal"``, ``"uniform"`` or ``"custom"`` (a callable weight).
        interval: ``(lo, hi)``, the support of the weight in eq. 3.
    """

    boundaries: Tensor
    levels: Tensor
    bits: int
    error: float
    weight: str
    interval: tuple[float, float]

    def __post_init__(self) -> None:
        bits = _check_bits(self.bits)
        for name, value, n in (("boundaries", self.boundaries, (1 << bits) - 1), ("levels", self.levels, 1 << bits)):
            if not isinstance(value, Tensor):
                raise TypeError(f"lowbit: {name} must be a tensor, got {type(value).__name__}")
            if value.dtype != torch.float32 or value.shape != (n,):
                raise ValueError(f"lowbit: {name} must be fp32 of shape ({n},), got {value.dtype} {tuple(value.shape)}")
            if not torch.isfinite(value).all():
                raise ValueError(f"lowbit: {name} must be finite")
        if (self.boundaries[1:] < self.boundaries[:-1]).any():
            raise ValueError("lowbit: boundaries must be sorted")
        if not (math.isfinite(self.error) and self.error >= 0):
            raise ValueError(f"lowbit: error must be finite and non-negative, got {self.error}")
        _check_interval(self.interval)

    def __call__(self, x: Tensor) -> Tensor:
        """``q(x | s, y)`` of eq. 2: the level of the interval each element of ``x`` falls in.

        Args:
            x: a floating-point tensor of any shape on any device; the result has its dtype.
        """
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"lowbit: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        boundaries = self.boundaries.to(device=x.device, dtype=x.dtype)
        return self.levels.to(device=x.device, dtype=x.dtype)[torch.bucketize(x, boundaries)]


def _make_table(
    s: Union[Sequence[float], np.ndarray],
    y: Union[Sequence[float], np.ndarray],
    bits: int,
    err: float,
    weight: str,
    interval: tuple[float, float],
) -> FewBitTable:
    return FewBitTable(
        # On the CPU whatever the default device: tables are constants, built under torch.device("meta") too.
        boundaries=torch.tensor(s, dtype=torch.float32, device="cpu"),
        levels=torch.tensor(y, dtype=torch.float32, device="cpu"),
        bits=bits,
        error=float(err),
        weight=weight,
        interval=interval,
    )


def table_bits(name: str) -> tuple[int, ...]:
    """The bit widths of activation ``name``'s tables: (1,) where its derivative takes two values (``relu``,
    ``leaky_relu``, registered ``two_values``), else 1..8.

    Args:
        name: one of :data:`~lowbit.nn.fewbit.ACTIVATIONS`, or a registered name.
    """
    exact = check_activation(name) in TWO_VALUED or two_values(name) is not None
    return (1,) if exact else tuple(range(1, MAX_BITS + 1))


@functools.cache
def _shipped() -> dict[str, Any]:
    with resources.files("lowbit.nn").joinpath(TABLE_FILE).open("r", encoding="utf-8") as fh:
        return json.load(fh)


def table(name: str, bits: int, weight: str = "normal") -> FewBitTable:
    """The optimal table for activation ``name`` (interval [-10, 10]): shipped for a built-in activation,
    derived once for one added by :func:`~lowbit.nn.register_activation`.

    Args:
        name: one of :data:`~lowbit.nn.fewbit.ACTIVATIONS`, or a registered name.
        bits: bits per element; one of :func:`table_bits` ``(name)``.
        weight: ``"normal"`` or ``"uniform"``.
    """
    name = check_activation(name)
    bits = _check_bits(bits)
    if bits not in table_bits(name):
        raise ValueError(f"lowbit: {name}'s derivative takes two values, so its 1-bit table is exact: bits must be 1")
    if not isinstance(weight, str):
        raise TypeError(f"lowbit: weight must be a str, got {type(weight).__name__}")
    if weight not in WEIGHTS:
        raise ValueError(f"lowbit: weight must be one of {WEIGHTS}, got {weight!r}")
    if registered(name):
        return _derived(name, bits, weight)
    data = _shipped()
    entry = data["tables"][name][weight][str(bits)]
    return _make_table(entry["boundaries"], entry["levels"], bits, entry["error"], weight, tuple(data["interval"]))


@functools.cache
def _derived(name: str, bits: int, weight: str) -> FewBitTable:
    """The table of a registered activation, solved once (a registered name never changes its function)."""
    values = two_values(name)
    if values is not None:
        # The layer encodes f'(x) itself, so one boundary between the two values separates them exactly.
        lo, hi = values
        return _make_table([(lo + hi) / 2], [lo, hi], 1, 0.0, weight, TABLE_INTERVAL)
    from lowbit.nn.fewbit.solver import optimal_levels  # the solver imports this module

    return optimal_levels(name, bits, weight, TABLE_INTERVAL)
