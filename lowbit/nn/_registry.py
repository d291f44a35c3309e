"""The built-in activations by name: the torch function, its derivative and where the derivative jumps.

One registry for everything in ``lowbit.nn`` that takes an activation by name: the few-bit tables
(:mod:`lowbit.nn.fewbit`), the inverted-activation tables (:mod:`lowbit.nn.invact`) and the layers of
:mod:`lowbit.nn.activations`. Each function is torch's own with torch's default parameters, so each
derivative is exactly what torch's backward multiplies the incoming gradient by.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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


def check_activation(name: object, arg: str = "name") -> str:
    if not isinstance(name, str):
        raise TypeError(f"lowbit: {arg} must be a str, got {type(name).__name__}")
    if name not in _ACTIVATION_FNS:
        raise ValueError(f"lowbit: {arg} must be a known activation ({', '.join(ACTIVATIONS)}), got {name!r}")
    return name


def activation_fn(name: str) -> Fn:
    """The torch function of the built-in activation ``name``, with torch's default parameters.

    Args:
        name: one of :data:`ACTIVATIONS`, e.g. ``"gelu"`` or ``"gelu_tanh"`` (GELU, tanh approximation).
    """
    return _ACTIVATION_FNS[check_activation(name)][0]


def derivative(name: str) -> Fn:
    """The derivative of the built-in activation ``name`` (one of :data:`ACTIVATIONS`).

    Computed by :func:`autograd_derivative` of the ``torch.nn.functional`` function with torch's
    defaults (``leaky_relu`` slope 0.01, ``elu`` alpha 1, ``softplus`` beta 1), so it equals torch's
    backward.

    Args:
        name: activation name, e.g. ``"gelu"`` or ``"gelu_tanh"`` (GELU with the tanh approximation).
    """
    return autograd_derivative(activation_fn(name))


def activation_breakpoints(name: str) -> tuple[float, ...]:
    """The points where the derivative of the built-in activation ``name`` jumps, sorted; often none.

    Args:
        name: one of :data:`ACTIVATIONS`.
    """
    return _ACTIVATION_FNS[check_activation(name)][1]
