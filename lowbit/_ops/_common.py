"""What every op file shares: dtype codes, sizes of packed data, argument checks, and the launcher that
turns a device into the native entry point for it."""

from __future__ import annotations

import array
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lowbit import _C
from lowbit._checks import is_block_size

# The native module owns the dtype codes (csrc/bindings.cpp, include/lowbit/dispatch.h).
DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPE_CODES.items()}
FLOAT_DTYPES = tuple(DTYPE_CODES)
MAX_MAP_BITS = 8

CUDA_NOT_BUILT = (
    "lowbit was built without CUDA kernels, but a CUDA tensor was passed. Rebuild with nvcc on PATH "
    "(or CUDACXX set): `LOWBIT_CUDA=ON pip install --no-build-isolation -e .`; "
    "`python -m lowbit` shows what this build contains."
)


class Kernel(NamedTuple):
    """The native entry points of one op: the CPU loop, and the CUDA launcher looked up at first use
    (a CPU-only build has none)."""

    cpu: Callable[..., None]
    cuda: Callable[[], Callable[..., None]]


def launch(kernel: Kernel, device: torch.device) -> Callable[..., None]:
    """``kernel``'s entry point for ``device``, with the trailing thread/stream arguments bound."""
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return lambda *args: kernel.cpu(*args, threads)
    if device.type == "cuda":
        if not _C.cuda_built():
            raise RuntimeError(CUDA_NOT_BUILT)
        fn = kernel.cuda()
        stream = torch.cuda.current_stream(device).cuda_stream
        return lambda *args: fn(*args, device.index, stream)
    raise ValueError(f"lowbit: tensors on device type {device.type!r} are not supported (expected cpu or cuda)")


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes taken by ``numel`` codes of ``bits`` bits each when bit-packed: ``ceil(numel*bits/8)``."""
    return (numel * bits + 7) // 8


def num_blocks(numel: int, blocksize: int) -> int:
    """Number of quantization blocks; ``blocksize == 0`` means one block for the whole tensor."""
    if blocksize == 0:
        return torch.sym_min(numel, 1)
    return (numel + blocksize - 1) // blocksize


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2 parameters, gradients, states, sharded storage), or ``t`` itself:
    what the ops take."""
    return t.to_local() if isinstance(t, DTensor) else t


def check(cond: bool, msg: str) -> None:
    """Raises ``ValueError("lowbit: " + msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(f"lowbit: {msg}")


def check_input(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """``t`` is a plain contiguous tensor of one of ``dtypes``."""
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
    check(t.is_contiguous(), f"{name} must be contiguous")


def check_same_device(ref_name: str, ref: Tensor, **others: Tensor) -> None:
    """Every tensor of ``others`` is on ``ref``'s device."""
    for name, t in others.items():
        check(
            t.device == ref.device,
            f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to the same device",
        )


def check_map(code: Tensor, bits: int) -> None:
    """``code`` is an fp32 quantization map of ``2**bits`` entries."""
    check_input("code", code, (torch.float32,))
    check(1 <= bits <= MAX_MAP_BITS, f"bits must be in 1..{MAX_MAP_BITS} for map quantization, got {bits}")
    check(code.dim() == 1 and code.numel() == 1 << bits, f"code must be 1-D with 2**bits = {1 << bits} entries")


def check_blocksize(blocksize: int) -> None:
    """A power of two in 64..4096 (the block sizes the native loops support), or 0 for tensor-wise."""
    check(
        blocksize == 0 or is_block_size(blocksize),
        f"blocksize must be a power of two in 64..4096, or 0 for tensor-wise; got {blocksize}",
    )


def check_codes(name: str, codes: Tensor, numel: int, bits: int) -> None:
    """``codes`` holds ``numel`` bit-packed codes of ``bits`` bits."""
    check_input(name, codes, (torch.uint8,))
    expected = packed_bytes(numel, bits)
    check(
        codes.numel() == expected,
        f"{name} has {codes.numel()} bytes but {numel} codes of {bits} bits take {expected}",
    )


def check_absmax(absmax: Tensor, numel: int, blocksize: int) -> None:
    """``absmax`` holds one fp32 scale per block of ``numel`` elements."""
    check_input("absmax", absmax, (torch.float32,))
    expected = num_blocks(numel, blocksize)
    check(absmax.numel() == expected, f"absmax has {absmax.numel()} entries but {numel} elements need {expected}")


def check_rng(seed: int, offset: int) -> None:
    """A seed and counter offset of the native generator (include/lowbit/rounding.h)."""
    check(0 <= seed < 2**63, f"seed must be in [0, 2**63), got {seed}")
    check(0 <= offset < 2**63, f"offset must be in [0, 2**63), got {offset}")


def op_signature(fields: type[tuple[Any, ...]]) -> inspect.Signature:
    """The signature of a function taking ``fields`` (a NamedTuple) as its arguments, for
    ``torch.library.custom_op`` to infer the op's schema from: an op of many arguments then names them
    once, in the NamedTuple its implementation, fake kernel and callers share."""
    hints = typing.get_type_hints(fields)
    defaults = fields._field_defaults  # type: ignore[attr-defined]
    return inspect.Signature(
        [
            inspect.Parameter(
                name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                annotation=hints[name],
                default=defaults.get(name, inspect.Parameter.empty),
            )
            for name in fields._fields  # type: ignore[attr-defined]
        ],
        return_annotation=None,
    )


def call_tables(
    rows: Sequence[Sequence[int]], cols: int, scalars: list[float], device: torch.device
) -> tuple[Tensor, Tensor]:
    """The per-tensor tables of a fused call: ``rows`` as an int64 (count, cols) table and ``scalars`` as
    fp32 (:func:`scalar_table`), on ``device`` (pinned and copied in stream order to a GPU, so the host does
    not wait)."""
    meta = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), cols)
    if device.type != "cpu":
        meta = meta.pin_memory().to(device, non_blocking=True)
    return meta, scalar_table(scalars, device)


def scalar_table(scalars: list[float], device: torch.device) -> Tensor:
    """``scalars`` as an fp32 tensor on ``device``, each rounded to nearest as ``torch.tensor`` rounds it; through
    an ``array`` of C floats, a third of ``torch.tensor``'s time on a list of Python floats."""
    scal = torch.frombuffer(array.array("f", scalars), dtype=torch.float32) if scalars else torch.empty(0)
    if device.type != "cpu":
        scal = scal.pin_memory().to(device, non_blocking=True)
    return scal
