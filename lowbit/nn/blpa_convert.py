"""The approximate-activation scheme (approx-activations-blpa.txt) applied to existing models:
``compress_activations(model, method="blpa", bits=4, sample_args=...)``.

A model's BatchNorm2d -> ReLU / ReLU6 -> Conv2d units (modules, Hugging Face's activation wrappers
included, which are torch's classes) are found by running it once on the sample, and their three modules
replaced by stand-ins that share the original parameters and buffers. The forward pass is unchanged bit
for bit; for backward only the convolution's stand-in saves anything: the ``bits``-bit codes of the
normalised activation (section 3.2, :func:`lowbit.nn.blpa._grid`), whose side of the ReLU cut is the exact
mask, and the per-channel ``1 / std``. ReLU6's upper clip ``a2 < 6`` is one more bit per element, packed:
where it is unset the convolution's input was exactly 6, which the backward pass restores, and the gradient
there is zero. A zero ``F.pad`` between the activation and the convolution (Hugging Face's TensorFlow
"SAME" padding in MobileNetV2) is recognised and replayed on the decoded input. Under ``torch.compile`` the
stand-ins run torch's layers: the compiled model trains exactly, saving what the original saves.

How the three stand-ins cooperate: the BatchNorm stand-in normalises without recording a graph and
returns its output through :class:`_Handoff`, an autograd node that saves nothing and carries the input and
batch statistics; the activation stand-in recognises that node on its input and hands on the same way;
the convolution stand-in recognises the activation's node (through a pad node) and runs
:class:`_UnitFunction` from the block's input ``x``. Any other use of a handed-on tensor that gradients
reach raises in backward instead of dropping its gradient. Calls that do not come through the chain run
the original layers.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lowbit import _ops
from lowbit.nn.blpa import _grid, _normalize, _requested

__all__ = ["BlpaBatchNorm2d", "BlpaConv2d", "BlpaReLU", "BlpaReLU6", "find_units"]

_RELU6_TOP = 6.0  # ReLU6's upper clip


@dataclass
class _Carry:
    """What the BatchNorm stand-in hands on: the block input and the statistics that normalised it."""

    bn: nn.BatchNorm2d
    x: Tensor
    mean: Tensor
    invstd: Tensor
    span: Optional[Tensor]
    batch_stats: bool
    relu6: bool = False


class _Handoff(torch.autograd.Function):
    """Returns ``value`` as a tensor in the graph of ``anchor`` without saving anything; its node carries
    ``carry`` to the next stand-in. Its backward runs only when the value was used outside the unit."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, anchor: Tensor, carry: _Carry, stage: str, where: str) -> Tensor:
        ctx.carry, ctx.stage, ctx.where = carry, stage, where
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:
        raise RuntimeError(
            f"lowbit: the output of {ctx.where} was used outside its BatchNorm -> ReLU -> Conv2d unit; "
            "compress_activations(method='blpa') converts only units whose intermediate outputs feed nothing else"
        )


# The class of _Handoff's graph nodes, typed Any as the nodes are: ctx's attributes are theirs at run time.
_HANDOFF_NODE: Any = _Handoff._backward_cls


def _carried(t: Tensor, stage: str) -> tuple[Optional[_Carry], Any]:
    """The carry of ``t``'s handoff node of ``stage`` (and the node), or (None, None)."""
    node: Any = t.grad_fn
    if node is None or type(node) is not _HANDOFF_NODE or node.stage != stage or node.carry is None:
        return None, None
    return node.carry, node


