"""Muon (Jordan et al. 2024; ``torch.optim.Muon``) with its momentum buffer in 8-bit block-wise codes or fp32.

Each step runs, per parameter, the fused native momentum step (``lowbit::muon_momentum_``: the buffer
decoded, updated, requantized, and the Nesterov-blended update written as fp32, so no fp32 buffer
outlives the step), then torch's Newton-Schulz orthogonalisation of that update (matmuls, compute rather
than memory), then ``p.mul_(1 - lr * weight_decay)`` and ``p.add_(O, alpha=-adjusted_lr)``, exactly as
``torch.optim.Muon`` orders them.

The 8-bit buffer uses the signed dynamic map, chosen by measurement over the linear map
(``benchmarks/bench_muon_map.py``: the README's Muon numerics). State: ``momentum_buffer`` (torch's name,
stored as ``state1``/``absmax1``) and ``step``.

FSDP2: Newton-Schulz orthogonalises the whole matrix, which a shard does not hold. A sharded DTensor
parameter makes ``step()`` raise (and change nothing); replicated DTensors are stepped whole. Keep the
Muon matrices out of ``fully_shard`` (its ``ignored_params``), or use DDP for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lowbit import _ops
from lowbit.functional import QuantState, create_dynamic_map, dequantize_blockwise
from lowbit.optim.optimizer import LowbitOptimizer, Params
from lowbit.optim.optimizers import AdamW
from lowbit.optim.state_storage import quantize_state, stored_block_size

__all__ = ["Muon", "adjust_lr", "muon_with_adamw", "zeropower_via_newtonschulz"]

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

_MAPS: dict[torch.device, Tensor] = {}


def _dynamic_map(device: torch.device) -> Tensor:
    if device not in _MAPS:
        _MAPS[device] = create_dynamic_map(signed=True).to(device)
    return _MAPS[device]


def zeropower_via_newtonschulz(
    update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration in bf16, op for op (so results are torch's): the
    update scaled to spectral norm <= 1, then ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on the
    wide orientation of the matrix."""
    a, b, c = ns_coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def adjust_lr(lr: float, adjust_lr_fn: Optional[str], shape: torch.Size) -> float:
    """torch.optim.Muon's learning rate for a matrix of ``shape``: ``lr * sqrt(max(1, A/B))`` ("original",
    the default) or ``0.2 * lr * sqrt(max(A, B))`` ("match_rms_adamw", Liu et al. 2025)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def _is_coefficients(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    )


class Muon(LowbitOptimizer):
    """Muon: momentum, orthogonalised by Newton-Schulz, for the 2-D hidden matrices of a network; a drop-in
    for ``torch.optim.Muon`` with the same arguments, defaults and errors.

    Args:
        params: 2-D parameters or param groups (others raise ValueError, as in torch). Embeddings, the
            head and 1-D parameters belong to another optimizer: :func:`lowbit.optim.muon_with_adamw`
            builds both from one model.
        lr: learning rate, adjusted per matrix shape by ``adjust_lr_fn``.
        weight_decay: decoupled: ``p *= 1 - lr * weight_decay`` before the update.
        momentum: the buffer's EMA coefficient: ``buf.lerp_(grad, 1 - momentum)``.
        nesterov: orthogonalise ``grad.lerp(buf, momentum)`` instead of ``buf``.
        ns_coefficients: (a, b, c) of the quintic Newton-Schulz iteration.
        eps: floor of the norm the update is divided by before the iteration.
        ns_steps: Newton-Schulz iterations, below 100 (torch refuses more at the first step; lowbit
            refuses them when given, so that no step ever fails halfway).
        adjust_lr_fn: None or "original" (``lr * sqrt(max(1, rows/cols))``), or "match_rms_adamw"
            (``0.2 * lr * sqrt(max(rows, cols))``).
        optim_bits: 8 for the 8-bit block-wise buffer (1 + 4/block_size bytes per parameter), 32 for fp32.
        block_size: elements per quantization block of the 8-bit buffer.
        min_8bit_size: matrices with fewer elements keep an fp32 buffer.
    """

    _state_names = ("momentum_buffer",)
    _state_signed = (True,)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
        *,
        optim_bits: int = 32,
        block_size: int = 256,
        min_8bit_size: int = 4096,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults, optim_bits=optim_bits, block_size=block_size, min_8bit_size=min_8bit_size)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's ``add_param_group``; refuses a group holding a parameter that is not 2-D."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.ndim != 2:
                self.param_groups.pop()
                raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}")

    def _check_config(self, config: dict[str, Any], where: str) -> None:
        super()._check_config(config, where)
        if config["optim_bits"] == 4:
            raise ValueError(f"lowbit: {where}: Muon keeps its momentum in 8 or 32 bits; optim_bits=4 is not supported")
        if config.get("rounding", "nearest") != "nearest":
            raise ValueError(
                f"lowbit: {where}: Muon's momentum rounds to nearest; rounding={config['rounding']!r} is not supported"
            )
        if config["adjust_lr_fn"] not in ADJUST_LR_FNS:
            fn = config["adjust_lr_fn"]
            raise ValueError(f"lowbit: {where}: Adjust learning rate function {fn} is not supported")
        if not _is_coefficients(config["ns_coefficients"]):
            raise ValueError(
                f"lowbit: {where}: ns_coefficients must be a tuple of exactly 3 finite numbers, "
                f"got {config['ns_coefficients']!r}"
            )
        steps = config["ns_steps"]
        if not (isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps < 100):
            raise ValueError(f"lowbit: {where}: ns_steps must be an int in 0..99, got {steps!r}")
        for name, default in (("max_unorm", 0.0), ("percentile_clipping", 100)):
            if config[name] != default:
                raise ValueError(f"lowbit: {where}: Muon does not take {name} (got {config[name]!r})")

    def _momentum_map(self, device: torch.device) -> Tensor:
        """The map of the 8-bit buffer's codes."""
        return _dynamic_map(device)

    def _pack(self, k: int, value: Tensor, config: dict[str, Any], width: int) -> tuple[Tensor, Tensor]:
        if width != 8:
            return super()._pack(k, value, config, width)
        return quantize_state(value, self._momentum_map(value.device), 8, config["block_size"])

    def _unpack(self, k: int, p: Tensor, state: dict[str, Any]) -> Tensor:
        s = _ops.local(state[f"state{k + 1}"])
        if s.dtype != torch.uint8:
            return s
        absmax = state[f"absmax{k + 1}"]
        block = stored_block_size(s.numel(), absmax.numel())
        code = self._momentum_map(s.device)
        return dequantize_blockwise(s, QuantState(absmax, code, block, s.shape, torch.float32, 8))

    def _prepare_step(
        self,
        config: dict[str, Any],
        batch: list[tuple[Tensor, dict[str, Any]]],
        places: list[str],
        positions: list[int],
    ) -> Callable[[], None]:
        """Checks every parameter of ``batch``, then returns the step: for each, the fused momentum step,
        Newton-Schulz, decay and update, in torch.optim.Muon's order. ``positions`` (the draws of stochastic
        rounding) go unused: Muon's momentum rounds to nearest."""
        name = type(self).__name__
        lr, momentum, block_size = config["lr"], config["momentum"], config["block_size"]
        work = []
        for (p, state), where in zip(batch, places, strict=True):
            if isinstance(p, DTensor) and not all(isinstance(pl, Replicate) for pl in p.placements):
                raise NotImplementedError(
                    f"lowbit: {name} {where} is sharded ({p.placements}); Newton-Schulz orthogonalises the "
                    "whole matrix, which a shard does not hold. Keep Muon's matrices out of fully_shard "
                    "(ignored_params) or replicate them, and shard the rest"
                )
            if torch.is_complex(p):
                raise RuntimeError(f"lowbit: {name} does not support complex parameters ({where})")
            shard, grad = _ops.local(p), _ops.local(cast(Tensor, p.grad))  # a batch holds stepped params
            if grad.ndim != 2:
                raise ValueError(f"lowbit: {name} {where}: Param gradient must be a 2D matrix")
            grad = grad.to(shard.dtype).contiguous()
            buf, absmax = _ops.local(state["state1"]), state["absmax1"]
            code = self._momentum_map(shard.device)
            update = torch.empty(shard.shape, dtype=torch.float32, device=shard.device)
            try:
                _ops.check_muon_momentum(grad, buf, absmax, code, update, momentum, block_size)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"lowbit: {name} {where}: {str(exc).removeprefix('lowbit: ')}") from exc
            work.append((p, shard, state, grad, buf, absmax, code, update))
        decay = 1 - lr * config["weight_decay"]

        def run() -> None:
            for p, shard, state, grad, buf, absmax, code, update in work:
                _ops.muon_momentum_(grad, buf, absmax, code, update, momentum, config["nesterov"], block_size)
                ortho = zeropower_via_newtonschulz(update, config["ns_coefficients"], config["ns_steps"], config["eps"])
                shard.mul_(decay)
                shard.add_(ortho, alpha=-adjust_lr(lr, config["adjust_lr_fn"], p.shape))
                state["step"] += 1

        return run


