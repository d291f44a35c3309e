"""Swap a model's activations for ones that save less for backward, in place, keeping every weight.

:func:`compress_activations` walks a model and replaces the activations it recognises
(:mod:`lowbit.nn._catalogue`): every pointwise ``torch.nn`` activation module with its parameters
(few-bit tables derived for parameters without shipped ones; exact 1-bit forms where the derivative takes
two values: ReLU6, Hardtanh, LeakyReLU with any slope, Threshold, Hardsigmoid, Hardshrink, Softshrink),
activation functions stored as module attributes (``self.act_fn = F.silu``), and Hugging Face
``transformers.activations`` modules. The forward pass of the model is unchanged bit for bit: a
Hugging Face Python formula (``QuickGELUActivation``, ``NewGELUActivation``, ...) keeps its own formula
in a few-bit layer. The inverted layers exist for torch's GELU, SiLU and Mish and for quick_gelu, and, saving
only the output, for ELU, CELU, SELU, LeakyReLU (slope >= 0; as functions, torch's defaults) and relu2; torch's
kernels round differently from the GELU formulas, so they replace ``NewGELUActivation`` and
``FastGELUActivation`` only with ``strict=False``. Classes that cannot be replaced (PReLU, RReLU,
softmax, ...) are listed with the reason.

A function attribute keeps the function's calling convention: a call with extra arguments
(``self.act(x, negative_slope=0.01)``, ``approximate="tanh"``, ``inplace=True``) runs a lowbit layer when
they select a function lowbit has a table for (in-place calls write the result into their input), and
otherwise the original function, unchanged, with a warning once per attribute and an entry in
:attr:`CompressionReport.fallbacks`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowbit.memory import SavedBytes, saved_tensor_bytes
from lowbit.nn import blpa, blpa_convert, invact
from lowbit.nn._catalogue import HF_EXACT, HF_FORMULA, hf_formula, hf_pointwise, torch_module
from lowbit.nn.activations import (
    FewBitActivation,
    InvActivation,
    InvCELU,
    InvELU,
    InvLeakyReLU,
    InvReLUSquared,
    InvSELU,
)
from lowbit.nn.fewbit.tables import WEIGHTS, _check_bits, table_bits

__all__ = ["CompressionReport", "Replacement", "compress_activations"]

METHODS = ("fewbit", "invact", "blpa")
WHEN = ("smaller", "always")

_FUNCTIONS: dict[Any, str] = {
    F.gelu: "gelu",
    F.silu: "silu",
    F.mish: "mish",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    F.selu: "selu",
    torch.selu: "selu",
    F.elu: "elu",
    F.softplus: "softplus",
    F.hardswish: "hardswish",
    F.leaky_relu: "leaky_relu",
    F.relu: "relu",
    torch.relu: "relu",
}

# The calling convention of each function in _FUNCTIONS after ``input``: (positional-or-keyword names,
# keyword-only names, defaults), one entry per key of _FUNCTIONS. A call is bound against it the way
# Python would bind it.
_SIGNATURES: dict[Any, tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]]] = {
    F.gelu: ((), ("approximate",), {"approximate": "none"}),
    F.silu: (("inplace",), (), {"inplace": False}),
    F.mish: (("inplace",), (), {"inplace": False}),
    torch.sigmoid: ((), ("out",), {"out": None}),
    F.sigmoid: ((), (), {}),
    torch.tanh: ((), ("out",), {"out": None}),
    F.tanh: ((), (), {}),
    F.selu: (("inplace",), (), {"inplace": False}),
    torch.selu: ((), (), {}),
    F.elu: (("alpha", "inplace"), (), {"alpha": 1.0, "inplace": False}),
    F.softplus: (("beta", "threshold"), (), {"beta": 1.0, "threshold": 20.0}),
    F.hardswish: (("inplace",), (), {"inplace": False}),
    F.leaky_relu: (("negative_slope", "inplace"), (), {"negative_slope": 0.01, "inplace": False}),
    F.relu: (("inplace",), (), {"inplace": False}),
    torch.relu: ((), (), {}),
}
_GELU_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}
# What method="invact" can replace, for the reports of what it cannot.
_INVERTIBLE_NAMES = "gelu, gelu_tanh, silu, mish, quick_gelu; ELU, CELU, SELU, LeakyReLU with a slope >= 0 and relu2"


@dataclass(frozen=True)
class Replacement:
    """One swapped activation: where (module path, ``.attr`` for a function attribute), what, by what.

    Attributes:
        path: the module path, ``parent.attr`` for a function attribute.
        before: the original activation.
        after: the lowbit layer now in its place.
        saved_before: bytes that only the original activation kept for backward on the sample
            (see :attr:`lowbit.memory.SavedBytes.exclusive`); None without a sample.
        saved_after: the same for the lowbit layer; None without a sample.
    """

    path: str
    before: str
    after: str
    saved_before: Optional[int] = None
    saved_after: Optional[int] = None


@dataclass
class CompressionReport:
    """What :func:`compress_activations` replaced, and what it left alone and why.

    Attributes:
        replaced: every swapped activation.
        skipped: ``(path, reason)`` of each recognised activation left alone.
        fallbacks: ``(path, reason)`` of each replaced function attribute that was later called with
            arguments no lowbit layer implements, so that it ran the original function; filled in while
            the model runs, once per attribute and set of such arguments (a warning says the same).
        bytes_before: bytes the model saved for backward on the sample before the call, measured by
            :func:`lowbit.memory.saved_tensor_bytes`; None without a sample.
        expected_bytes: bytes it is expected to save on the sample now: ``bytes_before`` less what each
            replacement frees (``saved_before - saved_after``); None without a sample. Measure it with
            ``lowbit.memory.saved_tensor_bytes(model, *sample_args, **sample_kwargs).total``.
    """

    replaced: list[Replacement] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: Optional[int] = None
    expected_bytes: Optional[int] = None

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} activation(s)"]
        if self.bytes_before is not None and self.expected_bytes is not None:
            lines[0] += f"; saved for backward on the sample: {self.bytes_before:,} -> {self.expected_bytes:,} bytes"
        lines += [f"  {r.path}: {r.before} -> {r.after}" for r in self.replaced]
        if self.skipped:
            lines.append(f"left {len(self.skipped)} alone")
            lines += [f"  {p}: {why}" for p, why in self.skipped]
        if self.fallbacks:
            lines.append(f"{len(self.fallbacks)} call(s) ran the original function")
            lines += [f"  {p}: {why}" for p, why in self.fallbacks]
        return "\n".join(lines)


def _function_name(fn: Any) -> Optional[str]:
    if isinstance(fn, functools.partial):
        if fn.func is F.gelu and not fn.args and fn.keywords == {"approximate": "tanh"}:
            return "gelu_tanh"
        if fn.func is F.gelu and not fn.args and fn.keywords in ({}, {"approximate": "none"}):
            return "gelu"
        return None
    try:
        return _FUNCTIONS.get(fn)
    except TypeError:  # unhashable callables
        return None


def _module_name(m: nn.Module, strict: bool, method: str) -> tuple[Optional[str], Optional[str]]:
    """(activation name, None) for a replaceable module, (None, reason) for a recognised one that is
    not, (None, None) for anything else."""
    cls, reason = hf_pointwise(m)
    if cls is None:
        return (None, reason) if reason is not None else torch_module(m)
    # Exact when it calls the torch function: directly (no ``act``) or through ``self.act``.
    act = getattr(m, "act", None)
    if cls in HF_EXACT and (act is None or _function_name(act) == HF_EXACT[cls]):
        return HF_EXACT[cls], None
    if method == "fewbit":
        return hf_formula(m), None  # the module's own formula: the forward stays bit-identical
    # An inverted layer computes torch's function, which rounds differently from the module's formula.
    torch_name = HF_EXACT.get(cls) or HF_FORMULA.get(cls)
    if torch_name is None:
        return None, f"{cls} has no inverted form in lowbit ({_INVERTIBLE_NAMES})"
    if strict:
        return None, f"{cls} computes a Python formula that rounds differently from torch's kernel (strict=False)"
    return torch_name, None


class _FunctionCall(nn.Module):
    """Called like the function attribute it replaces: ``(input, *args, **kwargs)`` with that function's
    signature. Mixed into a lowbit layer; the layer's own ``forward`` serves calls with the defaults."""

    name: str
    _activation: Callable[[Tensor, bool], Tensor]
    _fn: Any
    _path: str
    _report: CompressionReport
    _warned: set[tuple[str, ...]]

    def _setup(self, fn: Any, path: str, report: CompressionReport, alternates: dict[str, nn.Module]) -> None:
        # Underscored: _walk skips these, so compressing the model again leaves this layer as it is.
        self._fn, self._path, self._report, self._warned = fn, path, report, set()
        if alternates:
            self.alternates = nn.ModuleDict(alternates)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """``fn(*args, **kwargs)`` for the replaced function ``fn``: by a lowbit layer when the arguments
        select a function lowbit implements, else by ``fn`` itself."""
        fn, call_args, call_kwargs = self._fn, args, kwargs
        if isinstance(self._fn, functools.partial):
            part: functools.partial[Any] = self._fn
            fn, call_args, call_kwargs = part.func, part.args + args, {**part.keywords, **kwargs}
        bound = _bind(_SIGNATURES[fn], call_args, call_kwargs)
        if bound is None or not isinstance(bound["input"], Tensor):
            return self._fn(*args, **kwargs)  # whatever the original does with it, errors included
        x = bound.pop("input")
        inplace = bool(bound.pop("inplace", False))
        variant = self.name
        if fn is F.gelu:
            approximate = bound.pop("approximate")
            chosen = _GELU_APPROXIMATE.get(approximate) if isinstance(approximate, str) else None
            if chosen is None:
                return self._fn(*args, **kwargs)  # an invalid value: the original raises
            variant = chosen
        other = sorted(k for k, v in bound.items() if not _is_default(v, _SIGNATURES[fn][2][k]))
        if other:
            self._fall_back(other, bound)
            return self._fn(*args, **kwargs)
        # The alternates are layers of this class's family, made by _make as this one was.
        layer = self if variant == self.name else cast(_FunctionCall, self.alternates[variant])
        return layer._activation(x, inplace)

    def _describe(self) -> str:
        # The report names the public layer (the first public class after this mixin); the alternates are an
        # implementation detail.
        base = next(c for c in type(self).__mro__[2:] if not c.__name__.startswith("_"))
        return f"{base.__name__}({self.extra_repr()})"

    def _fall_back(self, names: list[str], bound: dict[str, Any]) -> None:
        key = tuple(names)
        if key in self._warned:
            return
        self._warned.add(key)
        given = ", ".join(f"{k}={bound[k]!r}" for k in names)
        fn_name = getattr(self._fn, "__name__", repr(self._fn))
        why = f"called with {given}, which lowbit has no table for: runs the original {fn_name}, saving its input"
        self._report.fallbacks.append((self._path, why))
        warnings.warn(f"lowbit: {self._path} {why}", UserWarning, stacklevel=3)


