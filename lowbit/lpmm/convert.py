"""Converting a model to low-precision parameters and back: :func:`convert`, the forward hooks that
materialize a module's parameters while it runs (lpmm.txt section 5.3), loading float state dicts,
:func:`low_precision_parameters` and :func:`export_float`.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lowbit import _ops
from lowbit._checks import check_bits, check_group_size, check_rounding
from lowbit.lpmm.parameter import LowPrecisionParameter
from lowbit.lpmm.saved import RecomputeSaved

__all__ = ["convert", "export_float", "low_precision_parameters"]


def _names(module: nn.Module) -> list[str]:
    """The names of the converted parameters of ``module`` (set by :func:`convert`)."""
    return cast(list[str], module._lpmm_names)


def _stored(module: nn.Module, name: str) -> LowPrecisionParameter:
    """The storage of ``module``'s converted parameter ``name``."""
    return cast(LowPrecisionParameter, module._modules[name])


def _load_float_entries(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook of a converted module: float tensors under a converted parameter's
    own name (an ordinary or exported state dict) become its codes, rounded to nearest."""
    for name in _names(module):
        key = prefix + name
        value = state_dict.get(key)
        lp = _stored(module, name)
        if isinstance(value, DTensor):  # an FSDP2 model's sharded float state dict
            value = value.full_tensor()
        if not isinstance(value, Tensor) or not value.is_floating_point() or tuple(value.shape) != tuple(lp.shape):
            continue  # left for load_state_dict to report (unexpected or missing keys)
        del state_dict[key]
        state_dict[key + ".codes"], state_dict[key + ".absmax"] = lp.encode(value.to(lp.device))
        state_dict[key + "._extra_state"] = lp.get_extra_state()


def _enter_forward(module: nn.Module, args: Any) -> None:
    temps = []
    for name in _names(module):
        lp = _stored(module, name)
        t = lp.materialize()
        module.__dict__[name] = t
        temps.append((lp, t))
    ctx = RecomputeSaved(temps)
    ctx.__enter__()
    module.__dict__.setdefault("_lpmm_active", []).append(ctx)


def _leave_forward(module: nn.Module, args: Any, output: Any) -> None:
    active = module.__dict__.get("_lpmm_active")
    if not active:
        return
    active.pop().__exit__(None, None, None)
    if not active:
        for name in _names(module):
            module.__dict__.pop(name, None)


# Modules that hold references to their parameters beyond attribute access.
_UNSUPPORTED = (nn.RNNBase,)


def convert(
    model: nn.Module,
    param_bits: int = 12,
    grad_bits: int = 8,
    group_size: int = 2048,
    rounding: str = "stochastic",
    *,
    generator: Optional[torch.Generator] = None,
) -> nn.Module:
    """Store every parameter of ``model`` in low precision, in place (lpmm.txt sections 3 and 5).

    Each parameter becomes a :class:`LowPrecisionParameter` submodule under the same name (so
    ``model.fc.weight`` is its storage outside forward), initialised from the current weights. Shared
    (tied) parameters share one storage. ``model.parameters()`` then yields the storages' handles,
    which :class:`lowbit.optim.LPMMSGD`/:class:`lowbit.optim.LPMMAdamW` optimize.

    Args:
        model: the model; works for any module whose forward reads its parameters as attributes
            (Linear, Conv, Embedding, norm layers, attention, custom modules).
        param_bits: bits per parameter element, 4..16 (paper: 12).
        grad_bits: bits per gradient-accumulator element, 4..16 (paper: 8).
        group_size: elements per quantization group, a power of two in 64..4096 (paper: 2048).
        rounding: ``"stochastic"`` (paper) or ``"nearest"`` for the accumulator and parameter updates.
        generator: source of rounding seeds (torch's default generator if None).

    Returns:
        ``model``, converted.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"lowbit.lpmm: model must be an nn.Module, got {type(model).__name__}")
    check_bits("param_bits", param_bits)
    check_bits("grad_bits", grad_bits)
    check_group_size(group_size)
    check_rounding(rounding)
    for name, m in model.named_modules():
        where = f"{name!r} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
        if isinstance(m, LowPrecisionParameter):
            raise ValueError(f"lowbit.lpmm: {where} is already converted")
        if isinstance(m, _UNSUPPORTED):
            raise TypeError(
                f"lowbit.lpmm: cannot convert {where}: it keeps its own references to its parameters "
                "(flat weights), so they cannot be stored in low precision; convert its sibling modules instead"
            )
        if torch.nn.utils.parametrize.is_parametrized(m):
            raise TypeError(f"lowbit.lpmm: cannot convert {where}: parametrized modules are not supported")
        for pname, p in m._parameters.items():
            if isinstance(p, DTensor):
                raise TypeError(
                    f"lowbit.lpmm: parameter {pname!r} of {where} is a DTensor: convert the model before "
                    "fully_shard (FSDP2 then shards the low-precision storage)"
                )
            if p is not None and p.dtype not in _ops.FLOAT_DTYPES:
                raise TypeError(
                    f"lowbit.lpmm: parameter {pname!r} of {where} has dtype {p.dtype}; "
                    "expected float32, float16 or bfloat16"
                )
    storages: dict[int, LowPrecisionParameter] = {}
    for m in list(model.modules()):
        names = [n for n, p in m._parameters.items() if p is not None]
        if not names:
            continue
        for n in names:
            p = cast(nn.Parameter, m._parameters.pop(n))  # names holds the parameters that are not None
            lp = storages.get(id(p))
            if lp is None:
                lp = LowPrecisionParameter(
                    p.detach(),
                    bits=param_bits,
                    grad_bits=grad_bits,
                    group_size=group_size,
                    rounding=rounding,
                    requires_grad=p.requires_grad,
                    generator=generator,
                )
                storages[id(p)] = lp
            m._modules[n] = lp
        m._lpmm_names = names  # type: ignore[assignment]  # a plain attribute: nn.Module keeps a list in __dict__
        m.register_forward_pre_hook(_enter_forward)
        m.register_forward_hook(_leave_forward, always_call=True)
        m._register_load_state_dict_pre_hook(_load_float_entries, with_module=True)
    return model


def low_precision_parameters(model: nn.Module) -> dict[str, LowPrecisionParameter]:
    """The distinct low-precision parameters of ``model`` by qualified name (first name of a tied one)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LowPrecisionParameter)}


def export_float(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every low-precision parameter replaced by its dequantized value.

    The result loads into the unconverted model (and into a converted one, which quantizes it). Under
    FSDP2 every rank must call it (the codes are gathered) and gets the whole values.
    """
    lps = {name: m for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, LowPrecisionParameter)}
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        owner = key.rsplit(".", 1)[0] if "." in key else ""
        if owner in lps:
            if owner not in out:
                out[owner] = lps[owner].dequantize()
            continue
        out[key] = value
    return out
