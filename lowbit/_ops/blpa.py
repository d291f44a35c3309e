"""Approximate-activation blocks: BatchNorm -> ReLU saved as few-bit codes on a per-channel grid
(approx-activations-blpa.txt section 3.2; include/lowbit/blpa.h; csrc/cpu/blpa.cpp, csrc/cuda/blpa.cu)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lowbit import _C
from lowbit._ops import _common
from lowbit._ops._common import DTYPE_CODES, FLOAT_DTYPES, Kernel, launch

_ENCODE = Kernel(_C.blpa_encode_cpu, lambda: _C.blpa_encode_cuda)
_DECODE = Kernel(_C.blpa_decode_cpu, lambda: _C.blpa_decode_cuda)
_BACKWARD = Kernel(_C.blpa_backward_cpu, lambda: _C.blpa_backward_cuda)


def _blpa_dims(shape: Sequence[int]) -> tuple[int, int]:
    """(channels, inner) of an (N, C, *spatial) shape."""
    _common.check(len(shape) >= 2, f"blpa tensors are (N, C, ...), got shape {tuple(shape)}")
    return int(shape[1]), int(math.prod(shape[2:]))


def _check_blpa_channels(channels: int, **vectors: Tensor) -> None:
    for name, v in vectors.items():
        _common.check_input(name, v, (torch.float32,))
        rows = 4 if name == "grid" else 1
        _common.check(v.numel() == rows * channels, f"{name} must hold {rows * channels} fp32 values, got {v.numel()}")


def _blpa_call(
    kernel: Kernel,
    device: torch.device,
    ptrs: list[Optional[Tensor]],
    n: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    bits: int,
    batch_stats: bool = False,
) -> None:
    channels, inner = _blpa_dims(shape)
    addresses = [0 if p is None else p.data_ptr() for p in ptrs]
    launch(kernel, device)(addresses, n, channels, inner, DTYPE_CODES[dtype], bits, int(batch_stats))


@torch.library.custom_op("lowbit::blpa_encode", mutates_args=())
def blpa_encode(x: Tensor, a2: Tensor, mean: Tensor, invstd: Tensor, grid: Tensor, bits: int) -> Tensor:
    """Packed ``bits``-bit codes of ``a1 = (x - mean) * invstd`` on the per-channel ``grid`` (rows t, o, h,
    side), each on the side of the cut that ``a2 > 0`` names. ``x`` and ``a2``: (N, C, ...), same dtype."""
    _common.check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _common.check_input("x", x, FLOAT_DTYPES)
    _common.check_input("a2", a2, FLOAT_DTYPES)
    _common.check(a2.shape == x.shape and a2.dtype == x.dtype, "a2 must have x's shape and dtype")
    channels, _ = _blpa_dims(x.shape)
    _check_blpa_channels(channels, mean=mean, invstd=invstd, grid=grid)
    _common.check_same_device("x", x, a2=a2, mean=mean, invstd=invstd, grid=grid)
    out = torch.empty(_common.packed_bytes(x.numel(), bits), dtype=torch.uint8, device=x.device)
    if x.numel() > 0:
        ptrs = [x, a2, None, None, out, mean, invstd, grid, None, None, None, None, None]
        _blpa_call(_ENCODE, x.device, ptrs, x.numel(), x.shape, x.dtype, bits)
    return out


@blpa_encode.register_fake
def _(x: Tensor, a2: Tensor, mean: Tensor, invstd: Tensor, grid: Tensor, bits: int) -> Tensor:
    return x.new_empty(_common.packed_bytes(x.numel(), bits), dtype=torch.uint8)


@torch.library.custom_op("lowbit::blpa_decode", mutates_args=())
def blpa_decode(
    packed: Tensor, grid: Tensor, gamma: Tensor, beta: Tensor, shape: list[int], bits: int, dtype: torch.dtype
) -> Tensor:
    """``relu(gamma * a1 + beta)`` of shape ``shape`` and dtype ``dtype`` from the codes of
    :func:`blpa_encode`, zero exactly where the encoded ``a2 > 0`` was false."""
    _common.check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _common.check(dtype in FLOAT_DTYPES, f"dtype must be float32, float16 or bfloat16, got {dtype}")
    channels, _ = _blpa_dims(shape)
    n = math.prod(shape)
    _common.check_codes("packed", packed, n, bits)
    _check_blpa_channels(channels, grid=grid, gamma=gamma, beta=beta)
    _common.check_same_device("packed", packed, grid=grid, gamma=gamma, beta=beta)
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    if n > 0:
        ptrs = [None, None, None, packed, None, None, None, grid, gamma, beta, out, None, None]
        _blpa_call(_DECODE, packed.device, ptrs, n, shape, dtype, bits)
    return out


@blpa_decode.register_fake
def _(
    packed: Tensor, grid: Tensor, gamma: Tensor, beta: Tensor, shape: list[int], bits: int, dtype: torch.dtype
) -> Tensor:
    return packed.new_empty(shape, dtype=dtype)


@torch.library.custom_op("lowbit::blpa_backward", mutates_args=())
def blpa_backward(
    packed: Tensor,
    grad: Tensor,
    grid: Tensor,
    gamma: Tensor,
    beta: Tensor,
    invstd: Tensor,
    bits: int,
    batch_stats: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dL/dx, dL/dgamma, dL/dbeta) of BatchNorm -> ReLU from ``grad`` = dL/d(ReLU output) and the codes of
    :func:`blpa_encode` (eq. 6-8; with ``batch_stats`` False, the running-statistics form without the
    mean terms). Gradients of gamma and beta are fp32."""
    _common.check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _common.check_input("grad", grad, FLOAT_DTYPES)
    channels, _ = _blpa_dims(grad.shape)
    _common.check_codes("packed", packed, grad.numel(), bits)
    _check_blpa_channels(channels, grid=grid, gamma=gamma, beta=beta, invstd=invstd)
    _common.check_same_device("grad", grad, packed=packed, grid=grid, gamma=gamma, beta=beta, invstd=invstd)
    out = torch.empty_like(grad)
    g_gamma = torch.zeros(channels, dtype=torch.float32, device=grad.device)
    g_beta = torch.zeros(channels, dtype=torch.float32, device=grad.device)
    if grad.numel() > 0:
        ptrs = [None, None, grad, packed, None, None, invstd, grid, gamma, beta, out, g_gamma, g_beta]
        _blpa_call(_BACKWARD, grad.device, ptrs, grad.numel(), grad.shape, grad.dtype, bits, batch_stats)
    return out, g_gamma, g_beta


@blpa_backward.register_fake
def _(packed: Tensor, grad: Tensor, *rest: Any) -> tuple[Tensor, Tensor, Tensor]:
    c = grad.shape[1]
    return torch.empty_like(grad), grad.new_empty(c, dtype=torch.float32), grad.new_empty(c, dtype=torch.float32)
