"""Activation layers that save less for backward: few-bit backward and inverted activations.

Few-bit backward (fewbit-backward.txt). The forward pass is torch's own activation, so outputs are
bit-identical to ``torch.nn.GELU`` and friends. For backward the layer saves only the index of the
interval of an optimal piecewise-constant approximation of f' that each input falls in, bit-packed:
exactly ``ceil(N * bits / 8)`` bytes plus the ``2**bits``-entry fp32 level table, instead of the whole
input. The backward pass multiplies the
incoming gradient by the level (section 3, eq. 2). Tables come from :func:`lowbit.nn.fewbit.table`.

Inverted activations (inverted-activations.txt). The forward pass is again torch's own; the layer saves
its output, which the next layer (a Linear) saves anyway, so autograd keeps one tensor for both, plus one
bit per element naming the monotone branch of ``f`` the input came from: ``ceil(N / 8)`` bytes on top of
the shared output. The backward pass evaluates ``f'(f^-1(y))`` by the tables of :mod:`lowbit.nn.invact`.

Exactly inverted activations. Where ``f'`` is a closed form of the output alone, the layer saves only the
output, with no branch bit, and its backward is that closed form in torch ops (CPU and CUDA alike): ELU,
``y > 0 -> 1, else y + alpha``; CELU, ``1, else y / alpha + 1``; SELU, ``scale, else y + scale * alpha``;
LeakyReLU with ``negative_slope >= 0``, ``1, else negative_slope``; relu2 (``relu(x) ** 2``),
``2 sqrt(y)``. For ELU, CELU, SELU and LeakyReLU these are the kernels torch's own ``inplace=True`` forms
run backward (``elu_backward`` and ``leaky_relu_backward`` on the result); a negative slope leaves
``y > 0`` ambiguous (both signs of ``x`` give positive ``y``), which torch's in-place LeakyReLU refuses too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowbit import _ops
from lowbit.nn import fewbit, invact
from lowbit.nn._registry import activation_fn, derivative, two_values

__all__ = [
    "FewBitActivation",
    "FewBitELU",
    "FewBitGELU",
    "FewBitHardswish",
    "FewBitLeakyReLU",
    "FewBitMish",
    "FewBitReLU",
    "FewBitSELU",
    "FewBitSiLU",
    "FewBitSigmoid",
    "FewBitSoftplus",
    "FewBitTanh",
    "InvActivation",
    "InvCELU",
    "InvELU",
    "InvGELU",
    "InvLeakyReLU",
    "InvMish",
    "InvReLUSquared",
    "InvSELU",
    "InvSiLU",
    "few_bit",
    "inv_act",
]


class _FewBitFunction(torch.autograd.Function):
    """y = f(x) by torch; saves the packed interval codes of x and the level table for backward.

    For a two-valued derivative the code is that of f'(x) itself: one boundary between the two values
    separates them exactly, however many intervals of x each value covers (ReLU6: 0, 1, 0).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, name: str, boundaries: Tensor, levels: Tensor, bits: int) -> Tensor:
        y = activation_fn(name)(x)
        coded = derivative(name)(x) if two_values(name) is not None else x
        packed = _ops.fewbit_encode(coded.contiguous(), boundaries, bits)
        ctx.save_for_backward(packed, levels)
        ctx.bits = bits
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        packed, levels = ctx.saved_tensors
        return _ops.fewbit_grad(grad.contiguous(), packed, levels, ctx.bits), None, None, None, None


def _table_tensors(name: str, bits: int, weight: str, device: torch.device) -> tuple[Tensor, Tensor]:
    t = fewbit.table(name, bits, weight)
    return t.boundaries.to(device), t.levels.to(device)


