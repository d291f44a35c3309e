"""Pure-PyTorch twins of the quantization ops: the counter-based random stream, block absmax,
block-wise and linear quantization, bit packing (include/lowbit/rounding.h, blockwise.h, pack.h)."""

from __future__ import annotations

import torch
from torch import Tensor

_U64 = 1 << 64

# below): tests/test_native_constants.py checks them against lowbit._C's.
_SEED_SALT = 0x6C6F776269742121
_MASK32 = 0xFFFFFFFF


def _mix64_int(z: int) -> int:
    z %= _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _U64
    return z ^ (z >> 31)


def _hash32(x: Tensor) -> Tensor:
    """lowbias32 on uint32 values held in int64 (rounding.h: hash32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform01(seed: int, offset: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """The draws u_i, i < n, of stochastic rounding (rounding.h: two hash32 rounds over counters)."""
    key = _mix64_int(seed ^ _SEED_SALT)
    counter = torch.arange(n, dtype=torch.int64, device=device) + offset
    lo, hi = counter & _MASK32, (counter >> 32) & _MASK32
    h = _hash32(_hash32(lo ^ (key & _MASK32)) ^ hi ^ (key >> 32))
    return (h >> 8).to(torch.float32) * 2.0**-24


def _blocks(n: int, blocksize: int) -> int:
    return min(n, 1) if blocksize == 0 else -(-n // blocksize)


def block_absmax(x: Tensor, blocksize: int) -> Tensor:
    """Per-block absmax of flat fp32 ``x``; NaN for blocks with a NaN or Inf (blockwise.h)."""
    n = x.numel()
    nb = _blocks(n, blocksize)
    size = n if blocksize == 0 else blocksize
    bits = x.view(torch.int32) & 0x7FFFFFFF
    padded = torch.zeros(nb * size, dtype=torch.int32, device=x.device)
    padded[:n] = bits
    m = padded.view(nb, size).amax(dim=1) if nb else padded[:0]
    amax = m.view(torch.float32).clone()
    amax[m >= 0x7F800000] = float("nan")
    return amax


def _expand(per_block: Tensor, n: int, blocksize: int) -> Tensor:
    if blocksize == 0:
        return per_block.expand(n)
    return per_block.repeat_interleave(blocksize)[:n]


def _normalise(x: Tensor, amax_e: Tensor) -> Tensor:
    """blockwise.h's normalise: x * (1 / absmax) (x / absmax where the reciprocal overflows), exactly
    +-1 at +-absmax, clamped to [-1, 1]."""
    pos = amax_e > 0
    safe = torch.where(pos, amax_e, torch.ones_like(amax_e))
    inv = 1 / safe
    inv = torch.where(pos & torch.isfinite(inv), inv, torch.zeros_like(inv))
    q = torch.where(inv != 0, x * inv, x / safe).clamp(-1, 1)
    q = torch.where(x == amax_e, torch.ones_like(q), torch.where(x == -amax_e, -torch.ones_like(q), q))
    return torch.where(pos, q, torch.zeros_like(x))


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Bit-pack integer codes LSB first: code i fills bits [i*bits, (i+1)*bits) (pack.h)."""
    codes = codes.reshape(-1).to(torch.int64)
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    stream = ((codes[:, None] >> torch.arange(bits, device=codes.device)) & 1).reshape(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=codes.device)
    padded[: stream.numel()] = stream
    weights = 1 << torch.arange(8, device=codes.device)
    return (padded.view(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`, as int64 codes."""
    stream = ((packed.to(torch.int64)[:, None] >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    stream = stream[: n * bits].view(n, bits)
    return (stream << torch.arange(bits, device=packed.device)).sum(dim=1)


def _store(codes: Tensor, bits: int) -> Tensor:
    return codes.to(torch.uint8) if bits == 8 else pack_bits(codes, bits)


def _load(packed: Tensor, bits: int, n: int) -> Tensor:
    return packed.to(torch.int64) if bits == 8 else unpack_bits(packed, bits, n)


def quantize_blockwise(
    x: Tensor, code: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Twin of ``lowbit::quantize_blockwise``: ``(packed codes, absmax)``."""
    x = x.reshape(-1).float()
    n = x.numel()
    amax = block_absmax(x, blocksize)
    xn = _normalise(x, _expand(amax, n, blocksize))
    return _store(map_codes(xn, code, stochastic, seed, offset), bits), amax


def map_codes(xn: Tensor, code: Tensor, stochastic: bool = False, seed: int = 0, offset: int = 0) -> Tensor:
    """The codes (int64) of normalised values ``xn`` on the sorted map ``code``: the nearest entry, or a
    stochastic choice between the two around each value (qmap.h)."""
    nmap = code.numel()
    lo = (torch.searchsorted(code, xn, right=True) - 1).clamp(min=0)
    hi = (lo + 1).clamp(max=nmap - 1)
    vlo, vhi = code[lo], code[hi]
    if stochastic:
        up = uniform01(seed, offset, xn.numel(), xn.device) * (vhi - vlo) < xn - vlo
    else:
        up = vhi - xn < xn - vlo
    return torch.where(up, hi, lo)


def dequantize_blockwise(
    packed: Tensor, absmax: Tensor, code: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Twin of ``lowbit::dequantize_blockwise``."""
    codes = _load(packed, bits, numel)
    return (code[codes] * _expand(absmax, numel, blocksize)).to(dtype)


def quantize_linear(
    x: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Twin of ``lowbit::quantize_linear``: ``(packed codes, absmax)``."""
    x = x.reshape(-1).float()
    n = x.numel()
    qmax = float(2 ** (bits - 1) - 1)
    amax = block_absmax(x, blocksize)
    y = (_normalise(x, _expand(amax, n, blocksize)) * qmax).clamp(-qmax, qmax)
    if stochastic:
        f = torch.floor(y)
        q = f + (uniform01(seed, offset, n, x.device) < y - f).float()
    else:
        q = torch.round(y)
    return _store((q + qmax).to(torch.int64), bits), amax


def dequantize_linear(
    packed: Tensor, absmax: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Twin of ``lowbit::dequantize_linear``."""
    qmax = float(2 ** (bits - 1) - 1)
    codes = _load(packed, bits, numel).float()
    # A tensor divisor, not a Python number: CUDA torch turns division by a scalar into multiplication by
    # its reciprocal, one ulp away from blockwise.h's true division.
    divisor = torch.full((), qmax, device=codes.device)
    return (((codes - qmax) / divisor) * _expand(absmax, numel, blocksize)).to(dtype)


def nearest_oracle(xn: Tensor, code: Tensor) -> Tensor:
    """Brute force: the smallest |code[j] - xn| for every element (used to check true argmin)."""
    return (code[None, :] - xn.reshape(-1, 1)).abs().min(dim=1).values


def _sqrt32(x: Tensor) -> Tensor:
    """Correctly rounded fp32 sqrt, as sqrtf is. torch's vectorised fp32 sqrt can be one ulp off;
    the square root of a float computed in double and rounded once is exact."""
    return torch.sqrt(x.double()).to(torch.float32)
