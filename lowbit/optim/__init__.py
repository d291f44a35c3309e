"""Optimizers with 8-bit block-wise or fp32 states, fused into one native call per param group."""

from lowbit.optim.config import clear_override, get_override, override
from lowbit.optim.optimizer import LowbitOptimizer
from lowbit.optim.optimizers import (
    SGD,
    Adagrad,
    Adagrad8bit,
    Adagrad32bit,
    Adam,
    Adam8bit,
    Adam32bit,
    AdamW,
    AdamW8bit,
    AdamW32bit,
    Lion,
    Lion8bit,
    Lion32bit,
    RMSprop,
    RMSprop8bit,
    RMSprop32bit,
    SGD8bit,
    SGD32bit,
)

__all__ = [
    "SGD",
    "Adagrad",
    "Adagrad8bit",
    "Adagrad32bit",
    "Adam",
    "Adam8bit",
    "Adam32bit",
    "AdamW",
    "AdamW8bit",
    "AdamW32bit",
    "Lion",
    "Lion8bit",
    "Lion32bit",
    "LowbitOptimizer",
    "RMSprop",
    "RMSprop8bit",
    "RMSprop32bit",
    "SGD8bit",
    "SGD32bit",
    "clear_override",
    "get_override",
    "override",
]
