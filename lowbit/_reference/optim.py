"""Pure-PyTorch twins of the optimizer steps: the fused 8-/32-bit step and the LPMM step
(include/lowbit/optim_rules.h, state_form.h; lpmm.txt Algorithm 1)."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
from torch import Tensor

from lowbit._ops.lpmm import LpmmStepArgs, counter_offsets
from lowbit._ops.optim import StepArgs, StepHyper, rank1_layouts
from lowbit._reference.lanes import lane_sum
from lowbit._reference.quantize import (
    _load,
    _mix64_int,
    _normalise,
    _sqrt32,
    _store,
    dequantize_blockwise,
    dequantize_linear,
    map_codes,
    quantize_blockwise,
    quantize_linear,
)

# Optimizer rules (include/lowbit/optim_rules.h), elementwise in fp32: each torch op rounds once, as
# each C++ operation does, so results agree bit for bit when no norm mode is used.
_RULE_ADAM, _RULE_SGD, _RULE_LION, _RULE_RMSPROP, _RULE_ADAGRAD, _RULE_LAMB, _RULE_AMSGRAD, _RULE_CENTERED = range(8)
_RULE_ADEMAMIX = 8
_DECOUPLED, _NESTEROV, _MAXIMIZE = 1, 2, 4
_NORM_GRAD = 3
# include/lowbit/norm_order.h: kSquareLanes and kBlockSumLanes (tests/test_native_constants.py checks the copies).
_SQUARE_LANES, _BLOCK_SUM_LANES = 8, 32


def _torch_lerp(m: Tensor, g: Tensor, w: float) -> Tensor:
    """optim_rules.h's torch_lerp: ATen's lerp formula, which switches form at |w| = 0.5."""
    f32 = torch.float32
    if abs(float(torch.tensor(w, dtype=f32))) < 0.5:
        return m + torch.tensor(w, dtype=f32) * (g - m)
    return g + (torch.tensor(w, dtype=f32) - 1.0) * (g - m)


def _rule_step(
    rule: int,
    h: StepHyper,
    flags: int,
    sc: Tensor,
    p: Tensor,
    g: Tensor,
    s1: Tensor,
    s2: Tensor,
    s3: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """(u, s1, s2) of optim_rules.h: the step subtracted from p and the updated states; (u, s1, s2, s3)
    when ``s3`` is given."""
    if s3 is not None:
        return _rule_step3(rule, h, flags, sc, p, g, s1, s2, s3)
    lr, b1, b2, eps, wd = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay
    omb1, omb2 = h.one_minus_beta1, h.one_minus_beta2
    step_size, bias2_sqrt, first = float(sc[0]), float(sc[1]), bool(sc[2])
    f32 = torch.float32
    if rule in (_RULE_ADAM, _RULE_LAMB):
        if rule == _RULE_ADAM and wd != 0 and not flags & _DECOUPLED:
            g = g + torch.tensor(wd, dtype=f32) * p
        s1 = _torch_lerp(s1, g, omb1)
        s2 = s2 * torch.tensor(b2, dtype=f32) + torch.tensor(omb2, dtype=f32) * g * g
        if rule == _RULE_ADAM:
            denom = _sqrt32(s2) / torch.tensor(bias2_sqrt, dtype=f32) + torch.tensor(eps, dtype=f32)
            return torch.tensor(step_size, dtype=f32) * s1 / denom, s1, s2
        denom = _sqrt32(s2) / torch.tensor(bias2_sqrt, dtype=f32) + torch.tensor(eps, dtype=f32)
        r = (s1 * torch.tensor(step_size, dtype=f32)) / denom + torch.tensor(wd, dtype=f32) * p
        return torch.tensor(lr, dtype=f32) * r, s1, s2
    if rule == _RULE_SGD:
        if wd != 0:
            g = g + torch.tensor(wd, dtype=f32) * p
        if b1 != 0:
            s1 = g if first else s1 * torch.tensor(b1, dtype=f32) + torch.tensor(omb1, dtype=f32) * g
            g = g + torch.tensor(b1, dtype=f32) * s1 if flags & _NESTEROV else s1
        return torch.tensor(lr, dtype=f32) * g, s1, s2
    if rule == _RULE_LION:
        c = torch.tensor(b1, dtype=f32) * s1 + torch.tensor(omb1, dtype=f32) * g
        s1 = torch.tensor(b2, dtype=f32) * s1 + torch.tensor(omb2, dtype=f32) * g
        return torch.tensor(lr, dtype=f32) * torch.sign(c), s1, s2
    if rule == _RULE_RMSPROP:
        if wd != 0:
            g = g + torch.tensor(wd, dtype=f32) * p
        s1 = s1 * torch.tensor(b2, dtype=f32) + torch.tensor(omb2, dtype=f32) * g * g
        avg = _sqrt32(s1) + torch.tensor(eps, dtype=f32)
        if b1 > 0:
            s2 = s2 * torch.tensor(b1, dtype=f32) + g / avg
            return torch.tensor(lr, dtype=f32) * s2, s1, s2
        return torch.tensor(lr, dtype=f32) * g / avg, s1, s2
    if wd != 0:  # Adagrad
        g = g + torch.tensor(wd, dtype=f32) * p
    s1 = s1 + g * g
    return torch.tensor(step_size, dtype=f32) * g / (_sqrt32(s1) + torch.tensor(eps, dtype=f32)), s1, s2


def _rule_step3(
    rule: int, h: StepHyper, flags: int, sc: Tensor, p: Tensor, g: Tensor, s1: Tensor, s2: Tensor, s3: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(u, s1, s2, s3) of optim_rules.h's rules that keep up to three states."""
    lr, b1, b2, eps, wd = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay
    omb1, omb2 = h.one_minus_beta1, h.one_minus_beta2
    f32 = torch.float32
    if rule == _RULE_AMSGRAD:
        if wd != 0 and not flags & _DECOUPLED:
            g = g + torch.tensor(wd, dtype=f32) * p
        s1 = _torch_lerp(s1, g, omb1)
        s2 = s2 * torch.tensor(b2, dtype=f32) + torch.tensor(omb2, dtype=f32) * g * g
        s3 = torch.maximum(s3, s2)
        denom = _sqrt32(s3) / torch.tensor(float(sc[1]), dtype=f32) + torch.tensor(eps, dtype=f32)
        return torch.tensor(float(sc[0]), dtype=f32) * s1 / denom, s1, s2, s3
    if rule == _RULE_CENTERED:
        if wd != 0:
            g = g + torch.tensor(wd, dtype=f32) * p
        s1 = s1 * torch.tensor(b2, dtype=f32) + torch.tensor(omb2, dtype=f32) * g * g
        s2 = s2 + torch.tensor(omb2, dtype=f32) * (g - s2)
        var = s1 - s2 * s2
        avg = _sqrt32(torch.where(var < 0, torch.zeros_like(var), var)) + torch.tensor(eps, dtype=f32)
        if b1 > 0:
            s3 = s3 * torch.tensor(b1, dtype=f32) + g / avg
            return torch.tensor(lr, dtype=f32) * s3, s1, s2, s3
        return torch.tensor(lr, dtype=f32) * g / avg, s1, s2, s3
    if rule == _RULE_ADEMAMIX:
        s1 = _torch_lerp(s1, g, omb1)
        s2 = s2 * torch.tensor(b2, dtype=f32) + torch.tensor(omb2, dtype=f32) * g * g
        s3 = _torch_lerp(s3, g, h.one_minus_beta3)
        denom = _sqrt32(s2) / torch.tensor(float(sc[1]), dtype=f32) + torch.tensor(eps, dtype=f32)
        fast = torch.tensor(float(sc[0]), dtype=f32) * s1
        return (fast + torch.tensor(h.slow_step_size, dtype=f32) * s3) / denom, s1, s2, s3
    u, s1, s2 = _rule_step(rule, h, flags, sc, p, g, s1, s2)
    return u, s1, s2, s3


