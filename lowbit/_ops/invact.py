"""Inverted activations: the gradient from the saved output and one branch bit per element
(inverted-activations.txt section 2; include/lowbit/invact.h; csrc/cpu/invact.cpp, csrc/cuda/invact.cu)."""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit import _C
from lowbit._ops import _common
from lowbit._ops._common import DTYPE_CODES, FLOAT_DTYPES, Kernel, launch

# Table sizes of include/lowbit/invact.h, owned by the native module.
INVACT_COEFFS = _C.INVACT_COEFFS
INVACT_PARAMS = _C.INVACT_PARAMS
_GRAD = Kernel(_C.invact_grad_cpu, lambda: _C.invact_grad_cuda)


@torch.library.custom_op("lowbit::invact_grad", mutates_args=())
def invact_grad(grad: Tensor, y: Tensor, bits: Tensor, coeffs: Tensor, params: Tensor) -> Tensor:
    """``grad * f'(f^-1(y))`` element-wise on the branch named by each element's bit (fp32 math).

    ``bits`` holds one packed bit per element (1: right branch, ``x > T``), as
    ``fewbit_encode(x, [T], 1)`` writes it; ``coeffs`` (192 fp32) and ``params`` (5 fp32) are a table of
    :mod:`lowbit.nn.invact`. ``grad`` and ``y`` share shape and dtype; so does the result.
    """
    _common.check_input("grad", grad, FLOAT_DTYPES)
    _common.check_input("y", y, FLOAT_DTYPES)
    _common.check(y.dtype == grad.dtype, f"y has dtype {y.dtype} but grad has {grad.dtype}; they must match")
    _common.check(
        y.shape == grad.shape, f"y has shape {tuple(y.shape)} but grad has {tuple(grad.shape)}; they must match"
    )
    n = grad.numel()
    _common.check_codes("bits", bits, n, 1)
    _common.check_input("coeffs", coeffs, (torch.float32,))
    _common.check_input("params", params, (torch.float32,))
    _common.check(coeffs.numel() == INVACT_COEFFS, f"coeffs must hold {INVACT_COEFFS} values, got {coeffs.numel()}")
    _common.check(params.numel() == INVACT_PARAMS, f"params must hold {INVACT_PARAMS} values, got {params.numel()}")
    _common.check_same_device("grad", grad, y=y, bits=bits, coeffs=coeffs, params=params)
    out = torch.empty_like(grad)
    if n > 0:
        launch(_GRAD, grad.device)(
            grad.data_ptr(),
            y.data_ptr(),
            bits.data_ptr(),
            n,
            DTYPE_CODES[grad.dtype],
            coeffs.data_ptr(),
            params.data_ptr(),
            out.data_ptr(),
        )
    return out


@invact_grad.register_fake
def _(grad: Tensor, y: Tensor, bits: Tensor, coeffs: Tensor, params: Tensor) -> Tensor:
    return torch.empty_like(grad)
