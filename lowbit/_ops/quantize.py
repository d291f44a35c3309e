"""Block-wise and tensor-wise quantization and bit packing (8bit-optimizers.txt section 2;
include/lowbit/blockwise.h, qmap.h, pack.h; csrc/cpu/quantize.cpp, csrc/cuda/quantize.cu)."""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit import _C
from lowbit._checks import MAX_LINEAR_BITS
from lowbit._ops import _common
from lowbit._ops._common import DTYPE_CODES, FLOAT_DTYPES, Kernel, launch

_QUANTIZE = Kernel(_C.quantize_cpu, lambda: _C.quantize_cuda)
_DEQUANTIZE = Kernel(_C.dequantize_cpu, lambda: _C.dequantize_cuda)
_PACK_BITS = Kernel(_C.pack_bits_cpu, lambda: _C.pack_bits_cuda)
_UNPACK_BITS = Kernel(_C.unpack_bits_cpu, lambda: _C.unpack_bits_cuda)


def _quantize(
    x: Tensor, code: Tensor | None, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    n = x.numel()
    out = torch.empty(_common.packed_bytes(n, bits), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(_common.num_blocks(n, blocksize), dtype=torch.float32, device=x.device)
    if n > 0:
        map_ptr, map_n = (code.data_ptr(), code.numel()) if code is not None else (0, 0)
        launch(_QUANTIZE, x.device)(
            x.data_ptr(),
            n,
            DTYPE_CODES[x.dtype],
            map_ptr,
            map_n,
            bits,
            blocksize,
            stochastic,
            seed,
            offset,
            out.data_ptr(),
            absmax.data_ptr(),
        )
    return out, absmax


def _dequantize(
    codes: Tensor, absmax: Tensor, code: Tensor | None, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if numel > 0:
        map_ptr, map_n = (code.data_ptr(), code.numel()) if code is not None else (0, 0)
        launch(_DEQUANTIZE, codes.device)(
            codes.data_ptr(),
            absmax.data_ptr(),
            numel,
            map_ptr,
            map_n,
            bits,
            blocksize,
            out.data_ptr(),
            DTYPE_CODES[dtype],
        )
    return out


@torch.library.custom_op("lowbit::quantize_blockwise", mutates_args=())
def quantize_blockwise(
    x: Tensor, code: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Block-wise map quantization of the elements of ``x`` (flattened).

    Returns ``(packed, absmax)``: ``ceil(numel*bits/8)`` bytes of bit-packed indices into ``code`` and
    one fp32 absmax per block. Stochastic rounding draws element ``i`` from counter ``offset + i``
    of the stream keyed by ``seed``.
    """
    _common.check_input("x", x, FLOAT_DTYPES)
    _common.check_map(code, bits)
    _common.check_same_device("x", x, code=code)
    _common.check_blocksize(blocksize)
    _common.check_rng(seed, offset)
    return _quantize(x, code, bits, blocksize, stochastic, seed, offset)


def _fake_quantized(x: Tensor, bits: int, blocksize: int) -> tuple[Tensor, Tensor]:
    n = x.numel()
    return (
        x.new_empty(_common.packed_bytes(n, bits), dtype=torch.uint8),
        x.new_empty(_common.num_blocks(n, blocksize), dtype=torch.float32),
    )


@quantize_blockwise.register_fake
def _(
    x: Tensor, code: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    return _fake_quantized(x, bits, blocksize)


@torch.library.custom_op("lowbit::dequantize_blockwise", mutates_args=())
def dequantize_blockwise(
    codes: Tensor, absmax: Tensor, code: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Inverse of :func:`quantize_blockwise`: a flat tensor of ``numel`` elements of ``dtype``."""
    _common.check_map(code, bits)
    _common.check_blocksize(blocksize)
    _common.check(dtype in FLOAT_DTYPES, f"dtype must be float32, float16 or bfloat16, got {dtype}")
    _common.check_codes("codes", codes, numel, bits)
    _common.check_absmax(absmax, numel, blocksize)
    _common.check_same_device("codes", codes, absmax=absmax, code=code)
    return _dequantize(codes, absmax, code, bits, blocksize, numel, dtype)


@dequantize_blockwise.register_fake
def _(codes: Tensor, absmax: Tensor, code: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype) -> Tensor:
    return codes.new_empty(numel, dtype=dtype)


@torch.library.custom_op("lowbit::quantize_linear", mutates_args=())
def quantize_linear(
    x: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Group-wise symmetric linear absmax quantization (lpmm.txt eq. 6) to ``bits`` in 2..16.

    Element codes are ``q + qmax`` with ``q = round(xn * qmax)``, ``qmax = 2**(bits-1) - 1``, where
    ``xn = x * (1 / absmax)`` (exactly +-1 at the absmax element), bit-packed. Returns ``(packed, absmax)``.
    """
    _common.check_input("x", x, FLOAT_DTYPES)
    _common.check(2 <= bits <= MAX_LINEAR_BITS, f"bits must be in 2..{MAX_LINEAR_BITS}, got {bits}")
    _common.check_blocksize(blocksize)
    _common.check_rng(seed, offset)
    return _quantize(x, None, bits, blocksize, stochastic, seed, offset)


@quantize_linear.register_fake
def _(x: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int) -> tuple[Tensor, Tensor]:
    return _fake_quantized(x, bits, blocksize)


@torch.library.custom_op("lowbit::dequantize_linear", mutates_args=())
def dequantize_linear(
    codes: Tensor, absmax: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Inverse of :func:`quantize_linear`: a flat tensor of ``numel`` elements of ``dtype``."""
    _common.check(2 <= bits <= MAX_LINEAR_BITS, f"bits must be in 2..{MAX_LINEAR_BITS}, got {bits}")
    _common.check_blocksize(blocksize)
    _common.check(dtype in FLOAT_DTYPES, f"dtype must be float32, float16 or bfloat16, got {dtype}")
    _common.check_codes("codes", codes, numel, bits)
    _common.check_absmax(absmax, numel, blocksize)
    _common.check_same_device("codes", codes, absmax=absmax)
    return _dequantize(codes, absmax, None, bits, blocksize, numel, dtype)


@dequantize_linear.register_fake
def _(codes: Tensor, absmax: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype) -> Tensor:
    return codes.new_empty(numel, dtype=dtype)


@torch.library.custom_op("lowbit::pack_bits", mutates_args=())
def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Packs uint8 codes (each below ``2**bits``) into ``ceil(numel*bits/8)`` bytes, LSB first."""
    _common.check_input("codes", codes, (torch.uint8,))
    _common.check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    n = codes.numel()
    out = torch.empty(_common.packed_bytes(n, bits), dtype=torch.uint8, device=codes.device)
    if n > 0:
        launch(_PACK_BITS, codes.device)(codes.data_ptr(), out.data_ptr(), n, bits)
    return out


@pack_bits.register_fake
def _(codes: Tensor, bits: int) -> Tensor:
    return codes.new_empty(_common.packed_bytes(codes.numel(), bits))


@torch.library.custom_op("lowbit::unpack_bits", mutates_args=())
def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` uint8 codes."""
    _common.check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _common.check(numel >= 0, f"numel must be non-negative, got {numel}")
    _common.check_codes("packed", packed, numel, bits)
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    if numel > 0:
        launch(_UNPACK_BITS, packed.device)(packed.data_ptr(), out.data_ptr(), numel, bits)
    return out


@unpack_bits.register_fake
def _(packed: Tensor, bits: int, numel: int) -> Tensor:
    return packed.new_empty(numel)