def _second_moment_slot(rule: int) -> int:
    """state_form.h: second_moment_slot, the state stored as its root at low precision (-1: none)."""
    return {
        _RULE_ADAM: 1,
        _RULE_LAMB: 1,
        _RULE_AMSGRAD: 1,
        _RULE_ADEMAMIX: 1,
        _RULE_RMSPROP: 0,
        _RULE_ADAGRAD: 0,
        _RULE_CENTERED: 0,
    }.get(rule, -1)


def _root_slot(rule: int, k: int) -> bool:
    """state_form.h: root_slot, whether state slot k is stored as its root at low precision."""
    return k == _second_moment_slot(rule) or (rule == _RULE_AMSGRAD and k == 2)


def _restart_nonfinite(values: list[Tensor]) -> list[Tensor]:
    """state_form.h: restart_if_nonfinite, all states of an element with a NaN/Inf one set to 0."""
    bad = torch.zeros_like(values[0], dtype=torch.bool)
    for v in values:
        bad |= ~v.isfinite()
    return [v.masked_fill(bad, 0.0) for v in values]


def _rank1_scales(stats: Tensor, offset: int, dims: list[int], n: int) -> Tensor:
    """rank1.h: the scale of each of the ``n`` elements from global element ``offset`` of a tensor of shape
    ``dims``: the min over the axes of the axis maxima ``stats`` (axis 0's first) at the element's index."""
    rest = torch.arange(offset, offset + n, dtype=torch.int64)
    index = []
    for d in reversed(dims):
        index.append(rest % d)
        rest = rest // d
    bases = [0, *itertools.accumulate(dims)][: len(dims)]
    per_axis = [stats[base + i] for base, i in zip(bases, reversed(index), strict=True)]
    return functools.reduce(torch.minimum, per_axis)


