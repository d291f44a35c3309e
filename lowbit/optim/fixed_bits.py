"""The ``X8bit`` / ``X4bit`` / ``X32bit`` optimizers: each public optimizer with ``optim_bits`` fixed."""

from __future__ import annotations

from typing import Any, TypeVar

from lowbit.optim.ademamix import AdEMAMix
from lowbit.optim.muon import Muon
from lowbit.optim.optimizer import LowbitOptimizer, Params
from lowbit.optim.optimizers import SGD, Adagrad, Adam, AdamW, Lion, RMSprop
from lowbit.optim.trust_ratio import LAMB, LARS

_O = TypeVar("_O", bound=LowbitOptimizer)


def _fixed_bits(base: type[_O], bits: int) -> type[_O]:
    """``base`` with ``optim_bits`` fixed (the ``X8bit`` / ``X4bit`` / ``X32bit`` classes). Typed as ``base``, so
    that a checker checks the class's arguments against ``base``'s."""

    class Fixed(base):  # type: ignore[valid-type, misc]
        def __init__(self, params: Params, *args: Any, **kwargs: Any) -> None:
            if "optim_bits" in kwargs:
                raise TypeError(f"lowbit: {type(self).__name__} has fixed optim_bits={bits}; use {base.__name__}")
            super().__init__(params, *args, optim_bits=bits, **kwargs)

    Fixed.__name__ = Fixed.__qualname__ = f"{base.__name__}{bits}bit"
    form = {8: "8-bit block-wise", 4: "4-bit block-wise (blocks of 128 by default)", 32: "fp32"}[bits]
    Fixed.__doc__ = f"{base.__name__} with {form} states.\n\n{base.__doc__}"
    return Fixed


Adam8bit, Adam32bit = _fixed_bits(Adam, 8), _fixed_bits(Adam, 32)
AdamW8bit, AdamW32bit = _fixed_bits(AdamW, 8), _fixed_bits(AdamW, 32)
SGD8bit, SGD32bit = _fixed_bits(SGD, 8), _fixed_bits(SGD, 32)
Adam4bit, AdamW4bit, SGD4bit = _fixed_bits(Adam, 4), _fixed_bits(AdamW, 4), _fixed_bits(SGD, 4)
Lion8bit, Lion32bit = _fixed_bits(Lion, 8), _fixed_bits(Lion, 32)
RMSprop8bit, RMSprop32bit = _fixed_bits(RMSprop, 8), _fixed_bits(RMSprop, 32)
Adagrad8bit, Adagrad32bit = _fixed_bits(Adagrad, 8), _fixed_bits(Adagrad, 32)
LAMB8bit, LAMB32bit = _fixed_bits(LAMB, 8), _fixed_bits(LAMB, 32)
LARS8bit, LARS32bit = _fixed_bits(LARS, 8), _fixed_bits(LARS, 32)
Muon8bit, Muon32bit = _fixed_bits(Muon, 8), _fixed_bits(Muon, 32)
AdEMAMix8bit, AdEMAMix32bit = _fixed_bits(AdEMAMix, 8), _fixed_bits(AdEMAMix, 32)
