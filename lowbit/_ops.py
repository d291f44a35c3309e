"""Every lowbit tensor op, defined once as a ``torch.library`` custom op with a fake kernel.

This module is the only place that turns tensors into raw pointers for ``lowbit._C``. Each op checks
dtype, device, contiguity and sizes before it does so; the native side trusts these checks. The ops
work on flat element streams; shapes, maps and argument policy live in :mod:`lowbit.functional`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lowbit import _C

# The layout constants below come from the native module, which owns them (csrc/bindings.cpp).
_DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPE_CODES.items()}
FLOAT_DTYPES = tuple(_DTYPE_CODES)
MAX_MAP_BITS = 8
MAX_LINEAR_BITS = 16

CUDA_NOT_BUILT = (
    "lowbit was built without CUDA kernels, but a CUDA tensor was passed. Rebuild with nvcc on PATH "
    "(or CUDACXX set): `LOWBIT_CUDA=ON pip install --no-build-isolation -e .`; "
    "`python -m lowbit` shows what this build contains."
)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes taken by ``numel`` codes of ``bits`` bits each when bit-packed: ``ceil(numel*bits/8)``."""
    return (numel * bits + 7) // 8


def num_blocks(numel: int, blocksize: int) -> int:
    """Number of quantization blocks; ``blocksize == 0`` means one block for the whole tensor."""
    if blocksize == 0:
        return torch.sym_min(numel, 1)
    return (numel + blocksize - 1) // blocksize


def _launch(name: str, device: torch.device) -> Callable[..., None]:
    """The native entry point for ``device``, with the trailing thread/stream arguments bound."""
    if device.type == "cpu":
        fn = getattr(_C, f"{name}_cpu")
        threads = torch.get_num_threads()
        return lambda *args: fn(*args, threads)
    if device.type == "cuda":
        if not _C.cuda_built():
            raise RuntimeError(CUDA_NOT_BUILT)
        fn = getattr(_C, f"{name}_cuda")
        stream = torch.cuda.current_stream(device).cuda_stream
        return lambda *args: fn(*args, device.index, stream)
    raise ValueError(f"lowbit: tensors on device type {device.type!r} are not supported (expected cpu or cuda)")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"lowbit: {msg}")


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2 parameters, gradients, states, sharded storage), or ``t`` itself:
    what the ops take."""
    return t.to_local() if isinstance(t, DTensor) else t


def _check_input(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"lowbit: {name} must be a torch.Tensor, got {type(t).__name__}")
    if is_traceable_wrapper_subclass(t):
        # A wrapper such as DTensor has no storage of its own (data_ptr() is 0).
        raise TypeError(
            f"lowbit: {name} is a {type(t).__name__}, a tensor subclass without storage of its own; lowbit's ops "
            "take plain tensors (for a DTensor, its .to_local())"
        )
    if t.dtype not in dtypes:
        expected = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"lowbit: {name} has dtype {t.dtype}; expected one of: {expected}")
    _check(t.is_contiguous(), f"{name} must be contiguous")


def _check_same_device(ref_name: str, ref: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        _check(
            t.device == ref.device,
            f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to the same device",
        )


def _check_map(code: Tensor, bits: int) -> None:
    _check_input("code", code, (torch.float32,))
    _check(1 <= bits <= MAX_MAP_BITS, f"bits must be in 1..{MAX_MAP_BITS} for map quantization, got {bits}")
    _check(code.dim() == 1 and code.numel() == 1 << bits, f"code must be 1-D with 2**bits = {1 << bits} entries")


def _check_blocksize(blocksize: int) -> None:
    _check(
        blocksize == 0 or (64 <= blocksize <= 4096 and blocksize & (blocksize - 1) == 0),
        f"blocksize must be a power of two in 64..4096, or 0 for tensor-wise; got {blocksize}",
    )


def _check_codes(name: str, codes: Tensor, numel: int, bits: int) -> None:
    _check_input(name, codes, (torch.uint8,))
    expected = packed_bytes(numel, bits)
    _check(
        codes.numel() == expected,
        f"{name} has {codes.numel()} bytes but {numel} codes of {bits} bits take {expected}",
    )


def _check_absmax(absmax: Tensor, numel: int, blocksize: int) -> None:
    _check_input("absmax", absmax, (torch.float32,))
    expected = num_blocks(numel, blocksize)
    _check(absmax.numel() == expected, f"absmax has {absmax.numel()} entries but {numel} elements need {expected}")


def _quantize(
    x: Tensor, code: Tensor | None, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    n = x.numel()
    out = torch.empty(packed_bytes(n, bits), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(num_blocks(n, blocksize), dtype=torch.float32, device=x.device)
    if n > 0:
        map_ptr, map_n = (code.data_ptr(), code.numel()) if code is not None else (0, 0)
        _launch("quantize", x.device)(
            x.data_ptr(),
            n,
            _DTYPE_CODES[x.dtype],
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
        _launch("dequantize", codes.device)(
            codes.data_ptr(),
            absmax.data_ptr(),
            numel,
            map_ptr,
            map_n,
            bits,
            blocksize,
            out.data_ptr(),
            _DTYPE_CODES[dtype],
        )
    return out


def _check_rng(seed: int, offset: int) -> None:
    _check(0 <= seed < 2**63, f"seed must be in [0, 2**63), got {seed}")
    _check(0 <= offset < 2**63, f"offset must be in [0, 2**63), got {offset}")


@torch.library.custom_op("lowbit::quantize_blockwise", mutates_args=())
def quantize_blockwise(
    x: Tensor, code: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Block-wise map quantization of the elements of ``x`` (flattened).

    Returns ``(packed, absmax)``: ``ceil(numel*bits/8)`` bytes of bit-packed indices into ``code`` and
    one fp32 absmax per block. Stochastic rounding draws element ``i`` from counter ``offset + i``
    of the stream keyed by ``seed``.
    """
    _check_input("x", x, FLOAT_DTYPES)
    _check_map(code, bits)
    _check_same_device("x", x, code=code)
    _check_blocksize(blocksize)
    _check_rng(seed, offset)
    return _quantize(x, code, bits, blocksize, stochastic, seed, offset)


