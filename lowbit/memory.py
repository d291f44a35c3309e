"""Measured memory accounting: the bytes autograd keeps for the backward pass.

Counted through ``torch.autograd.graph.saved_tensors_hooks``, so the numbers are what autograd really
saves, whatever the layers do internally. A storage saved several times (an output that the next
layer saves as its input too) counts once, and parameter storages are left out: they are there with
or without a backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import Tensor, nn

__all__ = ["SavedBytes", "saved_tensor_bytes"]


@dataclass
class SavedBytes:
    """Bytes saved for backward by one forward pass.

    Attributes:
        total: bytes of all distinct storages saved, parameters excluded.
        by_module: the same bytes by the qualified name of the innermost module running when each
            storage was first saved (``""``: the top-level module, or outside any module).
    """

    total: int = 0
    by_module: dict[str, int] = field(default_factory=dict)


def _storage_key(t: Tensor) -> tuple[torch.device, int]:
    return (t.device, t.untyped_storage().data_ptr())


def saved_tensor_bytes(model_or_fn: Union[nn.Module, Callable[..., Any]], *inputs: Any, **kwargs: Any) -> SavedBytes:
    """Run ``model_or_fn(*inputs, **kwargs)`` once and count the bytes it saves for backward.

    Args:
        model_or_fn: an ``nn.Module`` (bytes are attributed to its submodules; its parameters are
            excluded) or any callable (everything saved counts, attributed to ``""``).
        inputs: positional arguments of the call.
        kwargs: keyword arguments of the call.
    """
    if not callable(model_or_fn):
        raise TypeError(f"lowbit: model_or_fn must be an nn.Module or a callable, got {type(model_or_fn).__name__}")
    excluded: set[tuple[torch.device, int]] = set()
    names: dict[nn.Module, str] = {}
    if isinstance(model_or_fn, nn.Module):
        excluded = {_storage_key(p) for p in model_or_fn.parameters()}
        names = {m: name for name, m in model_or_fn.named_modules()}
    stack: list[str] = [""]
    seen: set[tuple[torch.device, int]] = set()
    result = SavedBytes()

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in seen and key not in excluded:
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            result.total += nbytes
            result.by_module[stack[-1]] = result.by_module.get(stack[-1], 0) + nbytes
        return t

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(names[module])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model_or_fn(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return result
