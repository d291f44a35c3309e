"""Muon's fused momentum step: the 8-bit (or fp32) momentum buffer decoded, updated, requantized, and the
update Newton-Schulz orthogonalises written as fp32 (include/lowbit/momentum_rule.h; csrc/cpu/muon.cpp,
csrc/cuda/muon.cu)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lowbit import _C
from lowbit._ops import _common
from lowbit._ops._common import DTYPE_CODES, FLOAT_DTYPES, Kernel, launch

_MOMENTUM = Kernel(_C.muon_momentum_cpu, lambda: _C.muon_momentum_cuda)


def check_muon_momentum(
    grad: Tensor, state: Tensor, absmax: Tensor, code: Tensor, update: Tensor, momentum: float, block_size: int
) -> int:
    """The checks of ``lowbit::muon_momentum_``; returns the buffer's width, 8 or 32. The optimizer runs them
    for every parameter before the first one is written."""
    _common.check_input("grad", grad, FLOAT_DTYPES)
    _common.check_input("state", state, (torch.uint8, torch.float32))
    _common.check_input("update", update, (torch.float32,))
    n = grad.numel()
    _common.check(state.numel() == n, f"state has {state.numel()} elements but grad has {n}")
    _common.check(update.numel() == n, f"update has {update.numel()} elements but grad has {n}")
    _common.check(math.isfinite(momentum) and momentum >= 0, f"momentum must be a finite number >= 0, got {momentum}")
    _common.check_same_device("grad", grad, state=state, update=update)
    if state.dtype != torch.uint8:
        return 32
    _common.check_blocksize(block_size)
    _common.check(block_size > 0, "block_size must be positive for an 8-bit buffer")
    _common.check_absmax(absmax, n, block_size)
    _common.check_map(code, 8)
    _common.check_same_device("grad", grad, absmax=absmax, code=code)
    return 8


@torch.library.custom_op("lowbit::muon_momentum_", mutates_args=("state", "absmax", "update"))
def muon_momentum_(
    grad: Tensor,
    state: Tensor,
    absmax: Tensor,
    code: Tensor,
    update: Tensor,
    momentum: float,
    nesterov: bool,
    block_size: int,
) -> None:
    """torch.optim.Muon's momentum step, fused: ``buf.lerp_(grad, 1 - momentum)``, then
    ``update = grad.lerp(buf, momentum)`` if ``nesterov`` else ``buf``.

    ``state`` is the buffer: fp32, or uint8 codes into ``code`` (256 sorted fp32 values) with one fp32
    ``absmax`` per block of ``block_size`` elements, requantized to nearest (``absmax`` is then unused
    for an fp32 buffer). ``update`` (fp32, as many elements as ``grad``) receives the update, computed
    from the fp32 buffer before it is requantized. A buffer element that becomes NaN or Inf in an 8-bit
    buffer restarts from zero; its update keeps the non-finite value.
    """
    bits = check_muon_momentum(grad, state, absmax, code, update, momentum, block_size)
    n = grad.numel()
    if n == 0:
        return
    launch(_MOMENTUM, grad.device)(
        grad.data_ptr(),
        DTYPE_CODES[grad.dtype],
        n,
        state.data_ptr(),
        absmax.data_ptr() if bits == 8 else 0,
        bits,
        code.data_ptr() if bits == 8 else 0,
        block_size,
        update.data_ptr(),
        1.0 - momentum,
        momentum,
        nesterov,
    )


@muon_momentum_.register_fake
def _(
    grad: Tensor,
    state: Tensor,
    absmax: Tensor,
    code: Tensor,
    update: Tensor,
    momentum: float,
    nesterov: bool,
    block_size: int,
) -> None:
    return None
