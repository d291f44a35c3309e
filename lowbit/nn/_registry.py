"""The activations by name: the function, its derivative and where the derivative jumps.

One registry for everything in ``lowbit.nn`` that takes an activation by name: the few-bit tables
(:mod:`lowbit.nn.fewbit`), the inverted-activation tables (:mod:`lowbit.nn.invact`) and the layers of
:mod:`lowbit.nn.activations`. The built-in ones (:data:`ACTIVATIONS`, with shipped tables) are torch's
own functions with torch's default parameters, so each derivative is exactly what torch's backward
multiplies the incoming gradient by. :func:`register_activation` adds any other pointwise function;
its few-bit tables are derived on first use.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ACTIVATIONS",
    "TWO_VALUED",
    "Fn",
    "activation_breakpoints",
    "activation_fn",
    "autograd_derivative",
    "check_activation",
    "derivative",
    "register_activation",
    "registered",
    "two_values",
]

Fn = Callable[[Tensor], Tensor]

# Activations with shipped tables: the torch function and the points where its derivative jumps.
_ACTIVATION_FNS: dict[str, tuple[Fn, tuple[float, ...]]] = {
    "gelu": (F.gelu, ()),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), ()),
    "silu": (F.silu, ()),
    "sigmoid": (torch.sigmoid, ()),
    "tanh": (torch.tanh, ()),
    "selu": (F.selu, (0.0,)),
    "elu": (F.elu, (0.0,)),
    "softplus": (F.softplus, ()),
    "mish": (F.mish, ()),
    "hardswish": (F.hardswish, (-3.0, 3.0)),
    "leaky_relu": (F.leaky_relu, (0.0,)),
    "relu": (F.relu, (0.0,)),
}
ACTIVATIONS: tuple[str, ...] = tuple(_ACTIVATION_FNS)
# f' takes exactly two values (section 2, "ReLU activation function"): the 1-bit table is exact.
TWO_VALUED = frozenset({"relu", "leaky_relu"})


def autograd_derivative(f: Fn) -> Fn:
    """The derivative of a pointwise function ``f`` by reverse-mode autograd.

    ``f'(x)`` is the gradient of ``f(x).sum()`` with respect to ``x``: for a pointwise ``f`` this is
    exactly what torch's own backward of ``f`` multiplies the incoming gradient by, so a table built
    from it approximates the derivative torch would use.

    Args:
        f: a pointwise function of a tensor, differentiable by torch.autograd (e.g. ``F.gelu``).

    Returns:
        A function mapping a tensor ``x`` to ``f'(x)`` (a tensor of the same shape, no graph).
    """
    if not callable(f):
        raise TypeError(f"lowbit: f must be callable, got {type(f).__name__}")

    def fprime(x: Tensor) -> Tensor:
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(f(xg).sum(), xg)
        return grad

    fprime.__name__ = f"d_{getattr(f, '__name__', type(f).__name__)}"
    return fprime


@dataclass(frozen=True)
class _Registered:
    fn: Fn
    derivative: Fn
    breakpoints: tuple[float, ...]
    two_values: Optional[tuple[float, float]]


# Appended to, never changed: a name keeps its function, so tables derived for it stay valid.
_REGISTERED: dict[str, _Registered] = {}


def register_activation(
    name: str,
    fn: Fn,
    derivative: Optional[Fn] = None,
    breakpoints: Sequence[float] = (),
    two_values: Optional[tuple[float, float]] = None,
) -> str:
    """Make the pointwise activation ``fn`` available by ``name`` to the few-bit layers.

    :class:`~lowbit.nn.FewBitActivation` ``(name, bits)`` then runs ``fn`` forward and saves ``bits`` bits
    per element; its optimal table (:func:`lowbit.nn.fewbit.optimal_levels` of ``derivative`` on
    [-10, 10]) is derived on first use. Where ``f'`` takes only two values, pass them as ``two_values``:
    the layer then saves one bit per element, whether ``f'(x)`` is the larger one, and its backward is
    exact.

    Args:
        name: a new name; the built-in names and names already registered are refused.
        fn: a pointwise function of a tensor (fp32, fp16, bf16 and, for the table, float64).
        derivative: ``f'`` as a pointwise function of ``x``; default ``autograd_derivative(fn)``.
        breakpoints: points where ``f'`` jumps.
        two_values: the two values of a two-valued ``f'``, or None.

    Returns:
        ``name``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"lowbit: name must be a non-empty str, got {name!r}")
    if name in _ACTIVATION_FNS or name in _REGISTERED:
        raise ValueError(f"lowbit: name {name!r} is already an activation; choose another")
    if not callable(fn):
        raise TypeError(f"lowbit: fn must be callable, got {type(fn).__name__}")
    if derivative is not None and not callable(derivative):
        raise TypeError(f"lowbit: derivative must be callable or None, got {type(derivative).__name__}")
    points = tuple(sorted(_finite(v, "breakpoints") for v in breakpoints))
    values = None
    if two_values is not None:
        if not isinstance(two_values, (tuple, list)) or len(two_values) != 2:
            raise TypeError(f"lowbit: two_values must be a pair of numbers, got {two_values!r}")
        lo, hi = sorted(_finite(v, "two_values") for v in two_values)
        if lo == hi:
            raise ValueError(f"lowbit: two_values must be two different numbers, got {two_values!r}")
        values = (lo, hi)
    _REGISTERED[name] = _Registered(fn, derivative or autograd_derivative(fn), points, values)
    return name