def few_bit(x: Tensor, name: str, bits: int = 3, weight: str = "normal") -> Tensor:
    """Activation ``name`` of ``x`` with a ``bits``-bit backward pass (see the module docstring).

    Args:
        x: fp32, fp16 or bf16 input of any shape, on CPU or CUDA.
        name: one of :data:`lowbit.nn.fewbit.ACTIVATIONS` (torch's default parameters).
        bits: bits saved per element, 1..8 (``relu`` and ``leaky_relu``: 1 only, where they are exact).
        weight: the table's weight, ``"normal"`` (default) or ``"uniform"`` on [-10, 10].
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"lowbit: x must be a torch.Tensor, got {type(x).__name__}")
    boundaries, levels = _table_tensors(name, bits, weight, x.device)
    return _FewBitFunction.apply(x, name, boundaries, levels, bits)


def _check_layer_input(layer: nn.Module, x: object, table: Tensor) -> None:
    """x must be a tensor on the device of the layer's tables."""
    if not isinstance(x, Tensor):
        raise TypeError(f"lowbit: x must be a torch.Tensor, got {type(x).__name__}")
    if x.device != table.device:
        raise ValueError(
            f"lowbit: x is on {x.device} but {type(layer).__name__}'s tables are on {table.device}; "
            "move the module with .to(device)"
        )


_T = TypeVar("_T", bound="_TableLayer")


