"""Validation of a state dict before a lowbit optimizer loads it.

torch.optim checks only the number of groups and parameters; a state dict from another model, a
truncated file or a hand edit would then fail at some later step, or worse, step with states of the
wrong shape. lowbit checks every entry first and raises a ValueError that names the parameter (as
``param_groups[i] params[j]``) and the key, before the optimizer changes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lowbit import _ops
from lowbit.optim.hyperparams import GNORM_HISTORY, LAYOUT_OPTIONS

if TYPE_CHECKING:
    from lowbit.optim.optimizer import LowbitOptimizer

__all__ = ["check_loaded_state"]

BLOCK_SIZES = tuple(1 << s for s in range(6, 13))


def _fail(where: str, key: str, problem: str) -> ValueError:
    return ValueError(f"lowbit: cannot load the state of {where}: {key!r} {problem}")


def _check_step(value: Any, where: str) -> None:
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise _fail(
                where, "step", f"must be a real scalar, got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        value = float(value.detach().cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _fail(where, "step", f"must be a finite number >= 0, got {value!r}")


def _check_tensor(value: Any, where: str, key: str, shape: torch.Size, dtypes: tuple[torch.dtype, ...]) -> Tensor:
    if not isinstance(value, Tensor):
        raise _fail(where, key, f"must be a tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise _fail(where, key, f"must have dtype {' or '.join(map(str, dtypes))}, got {value.dtype}")
    if value.shape != shape:
        raise _fail(where, key, f"must have the parameter's shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


def _check_absmax(value: Any, where: str, key: str, numel: int) -> None:
    if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.dim() != 1:
        raise _fail(where, key, "must be a 1-D float32 tensor (one scale per block of the quantized state)")
    if value.numel() not in {_ops.num_blocks(numel, b) for b in BLOCK_SIZES}:
        raise _fail(where, key, f"has {value.numel()} blocks, which no block size gives for {numel} elements")
    if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
        raise _fail(where, key, "must hold finite scales >= 0")


def _check_axis_max(value: Any, where: str, key: str, p: Tensor) -> None:
    """Rank-1 statistics (lowbit/optim/rank1.py): sum(shape) finite fp32 maxima >= 0 of a 2-d or larger
    parameter."""
    if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.dim() != 1:
        raise _fail(where, key, "must be a 1-D float32 tensor (the rank-1 statistics of the second moment)")
    if p.dim() < 2 or value.numel() != sum(p.shape):
        raise _fail(where, key, f"has {value.numel()} values; a parameter of shape {tuple(p.shape)} has {sum(p.shape)}")
    if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
        raise _fail(where, key, "must hold finite maxima >= 0")


def _check_factors(entry: dict[str, Any], where: str, k: int, p: Tensor) -> None:
    """A factorized second moment (lowbit/optim/factored.py): fp32 ``row{k+1}`` of shape ``shape[:-1]`` and
    ``col{k+1}`` of shape ``shape[:-2] + shape[-1:]``, finite and >= 0, in place of ``state{k+1}``."""
    if p.dim() < 2:
        raise _fail(where, f"row{k + 1}", f"needs a parameter of 2 or more axes, not shape {tuple(p.shape)}")
    if f"state{k + 1}" in entry:
        raise _fail(where, f"state{k + 1}", f"comes with the factors 'row{k + 1}'/'col{k + 1}' of the same state")
    shapes = {f"row{k + 1}": p.shape[:-1], f"col{k + 1}": p.shape[:-2] + p.shape[-1:]}
    for key, shape in shapes.items():
        value = entry.get(key)
        if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.shape != shape:
            raise _fail(where, key, f"must be a float32 tensor of shape {tuple(shape)} (a factor of the second moment)")
        local = _ops.local(value)  # an FSDP2 state's factors: each rank checks its own values
        if not bool(torch.isfinite(local).all()) or bool((local < 0).any()):
            raise _fail(where, key, "must hold finite values >= 0")


# Keys that only bitsandbytes' 8-bit optimizers write: its quantization maps and tensor-wise scales. Its codes
# sit under the same names as lowbit's (state1/absmax1) but on other maps (v itself, not sqrt(v), on a map
# with a zero code), so such a state must be dequantized by bitsandbytes, never read as lowbit codes.
BNB_8BIT_KEYS = ("qmap1", "qmap2", "qmap3", "max1", "max2", "max3", "new_max1", "new_max2", "new_max3")


def _check_foreign(opt: LowbitOptimizer, entry: dict[str, Any], where: str) -> None:
    """Refuse, with what to do instead, the states of bitsandbytes' 8-bit optimizers and torchao's
    quantized tensor subclasses (docs/migration.md)."""
    name = type(opt).__name__
    if "unorm_vec" in entry:
        raise _fail(
            where,
            "unorm_vec",
            "is bitsandbytes' max_unorm buffer, which lowbit recomputes at every step: delete the key from "
            "each state entry before loading (the rest of a bitsandbytes 32-bit state loads as it is)",
        )
    bnb = [k for k in BNB_8BIT_KEYS if k in entry]
    if bnb:
        raise _fail(
            where,
            bnb[0],
            f"marks a bitsandbytes 8-bit optimizer state, whose codes lowbit cannot read (other maps). Load it "
            f"into the bitsandbytes optimizer, dequantize each state (bitsandbytes.functional.dequantize_blockwise"
            f"(state1, absmax=absmax1, code=qmap1) for 'exp_avg', and likewise for state2 -> 'exp_avg_sq'), and "
            f"load {name} from that torch.optim-layout state dict, or from the bitsandbytes 32-bit optimizer's "
            f"state dict, which loads as it is",
        )
    for key, value in entry.items():
        if isinstance(value, Tensor) and type(value).__module__.startswith("torchao"):
            raise _fail(
                where,
                key,
                f"is a torchao {type(value).__name__}, a quantized tensor subclass that lowbit cannot read. "
                f"Dequantize the state dict's tensors first (value.dequantize() for each of them) and load "
                f"{name} from that torch.optim-layout state dict",
            )


def _check_entry(opt: LowbitOptimizer, p: Tensor, entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"lowbit: cannot load the state of {where}: expected a dict, got {type(entry).__name__}")
    _check_foreign(opt, entry, where)
    n = len(opt._state_names)
    known = {"step", "gnorm_vec", *opt._state_names}
    known |= {f"{kind}{k + 1}" for kind in ("state", "absmax", "axis_max", "row", "col") for k in range(n)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise _fail(where, unknown[0], f"is not a state of {type(opt).__name__} (its states: {sorted(known)})")
    if "step" in entry:
        _check_step(entry["step"], where)
    floats = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    for k, name in enumerate(opt._state_names):
        if entry.get(name) is not None:  # torch.optim's layout (torch.optim.SGD stores None without momentum)
            _check_tensor(entry[name], where, name, p.shape, floats)
        if f"row{k + 1}" in entry or f"col{k + 1}" in entry:
            _check_factors(entry, where, k, p)
        codes = entry.get(f"state{k + 1}")
        if codes is None:
            if f"absmax{k + 1}" in entry:
                raise _fail(where, f"absmax{k + 1}", f"comes without 'state{k + 1}'")
            continue
        numel = _ops.local(p).numel()
        packed = (numel + 1) // 2  # 4-bit codes, two per byte (state_storage.stored_width)
        if not (isinstance(codes, Tensor) and codes.dtype == torch.uint8 and numel >= 2 and codes.shape == (packed,)):
            codes = _check_tensor(codes, where, f"state{k + 1}", p.shape, (torch.uint8, torch.float32))
        if codes.dtype == torch.uint8 and f"axis_max{k + 1}" in entry:
            _check_axis_max(entry[f"axis_max{k + 1}"], where, f"axis_max{k + 1}", p)
        elif codes.dtype == torch.uint8:
            if f"absmax{k + 1}" not in entry:
                raise _fail(where, f"state{k + 1}", f"is quantized but 'absmax{k + 1}' is missing")
            _check_absmax(entry[f"absmax{k + 1}"], where, f"absmax{k + 1}", numel)
    if "gnorm_vec" in entry:
        vec = entry["gnorm_vec"]
        if not isinstance(vec, Tensor) or vec.dtype != torch.float32 or vec.shape != (GNORM_HISTORY,):
            raise _fail(where, "gnorm_vec", f"must be a float32 tensor of shape ({GNORM_HISTORY},)")


def check_loaded_state(opt: LowbitOptimizer, state_dict: dict[str, Any]) -> None:
    """Raise ValueError if ``state_dict`` cannot be loaded into ``opt``: group and parameter counts, the
    groups' options (as :mod:`lowbit.optim.hyperparams` checks them; layout options stay ``opt``'s) and
    every state entry: known keys, dtypes, shapes equal to the parameter's, 8-bit scales consistent
    with a block size, and ``step`` a finite number >= 0."""
    name = type(opt).__name__
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError(f"lowbit: {name}.load_state_dict expects a dict with 'state' and 'param_groups'")
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"lowbit: {name}.load_state_dict: the state dict has {len(groups)} param groups, "
            f"this optimizer has {len(opt.param_groups)}"
        )
    for i, (saved, group) in enumerate(zip(groups, opt.param_groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"lowbit: {name}.load_state_dict: param_groups[{i}] has {len(saved['params'])} parameters in the "
                f"state dict and {len(group['params'])} in this optimizer"
            )
        options = {**opt.defaults, **{k: v for k, v in saved.items() if k != "params"}}
        options.update({k: group[k] for k in LAYOUT_OPTIONS})
        opt._check_config(options, f"{name} state dict param_groups[{i}]")
        for j, (pid, p) in enumerate(zip(saved["params"], group["params"], strict=True)):
            if pid in state_dict["state"]:
                _check_entry(opt, p, state_dict["state"][pid], f"param_groups[{i}] params[{j}]")
