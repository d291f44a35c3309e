"""Few-bit backward: interval codes of the forward input and the gradient they select
(fewbit-backward.txt section 3; include/lowbit/fewbit.h; csrc/cpu/fewbit.cpp, csrc/cuda/fewbit.cu)."""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit import _C
from lowbit._ops import _common
from lowbit._ops._common import DTYPE_CODES, FLOAT_DTYPES, Kernel, launch

_ENCODE = Kernel(_C.fewbit_encode_cpu, lambda: _C.fewbit_encode_cuda)
_GRAD = Kernel(_C.fewbit_grad_cpu, lambda: _C.fewbit_grad_cuda)


def _check_fewbit_bits(bits: int) -> None:
    _common.check(isinstance(bits, int) and 1 <= bits <= 8, f"bits must be an int in 1..8, got {bits!r}")


@torch.library.custom_op("lowbit::fewbit_encode", mutates_args=())
def fewbit_encode(x: Tensor, boundaries: Tensor, bits: int) -> Tensor:
    """The interval codes of ``x``, bit-packed: ``ceil(numel*bits/8)`` uint8.

    Element i gets the number of ``boundaries`` (``2**bits - 1`` sorted fp32 values on x's device)
    that are < x_i, in ``bits`` bits (``torch.bucketize``'s convention); NaN gets 0. ``x`` is read in
    flat (contiguous) order.
    """
    _check_fewbit_bits(bits)
    _common.check_input("x", x, FLOAT_DTYPES)
    _common.check_input("boundaries", boundaries, (torch.float32,))
    _common.check(
        boundaries.numel() == 2**bits - 1,
        f"boundaries must hold 2**bits - 1 = {2**bits - 1} values for bits={bits}, got {boundaries.numel()}",
    )
    _common.check_same_device("x", x, boundaries=boundaries)
    n = x.numel()
    out = torch.empty(_common.packed_bytes(n, bits), dtype=torch.uint8, device=x.device)
    if n > 0:
        launch(_ENCODE, x.device)(x.data_ptr(), n, DTYPE_CODES[x.dtype], boundaries.data_ptr(), bits, out.data_ptr())
    return out


@fewbit_encode.register_fake
def _(x: Tensor, boundaries: Tensor, bits: int) -> Tensor:
    return x.new_empty(_common.packed_bytes(x.numel(), bits), dtype=torch.uint8)


@torch.library.custom_op("lowbit::fewbit_grad", mutates_args=())
def fewbit_grad(grad: Tensor, packed: Tensor, levels: Tensor, bits: int) -> Tensor:
    """``grad * levels[code]`` element-wise, for the codes of :func:`fewbit_encode` (fp32 math).

    ``levels`` holds ``2**bits`` fp32 values on grad's device; the result has grad's shape and dtype.
    """
    _check_fewbit_bits(bits)
    _common.check_input("grad", grad, FLOAT_DTYPES)
    _common.check_input("levels", levels, (torch.float32,))
    _common.check(
        levels.numel() == 2**bits, f"levels must hold 2**bits = {2**bits} values for bits={bits}, got {levels.numel()}"
    )
    n = grad.numel()
    _common.check_codes("packed", packed, n, bits)
    _common.check_same_device("grad", grad, packed=packed, levels=levels)
    out = torch.empty_like(grad)
    if n > 0:
        launch(_GRAD, grad.device)(
            grad.data_ptr(), packed.data_ptr(), n, DTYPE_CODES[grad.dtype], levels.data_ptr(), bits, out.data_ptr()
        )
    return out


@fewbit_grad.register_fake
def _(grad: Tensor, packed: Tensor, levels: Tensor, bits: int) -> Tensor:
    return torch.empty_like(grad)