def muon_with_adamw(
    model: nn.Module,
    *,
    optim_bits: int = 8,
    head: Optional[Iterable[str]] = None,
    muon: Optional[dict[str, Any]] = None,
    adamw: Optional[dict[str, Any]] = None,
) -> tuple[Muon, AdamW]:
    """Muon's usual recipe from one model: Muon for the hidden matrices, AdamW for the rest.

    The weights of ``nn.Linear`` modules go to :class:`Muon`, except the head's; embeddings
    (``nn.Embedding``, and any weight tied to one), the head, 1-D parameters (biases, norms) and
    parameters of other shapes go to :class:`~lowbit.optim.AdamW`. Both keep ``optim_bits``-bit states
    (8: ``Muon8bit`` + ``AdamW8bit``). Step both, every step::

        opt_muon, opt_adamw = lowbit.optim.muon_with_adamw(model, muon=dict(lr=0.02), adamw=dict(lr=3e-4))
        loss.backward(); opt_muon.step(); opt_adamw.step()
        opt_muon.zero_grad(); opt_adamw.zero_grad()

    Args:
        model: the model; each parameter is assigned once, in ``named_parameters()`` order.
        optim_bits: 8 or 32, for both optimizers.
        head: names of the output modules (``model.named_modules()`` names) kept off Muon; default:
            the last ``nn.Linear`` of ``model.modules()``.
        muon: keyword arguments of :class:`Muon` (lr, weight_decay, momentum, ...).
        adamw: keyword arguments of :class:`~lowbit.optim.AdamW`.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = set(head) if head is not None else {linears[-1][0]} if linears else set()
    unknown = heads - {name for name, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"lowbit: muon_with_adamw: head names no module of the model: {sorted(unknown)}")
    off_muon = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    off_muon |= {id(p) for name in heads for p in model.get_submodule(name).parameters()}
    hidden = {id(m.weight) for _, m in linears if m.weight.ndim == 2} - off_muon
    params = list(dict.fromkeys(model.parameters()))  # tied parameters once
    muon_params = [p for p in params if id(p) in hidden]
    rest = [p for p in params if id(p) not in hidden]
    return (
        Muon(muon_params, **(muon or {}), optim_bits=optim_bits),
        AdamW(rest, **(adamw or {}), optim_bits=optim_bits),
    )
