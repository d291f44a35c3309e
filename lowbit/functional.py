"""Quantization maps and block-wise / linear quantization of tensors.

Maps are sorted fp32 tables of ``2**bits`` values in [-1, 1]; a tensor is split into blocks, each block
is divided by its absolute maximum, and every element is replaced by the index of a map value
(8bit-optimizers.txt sections 1.2-2.2). ``rounding="nearest"`` returns a true argmin;
``rounding="stochastic"`` rounds to one of the two neighbouring values so that the result is unbiased
(lpmm.txt section 3.3), with draws that depend only on (seed, element index) and so agree on CPU and
CUDA.

Non-finite inputs: a block that contains NaN or +-Inf gets absmax NaN and dequantizes to NaN in full;
other blocks are unaffected. An all-zero block dequantizes to zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import torch
from torch import Tensor

from lowbit import _ops
from lowbit._checks import ROUNDING_MODES, is_block_size

__all__ = [
    "LinearQuantState",
    "QuantState",
    "create_dynamic_map",
    "create_inverse_dynamic_map",
    "create_linear_map",
    "create_quantile_map",
    "dequantize_blockwise",
    "dequantize_linear",
    "pack_bits",
    "quantize_blockwise",
    "quantize_linear",
    "unpack_bits",
]


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"lowbit: {name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"lowbit: {name} must be in {lo}..{hi}, got {value}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"lowbit: {name} must be a bool, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# Maps
# ---------------------------------------------------------------------------------------------


def _tree_magnitudes(magnitude_bits: int, max_exponent_bits: int, inverse: bool) -> list[float]:
    """The ``2**magnitude_bits - 1`` non-zero magnitudes of a dynamic tree type, largest exactly 1.

    A bit pattern with d leading zero bits, then the indicator bit, then ``magnitude_bits - 1 - d``
    fraction bits encodes a linear fraction of the decade [0.1, 1] * 10**-d (8bit-optimizers.txt
    section 1.3; the fraction values are bin midpoints as in the reference implementation). The
    inverse variant (Appendix E.1) gives the finest fractions to the smallest decades instead.
    Patterns with more than ``max_exponent_bits - 1`` leading zeros are spare: the first spare
    pattern holds 1.0, the rest are linear subnormals below the last decade. Without a spare
    pattern the largest midpoint is replaced by 1.0, so that the block absmax is always exact.
    """
    n, decades = magnitude_bits, min(max_exponent_bits, magnitude_bits)
    mags: list[float] = []
    for d in range(decades):
        count = 2 ** (n - 1 - d)
        scale = 10.0 ** (-(decades - 1 - d) if inverse else -d)
        mags += [scale * (0.1 + 0.9 * (k + 0.5) / count) for k in range(count)]
    spare = 2**n - 1 - len(mags)
    if spare == 0:
        mags[mags.index(max(mags))] = 1.0
    else:
        smallest = 0.1 * 10.0 ** (-(decades - 1))
        mags += [1.0] + [smallest * k / spare for k in range(1, spare)]
    return mags


def _map_from_magnitudes(mags: list[float], signed: bool) -> Tensor:
    values = [-m for m in mags] + [0.0, 0.0] + mags if signed else [0.0] + mags
    return torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)


def _check_map_args(signed: bool, max_exponent_bits: int, total_bits: int) -> int:
    _check_bool("signed", signed)
    _check_int("total_bits", total_bits, 2, _ops.MAX_MAP_BITS)
    _check_int("max_exponent_bits", max_exponent_bits, 1, _ops.MAX_MAP_BITS)
    return total_bits - 1 if signed else total_bits


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> Tensor:
    """Dynamic (tree) quantization map with ``2**total_bits`` sorted fp32 values in [-1, 1].

    Signed maps use a sign bit, then a run of zero bits as a base-10 exponent, an indicator bit and a
    linear fraction (8bit-optimizers.txt section 1.3). Unsigned maps spend the sign bit on one more
    fraction bit (section 2.2) and are identical to bitsandbytes' unsigned map (up to the last fp32
    rounding of the construction, which lowbit does in float64).

    Signed maps differ from bitsandbytes' in being exactly symmetric, ``map[i] == -map[-1 - i]``:
    bitsandbytes' signed 8-bit map holds +1 but not -1 (its most negative value is -0.99297), so a
    block whose absmax element is negative is not reconstructed exactly. Here the largest midpoint
    +-0.99297 is replaced by +-1, and the pattern that would be "-0" decodes to 0 as well (a 256-entry
    symmetric map that contains 0 must repeat one value), giving 255 distinct values.

    Args:
        signed: sign bit (for first moments, gradients) or not (second moments).
        max_exponent_bits: largest number of exponent (zero) bits, 1..8; 7 spans 1e-7..1. Maps
            with fewer magnitude bits use as many decades as they have bits.
        total_bits: map size is ``2**total_bits``, 2..8.
    """
    n = _check_map_args(signed, max_exponent_bits, total_bits)
    return _map_from_magnitudes(_tree_magnitudes(n, max_exponent_bits, inverse=False), signed)


def create_inverse_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> Tensor:
    """Inverse dynamic map (8bit-optimizers.txt Appendix E.1): finest resolution for small values.

    The base exponent starts at 10**-(max_exponent_bits - 1) and each zero bit raises it, so small
    magnitudes get the most fraction bits. Symmetry, zero and the exact +-1 follow
    :func:`create_dynamic_map`.

    Args:
        signed: with a sign bit or not.
        max_exponent_bits: number of decades, 1..8 (capped at the number of magnitude bits).
        total_bits: map size is ``2**total_bits``, 2..8.
    """
    n = _check_map_args(signed, max_exponent_bits, total_bits)
    return _map_from_magnitudes(_tree_magnitudes(n, max_exponent_bits, inverse=True), signed)


def create_linear_map(signed: bool = True, total_bits: int = 8) -> Tensor:
    """Uniform map with ``2**total_bits`` sorted values.

    Signed: ``k / (2**(b-1) - 1)`` for ``|k| <= 2**(b-1) - 1`` with 0 repeated, so it is symmetric and
    holds 0 and +-1 exactly (bitsandbytes' ``linspace(-1, 1, 256)`` holds no zero). Unsigned:
    ``linspace(0, 1, 2**b)``.

    Args:
        signed: symmetric around 0, or covering [0, 1].
        total_bits: map size is ``2**total_bits``, 1..8 (signed needs at least 2).
    """
    _check_bool("signed", signed)
    _check_int("total_bits", total_bits, 2 if signed else 1, _ops.MAX_MAP_BITS)
    if not signed:
        return torch.linspace(0.0, 1.0, 2**total_bits, dtype=torch.float64).to(torch.float32)
    qmax = 2 ** (total_bits - 1) - 1
    mags = [k / qmax for k in range(1, qmax + 1)]
    return _map_from_magnitudes(mags, signed=True)


_QUANTILE_SAMPLE = 1 << 22


def create_quantile_map(x: Tensor, total_bits: int = 8) -> Tensor:
    """Quantile map of the data ``x`` (8bit-optimizers.txt Appendix E.2, eq. 5).

    ``q_i = (Q(i / (2**b + 1)) + Q((i + 1) / (2**b + 1))) / 2`` for i = 0..2**b - 1, where Q is the
    empirical quantile function of ``x``, so each code is used equally often on data distributed like
    ``x``. The map is scaled so that its largest magnitude is exactly 1 (it is used on absmax-normalised
    blocks). Tensors above 2**22 elements are subsampled with a fixed stride.

    Args:
        x: floating-point sample with at least two distinct finite values.
        total_bits: map size is ``2**total_bits``, 1..8.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError("lowbit: x must be a floating-point torch.Tensor")
    _check_int("total_bits", total_bits, 1, _ops.MAX_MAP_BITS)
    data = x.detach().reshape(-1).to("cpu", torch.float64)
    if not bool(torch.isfinite(data).all()):
        raise ValueError("lowbit: x contains NaN or Inf; quantiles of non-finite data are undefined")
    # A constant sample (all zeros included) would give a map of 2**total_bits equal entries.
    if data.numel() == 0 or bool(data.amin() == data.amax()):
        got = "an empty tensor" if data.numel() == 0 else f"{data.numel()} element(s) all equal to {float(data[0]):g}"
        raise ValueError(f"lowbit: x must hold at least two distinct finite values for a quantile map, got {got}")
    if data.numel() > _QUANTILE_SAMPLE:
        data = data[:: math.ceil(data.numel() / _QUANTILE_SAMPLE)]
    k = 2**total_bits
    qs = torch.quantile(data, torch.arange(k + 1, dtype=torch.float64) / (k + 1))
    mids = (qs[:-1] + qs[1:]) / 2
    scale = mids.abs().max()
    code = torch.sort(mids / scale).values.to(torch.float32) if scale > 0 else mids.to(torch.float32)
    # Data whose quantiles all coincide (e.g. one value repeated but for a few outliers) gives a map
    # that can represent one value only.
    if not scale > 0 or bool(code[0] == code[-1]):
        raise ValueError(
            "lowbit: x's quantiles are all equal, so a quantile map of it holds a single value; "
            "x needs at least two values that each fill a quantile bin (1 / (2**total_bits + 1) of it)"
        )
    return code


@functools.cache
def _default_map(device: torch.device) -> Tensor:
    return create_dynamic_map(signed=True).to(device)


# ---------------------------------------------------------------------------------------------
# Quantization states
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class QuantState:
    """Everything needed to dequantize the codes of :func:`quantize_blockwise`.

    A plain dataclass of tensors and Python values: it pickles with ``torch.save`` and loads with
    ``torch.load(weights_only=True)``.

    Attributes:
        absmax: fp32 absolute maximum of each block (NaN for blocks holding NaN/Inf).
        code: the sorted fp32 map the codes index.
        blocksize: elements per block, or None for one block over the whole tensor.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (and of the dequantized result).
        bits: bits per code, ``log2(len(code))``.
    """

    absmax: Tensor
    code: Tensor
    blocksize: Optional[int]
    shape: torch.Size
    dtype: torch.dtype
    bits: int

    def to(self, device: Union[str, torch.device]) -> QuantState:
        """A copy with the tensors on ``device``."""
        return dataclasses.replace(self, absmax=self.absmax.to(device), code=self.code.to(device))


@dataclasses.dataclass
class LinearQuantState:
    """Everything needed to dequantize the codes of :func:`quantize_linear`.

    Attributes:
        absmax: fp32 absolute maximum of each group (NaN for groups holding NaN/Inf).
        blocksize: elements per group, or None for one group over the whole tensor.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor.
        bits: bits per code, 2..16.
    """

    absmax: Tensor
    blocksize: Optional[int]
    shape: torch.Size
    dtype: torch.dtype
    bits: int

    def to(self, device: Union[str, torch.device]) -> LinearQuantState:
        """A copy with the tensors on ``device``."""
        return dataclasses.replace(self, absmax=self.absmax.to(device))


torch.serialization.add_safe_globals([QuantState, LinearQuantState])


# ---------------------------------------------------------------------------------------------
# Argument handling shared by both quantizers
# ---------------------------------------------------------------------------------------------


def _check_tensor_input(x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"lowbit: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _ops.FLOAT_DTYPES:
        raise TypeError(f"lowbit: x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"lowbit: x is on {x.device}; only cpu and cuda tensors are supported")
    return x.detach().contiguous()


def _native_blocksize(blocksize: object) -> int:
    if blocksize is None:
        return 0
    if isinstance(blocksize, bool) or not isinstance(blocksize, int):
        raise TypeError(f"lowbit: blocksize must be an int or None (tensor-wise), got {type(blocksize).__name__}")
    if not is_block_size(blocksize):
        raise ValueError(f"lowbit: blocksize must be a power of two in 64..4096 or None, got {blocksize}")
    return blocksize


def _rounding_seed(rounding: object, generator: object) -> tuple[bool, int]:
    """(stochastic?, seed). The seed comes from ``generator`` or, without one, torch's default one."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"lowbit: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"lowbit: generator must be a torch.Generator or None, got {type(generator).__name__}")
    if rounding == "nearest":
        if generator is not None:
            raise ValueError("lowbit: generator is only used with rounding='stochastic'")
        return False, 0
    seed = torch.randint(
        0, 2**63 - 1, (1,), generator=generator, device=generator.device if generator is not None else "cpu"
    )
    return True, int(seed.item())


def _codes_out(packed: Tensor, x: Tensor, bits: int) -> Tensor:
    return packed.view(x.shape) if bits == 8 else packed


def _check_codes_arg(codes: object, state: object, cls: type) -> None:
    if not isinstance(state, cls):
        raise TypeError(f"lowbit: state must be a {cls.__name__}, got {type(state).__name__}")
    if not isinstance(codes, Tensor):
        raise TypeError(f"lowbit: codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"lowbit: codes must have dtype uint8, got {codes.dtype}")
    # Checked here as well as in the op: with a meta tensor among the inputs the dispatcher would
    # route the call to the fake kernel, which checks nothing.
    for name in ("absmax", "code"):
        t = getattr(state, name, None)
        if t is not None and t.device != codes.device:
            raise ValueError(f"lowbit: {name} is on {t.device} but codes is on {codes.device}; use state.to(device)")


# ---------------------------------------------------------------------------------------------
# Block-wise map quantization
# ---------------------------------------------------------------------------------------------


def _check_code(code: object, device: torch.device) -> tuple[Tensor, int]:
    if not isinstance(code, Tensor):
        raise TypeError(f"lowbit: code must be a torch.Tensor or None, got {type(code).__name__}")
    if code.dtype != torch.float32 or code.dim() != 1:
        raise TypeError(f"lowbit: code must be a 1-D float32 tensor, got {code.dim()}-D {code.dtype}")
    n = code.numel()
    if n < 2 or n > 256 or n & (n - 1):
        raise ValueError(f"lowbit: code must have 2**bits entries for bits in 1..8, got {n}")
    if code.device != device:
        raise ValueError(f"lowbit: code is on {code.device} but x is on {device}; move code with code.to(x.device)")
    host = code.detach().cpu()
    if not bool(torch.isfinite(host).all()) or float(host.abs().max()) > 1.0:
        raise ValueError("lowbit: code values must be finite and within [-1, 1]")
    if not bool((host[1:] >= host[:-1]).all()):
        raise ValueError("lowbit: code must be sorted in ascending order (use torch.sort(code).values)")
    return code.contiguous(), n.bit_length() - 1


def quantize_blockwise(
    x: Tensor,
    code: Optional[Tensor] = None,
    blocksize: Optional[int] = 2048,
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, QuantState]:
    """Quantize ``x`` block-wise against the map ``code``.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape on cpu or cuda (need not be contiguous).
        code: sorted fp32 map of ``2**bits`` values in [-1, 1] on ``x``'s device, bits in 1..8;
            default: the signed 8-bit dynamic map :func:`create_dynamic_map`.
        blocksize: elements per block (a power of two, 64..4096) or None for one tensor-wise block.
        rounding: ``"nearest"`` (true argmin over the map) or ``"stochastic"`` (unbiased).
        generator: source of the stochastic-rounding seed; default: torch's global generator, so
            ``torch.manual_seed`` makes results reproducible.

    Returns:
        ``(codes, state)``. For 8-bit maps ``codes`` is a uint8 tensor shaped like ``x``; below 8
        bits it is a flat uint8 tensor of exactly ``ceil(numel * bits / 8)`` packed bytes.
    """
    x = _check_tensor_input(x)
    if code is None:
        code, bits = _default_map(x.device), 8
    else:
        code, bits = _check_code(code, x.device)
    bs = _native_blocksize(blocksize)
    stochastic, seed = _rounding_seed(rounding, generator)
    packed, absmax = _ops.quantize_blockwise(x, code, bits, bs, stochastic, seed, 0)
    state = QuantState(absmax=absmax, code=code, blocksize=blocksize, shape=x.shape, dtype=x.dtype, bits=bits)
    return _codes_out(packed, x, bits), state


def dequantize_blockwise(codes: Tensor, state: QuantState) -> Tensor:
    """Reconstruct the tensor quantized by :func:`quantize_blockwise`, in ``state.dtype`` and shape."""
    _check_codes_arg(codes, state, QuantState)
    numel = math.prod(state.shape)
    out = _ops.dequantize_blockwise(
        codes.contiguous(),
        state.absmax,
        state.code,
        state.bits,
        _native_blocksize(state.blocksize),
        numel,
        state.dtype,
    )
    return out.view(state.shape)


# ---------------------------------------------------------------------------------------------
# Group-wise linear quantization (LPMM parameters and gradients)
# ---------------------------------------------------------------------------------------------


def quantize_linear(
    x: Tensor,
    bits: int = 8,
    blocksize: Optional[int] = 2048,
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, LinearQuantState]:
    """Symmetric linear absmax quantization to ``bits`` in 2..16, per group of ``blocksize`` elements.

    Implements ``Q(x) = delta * round(x / delta)`` with ``delta = absmax / (2**(bits-1) - 1)``
    (lpmm.txt eq. 6), stored as ``round(x / delta) + 2**(bits-1) - 1``. Stochastic rounding makes
    it unbiased (section 3.3); the group absmax is reconstructed exactly either way.

    Args:
        x: float32, float16 or bfloat16 tensor on cpu or cuda.
        bits: bits per code, 2..16 (LPMM: 8-bit gradients, 8/10/12-bit parameters).
        blocksize: group size (power of two, 64..4096) or None for one tensor-wise group.
        rounding: ``"nearest"`` or ``"stochastic"``.
        generator: source of the stochastic-rounding seed.

    Returns:
        ``(codes, state)``: 8-bit codes are uint8 shaped like ``x``; other widths are a flat uint8
        tensor of ``ceil(numel * bits / 8)`` packed bytes.
    """
    x = _check_tensor_input(x)
    _check_int("bits", bits, 2, _ops.MAX_LINEAR_BITS)
    bs = _native_blocksize(blocksize)
    stochastic, seed = _rounding_seed(rounding, generator)
    packed, absmax = _ops.quantize_linear(x, bits, bs, stochastic, seed, 0)
    state = LinearQuantState(absmax=absmax, blocksize=blocksize, shape=x.shape, dtype=x.dtype, bits=bits)
    return _codes_out(packed, x, bits), state


def dequantize_linear(codes: Tensor, state: LinearQuantState) -> Tensor:
    """Reconstruct the tensor quantized by :func:`quantize_linear`, in ``state.dtype`` and shape."""
    _check_codes_arg(codes, state, LinearQuantState)
    numel = math.prod(state.shape)
    out = _ops.dequantize_linear(
        codes.contiguous(), state.absmax, state.bits, _native_blocksize(state.blocksize), numel, state.dtype
    )
    return out.view(state.shape)


# ---------------------------------------------------------------------------------------------
# Bit packing
# ---------------------------------------------------------------------------------------------


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 ``codes`` (each < ``2**bits``) into ``ceil(numel * bits / 8)`` bytes, LSB first.

    Code i occupies bits ``[i*bits, (i+1)*bits)`` of the little-endian byte string.

    Args:
        codes: uint8 tensor of any shape; flattened in row-major order.
        bits: width of each code, 1..8.
    """
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8:
        raise TypeError("lowbit: codes must be a uint8 torch.Tensor")
    _check_int("bits", bits, 1, 8)
    codes = codes.contiguous()
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"lowbit: codes hold the value {int(codes.max())}, which does not fit in {bits} bits")
    return _ops.pack_bits(codes, bits)


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: a flat uint8 tensor of ``numel`` codes.

    Args:
        packed: uint8 tensor of exactly ``ceil(numel * bits / 8)`` bytes.
        bits: width of each code, 1..8.
        numel: number of codes.
    """
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        raise TypeError("lowbit: packed must be a uint8 torch.Tensor")
    _check_int("bits", bits, 1, 8)
    _check_int("numel", numel, 0, 2**62)
    return _ops.unpack_bits(packed.contiguous(), bits, numel)