def _rank1_maxima(w: Tensor, offset: int, dims: list[int]) -> Tensor:
    """The axis maxima of |w| (elements ``offset ..`` of a tensor of shape ``dims``, zeros elsewhere): for each
    axis, the max over all the other axes, concatenated axis 0 first."""
    full = torch.zeros(math.prod(dims), dtype=torch.float32)
    full[offset : offset + w.numel()] = w.abs()
    full = full.view(dims)

    def others(a: int) -> list[int]:
        return [d for d in range(len(dims)) if d != a]

    return torch.cat([full.amax(dim=others(a)) for a in range(len(dims))])


def optimizer_step_(*args: Any, **kwargs: Any) -> None:
    """Twin of ``lowbit::optimizer_step_`` (same arguments, :class:`~lowbit._ops.optim.StepArgs`; same
    in-place updates). Without ``update_scales``, the norm modes' scales are its own, from norms of whole
    tensors in float64 (not norm_order.h's order: they may differ from the op's in the last bit)."""
    _step(StepArgs(*args, **kwargs), stats_only=False)


def optimizer_norms(*args: Any, **kwargs: Any) -> Tensor:
    """Twin of ``lowbit::optimizer_norms``: per tensor, the sums of p^2 and of u^2 (with ``norm_mode`` 3, of the
    gradient as given) in include/lowbit/norm_order.h's order, as a float64 tensor of shape (count, 2)."""
    a = StepArgs(*args, **kwargs)
    norms = torch.zeros(len(a.params), 2, dtype=torch.float64)
    _step(a, stats_only=False, norms=norms)
    return norms


