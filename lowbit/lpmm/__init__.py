"""LPMM: training with the whole model memory in low precision (lpmm.txt).

:func:`convert` replaces every parameter of a model with a :class:`LowPrecisionParameter`: k-bit
group-wise absmax codes (linear map, section 5.1) plus a quantized gradient accumulator. A module's
parameters are dequantized into temporary full-precision tensors when its forward starts and dropped
when it ends (section 5.3); tensors that autograd saves for backward are not kept either, they are
dequantized again when backward needs them. Backward adds each gradient into the accumulator with
stochastic rounding, ``g <- Q(g + grad)`` (Algorithm 1, line 5), so no fp32 ``.grad`` persists, and
micro-batching is the usual gradient-accumulation loop. :class:`lowbit.optim.LPMMSGD` and
:class:`lowbit.optim.LPMMAdamW` then update the quantized parameters and momentum in one fused native
call (lines 7-8).

FSDP2: apply ``fully_shard`` after :func:`convert`. Each rank then keeps only its share of every
parameter's quantization groups (codes, absmaxes, accumulator and optimizer state, as DTensors of
``[groups, bytes per group]`` rows split like FSDP2 splits dim 0); forward gathers the codes, backward
reduce-scatters the gradient in fp32 and averages it over the ranks before accumulating, as FSDP2 does
for ordinary parameters. Group boundaries do not depend on the world size, so sharded storage holds the
same codes as one process's and distributed checkpoints reshard exactly. A ``MixedPrecisionPolicy``'s
``param_dtype`` sets the dtype of the values in forward; gradients are reduced in fp32 whatever its
``reduce_dtype``, and on every backward (``set_requires_gradient_sync(False)`` does not defer them).
Every rank must run the same forward and backward (the collectives are issued per parameter, in
autograd order).

Limits: a converted parameter must be read through its module's attribute inside that module's
forward, or passed to torch functions (``F.linear(x, emb.weight)`` works anywhere); modules that keep
their own references to parameters (``nn.RNN``/``nn.LSTM``/``nn.GRU``'s flat weights, parametrized
modules) cannot be converted and raise; FSDP2 meshes must be one-dimensional (no HSDP).
"""

from __future__ import annotations

from typing import Any

from lowbit._checks import check_rounding
from lowbit.lpmm.clip import clip_grad_norm_, clip_grad_value_
from lowbit.lpmm.convert import convert, export_float, low_precision_parameters
from lowbit.lpmm.parameter import LowPrecisionParameter, draw_seed

__all__ = [
    "LowPrecisionParameter",
    "MemoryReport",
    "check_rounding",
    "clip_grad_norm_",
    "clip_grad_value_",
    "convert",
    "draw_seed",
    "export_float",
    "low_precision_parameters",
    "memory_report",
]

# Moved to lowbit.memory, which imports this package; looked up there on first use, so that neither
# module needs the other half-initialised.
_IN_MEMORY = ("MemoryReport", "memory_report")


def __getattr__(name: str) -> Any:
    """``MemoryReport`` and ``memory_report``, from :mod:`lowbit.memory`."""
    if name in _IN_MEMORY:
        from lowbit import memory

        return getattr(memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