class _TableLayer(nn.Module):
    """A layer whose only tensors are fp32 lookup tables fixed by its configuration.

    The tables are non-persistent buffers, so ``.to(device)`` moves them and ``torch.compile`` sees them
    as module state, but they are constants, not data: they are created on the default device (meta
    under ``torch.device("meta")``) and re-derived after every ``_apply``, because ``to_empty`` leaves
    them uninitialised and ``half()``/``double()`` would cast them to a dtype the kernels reject.
    """

    def _table_values(self) -> dict[str, Tensor]:
        """The tables as CPU fp32 tensors, by buffer name."""
        raise NotImplementedError

    def _fill_tables(self, device: Optional[torch.device] = None) -> None:
        for key, value in self._table_values().items():
            where = device if device is not None else self._buffers[key].device  # type: ignore[union-attr]
            self.register_buffer(key, value.to(where, copy=True), persistent=False)

    def _apply(self: _T, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _T:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # unannotated in torch
        self._fill_tables()
        return self

    def reset_parameters(self) -> None:
        """Re-derives the lookup tables on their device; the layer has no parameters.

        ``to_empty`` already does this, so it is only needed by code that calls ``reset_parameters`` on
        every module holding tensors (FSDP's meta-device initialisation).
        """
        self._fill_tables()


class FewBitActivation(_TableLayer):
    """Activation ``name`` whose backward pass saves ``bits`` bits per element.

    The level tables are non-persistent fp32 buffers (not in the state dict); they follow ``.to(device)``,
    keep fp32 under ``.half()``/``.double()``, and are rebuilt by ``to_empty`` (meta-device initialisation).

    Args:
        name: one of :data:`lowbit.nn.fewbit.ACTIVATIONS` (torch's default parameters).
        bits: bits saved per element, 1..8 (``relu`` and ``leaky_relu``: 1 only, where they are exact).
        weight: the table's weight, ``"normal"`` (default) or ``"uniform"`` on [-10, 10].
    """

    boundaries: Tensor
    levels: Tensor

    def __init__(self, name: str, bits: int = 3, weight: str = "normal") -> None:
        super().__init__()
        self.name, self.bits, self.weight = name, bits, weight
        self._fill_tables(torch.get_default_device())

    def _table_values(self) -> dict[str, Tensor]:
        boundaries, levels = _table_tensors(self.name, self.bits, self.weight, torch.device("cpu"))
        return {"boundaries": boundaries, "levels": levels}

    def forward(self, x: Tensor) -> Tensor:
        """The activation of ``x``; the tables follow the module's device."""
        return self._activation(x, inplace=False)

    def _activation(self, x: Tensor, inplace: bool) -> Tensor:
        _check_layer_input(self, x, self.levels)
        y = _FewBitFunction.apply(x, self.name, self.boundaries, self.levels, self.bits)
        # The backward needs only the codes, so x may be overwritten; copy_'s backward routes the gradient to y.
        return x.copy_(y) if inplace else y

    def extra_repr(self) -> str:
        """Name, bits and weight."""
        return f"{self.name!r}, bits={self.bits}, weight={self.weight!r}"


def _gelu_name(approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"lowbit: approximate must be 'none' or 'tanh', got {approximate!r}")
    return "gelu" if approximate == "none" else "gelu_tanh"


class _OneFewBitActivation(FewBitActivation):
    """A :class:`FewBitActivation` of the one activation its subclass names in its class statement
    (``class FewBitSiLU(_OneFewBitActivation, activation="silu")``), built from ``bits`` and ``weight``."""

    _activation_name: ClassVar[str]

    def __init_subclass__(cls, activation: Optional[str] = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass of a named layer (class MySiLU(FewBitSiLU)) keeps its parent's activation.
        if activation is not None:
            cls._activation_name = activation

    def __init__(self, bits: int = 3, weight: str = "normal") -> None:
        super().__init__(self._activation_name, bits, weight)


class FewBitGELU(FewBitActivation):
    """torch.nn.GELU(approximate) with a few-bit backward pass."""

    def __init__(self, bits: int = 3, weight: str = "normal", approximate: str = "none") -> None:
        super().__init__(_gelu_name(approximate), bits, weight)


class FewBitSiLU(_OneFewBitActivation, activation="silu"):
    """torch.nn.SiLU() with a few-bit backward pass."""


class FewBitSigmoid(_OneFewBitActivation, activation="sigmoid"):
    """torch.nn.Sigmoid() with a few-bit backward pass."""


class FewBitTanh(_OneFewBitActivation, activation="tanh"):
    """torch.nn.Tanh() with a few-bit backward pass."""


class FewBitSELU(_OneFewBitActivation, activation="selu"):
    """torch.nn.SELU() with a few-bit backward pass."""


class FewBitELU(_OneFewBitActivation, activation="elu"):
    """torch.nn.ELU() with a few-bit backward pass."""


class FewBitSoftplus(_OneFewBitActivation, activation="softplus"):
    """torch.nn.Softplus() with a few-bit backward pass."""


class FewBitMish(_OneFewBitActivation, activation="mish"):
    """torch.nn.Mish() with a few-bit backward pass."""


class FewBitHardswish(_OneFewBitActivation, activation="hardswish"):
    """torch.nn.Hardswish() with a few-bit backward pass."""


class FewBitLeakyReLU(_OneFewBitActivation, activation="leaky_relu"):
    """torch.nn.LeakyReLU() (slope 0.01) with a few-bit backward pass; exact at 1 bit."""

    def __init__(self, bits: int = 1, weight: str = "normal") -> None:
        super().__init__(bits, weight)


class FewBitReLU(_OneFewBitActivation, activation="relu"):
    """torch.nn.ReLU() with a few-bit backward pass; exact at 1 bit."""

    def __init__(self, bits: int = 1, weight: str = "normal") -> None:
        super().__init__(bits, weight)


class _InvActFunction(torch.autograd.Function):
    """y = f(x) by torch; saves y and the packed branch bits (x > T) for backward."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, name: str, threshold: Tensor, coeffs: Tensor, params: Tensor, scale: float
    ) -> Tensor:
        y = activation_fn(name)(x)
        bits = _ops.fewbit_encode(x.contiguous(), threshold, 1)
        ctx.save_for_backward(y, bits)
        # The tables are constants shared by every call, kept by reference rather than saved: what the
        # layer saves is exactly y and ceil(N / 8) bytes of bits.
        ctx.coeffs, ctx.params, ctx.scale = coeffs, params, scale
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        y, bits = ctx.saved_tensors
        # f(x) = g(a x) / a (invact.SCALED): g's table reads g's output, a y.
        g_of_ax = y.contiguous() if ctx.scale == 1.0 else y * ctx.scale
        dx = _ops.invact_grad(grad.contiguous(), g_of_ax, bits, ctx.coeffs, ctx.params)
        return dx, None, None, None, None, None


class _InvActInPlaceFunction(torch.autograd.Function):
    """:class:`_InvActFunction` writing y into x, as torch's ``inplace=True``: x is returned and saved as
    the output, so a next layer that saves its input shares the storage, as with the out-of-place form."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, name: str, threshold: Tensor, coeffs: Tensor, params: Tensor, scale: float
    ) -> Tensor:
        bits = _ops.fewbit_encode(x.contiguous(), threshold, 1)
        x.copy_(activation_fn(name)(x))
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, bits)
        ctx.coeffs, ctx.params, ctx.scale = coeffs, params, scale
        return x

    backward = _InvActFunction.backward