def _norm_order_sum(x: Tensor, block_size: int) -> float:
    """norm_order.h: the sum of the squares of fp32 ``x`` in double (each square exact: 48 significant bits), in
    _SQUARE_LANES lanes within each block of ``block_size`` elements, the blocks' sums in _BLOCK_SUM_LANES lanes.
    The last block is padded with zeros, which change no lane (each starts at +0, squares are +0 or more)."""
    squares = x.double().square()
    blocks = -(-squares.numel() // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float64)
    padded[: squares.numel()] = squares
    block_sums = lane_sum(padded.view(blocks, block_size), _SQUARE_LANES)
    return float(lane_sum(block_sums, _BLOCK_SUM_LANES))


def rank1_statistics_(*args: Any, **kwargs: Any) -> None:
    """Twin of ``lowbit::rank1_statistics_``: ``new_axis_max`` raised to the axis maxima of the new stored second
    moments of the rank-1 tensors, computed independently (a reshape and ``amax`` per axis)."""
    _step(StepArgs(*args, **kwargs), stats_only=True)


def _step(a: StepArgs, stats_only: bool, norms: Tensor | None = None) -> None:
    """The twins' loop over the tensors: the step, or its rank-1 statistics (``stats_only``), or its norm
    pre-pass alone (the sums into ``norms``, nothing updated)."""
    params, grads, scalars, grad_scales = a.params, a.grads, a.scalars, a.grad_scales
    rule, flags, norm_mode, n_states, block_size = a.rule, a.flags, a.norm_mode, a.n_states, a.block_size
    hyper = StepHyper(*map(float, a.hyper))
    states, absmaxes, maps = [a.state1, a.state2, a.state3], [a.absmax1, a.absmax2, a.absmax3], [a.map1, a.map2, a.map3]
    f32, f64 = torch.float32, torch.float64
    rank1, slot = rank1_layouts(a), _second_moment_slot(rule)
    # Each rank-1 tensor's statistics within the flat axis_max / new_axis_max, in tensor order.
    where, base = {}, 0
    for i in sorted(rank1):
        where[i] = slice(base, base + sum(rank1[i][1]))
        base = where[i].stop
    for i, p in enumerate(params):
        n = p.numel()
        eight = n_states > 0 and states[0][i].dtype == torch.uint8  # quantized: 8-bit or 4-bit codes
        values = []
        for k in range(3):
            if k >= n_states:
                values.append(torch.zeros(n, dtype=f32))
            elif i in rank1 and k == slot:
                assert a.axis_max is not None
                rank1_scale = _rank1_scales(a.axis_max[where[i]], *rank1[i], n)
                stored = maps[k][_load(states[k][i].reshape(-1), 4, n)] * rank1_scale
                values.append(stored * stored)
            elif eight:
                stored = dequantize_blockwise(
                    states[k][i].reshape(-1), absmaxes[k][i], maps[k], a.state_bits, block_size, n, torch.float32
                )
                values.append(stored * stored if _root_slot(rule, k) else stored)
            else:
                values.append(states[k][i].reshape(-1).clone())
        sc = torch.tensor(scalars[3 * i : 3 * i + 3], dtype=f32)
        pf = p.detach().reshape(-1).float()
        g = grads[i].reshape(-1).float()
        if grad_scales is not None:
            g = g * grad_scales[i].to(f32)
        if flags & _MAXIMIZE:
            g = -g
        if norms is not None and norm_mode == _NORM_GRAD:
            raw = grads[i].reshape(-1).float()
            norms[i] = torch.tensor([_norm_order_sum(pf, block_size), _norm_order_sum(raw, block_size)], dtype=f64)
            continue
        u, *updated = _rule_step(rule, hyper, flags, sc, pf, g, *values)
        if norms is not None:
            norms[i] = torch.tensor([_norm_order_sum(pf, block_size), _norm_order_sum(u, block_size)], dtype=f64)
            continue
        scale = 1.0
        if a.update_scales is not None:
            scale = float(a.update_scales[i])
        elif norm_mode != 0:
            p_norm, u_norm = float(pf.double().norm()), float(u.double().norm())
            lr, max_unorm = hyper.lr, hyper.max_unorm
            if math.isnan(p_norm) or math.isnan(u_norm):
                scale = math.nan
            elif norm_mode == 1 and p_norm > 0 and u_norm > 0:
                scale = p_norm * lr / u_norm
            elif norm_mode == 2 and p_norm > 0 and u_norm > max_unorm * p_norm * lr:
                scale = max_unorm * p_norm * lr / u_norm
        if hyper.weight_decay != 0 and flags & _DECOUPLED:
            pf = pf * torch.tensor(hyper.decay, dtype=f32)
        pf = pf - torch.tensor(scale, dtype=f32) * u
        new_states = updated[:n_states]
        if eight and new_states:
            new_states = _restart_nonfinite(new_states)
        if stats_only:
            if i in rank1:
                assert a.new_axis_max is not None
                maxima = _rank1_maxima(_sqrt32(new_states[slot]), *rank1[i])
                a.new_axis_max[where[i]] = torch.maximum(a.new_axis_max[where[i]], maxima)
            continue
        p.data.copy_(pf.reshape(p.shape).to(p.dtype))
        for k, value in enumerate(new_states):
            # Stochastic rounding (include/lowbit/state_rounding.h): stream 1 + k of the tensor's step seed,
            # element e at counter offset + e; nearest without a rounding table.
            sr = a.rounding is not None
            seed = _lpmm_stream_seed(a.rounding[2 * i], 1 + k) if a.rounding is not None else 0
            offset = a.rounding[2 * i + 1] if a.rounding is not None else 0
            if i in rank1 and k == slot:
                assert a.new_axis_max is not None
                w = _sqrt32(value)
                xn = _normalise(w, _rank1_scales(a.new_axis_max[where[i]], *rank1[i], n))
                states[k][i].copy_(_store(map_codes(xn, maps[k], sr, seed, offset), 4))
            elif eight:
                codes, amax = quantize_blockwise(
                    _sqrt32(value) if _root_slot(rule, k) else value,
                    maps[k],
                    a.state_bits,
                    block_size,
                    sr,
                    seed,
                    offset,
                )
                states[k][i].copy_(codes.reshape(states[k][i].shape))
                absmaxes[k][i].copy_(amax)
            else:
                states[k][i].copy_(value.reshape(states[k][i].shape))


def lpmm_accumulate_(
    grad: Tensor, codes: Tensor, absmax: Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> None:
    """Twin of ``lowbit::lpmm_accumulate_``: ``g <- Q(g + grad)`` in place."""
    n = grad.numel()
    total = dequantize_linear(codes, absmax, bits, group_size, n, torch.float32) + grad.reshape(-1).float()
    new_codes, new_absmax = quantize_linear(total, bits, group_size, stochastic, seed, 0)
    codes.copy_(new_codes)
    absmax.copy_(new_absmax)


def _lpmm_stream_seed(seed: int, stream: int) -> int:
    """The seed whose uniform01 draws are those of kernels.h: lpmm_key(seed, stream)."""
    return _mix64_int(seed + stream)


def lpmm_step_(*args: Any, **kwargs: Any) -> None:
    """Twin of ``lowbit::lpmm_step_`` (same arguments, :class:`~lowbit._ops.lpmm.LpmmStepArgs`; same
    in-place updates)."""
    a = LpmmStepArgs(*args, **kwargs)
    params, param_absmax, grads, grad_absmax = a.params, a.param_absmax, a.grads, a.grad_absmax
    rule, flags, n_states, group_size, seed = a.rule, a.flags, a.n_states, a.group_size, a.seed
    param_bits, grad_bits, state_bits = a.param_bits, a.grad_bits, a.state_bits
    hyper = StepHyper(*map(float, a.hyper))
    f32 = torch.float32
    states, absmaxes, maps = [a.state1, a.state2], [a.absmax1, a.absmax2], [a.map1, a.map2]
    root = _second_moment_slot(rule)
    for i, (n, offset) in enumerate(zip(a.numels, counter_offsets(a), strict=True)):
        p = dequantize_linear(params[i], param_absmax[i], param_bits, group_size, n, f32)
        g = dequantize_linear(grads[i], grad_absmax[i], grad_bits, group_size, n, f32)
        values = [
            dequantize_blockwise(states[k][i], absmaxes[k][i], maps[k], state_bits, group_size, n, f32)
            if k < n_states
            else torch.zeros(n, dtype=f32)
            for k in range(2)
        ]
        values[root] = values[root] * values[root] if root >= 0 else values[root]
        sc = torch.tensor(a.scalars[3 * i : 3 * i + 3], dtype=f32)
        u, s1, s2 = _rule_step(rule, hyper, flags, sc, p, g, values[0], values[1])
        if hyper.weight_decay != 0 and flags & _DECOUPLED:
            p = p * torch.tensor(hyper.decay, dtype=f32)
        p = p - u
        codes, amax = quantize_linear(p, param_bits, group_size, a.stochastic_param, _lpmm_stream_seed(seed, 0), offset)
        params[i].copy_(codes)
        param_absmax[i].copy_(amax)
        for k, value in enumerate(_restart_nonfinite([s1, s2])[:n_states]):
            codes, amax = quantize_blockwise(
                _sqrt32(value) if k == root else value,
                maps[k],
                state_bits,
                group_size,
                a.stochastic_state,
                _lpmm_stream_seed(seed, 1 + k),
                offset,
            )
            states[k][i].copy_(codes)
            absmaxes[k][i].copy_(amax)
        grad_absmax[i].zero_()
