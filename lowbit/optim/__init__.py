"""Optimizers with 8-bit or 4-bit block-wise or fp32 states, fused into one native call per param group."""

from lowbit.optim.config import clear_override, get_override, override
from lowbit.optim.fixed_bits import (
    Adagrad8bit,
    Adagrad32bit,
    Adam4bit,
    Adam8bit,
    Adam32bit,
    AdamW4bit,
    AdamW8bit,
    AdamW32bit,
    LAMB8bit,
    LAMB32bit,
    LARS8bit,
    LARS32bit,
    Lion8bit,
    Lion32bit,
    RMSprop8bit,
    RMSprop32bit,
    SGD4bit,
    SGD8bit,
    SGD32bit,
)
from lowbit.optim.gradient_release import GradientRelease, step_in_backward
from lowbit.optim.lpmm import LPMMSGD, LPMMAdamW, LPMMOptimizer
from lowbit.optim.optimizer import LowbitOptimizer
from lowbit.optim.optimizers import SGD, Adagrad, Adam, AdamW, Lion, RMSprop
from lowbit.optim.trust_ratio import LAMB, LARS

__all__ = [
    "LAMB",
    "LARS",
    "SGD",
    "Adagrad",
    "Adagrad8bit",
    "Adagrad32bit",
    "Adam",
    "Adam4bit",
    "Adam8bit",
    "Adam32bit",
    "AdamW",
    "AdamW4bit",
    "AdamW8bit",
    "AdamW32bit",
    "LAMB8bit",
    "LAMB32bit",
    "LARS8bit",
    "LARS32bit",
    "LPMMSGD",
    "LPMMAdamW",
    "LPMMOptimizer",
    "Lion",
    "Lion8bit",
    "Lion32bit",
    "LowbitOptimizer",
    "RMSprop",
    "RMSprop8bit",
    "RMSprop32bit",
    "SGD4bit",
    "SGD8bit",
    "SGD32bit",
    "GradientRelease",
    "clear_override",
    "get_override",
    "override",
    "step_in_backward",
]