def _invact_tensors(name: str, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    base, scale = invact.inverted(name)
    t = invact.table(base)
    # The branch of f(x) = g(a x) / a is that of g at a x: x > T_g / a.
    return (t.threshold_tensor / scale).to(device), t.coeffs.to(device), t.params.to(device)


def inv_act(x: Tensor, name: str) -> Tensor:
    """Activation ``name`` of ``x`` with an inverted-activation backward pass (see the module docstring).

    Saves the output (shared with the next layer when that saves its input) and ``ceil(N / 8)`` bytes.

    Args:
        x: fp32, fp16 or bf16 input of any shape, on CPU or CUDA.
        name: one of :data:`lowbit.nn.invact.INVERTIBLE` (``gelu``, ``gelu_tanh``, ``silu``, ``mish``,
            ``quick_gelu``).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"lowbit: x must be a torch.Tensor, got {type(x).__name__}")
    return _InvActFunction.apply(x, name, *_invact_tensors(name, x.device), invact.inverted(name)[1])


class InvActivation(_TableLayer):
    """Activation ``name`` that saves its output and 1 bit per element for backward.

    The coefficient tables are non-persistent fp32 buffers (not in the state dict); they follow
    ``.to(device)``, keep fp32 under ``.half()``/``.double()``, and are rebuilt by ``to_empty``.

    Args:
        name: one of :data:`lowbit.nn.invact.INVERTIBLE` (``gelu``, ``gelu_tanh``, ``silu``, ``mish``,
            ``quick_gelu``).
    """

    threshold: Tensor
    coeffs: Tensor
    params: Tensor

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.scale = invact.inverted(name)[1]
        self._fill_tables(torch.get_default_device())

    def _table_values(self) -> dict[str, Tensor]:
        threshold, coeffs, params = _invact_tensors(self.name, torch.device("cpu"))
        return {"threshold": threshold, "coeffs": coeffs, "params": params}

    def forward(self, x: Tensor) -> Tensor:
        """The activation of ``x``; the tables follow the module's device."""
        return self._activation(x, inplace=False)

    def _activation(self, x: Tensor, inplace: bool) -> Tensor:
        _check_layer_input(self, x, self.coeffs)
        fn: type[torch.autograd.Function] = _InvActInPlaceFunction if inplace else _InvActFunction
        return fn.apply(x, self.name, self.threshold, self.coeffs, self.params, self.scale)

    def extra_repr(self) -> str:
        """The activation's name."""
        return repr(self.name)


class InvGELU(InvActivation):
    """torch.nn.GELU(approximate) with an inverted-activation backward pass."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__(_gelu_name(approximate))


class InvSiLU(InvActivation):
    """torch.nn.SiLU() with an inverted-activation backward pass."""

    def __init__(self) -> None:
        super().__init__("silu")


class InvMish(InvActivation):
    """torch.nn.Mish() with an inverted-activation backward pass."""

    def __init__(self) -> None:
        super().__init__("mish")


# torch's SELU constants (aten/src/ATen/native/Activation.cpp, SELU_ALPHA and SELU_SCALE): torch's SELU is
# elu(x, alpha=SELU_ALPHA, scale=SELU_SCALE), so its backward from the output needs them.
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _exact_forward(kind: str, x: Tensor, p: float) -> Tensor:
    """Torch's own forward of activation ``kind`` with parameter ``p`` (alpha or negative_slope)."""
    if kind == "elu":
        return F.elu(x, p)
    if kind == "celu":
        return F.celu(x, p)
    if kind == "selu":
        return F.selu(x)
    if kind == "leaky_relu":
        return F.leaky_relu(x, p)
    # transformers' ReLUSquaredActivation, its own two ops, so the output is bit-identical.
    return torch.square(F.relu(x))


def _exact_grad(kind: str, grad: Tensor, y: Tensor, p: float) -> Tensor:
    """``grad * f'(x)`` from ``y = f(x)`` alone (see the module docstring)."""
    # elu_backward(grad, alpha, scale, input_scale, is_result=True, y): y <= 0 -> grad * input_scale *
    # (y + alpha * scale), else grad * scale.
    if kind == "elu":
        return torch.ops.aten.elu_backward(grad, p, 1.0, 1.0, True, y)
    if kind == "celu":  # celu(x, a) = elu(x, a, input_scale=1/a): (y + a) / a = y / a + 1
        return torch.ops.aten.elu_backward(grad, p, 1.0, 1.0 / p, True, y)
    if kind == "selu":
        return torch.ops.aten.elu_backward(grad, _SELU_ALPHA, _SELU_SCALE, 1.0, True, y)
    if kind == "leaky_relu":  # y > 0 -> grad, else grad * slope: exact for a slope >= 0
        return torch.ops.aten.leaky_relu_backward(grad, y, p, True)
    # relu(x) ** 2: 2 relu(x) = 2 sqrt(y); 0 where y <= 0 (threshold_backward, as torch's ReLU backward). In
    # place on the fresh sqrt: one buffer fewer, the same roundings as grad * (2 * sqrt(y)).
    return torch.ops.aten.threshold_backward(y.sqrt().mul_(2).mul_(grad), y, 0)


class _ExactInvFunction(torch.autograd.Function):
    """y = f(x) by torch; saves y alone, from which the backward computes f'(x) exactly."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, kind: str, p: float) -> Tensor:
        y = _exact_forward(kind, x, p)
        ctx.save_for_backward(y)
        ctx.kind, ctx.p = kind, p
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        (y,) = ctx.saved_tensors
        return _exact_grad(ctx.kind, grad, y, ctx.p), None, None


def _check_alpha(value: object, zero: bool) -> float:
    """alpha as a float: > 0, or >= 0 where ``zero`` (ELU's alpha = 0 is ReLU; a negative alpha makes the
    negative branch's output positive, so the output no longer names the branch, as torch's in-place ELU says)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
        raise ValueError(f"lowbit: alpha must be a number {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


class _ExactInvActivation(nn.Module):
    """An activation whose backward reads only its output (see the module docstring); no tensors of its own.

    ``inplace=True`` runs torch's in-place function, whose backward already reads the output: it is torch's
    own inverted form, so the layer adds nothing to it.
    """

    kind: ClassVar[str]

    def __init__(self, p: float = 0.0, inplace: bool = False) -> None:
        super().__init__()
        self.p, self.inplace = p, inplace

    @property
    def name(self) -> str:
        """The activation: ``elu``, ``celu``, ``selu``, ``leaky_relu`` or ``relu2``."""
        return self.kind

    def forward(self, x: Tensor) -> Tensor:
        """The activation of ``x``, torch's own, bit for bit."""
        return self._activation(x, self.inplace)

    def _activation(self, x: Tensor, inplace: bool) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"lowbit: x must be a torch.Tensor, got {type(x).__name__}")
        if inplace:
            return self._inplace(x)
        return _ExactInvFunction.apply(x, self.kind, self.p)

    def _inplace(self, x: Tensor) -> Tensor:
        raise NotImplementedError


class _AlphaExactInv(_ExactInvActivation):
    """ELU and CELU: one parameter, ``alpha``, and torch's in-place function of it."""

    _inplace_fn: ClassVar[Callable[..., Tensor]]

    @property
    def alpha(self) -> float:
        """torch.nn.ELU's or torch.nn.CELU's ``alpha``."""
        return self.p

    def _inplace(self, x: Tensor) -> Tensor:
        return type(self)._inplace_fn(x, self.p, inplace=True)

    def extra_repr(self) -> str:
        """As torch.nn.ELU's and torch.nn.CELU's."""
        return f"alpha={self.p}" + (", inplace=True" if self.inplace else "")


class InvELU(_AlphaExactInv):
    """torch.nn.ELU(alpha, inplace) whose backward reads only the output: ``y > 0 -> 1, else y + alpha``.

    Args:
        alpha: the negative branch's saturation, >= 0 (where the output names the branch).
        inplace: run torch's in-place ELU, which already saves only its output.
    """

    kind = "elu"
    _inplace_fn = F.elu

    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        super().__init__(_check_alpha(alpha, zero=True), inplace)


class InvCELU(_AlphaExactInv):
    """torch.nn.CELU(alpha, inplace) whose backward reads only the output: ``y > 0 -> 1, else y / alpha + 1``.

    Args:
        alpha: the negative branch's saturation, > 0 (torch refuses 0 too).
        inplace: run torch's in-place CELU, which already saves only its output.
    """

    kind = "celu"
    _inplace_fn = F.celu

    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        super().__init__(_check_alpha(alpha, zero=False), inplace)


class InvSELU(_ExactInvActivation):
    """torch.nn.SELU(inplace) whose backward reads only the output: ``y > 0 -> scale, else y + scale * alpha``.

    Args:
        inplace: run torch's in-place SELU, which already saves only its output.
    """

    kind = "selu"

    def __init__(self, inplace: bool = False) -> None:
        super().__init__(0.0, inplace)

    def _inplace(self, x: Tensor) -> Tensor:
        return F.selu(x, inplace=True)

    def extra_repr(self) -> str:
        """As torch.nn.SELU's."""
        return "inplace=True" if self.inplace else ""


class InvLeakyReLU(_ExactInvActivation):
    """torch.nn.LeakyReLU(negative_slope, inplace) whose backward reads only the output:
    ``y > 0 -> 1, else negative_slope``.

    Args:
        negative_slope: the slope for x < 0, >= 0. A negative slope makes ``y > 0`` hold on both sides of 0, so
            the output no longer names the branch: use :class:`FewBitActivation`'s exact 1-bit form
            (``compress_activations(method="fewbit")``), which saves only that bit.
        inplace: run torch's in-place LeakyReLU, which already saves only its output.
    """

    kind = "leaky_relu"

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        s = negative_slope
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0:
            raise ValueError(
                f"lowbit: negative_slope must be a number >= 0, got {s!r} (a negative slope needs the sign bit "
                "of x: FewBitActivation's exact 1-bit form saves only that)"
            )
        super().__init__(float(s), inplace)

    @property
    def negative_slope(self) -> float:
        """torch.nn.LeakyReLU's ``negative_slope``."""
        return self.p

    def _inplace(self, x: Tensor) -> Tensor:
        return F.leaky_relu(x, self.p, inplace=True)

    def extra_repr(self) -> str:
        """As torch.nn.LeakyReLU's."""
        return f"negative_slope={self.p}" + (", inplace=True" if self.inplace else "")


class InvReLUSquared(_ExactInvActivation):
    """transformers' ReLUSquaredActivation (``relu2``, ``relu(x) ** 2``) whose backward reads only the output:
    ``2 sqrt(y)``. No ``inplace``: the module has none. Exact wherever ``y`` is a normal number (sqrt of a
    correctly rounded square returns the root); where ``relu(x) ** 2`` overflows the forward is already inf.
    """

    kind = "relu2"

    def __init__(self) -> None:
        super().__init__()
