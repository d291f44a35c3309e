"""The handle of a low-precision parameter: the empty ``nn.Parameter`` that stands for it in
``model.parameters()``, its ``.grad`` placeholder, and the autograd link from handle to value.

Gradients of a converted parameter live in its low-precision accumulator, so ``handle.grad`` is an
empty :class:`AccumulatorGrad` whose in-place operations (``zero_grad``, ``clip_grad_norm_``,
``GradScaler``'s unscale) act on the accumulator; anything else raises rather than silently reading an
empty tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lowbit.lpmm.parameter import LowPrecisionParameter

__all__ = ["AccumulatorGrad", "Handle", "Materialize"]


class Materialize(torch.autograd.Function):
    """The full-precision value of a low-precision parameter; backward feeds its accumulator."""

    @staticmethod
    def forward(ctx: Any, handle: Tensor, lp: LowPrecisionParameter, release_leaf: Optional[Tensor]) -> Tensor:
        ctx.lp = lp
        ctx.release_leaf = release_leaf is not None
        return lp.dequantize(handle.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, Optional[Tensor]]:
        lp = ctx.lp
        lp.accumulate_(grad)
        # An empty gradient for the empty handle marks it as used, as DDP's reducer expects; FSDP2 cannot
        # reduce-scatter empty gradients, and the sharded accumulator already holds the reduced one. The
        # release leaf (gradient release of a sharded parameter) gets an empty gradient too: autograd runs
        # its post-accumulate-grad hook once every use of the parameter has fed the accumulator.
        leaf_grad = grad.new_zeros(0) if ctx.release_leaf else None
        return (torch.zeros_like(lp.handle) if lp.shards is None else None), None, leaf_grad


# The getset descriptor of the tensor's own .grad (the stubs type the attribute's value, not its descriptor).
_TENSOR_GRAD: Any = torch._C.TensorBase.grad


def _grad_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"lowbit.lpmm: {what} cannot be applied to the .grad of a converted parameter: its gradient lives in a "
        "low-precision accumulator and .grad is an empty placeholder. Use lowbit.lpmm.clip_grad_norm_ or "
        "lowbit.lpmm.clip_grad_value_ to clip, or LowPrecisionParameter.grad to read the value"
    )


def _storage(t: Any) -> Optional[LowPrecisionParameter]:
    return t._lpmm_storage if isinstance(t, AccumulatorGrad) else None


def _split(tensors: Any) -> tuple[list[int], list[Any]]:
    """Positions of placeholders in ``tensors`` and the other entries."""
    tensors = list(tensors)
    mine = [i for i, t in enumerate(tensors) if isinstance(t, AccumulatorGrad)]
    return mine, [t for t in tensors if not isinstance(t, AccumulatorGrad)]


def _plain(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _grad_norm(t: AccumulatorGrad, ord: float = 2.0, dtype: Optional[torch.dtype] = None) -> Tensor:
    lp = t._lpmm_storage
    g = lp.grad
    value = torch.zeros((), device=lp.device) if g is None else torch.linalg.vector_norm(g, ord)
    return value.to(dtype or t.dtype)


def _vector_norm(x: Tensor, ord: float = 2.0, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
    if dim is not None or keepdim:
        raise _grad_error("torch.linalg.vector_norm with dim or keepdim")
    return _grad_norm(x, ord, dtype)  # type: ignore[arg-type]


def _foreach_norm(tensors: Any, ord: float = 2.0, dtype: Any = None) -> list[Tensor]:
    tensors = list(tensors)
    mine, other = _split(tensors)
    rest = iter(_plain(torch._foreach_norm, other, ord, dtype=dtype) if other else [])
    return [_grad_norm(t, ord, dtype) if i in mine else next(rest) for i, t in enumerate(tensors)]


def _check_scalar(factor: Any) -> Any:
    if isinstance(factor, Tensor) and factor.numel() != 1:
        raise _grad_error("an elementwise multiplication by a non-scalar")
    if not isinstance(factor, (Tensor, int, float)) or isinstance(factor, bool):
        raise _grad_error(f"a multiplication by {type(factor).__name__}")
    return factor


def _mul_(t: Tensor, factor: Any) -> Tensor:
    t._lpmm_storage.scale_grad_(_check_scalar(factor))  # type: ignore[attr-defined]
    return t


def _foreach_mul_(tensors: Any, factor: Any) -> None:
    tensors = list(tensors)
    mine, other = _split(tensors)
    if isinstance(factor, (list, tuple)):
        for i in mine:
            _mul_(tensors[i], factor[i])
        if other:
            _plain(torch._foreach_mul_, other, [f for i, f in enumerate(factor) if i not in mine])
        return
    for i in mine:
        _mul_(tensors[i], factor)
    if other:
        _plain(torch._foreach_mul_, other, factor)


def _zero_(t: Tensor) -> Tensor:
    t._lpmm_storage.zero_grad_(set_to_none=False)  # type: ignore[attr-defined]
    return t


def _foreach_zero_(tensors: Any) -> None:
    _, other = _split(tensors)
    for t in tensors:
        if isinstance(t, AccumulatorGrad):
            _zero_(t)
    if other:
        _plain(torch._foreach_zero_, other)


def _unscale_(tensors: Any, found_inf: Tensor, inv_scale: Tensor) -> None:
    """GradScaler's ``unscale_``: flags a non-finite accumulated gradient in ``found_inf`` and multiplies the
    accumulators by ``inv_scale`` (exact for GradScaler's power-of-two scales: only group absmaxes change)."""
    tensors = list(tensors)
    _, other = _split(tensors)
    for t in tensors:
        lp = _storage(t)
        if lp is None or not lp.has_grad:
            continue
        if not bool(torch.isfinite(lp.grad_absmax).all()):
            found_inf.fill_(1.0)
        lp.scale_grad_(inv_scale)
    if other:
        _plain(torch._amp_foreach_non_finite_check_and_unscale_, other, found_inf, inv_scale)


_GRAD_OPS: dict[Any, Callable[..., Any]] = {
    Tensor.zero_: _zero_,
    torch._foreach_zero_: _foreach_zero_,
    Tensor.mul_: _mul_,
    torch._foreach_mul_: _foreach_mul_,
    torch.linalg.vector_norm: _vector_norm,
    torch._foreach_norm: _foreach_norm,
    torch._amp_foreach_non_finite_check_and_unscale_: _unscale_,
}
# Metadata and autograd bookkeeping that zero_grad, GradScaler and torch.compile (wrapping the placeholder
# while tracing model.zero_grad) read; everything else raises.
_GRAD_PASSTHROUGH = {
    "__get__", "requires_grad_", "detach_", "__repr__", "__format__", "size", "dim", "numel",
    "stride", "storage_offset", "untyped_storage", "_is_view", "is_conj", "is_neg",
}  # fmt: skip
_GRAD_CLAMPS = {"clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "clip", "clip_"}


class AccumulatorGrad(Tensor):
    """What ``handle.grad`` returns for a converted parameter: an empty tensor standing for the accumulated
    gradient. The in-place operations of ``zero_grad``, ``clip_grad_norm_`` and ``GradScaler`` act on the
    accumulator; anything else raises rather than silently reading an empty tensor."""

    _lpmm_storage: LowPrecisionParameter

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _GRAD_OPS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in _GRAD_PASSTHROUGH:
            return _plain(func, *args, **kwargs)
        if name.lstrip("_").removeprefix("foreach_") in _GRAD_CLAMPS:
            raise _grad_error(f"torch.{name} (clip_grad_value_)")
        raise _grad_error(f"torch.{name}")


class Handle(nn.Parameter):
    """The parameter that stands for a :class:`LowPrecisionParameter` in ``model.parameters()``. Its
    ``.grad`` is None or an :class:`AccumulatorGrad` placeholder, and setting it to None (``zero_grad``)
    empties the accumulator, so a discarded gradient is never applied."""

    @property
    def grad(self) -> Optional[Tensor]:
        g: Optional[Tensor] = _TENSOR_GRAD.__get__(self)
        lp = self.__dict__.get("_lpmm")
        if g is None or lp is None:
            return g
        placeholder = torch.Tensor._make_subclass(AccumulatorGrad, g)
        placeholder._lpmm_storage = lp
        return placeholder

    @grad.setter
    def grad(self, value: Optional[Tensor]) -> None:
        lp = self.__dict__.get("_lpmm")
        if value is not None and lp is not None:
            if _storage(value) is not lp:
                raise TypeError(
                    "lowbit.lpmm: cannot assign a gradient to a converted parameter: its gradient lives in a "
                    "low-precision accumulator (LowPrecisionParameter.accumulate_ adds to it)"
                )
            return
        _TENSOR_GRAD.__set__(self, value)
        if lp is not None:
            lp.zero_grad_()

    @grad.deleter
    def grad(self) -> None:
        self.grad = None
