"""Measured memory accounting.

:func:`memory_report`: the bytes of model memory (parameters, gradients, optimizer state) that a model
and its optimizer hold, counted from their storage, converted (:mod:`lowbit.lpmm`) or not.

:func:`saved_tensor_bytes`: the bytes autograd keeps for the backward pass, counted through
``torch.autograd.graph.saved_tensors_hooks``, so the numbers are what autograd really saves, whatever
the layers do internally. A storage saved several times (an output that the next layer saves as its
input too) counts once, and parameter storages are left out: they are there with or without a
backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lowbit import _ops
from lowbit.lpmm.convert import low_precision_parameters

__all__ = ["MemoryReport", "SavedBytes", "memory_report", "saved_tensor_bytes"]


@dataclass
class SavedBytes:
    """Bytes saved for backward by one forward pass.

    Attributes:
        total: bytes of all distinct storages saved, parameters excluded.
        by_module: the same bytes by the qualified name of the innermost module running when each
            storage was first saved (``""``: the top-level module, or outside any module).
        exclusive: by module name, the bytes of the storages that only that module saved: what autograd
            would no longer keep if that module saved nothing. An activation's output that the next
            layer saves as its input counts for neither.
        by_savers: bytes by the set of module names that saved each storage; what autograd would no longer
            keep if a group of modules saved nothing is the sum over the sets inside that group.
    """

    total: int = 0
    by_module: dict[str, int] = field(default_factory=dict)
    exclusive: dict[str, int] = field(default_factory=dict)
    by_savers: dict[frozenset[str], int] = field(default_factory=dict)

    def exclusive_to(self, names: set[str]) -> int:
        """Bytes of the storages saved only by modules in ``names`` (one or several of them)."""
        return sum(nbytes for who, nbytes in self.by_savers.items() if who <= names)


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
    # Each distinct saved storage: its bytes and the modules that saved it.
    savers: dict[tuple[torch.device, int], tuple[int, set[str]]] = {}
    result = SavedBytes()

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key in excluded:
            return t
        if key not in savers:
            nbytes = t.untyped_storage().nbytes()
            savers[key] = (nbytes, set())
            result.total += nbytes
            result.by_module[stack[-1]] = result.by_module.get(stack[-1], 0) + nbytes
        savers[key][1].add(stack[-1])
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
    for nbytes, who in savers.values():
        key = frozenset(who)
        result.by_savers[key] = result.by_savers.get(key, 0) + nbytes
        if len(who) == 1:
            (only,) = who
            result.exclusive[only] = result.exclusive.get(only, 0) + nbytes
    return result


def _nbytes(t: Optional[Tensor]) -> int:
    """Bytes of ``t`` held by this process (a DTensor's local shard)."""
    return 0 if t is None else _ops.local(t).numel() * t.element_size()


@dataclass
class MemoryReport:
    """Measured bytes of model memory (lpmm.txt section 3.1): parameters, gradients, optimizer state.

    Attributes:
        params: bytes of parameter storage (codes and absmaxes, or float tensors).
        grads: bytes of gradient storage (accumulators, or existing ``.grad`` tensors).
        optimizer_state: bytes of the optimizer's state tensors for these parameters.
        num_params: number of parameter elements.
        per_parameter: the same three byte counts per parameter name.
    """

    params: int = 0
    grads: int = 0
    optimizer_state: int = 0
    num_params: int = 0
    per_parameter: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """params + grads + optimizer_state."""
        return self.params + self.grads + self.optimizer_state

    @property
    def bytes_per_param(self) -> float:
        """total / num_params."""
        return self.total / max(self.num_params, 1)

    def __str__(self) -> str:
        n = max(self.num_params, 1)
        rows = [("parameters", self.params), ("gradients", self.grads), ("optimizer state", self.optimizer_state)]
        lines = [f"{'':<16}{'bytes':>14}{'bytes/param':>13}"]
        lines += [f"{label:<16}{b:>14,}{b / n:>13.3f}" for label, b in (*rows, ("total", self.total))]
        return "\n".join(lines + [f"{self.num_params:,} parameters"])


def memory_report(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> MemoryReport:
    """Measure the model memory of ``model`` (converted or not) and ``optimizer`` from their storage.

    Gradient bytes count the accumulators of low-precision parameters (persistent in the ordinary loop;
    gradient release frees each after its parameter's step) and the ``.grad`` tensors that ordinary
    parameters hold at the time of the call.
    """
    state = optimizer.state if optimizer is not None else {}
    report = MemoryReport()

    def add(name: str, key: Tensor, n: int, params: int, grads: int) -> None:
        st = sum(_nbytes(v) for v in state.get(key, {}).values() if isinstance(v, Tensor))
        report.per_parameter[name] = {"params": params, "grads": grads, "optimizer_state": st}
        report.params += params
        report.grads += grads
        report.optimizer_state += st
        report.num_params += n

    handles = set()
    for name, lp in low_precision_parameters(model).items():
        handles.add(id(lp.handle))
        add(
            name,
            lp.handle,
            lp.numel(),
            _nbytes(lp.codes) + _nbytes(lp.absmax),
            _nbytes(lp.grad_codes) + _nbytes(lp.grad_absmax),
        )
    for name, p in model.named_parameters():
        if id(p) not in handles:
            add(name, p, p.numel(), _nbytes(p), _nbytes(p.grad))
    return report