def _quick_gelu(x: Tensor) -> Tensor:
    # Hugging Face's QuickGELUActivation (CLIP), the same expression, so outputs are bit-identical.
    return x * torch.sigmoid(1.702 * x)


def _finite(value: object, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"lowbit: {arg} must hold finite numbers, got {value!r}")
    return float(value)


def registered(name: str) -> bool:
    """Whether ``name`` was added by :func:`register_activation` (it has no shipped tables)."""
    return name in _REGISTERED


def two_values(name: str) -> Optional[tuple[float, float]]:
    """The two values, ascending, of a registered two-valued derivative; None for any other activation."""
    entry = _REGISTERED.get(check_activation(name))
    return None if entry is None else entry.two_values


def check_activation(name: object, arg: str = "name") -> str:
    if not isinstance(name, str):
        raise TypeError(f"lowbit: {arg} must be a str, got {type(name).__name__}")
    if name not in _ACTIVATION_FNS and name not in _REGISTERED:
        raise ValueError(
            f"lowbit: {arg} must be a known activation ({', '.join(ACTIVATIONS)}) or one added by "
            f"lowbit.nn.register_activation, got {name!r}"
        )
    return name


def activation_fn(name: str) -> Fn:
    """The function of activation ``name``: for a built-in one torch's, with torch's default parameters.

    Args:
        name: one of :data:`ACTIVATIONS`, e.g. ``"gelu"`` or ``"gelu_tanh"`` (GELU, tanh approximation), or
            a registered name.
    """
    if check_activation(name) in _REGISTERED:
        return _REGISTERED[name].fn
    return _ACTIVATION_FNS[name][0]


def derivative(name: str) -> Fn:
    """The derivative of activation ``name`` (one of :data:`ACTIVATIONS`, or a registered name).

    For a built-in one, :func:`autograd_derivative` of the ``torch.nn.functional`` function with torch's
    defaults (``leaky_relu`` slope 0.01, ``elu`` alpha 1, ``softplus`` beta 1), so it equals torch's
    backward; for a registered one, the derivative it was registered with.

    Args:
        name: activation name, e.g. ``"gelu"`` or ``"gelu_tanh"`` (GELU with the tanh approximation).
    """
    if check_activation(name) in _REGISTERED:
        return _REGISTERED[name].derivative
    return autograd_derivative(activation_fn(name))


def activation_breakpoints(name: str) -> tuple[float, ...]:
    """The points where the derivative of activation ``name`` jumps, sorted; often none.

    Args:
        name: one of :data:`ACTIVATIONS`, or a registered name.
    """
    if check_activation(name) in _REGISTERED:
        return _REGISTERED[name].breakpoints
    return _ACTIVATION_FNS[name][1]


# No shipped few-bit tables (derived on first use); its inverted form is SiLU's, scaled (lowbit.nn.invact.SCALED).
register_activation("quick_gelu", _quick_gelu)