class _FewBitFunctionCall(_FunctionCall, FewBitActivation):
    """A :class:`FewBitActivation` standing in for a function attribute (see :class:`_FunctionCall`)."""


class _InvFunctionCall(_FunctionCall, InvActivation):
    """An :class:`InvActivation` standing in for a function attribute (see :class:`_FunctionCall`)."""


class _InvELUCall(_FunctionCall, InvELU):
    """An :class:`InvELU` standing in for ``F.elu`` (see :class:`_FunctionCall`)."""


class _InvSELUCall(_FunctionCall, InvSELU):
    """An :class:`InvSELU` standing in for ``F.selu`` or ``torch.selu`` (see :class:`_FunctionCall`)."""


class _InvLeakyReLUCall(_FunctionCall, InvLeakyReLU):
    """An :class:`InvLeakyReLU` standing in for ``F.leaky_relu`` (see :class:`_FunctionCall`)."""


# Functions whose inverted form saves only the output, with torch's default parameters (other parameters
# fall back to the function, as for the few-bit layers).
_EXACT_CALLS: dict[str, type[_FunctionCall]] = {
    "elu": _InvELUCall,
    "selu": _InvSELUCall,
    "leaky_relu": _InvLeakyReLUCall,
}


def _bind(
    signature: tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Optional[dict[str, Any]]:
    """Every argument by name, defaults filled in, or None where Python would reject the call."""
    positional, keyword_only, defaults = signature
    names = ("input", *positional)
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args, strict=False))  # fewer args than names: the rest by keyword or default
    for key, value in kwargs.items():
        if key in bound or (key not in names and key not in keyword_only):
            return None
        bound[key] = value
    if "input" not in bound:
        return None
    return {**defaults, **bound}


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` computes exactly what ``default`` does (a number equal to a numeric default)."""
    if default is None:
        return value is None
    if isinstance(default, str):
        return isinstance(value, str) and value == default
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default


def _fewbit_bits(name: str, bits: int) -> int:
    # ReLU and LeakyReLU are exact at 1 bit, their only table.
    return 1 if table_bits(name) == (1,) else bits


def _exact_inverse(m: nn.Module) -> tuple[Optional[nn.Module], Optional[str]]:
    """The layer that computes module ``m`` and saves only its output (lowbit.nn.activations: exactly
    inverted activations); (None, reason) where the output does not name the branch; (None, None) for
    modules of other classes."""
    cls = type(m)
    if cls in (nn.ReLU, nn.Sigmoid, nn.Tanh):
        # relu' = (y > 0), sigmoid' = y (1 - y), tanh' = 1 - y**2: torch's backward already reads the output.
        return None, f"torch's backward of {cls.__name__} already reads only its output: it is its own inverted form"
    # Exact classes, tested as type(m) rather than cls so that the checker narrows m.
    if type(m) is nn.ELU:
        if m.alpha < 0:
            return None, "ELU with alpha < 0: positive outputs come from both signs of x, so the output cannot invert"
        return InvELU(float(m.alpha), m.inplace), None
    if type(m) is nn.CELU:
        return InvCELU(float(m.alpha), m.inplace), None
    if type(m) is nn.SELU:
        return InvSELU(m.inplace), None
    if type(m) is nn.LeakyReLU:
        if m.negative_slope < 0:
            return None, (
                "LeakyReLU with a negative slope: positive outputs come from both signs of x, so the inverted "
                "form would need the sign bit too; method='fewbit' has the exact form that saves only that bit"
            )
        return InvLeakyReLU(float(m.negative_slope), m.inplace), None
    if hf_pointwise(m)[0] == "ReLUSquaredActivation":
        return InvReLUSquared(), None
    return None, None


def _make(
    name: str, method: str, bits: int, weight: str, device: torch.device
) -> tuple[Optional[nn.Module], Optional[str]]:
    if method == "invact":
        if name not in invact.INVERTIBLE:
            return None, f"{name} has no inverted form in lowbit ({_INVERTIBLE_NAMES})"
        return InvActivation(name).to(device), None
    return FewBitActivation(name, _fewbit_bits(name, bits), weight).to(device), None


def _make_call(
    fn: Any, name: str, path: str, report: CompressionReport, method: str, bits: int, weight: str, device: torch.device
) -> tuple[Optional[nn.Module], Optional[str]]:
    """The layer for function attribute ``fn``; for GELU also the other approximation, which a call may ask
    for with ``approximate=``."""
    if method == "invact" and name not in invact.INVERTIBLE and name not in _EXACT_CALLS:
        return None, f"function {name} has no inverted form in lowbit ({_INVERTIBLE_NAMES})"
    alternates: dict[str, nn.Module] = {}
    if name in _GELU_APPROXIMATE.values():
        other = "gelu_tanh" if name == "gelu" else "gelu"
        made, _ = _make(other, method, bits, weight, device)
        alternates[other] = cast(nn.Module, made)  # not None: both GELU forms are invertible and have few-bit forms
    if method == "invact" and name in _EXACT_CALLS:
        new: _FunctionCall = _EXACT_CALLS[name]()
    elif method == "invact":
        new = _InvFunctionCall(name)
    else:
        new = _FewBitFunctionCall(name, _fewbit_bits(name, bits), weight)
    new._setup(fn, path, report, alternates)
    return new.to(device), None


@dataclass
class _Swap:
    """One recognised activation and the lowbit layer that may take its place."""

    owner: nn.Module
    key: str
    is_module: bool
    path: str
    old: Any
    new: nn.Module
    before: str
    after: str

    def install(self, value: Any) -> None:
        if isinstance(value, nn.Module):
            setattr(self.owner, self.key, value)
        else:
            # A function attribute back in place of a module registered under its name.
            self.owner._modules.pop(self.key, None)
            setattr(self.owner, self.key, value)


class _Probe(nn.Module):
    """Runs a function attribute unchanged as a module, so that what it saves is counted under its path."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``."""
        return self.fn(*args, **kwargs)


def _saves_output(activation: Any) -> bool:
    """Whether torch's backward of ``activation`` (a module, or a function called with its defaults) keeps
    the output: then the next layer, which saves its input, usually keeps the same storage."""
    saved: list[Tensor] = []

    def keep(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        # A non-leaf input, so that in-place activations run as they do inside a model.
        x = torch.linspace(-3.0, 3.0, 8, requires_grad=True) * 1.0
        y = activation(x)
    return any(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in saved)


def _check_sample(sample_args: Any, sample_kwargs: Any) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
    if sample_args is None and sample_kwargs is None:
        return None
    if sample_args is not None and not isinstance(sample_args, tuple):
        raise TypeError(f"lowbit: sample_args must be a tuple of arguments, got {type(sample_args).__name__}")
    if sample_kwargs is not None and not (
        isinstance(sample_kwargs, dict) and all(isinstance(k, str) for k in sample_kwargs)
    ):
        raise TypeError(f"lowbit: sample_kwargs must be a dict of keywords, got {type(sample_kwargs).__name__}")
    return tuple(sample_args or ()), dict(sample_kwargs or {})


def _cuda_index(t: Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _saved_on(model: nn.Module, sample: tuple[tuple[Any, ...], dict[str, Any]]) -> SavedBytes:
    """What ``model`` saves for backward on ``sample``, leaving its buffers (batch-norm running statistics)
    and the random generators (dropout) as they were: measuring must not change the model's training."""
    return _on_sample(model, sample, saved_tensor_bytes)


def _on_sample(model: nn.Module, sample: tuple[tuple[Any, ...], dict[str, Any]], run: Callable[..., Any]) -> Any:
    """``run(model, *args, **kwargs)`` with grad, leaving the buffers and random generators as they were."""
    args, kwargs = sample
    buffers = [(b, b.clone()) for b in model.buffers()]
    tensors = [*(b for b, _ in buffers), *model.parameters(), *args, *kwargs.values()]
    devices = sorted({_cuda_index(t) for t in tensors if isinstance(t, Tensor) and t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            return run(model, *args, **kwargs)
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


def compress_activations(
    model: nn.Module,
    method: str = "fewbit",
    bits: int = 3,
    weight: str = "normal",
    strict: bool = True,
    when: str = "smaller",
    sample_args: Optional[tuple[Any, ...]] = None,
    sample_kwargs: Optional[dict[str, Any]] = None,
) -> CompressionReport:
    """Replace the activations of ``model`` in place by ones that save less for backward.

    An activation is replaced only where that lowers the bytes autograd keeps (``when="smaller"``),
    counting storage that another layer saves anyway: torch's ReLU saves its output, which the next
    convolution saves as its input, so a few-bit ReLU there would add its codes and free nothing. With a
    sample input the model runs twice on it (as it is, and with every replacement) and each activation is
    judged by the bytes that only it keeps (:attr:`lowbit.memory.SavedBytes.exclusive`); the report then
    states the bytes expected after the call. Without a sample, activations whose torch backward keeps the
    output (ReLU, Sigmoid, Tanh, in-place forms) are left alone, and the others, which keep their input,
    are replaced. The sample runs leave the model's buffers and the random generators as they were.

    Args:
        model: any ``nn.Module``; its submodules are replaced, the model object itself is kept.
        method: ``"fewbit"`` (:class:`~lowbit.nn.FewBitActivation`, ``bits`` bits per element; ReLU and
            LeakyReLU take their exact 1-bit form), ``"invact"`` (:class:`~lowbit.nn.InvActivation`, the
            output plus 1 bit per element, for GELU, SiLU, Mish and quick_gelu; the output alone for ELU, CELU,
            SELU, LeakyReLU with a slope >= 0 and relu2: :class:`~lowbit.nn.InvELU` and friends) or ``"blpa"``
            (approximate activations, :mod:`lowbit.nn.blpa_convert`: each BatchNorm2d -> ReLU/ReLU6 ->
            Conv2d unit saves ``bits`` bits per element of the convolution's input, plus one for ReLU6's
            clip, instead of the BatchNorm input and the activation output; its backward is approximate,
            its forward unchanged; needs a sample to find the units).
        bits: bits per element for ``"fewbit"`` and ``"blpa"``, 1..8.
        weight: the few-bit tables' weight, ``"normal"`` or ``"uniform"``.
        strict: replace only activations whose forward stays bit-identical (default); with False
            ``"invact"`` also replaces Python-formula activations such as Hugging Face's
            ``NewGELUActivation`` by torch's function, whose outputs then differ by rounding.
        when: ``"smaller"`` (default): only where the replacement saves fewer bytes, as above;
            ``"always"``: every recognised activation.
        sample_args: positional arguments of one forward call of ``model`` (a tuple), to measure on.
        sample_kwargs: keyword arguments of that call (a dict).

    Returns:
        A :class:`CompressionReport` listing every replacement and every recognised activation left
        alone, with the reason, and with a sample the bytes saved for backward before and expected after.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"lowbit: model must be a torch.nn.Module, got {type(model).__name__}")
    if method not in METHODS:
        raise ValueError(f"lowbit: method must be one of {METHODS}, got {method!r}")
    if method == "blpa":
        blpa._check_bits(bits)
    if method == "fewbit":
        _check_bits(bits)
        if weight not in WEIGHTS:
            raise ValueError(f"lowbit: weight must be one of {WEIGHTS}, got {weight!r}")
    if when not in WHEN:
        raise ValueError(f"lowbit: when must be one of {WHEN}, got {when!r}")
    sample = _check_sample(sample_args, sample_kwargs)
    if method == "blpa" and sample is None:
        raise ValueError(
            "lowbit: method='blpa' needs sample_args or sample_kwargs: BatchNorm -> ReLU -> Conv2d units are "
            "found by running the model on them"
        )
    # The new layers' tables go where the model lives (activations themselves hold no tensors).
    device = next(iter(model.parameters()), torch.empty(0)).device
    report = CompressionReport()
    if method == "blpa":
        assert sample is not None  # checked above
        _convert_units(model, sample, bits, when, report)
        return report
    root_name, root_reason = _module_name(model, strict, method)
    if root_name is not None or root_reason is not None:
        report.skipped.append(("", "the root module cannot be replaced in place; wrap it or convert its parent"))
    swaps: list[_Swap] = []
    _walk(model, "", (method, bits, weight, device), strict, report, swaps)
    if sample is None:
        for swap in swaps:
            if when == "smaller" and _saves_output(swap.old):
                report.skipped.append((swap.path, _keeps_output_reason(swap)))
            else:
                swap.install(swap.new)
                report.replaced.append(Replacement(swap.path, swap.before, swap.after))
        return report
    _measured_swaps(model, swaps, sample, when, report)
    return report


def _keeps_output_reason(swap: _Swap) -> str:
    return (
        f"torch's backward of {swap.before} keeps its output, which the next layer usually saves as its input: "
        f"{swap.after} would add its codes and free nothing (pass sample_args to measure, or when='always')"
    )


def _measured_swaps(
    model: nn.Module,
    swaps: list[_Swap],
    sample: tuple[tuple[Any, ...], dict[str, Any]],
    when: str,
    report: CompressionReport,
) -> None:
    """Install the swaps that lower the bytes saved on ``sample`` (all of them for ``when="always"``)."""
    try:
        for swap in swaps:
            if not swap.is_module:
                swap.install(_Probe(swap.old))
        before = _saved_on(model, sample)
        for swap in swaps:
            swap.install(swap.new)
        after = _saved_on(model, sample)
    except BaseException:
        for swap in swaps:
            swap.install(swap.old)
        raise
    report.bytes_before = report.expected_bytes = before.total
    for swap in swaps:
        kept_before, kept_after = before.exclusive.get(swap.path, 0), after.exclusive.get(swap.path, 0)
        if when == "smaller" and kept_after >= kept_before:
            swap.install(swap.old)
            report.skipped.append(
                (
                    swap.path,
                    f"on the sample, {swap.before} keeps {kept_before:,} bytes for backward that no other layer "
                    f"keeps, {swap.after} would keep {kept_after:,}: no saving",
                )
            )
            continue
        report.expected_bytes -= kept_before - kept_after
        report.replaced.append(Replacement(swap.path, swap.before, swap.after, kept_before, kept_after))


def _walk(
    module: nn.Module, prefix: str, how: tuple[Any, ...], strict: bool, report: CompressionReport, swaps: list[_Swap]
) -> None:
    """Collect a swap for each recognised activation under ``module``; record the ones lowbit cannot take."""
    for attr, value in list(vars(module).items()):
        if attr.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)):
            continue
        name = _function_name(value) if callable(value) else None
        if name is None:
            continue
        path = f"{prefix}.{attr}" if prefix else attr
        new, reason = _make_call(value, name, path, report, *how)
        if new is None:
            report.skipped.append((path, reason or ""))
            continue
        after = new._describe() if isinstance(new, _FunctionCall) else repr(new)
        swaps.append(_Swap(module, attr, False, path, value, new, getattr(value, "__name__", repr(value)), after))
    for child_name, child in list(module._modules.items()):
        if child is None:
            continue
        path = f"{prefix}.{child_name}" if prefix else child_name
        exact, reason = _exact_inverse(child) if how[0] == "invact" else (None, None)
        if exact is not None:
            swaps.append(_Swap(module, child_name, True, path, child, exact, repr(child), repr(exact)))
            continue
        if reason is not None:
            report.skipped.append((path, reason))
            continue
        name, reason = _module_name(child, strict, how[0])
        if name is None:
            if reason is not None:
                report.skipped.append((path, reason))
            else:
                _walk(child, path, how, strict, report, swaps)
            continue
        new, why = _make(name, *how)
        if new is None:
            report.skipped.append((path, why or ""))
            continue
        swaps.append(_Swap(module, child_name, True, path, child, new, repr(child), repr(new)))


def _convert_units(
    model: nn.Module, sample: tuple[tuple[Any, ...], dict[str, Any]], bits: int, when: str, report: CompressionReport
) -> None:
    """Replace the BatchNorm2d -> ReLU(6) -> Conv2d units that ``model`` runs on ``sample`` by the stand-ins of
    :mod:`lowbit.nn.blpa_convert` where that lowers the bytes saved (every unit for ``when="always"``)."""
    units, left = _on_sample(model, sample, lambda m, *a, **k: blpa_convert.find_units(m, a, k))
    report.skipped += left
    # Every other activation the model holds is named too, so that none is passed over silently.
    named = {
        p
        for where in [f"{u.bn} -> {u.act} -> {u.conv}" for u in units] + [w for w, _ in left]
        for p in where.split(" -> ")
    }
    for path, m in model.named_modules():
        if path and path not in named and _module_name(m, True, "fewbit") != (None, None):
            report.skipped.append(
                (
                    path,
                    f"{type(m).__name__} is in no BatchNorm2d -> ReLU/ReLU6 -> Conv2d unit on the sample, the only "
                    "activations method='blpa' converts (compress the model with 'fewbit' or 'invact' for the rest)",
                )
            )
    modules = dict(model.named_modules())
    groups: list[tuple[blpa_convert.Unit, list[_Swap]]] = []
    for unit in units:
        swaps = []
        for path in (unit.bn, unit.act, unit.conv):
            owner, _, key = path.rpartition(".")
            old = modules[path]
            new = blpa_convert.stand_in(old, bits)
            swaps.append(_Swap(modules[owner], key, True, path, old, new, type(old).__name__, type(new).__name__))
        groups.append((unit, swaps))
    try:
        before = _saved_on(model, sample)
        for _, swaps in groups:
            for swap in swaps:
                swap.install(swap.new)
        after = _saved_on(model, sample)
    except BaseException:
        for _, swaps in groups:
            for swap in swaps:
                swap.install(swap.old)
        raise
    report.bytes_before = report.expected_bytes = before.total
    for unit, swaps in groups:
        paths = {unit.bn, unit.act, unit.conv}
        kept_before, kept_after = before.exclusive_to(paths), after.exclusive_to(paths)
        where = f"{unit.bn} -> {unit.act} -> {unit.conv}"
        was = " -> ".join(swap.before for swap in swaps)
        if when == "smaller" and kept_after >= kept_before:
            for swap in swaps:
                swap.install(swap.old)
            report.skipped.append(
                (
                    where,
                    f"on the sample, {was} keeps {kept_before:,} bytes for backward, {bits}-bit codes would keep "
                    f"{kept_after:,}: no saving",
                )
            )
            continue
        report.expected_bytes -= kept_before - kept_after
        report.replaced.append(Replacement(where, was, f"BLPA {bits}-bit unit", kept_before, kept_after))