def _needs_graph(module: nn.Module, x: Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


class BlpaBatchNorm2d(nn.BatchNorm2d):
    """A converted unit's ``nn.BatchNorm2d``: the same output, no saved tensors; see the module docstring."""

    def forward(self, input: Tensor) -> Tensor:
        """``BatchNorm2d(input)``, handed on to the unit's activation when a graph is recorded."""
        if (
            torch.compiler.is_compiling()
            or not isinstance(input, Tensor)
            or input.dim() != 4
            or input.dtype not in _ops.FLOAT_DTYPES  # the codes' kernels: fp32, fp16, bf16; others run torch's
            or not _needs_graph(self, input)
        ):
            return super().forward(input)
        with torch.no_grad():
            a2, mean, invstd, span, batch_stats = _normalize(self, input)
        # A tensor that records a graph, so that the handed-on output has a node to carry the unit on.
        anchor = next(t for t in (self.weight, self.bias, input) if t is not None and t.requires_grad)
        return _Handoff.apply(a2, anchor, _Carry(self, input, mean, invstd, span, batch_stats), "bn", "BatchNorm2d")


def _activation_forward(module: nn.Module, x: Tensor, relu6: bool) -> Optional[Tensor]:
    if torch.compiler.is_compiling() or not isinstance(x, Tensor):
        return None
    carry, node = _carried(x, "bn")
    if carry is None:
        return None
    node.carry = None  # handed on: the node keeps nothing alive
    with torch.no_grad():
        a3 = F.hardtanh(x, 0.0, _RELU6_TOP) if relu6 else F.relu(x)
    carry.relu6 = relu6
    return _Handoff.apply(a3, x, carry, "act", type(module).__name__)


class BlpaReLU(nn.ReLU):
    """A converted unit's ``nn.ReLU``: the same output, no saved tensors; see the module docstring."""

    def forward(self, input: Tensor) -> Tensor:
        """``relu(input)``; handed on when ``input`` comes from the unit's BatchNorm stand-in (never in place)."""
        out = _activation_forward(self, input, relu6=False)
        return super().forward(input) if out is None else out


class BlpaReLU6(nn.ReLU6):
    """A converted unit's ``nn.ReLU6``: the same output, no saved tensors; see the module docstring."""

    def forward(self, input: Tensor) -> Tensor:
        """``relu6(input)``; handed on when ``input`` comes from the unit's BatchNorm stand-in (never in place)."""
        out = _activation_forward(self, input, relu6=True)
        return super().forward(input) if out is None else out


def _zero_pad_of(t: Tensor) -> Optional[tuple[Any, list[int]]]:
    """(the node of the padded tensor, the pad) when ``t`` is a non-negative constant pad of a tensor whose
    padded border is zero, else None."""
    node: Any = t.grad_fn  # a node's saved attributes (_saved_pad) are not in its type
    if node is None or type(node).__name__ != "ConstantPadNdBackward0" or t.dim() != 4:
        return None
    pad = [int(p) for p in node._saved_pad]
    if len(pad) > 4 or min(pad) < 0:
        return None
    pad += [0] * (4 - len(pad))
    left, right, top, bottom = pad
    h, w = t.shape[2], t.shape[3]
    with torch.no_grad():
        border = (t[:, :, :top], t[:, :, h - bottom :], t[:, :, :, :left], t[:, :, :, w - right :])
        if any(b.numel() and bool(b.any()) for b in border):
            return None
    return node.next_functions[0][0], pad


class BlpaConv2d(nn.Conv2d):
    """A converted unit's ``nn.Conv2d``: the same output; when its input comes from the unit's activation
    stand-in it saves the ``bits``-bit codes (and ReLU6's clip bit) for the whole unit's backward."""

    bits: int

    def forward(self, input: Tensor) -> Tensor:
        """``Conv2d(input)``; the whole unit's backward from codes when ``input`` was handed on."""
        if not torch.compiler.is_compiling() and isinstance(input, Tensor):
            carry, node = _carried(input, "act")
            pad: list[int] = [0, 0, 0, 0]
            if carry is None and (padded := _zero_pad_of(input)) is not None:
                inner, pad = padded
                if type(inner) is _HANDOFF_NODE and inner.stage == "act" and inner.carry is not None:
                    carry, node = inner.carry, inner
            if carry is not None:
                node.carry = None
                bn = carry.bn
                return _UnitFunction.apply(
                    carry.x, bn.weight, bn.bias, self.weight, self.bias, (self, carry, input, pad)
                )
        return super().forward(input)

    def extra_repr(self) -> str:
        """Conv2d's, with the code width."""
        return f"{super().extra_repr()}, bits={self.bits}"  # type: ignore[no-untyped-call]  # unannotated in torch


class _UnitFunction(torch.autograd.Function):
    """BatchNorm -> ReLU(6) -> [zero pad] -> Conv2d from already normalised values; saves the codes."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, gamma: Tensor, beta: Tensor, weight: Tensor, bias: Optional[Tensor], how: tuple[Any, ...]
    ) -> Tensor:
        conv, carry, conv_input, pad = how
        out = conv._conv_forward(conv_input, weight, bias)  # the original call, on the original input
        a3 = conv_input[:, :, pad[2] : conv_input.shape[2] - pad[3], pad[0] : conv_input.shape[3] - pad[1]]
        grid = _grid(gamma, beta, conv.bits, carry.span)
        # a3 > 0 exactly where a2 > 0: the codes' side of the cut is ReLU's mask (blpa_encode reads only the sign).
        a3 = a3.contiguous()
        packed = _ops.blpa_encode(carry.x.contiguous(), a3, carry.mean, carry.invstd, grid, conv.bits)
        below = None
        if carry.relu6:
            below = _ops.pack_bits((a3 < _RELU6_TOP).to(torch.uint8).reshape(-1), 1)
        ctx.save_for_backward(packed, below, carry.invstd, gamma, beta, weight, bias, carry.span)
        ctx.shape, ctx.dtype, ctx.batch_stats, ctx.conv, ctx.pad = (
            list(a3.shape),
            a3.dtype,
            carry.batch_stats,
            conv,
            pad,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        packed, below, invstd, gamma, beta, weight, bias, span = ctx.saved_tensors
        conv, bits, pad = ctx.conv, ctx.conv.bits, ctx.pad
        # Only the gradients autograd asks for, as torch's layers do (see blpa._ApproxFunction.backward).
        need_x, need_gamma, need_beta, need_w, need_bias = ctx.needs_input_grad[:5]
        need_in = need_x or need_gamma or need_beta
        grid = _grid(gamma, beta, bits, span)
        g32, b32 = gamma.detach().float().contiguous(), beta.detach().float().contiguous()
        clipped = None
        if below is not None:
            clipped = _ops.unpack_bits(below, 1, math.prod(ctx.shape)).reshape(ctx.shape) == 0  # ReLU6 gave 6
        if need_w:
            a3 = _ops.blpa_decode(packed, grid, g32, b32, ctx.shape, bits, ctx.dtype)
            if clipped is not None:
                # In place on the fresh decoded tensor: min(a3, 6), and 6 where clipped, without two more
                # full-size tensors.
                a3 = a3.clamp_max_(_RELU6_TOP).masked_fill_(clipped, _RELU6_TOP)
            if any(pad):
                a3 = F.pad(a3, pad)
        else:  # the convolution's backward reads only its shape and layout
            n, c, h, w = ctx.shape
            a3 = grad.new_empty((n, c, h + pad[2] + pad[3], w + pad[0] + pad[1]), dtype=ctx.dtype)
        g_in, g_w, g_bias = torch.ops.aten.convolution_backward(
            grad,
            a3,
            weight,
            [weight.shape[0]] if bias is not None else None,
            conv.stride,
            conv.padding if isinstance(conv.padding, tuple) else _same_padding(conv),
            conv.dilation,
            False,
            [0, 0],
            conv.groups,
            [need_in, need_w, need_bias and bias is not None],
        )
        if not need_in:
            return None, None, None, g_w, g_bias, None
        if any(pad):
            g_in = g_in[:, :, pad[2] : g_in.shape[2] - pad[3], pad[0] : g_in.shape[3] - pad[1]]
        if clipped is not None:
            g_in = g_in.masked_fill_(clipped, 0.0)  # ReLU6 passes no gradient at its clip (g_in is fresh)
        g_x, g_gamma, g_beta = _ops.blpa_backward(
            packed, g_in.contiguous(), grid, g32, b32, invstd, bits, ctx.batch_stats
        )
        return _requested(ctx.needs_input_grad, g_x, g_gamma.to(gamma.dtype), g_beta.to(beta.dtype), g_w, g_bias)


def _same_padding(conv: nn.Conv2d) -> tuple[int, int]:
    """Conv2d's symmetric padding for ``padding="same"``/``"valid"`` (find_units admits only symmetric cases)."""
    if conv.padding == "valid":
        return (0, 0)
    return tuple(d * (k - 1) // 2 for d, k in zip(conv.dilation, conv.kernel_size, strict=True))  # type: ignore[return-value]


def _unit_conv(conv: nn.Module) -> bool:
    """Whether a convolution's backward can be replayed here: a plain zero-padded Conv2d."""
    if type(conv) is not nn.Conv2d or conv.padding_mode != "zeros":
        return False
    if conv.padding == "same":
        return all((d * (k - 1)) % 2 == 0 for d, k in zip(conv.dilation, conv.kernel_size, strict=True))
    return True


@dataclass(frozen=True)
class Unit:
    """One BatchNorm2d -> ReLU/ReLU6 -> Conv2d unit of a model, by module path."""

    bn: str
    act: str
    conv: str


def find_units(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Unit], list[tuple[str, str]]]:
    """The BN -> ReLU(6) -> Conv units that one forward call of ``model`` runs, each module called once,
    and ``(path, reason)`` of each unit left out. Runs the model once with a graph; the caller keeps its
    buffers and random state."""
    names = {m: n for n, m in model.named_modules()}
    calls: dict[str, int] = {}
    # By id: (path(s), the tensor, its version, the BatchNorm's node). Tensors are held so that ids stay
    # unique; an output modified in place afterwards (``h += residual``) is no longer the unit's value.
    bn_out: dict[int, tuple[str, Tensor, int, Any]] = {}
    act_out: dict[int, tuple[str, str, Tensor, int, Any]] = {}
    found: list[tuple[Unit, list[Any]]] = []

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        path = names[module]
        calls[path] = calls.get(path, 0) + 1
        x = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        if x is None or not isinstance(output, Tensor):
            return
        if type(module) is nn.BatchNorm2d and module.affine:
            bn_out[id(output)] = (path, output, output._version, output.grad_fn)
        elif type(module) in (nn.ReLU, nn.ReLU6):
            hit = bn_out.get(id(x))
            # An in-place activation (inplace=True) has bumped its input's version once, itself.
            if hit is not None and hit[1] is x and x._version == hit[2] + (output is x):
                act_out[id(output)] = (hit[0], path, output, output._version, hit[3])
        elif _unit_conv(module):
            source = x
            padded = _zero_pad_of(x)
            if padded is not None:
                source = next((t for _, _, t, _, _ in act_out.values() if t.grad_fn is padded[0]), x)
            act_hit = act_out.get(id(source))
            if act_hit is not None and act_hit[2] is source and source._version == act_hit[3]:
                # The nodes whose outputs only the unit may use: BatchNorm's, the activation's, the pad's.
                inner = [act_hit[4], source.grad_fn] + ([x.grad_fn] if source is not x else [])
                found.append((Unit(act_hit[0], act_hit[1], path), inner))

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        with torch.enable_grad():
            output = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    uses = _graph_uses(output)
    units, left = [], []
    for u, inner in found:
        where = f"{u.bn} -> {u.act} -> {u.conv}"
        repeated = [p for p in (u.bn, u.act, u.conv) if calls[p] != 1]
        if repeated:
            left.append((where, f"{', '.join(repeated)} called more than once"))
        elif any(uses.get(node, 0) != 1 for node in inner):
            left.append((where, "an intermediate output feeds more than the next layer of the unit"))
        else:
            units.append(u)
    return units, left


def _graph_uses(output: Any) -> dict[Any, int]:
    """How often each autograd node under ``output`` is an input of another node; an output tensor's own
    node counts as one more use (gradients may enter there)."""
    uses: dict[Any, int] = {}
    roots = [t.grad_fn for t in tree_leaves(output) if isinstance(t, Tensor) and t.grad_fn is not None]
    for node in roots:
        uses[node] = uses.get(node, 0) + 1
    seen, todo = set(roots), list(roots)
    while todo:
        for nxt, _ in todo.pop().next_functions:
            if nxt is None:
                continue
            uses[nxt] = uses.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return uses


def stand_in(module: nn.Module, bits: int) -> nn.Module:
    """The stand-in of a unit's module, sharing its parameters, buffers and hooks."""
    new = copy.copy(module)
    new.__class__ = {
        nn.BatchNorm2d: BlpaBatchNorm2d,
        nn.ReLU: BlpaReLU,
        nn.ReLU6: BlpaReLU6,
        nn.Conv2d: BlpaConv2d,
    }[type(module)]
    if isinstance(new, BlpaConv2d):
        new.bits = bits
    return new