def _fake_quantized(x: Tensor, bits: int, blocksize: int) -> tuple[Tensor, Tensor]:
    n = x.numel()
    return (
        x.new_empty(packed_bytes(n, bits), dtype=torch.uint8),
        x.new_empty(num_blocks(n, blocksize), dtype=torch.float32),
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
    _check_map(code, bits)
    _check_blocksize(blocksize)
    _check(dtype in FLOAT_DTYPES, f"dtype must be float32, float16 or bfloat16, got {dtype}")
    _check_codes("codes", codes, numel, bits)
    _check_absmax(absmax, numel, blocksize)
    _check_same_device("codes", codes, absmax=absmax, code=code)
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
    _check_input("x", x, FLOAT_DTYPES)
    _check(2 <= bits <= MAX_LINEAR_BITS, f"bits must be in 2..{MAX_LINEAR_BITS}, got {bits}")
    _check_blocksize(blocksize)
    _check_rng(seed, offset)
    return _quantize(x, None, bits, blocksize, stochastic, seed, offset)


@quantize_linear.register_fake
def _(x: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int) -> tuple[Tensor, Tensor]:
    return _fake_quantized(x, bits, blocksize)


@torch.library.custom_op("lowbit::dequantize_linear", mutates_args=())
def dequantize_linear(
    codes: Tensor, absmax: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Inverse of :func:`quantize_linear`: a flat tensor of ``numel`` elements of ``dtype``."""
    _check(2 <= bits <= MAX_LINEAR_BITS, f"bits must be in 2..{MAX_LINEAR_BITS}, got {bits}")
    _check_blocksize(blocksize)
    _check(dtype in FLOAT_DTYPES, f"dtype must be float32, float16 or bfloat16, got {dtype}")
    _check_codes("codes", codes, numel, bits)
    _check_absmax(absmax, numel, blocksize)
    _check_same_device("codes", codes, absmax=absmax)
    return _dequantize(codes, absmax, None, bits, blocksize, numel, dtype)


@dequantize_linear.register_fake
def _(codes: Tensor, absmax: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype) -> Tensor:
    return codes.new_empty(numel, dtype=dtype)


@torch.library.custom_op("lowbit::pack_bits", mutates_args=())
def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Packs uint8 codes (each below ``2**bits``) into ``ceil(numel*bits/8)`` bytes, LSB first."""
    _check_input("codes", codes, (torch.uint8,))
    _check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    n = codes.numel()
    out = torch.empty(packed_bytes(n, bits), dtype=torch.uint8, device=codes.device)
    if n > 0:
        _launch("pack_bits", codes.device)(codes.data_ptr(), out.data_ptr(), n, bits)
    return out


@pack_bits.register_fake
def _(codes: Tensor, bits: int) -> Tensor:
    return codes.new_empty(packed_bytes(codes.numel(), bits))


@torch.library.custom_op("lowbit::unpack_bits", mutates_args=())
def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` uint8 codes."""
    _check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _check(numel >= 0, f"numel must be non-negative, got {numel}")
    _check_codes("packed", packed, numel, bits)
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    if numel > 0:
        _launch("unpack_bits", packed.device)(packed.data_ptr(), out.data_ptr(), numel, bits)
    return out


@unpack_bits.register_fake
def _(packed: Tensor, bits: int, numel: int) -> Tensor:
    return packed.new_empty(numel)


# ---------------------------------------------------------------------------------------------
# Few-bit backward (fewbit-backward.txt section 3; include/lowbit/fewbit.h)
# ---------------------------------------------------------------------------------------------


def _check_fewbit_bits(bits: int) -> None:
    _check(isinstance(bits, int) and 1 <= bits <= 8, f"bits must be an int in 1..8, got {bits!r}")


@torch.library.custom_op("lowbit::fewbit_encode", mutates_args=())
def fewbit_encode(x: Tensor, boundaries: Tensor, bits: int) -> Tensor:
    """The interval codes of ``x``, bit-packed: ``ceil(numel*bits/8)`` uint8.

    Element i gets the number of ``boundaries`` (``2**bits - 1`` sorted fp32 values on x's device)
    that are < x_i, in ``bits`` bits (``torch.bucketize``'s convention); NaN gets 0. ``x`` is read in
    flat (contiguous) order.
    """
    _check_fewbit_bits(bits)
    _check_input("x", x, FLOAT_DTYPES)
    _check_input("boundaries", boundaries, (torch.float32,))
    _check(
        boundaries.numel() == 2**bits - 1,
        f"boundaries must hold 2**bits - 1 = {2**bits - 1} values for bits={bits}, got {boundaries.numel()}",
    )
    _check_same_device("x", x, boundaries=boundaries)
    n = x.numel()
    out = torch.empty(packed_bytes(n, bits), dtype=torch.uint8, device=x.device)
    if n > 0:
        _launch("fewbit_encode", x.device)(
            x.data_ptr(), n, _DTYPE_CODES[x.dtype], boundaries.data_ptr(), bits, out.data_ptr()
        )
    return out


@fewbit_encode.register_fake
def _(x: Tensor, boundaries: Tensor, bits: int) -> Tensor:
    return x.new_empty(packed_bytes(x.numel(), bits), dtype=torch.uint8)


@torch.library.custom_op("lowbit::fewbit_grad", mutates_args=())
def fewbit_grad(grad: Tensor, packed: Tensor, levels: Tensor, bits: int) -> Tensor:
    """``grad * levels[code]`` element-wise, for the codes of :func:`fewbit_encode` (fp32 math).

    ``levels`` holds ``2**bits`` fp32 values on grad's device; the result has grad's shape and dtype.
    """
    _check_fewbit_bits(bits)
    _check_input("grad", grad, FLOAT_DTYPES)
    _check_input("levels", levels, (torch.float32,))
    _check(
        levels.numel() == 2**bits, f"levels must hold 2**bits = {2**bits} values for bits={bits}, got {levels.numel()}"
    )
    n = grad.numel()
    _check_codes("packed", packed, n, bits)
    _check_same_device("grad", grad, packed=packed, levels=levels)
    out = torch.empty_like(grad)
    if n > 0:
        _launch("fewbit_grad", grad.device)(
            grad.data_ptr(), packed.data_ptr(), n, _DTYPE_CODES[grad.dtype], levels.data_ptr(), bits, out.data_ptr()
        )
    return out


@fewbit_grad.register_fake
def _(grad: Tensor, packed: Tensor, levels: Tensor, bits: int) -> Tensor:
    return torch.empty_like(grad)


# Inverted activations (inverted-activations.txt section 2; include/lowbit/invact.h)
_INVACT_COEFFS = _C.INVACT_COEFFS
_INVACT_PARAMS = _C.INVACT_PARAMS


@torch.library.custom_op("lowbit::invact_grad", mutates_args=())
def invact_grad(grad: Tensor, y: Tensor, bits: Tensor, coeffs: Tensor, params: Tensor) -> Tensor:
    """``grad * f'(f^-1(y))`` element-wise on the branch named by each element's bit (fp32 math).

    ``bits`` holds one packed bit per element (1: right branch, ``x > T``), as
    ``fewbit_encode(x, [T], 1)`` writes it; ``coeffs`` (192 fp32) and ``params`` (5 fp32) are a table of
    :mod:`lowbit.nn.invact`. ``grad`` and ``y`` share shape and dtype; so does the result.
    """
    _check_input("grad", grad, FLOAT_DTYPES)
    _check_input("y", y, FLOAT_DTYPES)
    _check(y.dtype == grad.dtype, f"y has dtype {y.dtype} but grad has {grad.dtype}; they must match")
    _check(y.shape == grad.shape, f"y has shape {tuple(y.shape)} but grad has {tuple(grad.shape)}; they must match")
    n = grad.numel()
    _check_codes("bits", bits, n, 1)
    _check_input("coeffs", coeffs, (torch.float32,))
    _check_input("params", params, (torch.float32,))
    _check(coeffs.numel() == _INVACT_COEFFS, f"coeffs must hold {_INVACT_COEFFS} values, got {coeffs.numel()}")
    _check(params.numel() == _INVACT_PARAMS, f"params must hold {_INVACT_PARAMS} values, got {params.numel()}")
    _check_same_device("grad", grad, y=y, bits=bits, coeffs=coeffs, params=params)
    out = torch.empty_like(grad)
    if n > 0:
        _launch("invact_grad", grad.device)(
            grad.data_ptr(),
            y.data_ptr(),
            bits.data_ptr(),
            n,
            _DTYPE_CODES[grad.dtype],
            coeffs.data_ptr(),
            params.data_ptr(),
            out.data_ptr(),
        )
    return out


@invact_grad.register_fake
def _(grad: Tensor, y: Tensor, bits: Tensor, coeffs: Tensor, params: Tensor) -> Tensor:
    return torch.empty_like(grad)


# Approximate-activation blocks (approx-activations-blpa.txt section 3.2; include/lowbit/blpa.h)


def _blpa_dims(shape: Sequence[int]) -> tuple[int, int]:
    """(channels, inner) of an (N, C, *spatial) shape."""
    _check(len(shape) >= 2, f"blpa tensors are (N, C, ...), got shape {tuple(shape)}")
    return int(shape[1]), int(math.prod(shape[2:]))


def _check_blpa_channels(channels: int, **vectors: Tensor) -> None:
    for name, v in vectors.items():
        _check_input(name, v, (torch.float32,))
        rows = 4 if name == "grid" else 1
        _check(v.numel() == rows * channels, f"{name} must hold {rows * channels} fp32 values, got {v.numel()}")


def _blpa_call(
    which: str,
    device: torch.device,
    ptrs: list,
    n: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    bits: int,
    batch_stats: bool = False,
) -> None:
    channels, inner = _blpa_dims(shape)
    addresses = [0 if p is None else p.data_ptr() for p in ptrs]
    _launch(f"blpa_{which}", device)(addresses, n, channels, inner, _DTYPE_CODES[dtype], bits, int(batch_stats))


@torch.library.custom_op("lowbit::blpa_encode", mutates_args=())
def blpa_encode(x: Tensor, a2: Tensor, mean: Tensor, invstd: Tensor, grid: Tensor, bits: int) -> Tensor:
    """Packed ``bits``-bit codes of ``a1 = (x - mean) * invstd`` on the per-channel ``grid`` (rows t, o, h,
    side), each on the side of the cut that ``a2 > 0`` names. ``x`` and ``a2``: (N, C, ...), same dtype."""
    _check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _check_input("x", x, FLOAT_DTYPES)
    _check_input("a2", a2, FLOAT_DTYPES)
    _check(a2.shape == x.shape and a2.dtype == x.dtype, "a2 must have x's shape and dtype")
    channels, _ = _blpa_dims(x.shape)
    _check_blpa_channels(channels, mean=mean, invstd=invstd, grid=grid)
    _check_same_device("x", x, a2=a2, mean=mean, invstd=invstd, grid=grid)
    out = torch.empty(packed_bytes(x.numel(), bits), dtype=torch.uint8, device=x.device)
    if x.numel() > 0:
        ptrs = [x, a2, None, None, out, mean, invstd, grid, None, None, None, None, None]
        _blpa_call("encode", x.device, ptrs, x.numel(), x.shape, x.dtype, bits)
    return out


@blpa_encode.register_fake
def _(x: Tensor, a2: Tensor, mean: Tensor, invstd: Tensor, grid: Tensor, bits: int) -> Tensor:
    return x.new_empty(packed_bytes(x.numel(), bits), dtype=torch.uint8)


@torch.library.custom_op("lowbit::blpa_decode", mutates_args=())
def blpa_decode(
    packed: Tensor, grid: Tensor, gamma: Tensor, beta: Tensor, shape: list[int], bits: int, dtype: torch.dtype
) -> Tensor:
    """``relu(gamma * a1 + beta)`` of shape ``shape`` and dtype ``dtype`` from the codes of
    :func:`blpa_encode`, zero exactly where the encoded ``a2 > 0`` was false."""
    _check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _check(dtype in FLOAT_DTYPES, f"dtype must be float32, float16 or bfloat16, got {dtype}")
    channels, _ = _blpa_dims(shape)
    n = math.prod(shape)
    _check_codes("packed", packed, n, bits)
    _check_blpa_channels(channels, grid=grid, gamma=gamma, beta=beta)
    _check_same_device("packed", packed, grid=grid, gamma=gamma, beta=beta)
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    if n > 0:
        ptrs = [None, None, None, packed, None, None, None, grid, gamma, beta, out, None, None]
        _blpa_call("decode", packed.device, ptrs, n, shape, dtype, bits)
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
    _check(1 <= bits <= 8, f"bits must be in 1..8, got {bits}")
    _check_input("grad", grad, FLOAT_DTYPES)
    channels, _ = _blpa_dims(grad.shape)
    _check_codes("packed", packed, grad.numel(), bits)
    _check_blpa_channels(channels, grid=grid, gamma=gamma, beta=beta, invstd=invstd)
    _check_same_device("grad", grad, packed=packed, grid=grid, gamma=gamma, beta=beta, invstd=invstd)
    out = torch.empty_like(grad)
    g_gamma = torch.zeros(channels, dtype=torch.float32, device=grad.device)
    g_beta = torch.zeros(channels, dtype=torch.float32, device=grad.device)
    if grad.numel() > 0:
        ptrs = [None, None, grad, packed, None, None, invstd, grid, gamma, beta, out, g_gamma, g_beta]
        _blpa_call("backward", grad.device, ptrs, grad.numel(), grad.shape, grad.dtype, bits, batch_stats)
    return out, g_gamma, g_beta


@blpa_backward.register_fake
def _(
    packed: Tensor,
    grad: Tensor,
    grid: Tensor,
    gamma: Tensor,
    beta: Tensor,
    invstd: Tensor,
    bits: int,
    batch_stats: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    c = grad.shape[1]
    return torch.empty_like(grad), grad.new_empty(c, dtype=torch.float32), grad.new_empty(c, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Fused optimizer step
# ---------------------------------------------------------------------------------------------

# Column layout of the per-tensor tables (csrc/kernels.h: MetaCol, ScalarCol).
_META_COLS = _C.META_COLS
_MAX_STATES = _C.MAX_STATES
_SCALAR_COLS = _C.SCALAR_COLS


def _step_widths(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[list[Tensor]],
    absmaxes: list[list[Tensor]],
    n_states: int,
    block_size: int,
) -> list[int] | None:
    """State widths (8 or 32) when every tensor is valid, else None; the fast path of the check."""
    count = len(params)
    if len(grads) != count or any(len(states[k]) != count or len(absmaxes[k]) != count for k in range(n_states)):
        return None
    device = params[0].device if params else None
    widths = []
    for i, p in enumerate(params):
        g = grads[i]
        if not (
            isinstance(p, Tensor)
            and isinstance(g, Tensor)
            and not is_traceable_wrapper_subclass(p)
            and not is_traceable_wrapper_subclass(g)
            and p.dtype in _DTYPE_CODES
            and g.dtype == p.dtype
            and g.shape == p.shape
            and p.device == device
            and g.device == device
            and p.is_contiguous()
            and g.is_contiguous()
        ):
            return None
        n = p.numel()
        eight = n_states > 0 and states[0][i].dtype == torch.uint8
        for k in range(n_states):
            st, a = states[k][i], absmaxes[k][i]
            if not (
                isinstance(st, Tensor)
                and not is_traceable_wrapper_subclass(st)
                and st.dtype == (torch.uint8 if eight else torch.float32)
                and st.numel() == n
                and st.device == device
                and st.is_contiguous()
            ):
                return None
            if eight and not (
                isinstance(a, Tensor)
                and a.dtype == torch.float32
                and a.numel() == num_blocks(n, block_size)
                and a.device == device
                and a.is_contiguous()
            ):
                return None
        widths.append(8 if eight else 32)
    return widths


def _check_step_tensors(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[list[Tensor]],
    absmaxes: list[list[Tensor]],
    n_states: int,
    block_size: int,
) -> list[int]:
    """Validates the tensor lists of an optimizer step; returns each tensor's state width (8 or 32)."""
    count = len(params)
    for name, lst in (("grads", grads), *((f"state{k + 1}", states[k]) for k in range(n_states))):
        _check(len(lst) == count, f"{name} has {len(lst)} tensors but params has {count}")
    for name, lst in ((f"absmax{k + 1}", absmaxes[k]) for k in range(n_states)):
        _check(len(lst) == count, f"{name} has {len(lst)} tensors but params has {count}")
    widths = []
    device = params[0].device if params else None
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        _check_input(f"params[{i}]", p, FLOAT_DTYPES)
        _check_input(f"grads[{i}]", g, (p.dtype,))
        _check(g.shape == p.shape, f"grads[{i}] has shape {tuple(g.shape)} but params[{i}] has {tuple(p.shape)}")
        _check(p.device == device and g.device == device, f"params[{i}] and grads[{i}] must be on {device}")
        n = p.numel()
        width = 32
        for k in range(n_states):
            s, a = states[k][i], absmaxes[k][i]
            _check_input(f"state{k + 1}[{i}]", s, (torch.uint8, torch.float32))
            _check(s.numel() == n and s.device == device, f"state{k + 1}[{i}] must have {n} elements on {device}")
            width = 8 if s.dtype == torch.uint8 else 32
            if width == 8:
                _check_input(f"absmax{k + 1}[{i}]", a, (torch.float32,))
                nb = num_blocks(n, block_size)
                _check(a.numel() == nb and a.device == device, f"absmax{k + 1}[{i}] must have {nb} entries")
        _check(
            all((states[k][i].dtype == torch.uint8) == (width == 8) for k in range(n_states)),
            f"the states of params[{i}] must all be 8-bit or all 32-bit",
        )
        widths.append(width)
    return widths


def _optimizer_step_impl(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    scalars: list[float],
    grad_scales: Optional[Tensor],
    map1: Tensor,
    map2: Tensor,
    map3: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
    update_scales: Optional[Tensor] = None,
) -> None:
    """One fused optimizer step over all tensors of a parameter group, updating params and states.

    ``scalars`` holds 3 floats per tensor (step size, sqrt of Adam's second bias correction, 1.0 on
    the first step); ``grad_scales`` (optional, fp32, one per tensor, on the params' device) multiplies
    each gradient; ``hyper`` holds lr, beta1, beta2, 1 - beta1, 1 - beta2, eps, weight_decay,
    1 - lr * weight_decay, max_unorm; ``norm_mode`` selects LAMB's trust ratio (1) or max_unorm
    clipping (2). Each of the ``n_states`` states (up to 3, in the rule's slot order) is either uint8
    codes into its map (``map1``..``map3``) with one fp32 absmax per block of ``block_size`` elements,
    or an fp32 tensor (then its absmax entry is unused). ``update_scales``
    (optional, fp32, one per tensor, on the params' device) replaces the norm mode's own per-tensor
    scales: the step of tensors whose norms span ranks (see :func:`optimizer_norms`).
    """
    _optimizer_call(
        params,
        grads,
        state1,
        state2,
        state3,
        absmax1,
        absmax2,
        absmax3,
        scalars,
        grad_scales,
        map1,
        map2,
        map3,
        rule,
        hyper,
        flags,
        norm_mode,
        n_states,
        block_size,
        None,
        update_scales,
    )


def check_optimizer_step(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    scalars: list[float],
    grad_scales: Optional[Tensor],
    map1: Tensor,
    map2: Tensor,
    map3: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
    update_scales: Optional[Tensor] = None,
) -> list[int]:
    """The checks of ``lowbit::optimizer_step_`` (same arguments; ``rule`` and ``flags`` are the native
    side's to read); returns each tensor's state width (8 or 32). An optimizer that steps several fused
    calls checks every one before the first one writes."""
    _check(0 <= n_states <= _MAX_STATES, f"n_states must be 0 to {_MAX_STATES}, got {n_states}")
    _check(norm_mode in (0, 1, 2), f"norm_mode must be 0, 1 or 2, got {norm_mode}")
    _check_blocksize(block_size)
    _check(block_size > 0, "block_size must be positive for optimizer states")
    _check(len(hyper) == 9, f"hyper must hold 9 values, got {len(hyper)}")
    _check(len(scalars) == _SCALAR_COLS * len(params), "scalars must hold 3 values per tensor")
    for name, t, dtype in (
        ("grad_scales", grad_scales, torch.float32),
        ("update_scales", update_scales, torch.float32),
    ):
        if t is not None:
            _check_input(name, t, (dtype,))
            _check(t.numel() == len(params), f"{name} must hold one value per tensor")
    states, absmaxes = [state1, state2, state3], [absmax1, absmax2, absmax3]
    widths = _step_widths(params, grads, states, absmaxes, n_states, block_size)
    if widths is None:
        widths = _check_step_tensors(params, grads, states, absmaxes, n_states, block_size)
    if params:
        maps = (("map1", map1), ("map2", map2), ("map3", map3))
        for name, t in (*maps, ("grad_scales", grad_scales), ("update_scales", update_scales)):
            if t is not None:
                _check_same_device("params[0]", params[0], **{name: t})
        for _, t in maps:
            _check_map(t, 8)
    return widths


def _optimizer_call(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    scalars: list[float],
    grad_scales: Optional[Tensor],
    map1: Tensor,
    map2: Tensor,
    map3: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
    norm_sums: Optional[Tensor],
    update_scales: Optional[Tensor],
) -> None:
    """The checks and the native call behind optimizer_step_ and optimizer_norms."""
    widths = check_optimizer_step(
        params,
        grads,
        state1,
        state2,
        state3,
        absmax1,
        absmax2,
        absmax3,
        scalars,
        grad_scales,
        map1,
        map2,
        map3,
        rule,
        hyper,
        flags,
        norm_mode,
        n_states,
        block_size,
        update_scales,
    )
    if not params:
        return
    states, absmaxes = [state1, state2, state3], [absmax1, absmax2, absmax3]
    device = params[0].device
    rows = []
    first_block = 0
    for i, p in enumerate(params):
        ptrs = [states[k][i].data_ptr() if k < n_states else 0 for k in range(_MAX_STATES)]
        amax = [absmaxes[k][i].data_ptr() if k < n_states and widths[i] == 8 else 0 for k in range(_MAX_STATES)]
        n = p.numel()
        rows.append([p.data_ptr(), grads[i].data_ptr(), *ptrs, *amax, n, _DTYPE_CODES[p.dtype], widths[i], first_block])
        first_block += num_blocks(n, block_size)
    meta = torch.tensor(rows, dtype=torch.int64).reshape(len(params), _META_COLS)
    scal = torch.tensor(scalars, dtype=torch.float32)
    if device.type != "cpu":
        meta, scal = (t.pin_memory().to(device, non_blocking=True) for t in (meta, scal))
    _launch("optimizer_step", device)(
        rule,
        hyper,
        flags,
        norm_mode,
        n_states,
        block_size,
        map1.data_ptr(),
        map2.data_ptr(),
        map3.data_ptr(),
        meta.data_ptr(),
        scal.data_ptr(),
        grad_scales.data_ptr() if grad_scales is not None else 0,
        len(params),
        first_block,
        norm_sums.data_ptr() if norm_sums is not None else 0,
        update_scales.data_ptr() if update_scales is not None else 0,
    )


optimizer_step_ = torch.library.custom_op(
    "lowbit::optimizer_step_",
    _optimizer_step_impl,
    mutates_args=("params", "state1", "state2", "state3", "absmax1", "absmax2", "absmax3"),
)


def optimizer_step_eager(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    *rest: Any,
) -> None:
    """``lowbit::optimizer_step_`` without the dispatcher, for eager optimizer steps over many tensors.

    The custom op's per-tensor bookkeeping (alias checks, list conversions) costs about 15 us per
    tensor, as much as stepping 100k parameters; outside tracing the optimizers call this instead. It
    bumps the version counters of the tensors it writes, as the op does, so autograd still sees the
    in-place update.
    """
    _optimizer_step_impl(params, grads, state1, state2, state3, absmax1, absmax2, absmax3, *rest)
    torch.autograd.graph.increment_version([*params, *state1, *state2, *state3, *absmax1, *absmax2, *absmax3])


@optimizer_step_.register_fake
def _(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    scalars: list[float],
    grad_scales: Optional[Tensor],
    map1: Tensor,
    map2: Tensor,
    map3: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
    update_scales: Optional[Tensor] = None,
) -> None:
    return None


@torch.library.custom_op("lowbit::optimizer_norms", mutates_args=())
def optimizer_norms(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    scalars: list[float],
    grad_scales: Optional[Tensor],
    map1: Tensor,
    map2: Tensor,
    map3: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
) -> Tensor:
    """The norm pre-pass of ``lowbit::optimizer_step_`` alone: for each tensor, the sums of p^2 and of u^2
    (u the step the rule would subtract), as a float64 tensor of shape (count, 2); nothing is updated.

    For tensors sharded over ranks (FSDP2), the caller all-reduces these sums and passes the resulting
    scales to the step as ``update_scales``.
    """
    _check(norm_mode in (1, 2), f"norm_mode must be 1 (trust ratio) or 2 (max_unorm) for norms, got {norm_mode}")
    device = params[0].device if params else torch.device("cpu")
    sums = torch.zeros(len(params), 2, dtype=torch.float64, device=device)
    _optimizer_call(
        params,
        grads,
        state1,
        state2,
        state3,
        absmax1,
        absmax2,
        absmax3,
        scalars,
        grad_scales,
        map1,
        map2,
        map3,
        rule,
        hyper,
        flags,
        norm_mode,
        n_states,
        block_size,
        sums,
        None,
    )
    return sums


@optimizer_norms.register_fake
def _(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    scalars: list[float],
    grad_scales: Optional[Tensor],
    map1: Tensor,
    map2: Tensor,
    map3: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
) -> Tensor:
    return map1.new_empty(len(params), 2, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# LPMM: low-precision parameters and gradient accumulators (lpmm.txt Algorithm 1)
# ---------------------------------------------------------------------------------------------

# Column layout of the per-tensor table (csrc/kernels.h: LpmmCol).
_LP_COLS = _C.LP_COLS
MIN_LPMM_BITS = 2


def _check_lpmm_bits(name: str, bits: int, low: int, high: int) -> None:
    _check(
        isinstance(bits, int) and not isinstance(bits, bool) and low <= bits <= high,
        f"{name} must be an int in {low}..{high}, got {bits!r}",
    )


def _check_lpmm_tensor(
    name: str, codes: Tensor, absmax: Tensor, numel: int, bits: int, group_size: int, device: torch.device
) -> None:
    """Packed codes and group absmaxes of one quantized tensor (``name`` names it in errors)."""
    _check_codes(f"{name} codes", codes, numel, bits)
    _check_input(f"{name} absmax", absmax, (torch.float32,))
    groups = num_blocks(numel, group_size)
    _check(absmax.numel() == groups, f"{name} absmax has {absmax.numel()} entries but {numel} elements need {groups}")
    _check(codes.device == device and absmax.device == device, f"{name} codes and absmax must be on {device}")


@torch.library.custom_op("lowbit::lpmm_accumulate_", mutates_args=("codes", "absmax"))
def lpmm_accumulate_(
    grad: Tensor, codes: Tensor, absmax: Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> None:
    """Gradient accumulation into a quantized accumulator, ``g <- Q(g + grad)`` (lpmm.txt Algorithm 1, line 5).

    ``codes``/``absmax`` hold ``grad.numel()`` bit-packed linear codes of ``bits`` bits with one fp32
    absmax per group of ``group_size`` elements (an absmax of 0 reads as an all-zero group). Each group is
    decoded, ``grad`` added in fp32, and the sum re-encoded against its new absmax, with stochastic
    rounding (draws keyed by ``seed``) or round-to-nearest.
    """
    _check_input("grad", grad, FLOAT_DTYPES)
    _check_lpmm_bits("bits", bits, MIN_LPMM_BITS, MAX_LINEAR_BITS)
    _check_blocksize(group_size)
    _check(group_size > 0, "group_size must be positive")
    _check_rng(seed, 0)
    _check_lpmm_tensor("accumulator", codes, absmax, grad.numel(), bits, group_size, grad.device)
    if grad.numel() == 0:
        return
    _launch("lpmm_accumulate", grad.device)(
        grad.data_ptr(),
        _DTYPE_CODES[grad.dtype],
        grad.numel(),
        codes.data_ptr(),
        absmax.data_ptr(),
        bits,
        group_size,
        stochastic,
        seed,
    )


@lpmm_accumulate_.register_fake
def _(grad: Tensor, codes: Tensor, absmax: Tensor, bits: int, group_size: int, stochastic: bool, seed: int) -> None:
    return None


def _lpmm_step_impl(
    params: list[Tensor],
    param_absmax: list[Tensor],
    grads: list[Tensor],
    grad_absmax: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    numels: list[int],
    scalars: list[float],
    map1: Tensor,
    map2: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    n_states: int,
    group_size: int,
    param_bits: int,
    grad_bits: int,
    state_bits: int,
    stochastic_param: bool,
    stochastic_state: bool,
    seed: int,
) -> None:
    """One fused LPMM step (lpmm.txt Algorithm 1, lines 7-8) over quantized tensors; clears the accumulators.

    Tensor i has ``numels[i]`` elements: bit-packed linear parameter codes ``params[i]`` (``param_bits``)
    and accumulator codes ``grads[i]`` (``grad_bits``), optimizer states ``state1[i]``/``state2[i]``
    bit-packed at ``state_bits`` into ``map1``/``map2`` (``2**state_bits`` entries each), and one fp32
    absmax per group of ``group_size`` elements for each. ``rule`` is Adam (0) or SGD (1); ``hyper``,
    ``flags`` and ``scalars`` are laid out as for ``lowbit::optimizer_step_``. Parameters and states are
    re-encoded against fresh group absmaxes with stochastic rounding where asked (draws keyed by
    ``seed``); every accumulator absmax is set to 0.
    """
    count = len(params)
    _check(rule in (0, 1), f"rule must be 0 (Adam) or 1 (SGD), got {rule}")
    _check(0 <= n_states <= 2, f"n_states must be 0, 1 or 2, got {n_states}")
    _check_blocksize(group_size)
    _check(group_size > 0, "group_size must be positive")
    _check_lpmm_bits("param_bits", param_bits, MIN_LPMM_BITS, MAX_LINEAR_BITS)
    _check_lpmm_bits("grad_bits", grad_bits, MIN_LPMM_BITS, MAX_LINEAR_BITS)
    _check_lpmm_bits("state_bits", state_bits, 1, MAX_MAP_BITS)
    _check_rng(seed, 0)
    _check(len(hyper) == 9, f"hyper must hold 9 values, got {len(hyper)}")
    _check(len(scalars) == _SCALAR_COLS * count, "scalars must hold 3 values per tensor")
    lists = {"param_absmax": param_absmax, "grads": grads, "grad_absmax": grad_absmax, "numels": numels}
    for k, (s, a) in enumerate(((state1, absmax1), (state2, absmax2))[:n_states]):
        lists[f"state{k + 1}"], lists[f"absmax{k + 1}"] = s, a
    for name, lst in lists.items():
        _check(len(lst) == count, f"{name} has {len(lst)} entries but params has {count}")
    if count == 0:
        return
    device = params[0].device
    _check_map(map1, state_bits)
    _check_map(map2, state_bits)
    _check_same_device("params[0]", params[0], map1=map1, map2=map2)
    rows = []
    first_group = 0
    offset = 0
    for i in range(count):
        n = numels[i]
        _check(isinstance(n, int) and n >= 0, f"numels[{i}] must be a non-negative int, got {n!r}")
        _check_lpmm_tensor(f"params[{i}]", params[i], param_absmax[i], n, param_bits, group_size, device)
        _check_lpmm_tensor(f"grads[{i}]", grads[i], grad_absmax[i], n, grad_bits, group_size, device)
        states = [(s[i], a[i]) for s, a in ((state1, absmax1), (state2, absmax2))[:n_states]]
        for k, (s, a) in enumerate(states):
            _check_lpmm_tensor(f"state{k + 1}[{i}]", s, a, n, state_bits, group_size, device)
        ptrs = [s.data_ptr() for s, _ in states] + [0] * (2 - n_states)
        amax = [a.data_ptr() for _, a in states] + [0] * (2 - n_states)
        rows.append(
            [
                params[i].data_ptr(),
                param_absmax[i].data_ptr(),
                grads[i].data_ptr(),
                grad_absmax[i].data_ptr(),
                *ptrs,
                *amax,
                n,
                first_group,
                offset,
            ]
        )
        first_group += num_blocks(n, group_size)
        offset += n
    meta = torch.tensor(rows, dtype=torch.int64).reshape(count, _LP_COLS)
    scal = torch.tensor(scalars, dtype=torch.float32)
    if device.type != "cpu":
        meta, scal = (t.pin_memory().to(device, non_blocking=True) for t in (meta, scal))
    _launch("lpmm_step", device)(
        rule,
        hyper,
        flags,
        n_states,
        group_size,
        [param_bits, grad_bits, state_bits],
        map1.data_ptr(),
        map2.data_ptr(),
        [stochastic_param, stochastic_state],
        seed,
        meta.data_ptr(),
        scal.data_ptr(),
        count,
        first_group,
    )


lpmm_step_ = torch.library.custom_op(
    "lowbit::lpmm_step_",
    _lpmm_step_impl,
    mutates_args=("params", "param_absmax", "grad_absmax", "state1", "state2", "absmax1", "absmax2"),
)


def lpmm_step_eager(
    params: list[Tensor],
    param_absmax: list[Tensor],
    grads: list[Tensor],
    grad_absmax: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    *rest: Any,
) -> None:
    """``lowbit::lpmm_step_`` without the dispatcher's per-tensor bookkeeping (see :func:`optimizer_step_eager`)."""
    _lpmm_step_impl(params, param_absmax, grads, grad_absmax, state1, state2, absmax1, absmax2, *rest)
    torch.autograd.graph.increment_version([*params, *param_absmax, *grad_absmax, *state1, *state2, *absmax1, *absmax2])


@lpmm_step_.register_fake
def _(
    params: list[Tensor],
    param_absmax: list[Tensor],
    grads: list[Tensor],
    grad_absmax: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    numels: list[int],
    scalars: list[float],
    map1: Tensor,
    map2: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    n_states: int,
    group_size: int,
    param_bits: int,
    grad_bits: int,
    state_bits: int,
    stochastic_param: bool,
    stochastic_state: bool,
    seed: int,
) -> None:
    return None
