"""The activation modules of torch.nn and transformers, by what :func:`~lowbit.nn.compress_activations`
does with each: the activation name of the layer that computes it, or the reason it is left alone.

Parametrised forms without shipped tables (LeakyReLU with any slope, Hardtanh, ReLU6, ELU with any alpha,
...) and Hugging Face's Python-formula activations are registered (:func:`~lowbit.nn.register_activation`)
under a name that spells out their parameters, on first use. A registered formula is the module's own
forward, so the few-bit layer's output stays bit-identical. Classes are listed one by one: a class this
file does not know is not recognised, which is what a test enumerating both registries looks for.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowbit.nn._registry import Fn, register_activation, registered

__all__ = ["HF_EXACT", "HF_FORMULA", "UNSUPPORTED", "hf_formula", "hf_pointwise", "torch_module"]

Result = tuple[Optional[str], Optional[str]]  # (activation name, None) or (None, reason)

_NOT_POINTWISE = "not pointwise: each output depends on several inputs, so no per-element code can stand in for them"
UNSUPPORTED: dict[type, str] = {
    nn.PReLU: "PReLU learns its slope: the slope's gradient needs the input itself",
    nn.RReLU: "RReLU draws a random slope per element in training, which backward needs element by element",
    nn.GLU: _NOT_POINTWISE,
    nn.Softmax: _NOT_POINTWISE,
    nn.Softmin: _NOT_POINTWISE,
    nn.Softmax2d: _NOT_POINTWISE,
    nn.LogSoftmax: _NOT_POINTWISE,
    nn.MultiheadAttention: "attention, not an activation function",
}


def _ones_backward(op: Callable[..., Tensor], *args: object) -> Fn:
    """f'(x) by torch's own backward kernel ``op(grad, x, *args)`` at grad = 1: exactly what torch multiplies by."""
    return lambda x: op(torch.ones_like(x), x, *args)


def _register(name: str, fn: Fn, **kwargs: object) -> str:
    # The name spells out every parameter, so an existing entry under it is this same function.
    return name if registered(name) else register_activation(name, fn, **kwargs)  # type: ignore[arg-type]


def _two_valued(name: str, fn: Fn, fprime: Fn, values: tuple[float, float]) -> Result:
    if values[0] == values[1]:
        return None, f"{name} is linear: it keeps nothing for backward"
    return _register(name, fn, derivative=fprime, two_values=values), None


def _leaky_relu(m: nn.LeakyReLU) -> Result:
    s = float(m.negative_slope)
    if s == 0.01:
        return "leaky_relu", None
    fprime = _ones_backward(torch.ops.aten.leaky_relu_backward, s, False)
    fn = functools.partial(F.leaky_relu, negative_slope=s)
    return _two_valued(f"leaky_relu(negative_slope={s!r})", fn, fprime, (s, 1.0))


def _hardtanh(m: nn.Hardtanh) -> Result:
    lo, hi = float(m.min_val), float(m.max_val)
    fn = functools.partial(F.hardtanh, min_val=lo, max_val=hi)
    fprime = _ones_backward(torch.ops.aten.hardtanh_backward, lo, hi)
    return _two_valued(f"hardtanh(min_val={lo!r}, max_val={hi!r})", fn, fprime, (0.0, 1.0))


def _threshold(m: nn.Threshold) -> Result:
    t, v = float(m.threshold), float(m.value)
    fn = functools.partial(F.threshold, threshold=t, value=v)
    fprime = _ones_backward(torch.ops.aten.threshold_backward, t)
    return _two_valued(f"threshold(threshold={t!r}, value={v!r})", fn, fprime, (0.0, 1.0))


def _shrink(m: Union[nn.Hardshrink, nn.Softshrink]) -> Result:
    lam = float(m.lambd)
    fn, op = {
        nn.Hardshrink: (F.hardshrink, torch.ops.aten.hardshrink_backward),
        nn.Softshrink: (F.softshrink, torch.ops.aten.softshrink_backward),
    }[type(m)]
    name = f"{fn.__name__}(lambd={lam!r})"
    return _two_valued(name, functools.partial(fn, lambd=lam), _ones_backward(op, lam), (0.0, 1.0))


def _hardsigmoid(m: nn.Hardsigmoid) -> Result:
    # torch's backward multiplies by 1/6 rounded to the tensor's type; the level is the same fp32 number.
    return _two_valued("hardsigmoid", F.hardsigmoid, _ones_backward(torch.ops.aten.hardsigmoid_backward), (0.0, 1 / 6))


def _elu(m: nn.ELU) -> Result:
    a = float(m.alpha)
    if a == 1.0:
        return "elu", None
    return _register(f"elu(alpha={a!r})", functools.partial(F.elu, alpha=a), breakpoints=(0.0,)), None


def _celu(m: nn.CELU) -> Result:
    a = float(m.alpha)
    return _register(f"celu(alpha={a!r})", functools.partial(F.celu, alpha=a), breakpoints=(0.0,)), None


def _softplus(m: nn.Softplus) -> Result:
    b, t = float(m.beta), float(m.threshold)
    if (b, t) == (1.0, 20.0):
        return "softplus", None
    # Above beta * x = threshold torch returns x itself: the derivative jumps from sigmoid(threshold) to 1.
    fn = functools.partial(F.softplus, beta=b, threshold=t)
    return _register(f"softplus(beta={b!r}, threshold={t!r})", fn, breakpoints=(t / b,)), None


def _smooth(name: str, fn: Fn) -> Callable[[nn.Module], Result]:
    return lambda m: (_register(name, fn), None)


# torch.nn's pointwise activations by exact class (ReLU6 is a Hardtanh with its own class); each function takes
# an instance of its key, which a dict's type cannot say (hence Any).
_TORCH: dict[type, Callable[[Any], Result]] = {
    nn.GELU: lambda m: ({"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate), None),
    nn.SiLU: lambda m: ("silu", None),
    nn.Mish: lambda m: ("mish", None),
    nn.Sigmoid: lambda m: ("sigmoid", None),
    nn.Tanh: lambda m: ("tanh", None),
    nn.SELU: lambda m: ("selu", None),
    nn.Hardswish: lambda m: ("hardswish", None),
    nn.ReLU: lambda m: ("relu", None),
    nn.ELU: _elu,
    nn.CELU: _celu,
    nn.Softplus: _softplus,
    nn.LeakyReLU: _leaky_relu,
    nn.Hardtanh: _hardtanh,
    nn.ReLU6: _hardtanh,
    nn.Threshold: _threshold,
    nn.Hardshrink: _shrink,
    nn.Softshrink: _shrink,
    nn.Hardsigmoid: _hardsigmoid,
    nn.LogSigmoid: _smooth("logsigmoid", F.logsigmoid),
    nn.Softsign: _smooth("softsign", F.softsign),
    nn.Tanhshrink: _smooth("tanhshrink", F.tanhshrink),
}


def torch_module(m: nn.Module) -> Result:
    """(name, None) for a torch.nn activation a few-bit layer computes, (None, reason) for one it cannot,
    (None, None) for any other module."""
    rule = _TORCH.get(type(m))
    if rule is not None:
        return rule(m)
    return None, UNSUPPORTED.get(type(m))


# Hugging Face's activations (transformers.activations) that compute exactly a lowbit activation (torch's
# function directly or through ``self.act``; quick_gelu's own expression), by class name.
HF_EXACT = {
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "SiLUActivation": "silu",
    "MishActivation": "mish",
    "QuickGELUActivation": "quick_gelu",
}
# Python formulas of a torch function: an inverted layer of that function changes the output by rounding.
HF_FORMULA = {"NewGELUActivation": "gelu_tanh", "FastGELUActivation": "gelu_tanh"}
# Pointwise, parameter-free formulas: a few-bit layer runs the module's own forward.
_HF_POINTWISE = {
    *HF_EXACT,
    *HF_FORMULA,
    "ClippedGELUActivation",
    "AccurateGELUActivation",
    "LaplaceActivation",
    "ReLUSquaredActivation",
    "SqrtSoftplusActivation",
}
_HF_UNSUPPORTED = {
    "LinearActivation": "the identity: it keeps nothing for backward",
    "XIELUActivation": "xIELU learns alpha_p and alpha_n: their gradients need the input itself",
}


def hf_pointwise(m: nn.Module) -> Result:
    """(class name, None) for a pointwise Hugging Face activation, (None, reason) for one lowbit cannot
    replace, (None, None) for any other module."""
    cls = type(m).__name__
    if type(m).__module__ != "transformers.activations":
        return None, None
    return (cls, None) if cls in _HF_POINTWISE else (None, _HF_UNSUPPORTED.get(cls))


def hf_formula(m: nn.Module) -> str:
    """The registered name of a pointwise Hugging Face module (see :func:`hf_pointwise`): its own forward,
    its attributes in the name."""
    cls = type(m).__name__
    params = ", ".join(
        f"{k}={getattr(v, '__name__', None) or repr(v)}"
        for k, v in sorted(vars(m).items())
        if not k.startswith("_") and k != "training"
    )
    return _register(f"transformers.{cls}({params})", copy.deepcopy(m))
