"""Pure-PyTorch twins of the lowbit ops: the test oracle and the benchmark baseline.

Each function computes, with ordinary torch operations, the same fp32 arithmetic in the same order
as the native kernels, so results agree bit for bit (codes, absmax and dequantized values),
including the counter-based random stream of stochastic rounding. They are written for clarity, not
speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

_U64 = 1 << 64


# Torch-pure copies of native constants (rounding.h's kSeedSalt here, optim_rules.h's Rule and flags
# below): tests/test_native_constants.py checks them against lowbit._C's.
_SEED_SALT = 0x6C6F776269742121
_MASK32 = 0xFFFFFFFF


def _mix64_int(z: int) -> int:
    z %= _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _U64
    return z ^ (z >> 31)


def _hash32(x: Tensor) -> Tensor:
    """lowbias32 on uint32 values held in int64 (rounding.h: hash32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform01(seed: int, offset: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """The draws u_i, i < n, of stochastic rounding (rounding.h: two hash32 rounds over counters)."""
    key = _mix64_int(seed ^ _SEED_SALT)
    counter = torch.arange(n, dtype=torch.int64, device=device) + offset
    lo, hi = counter & _MASK32, (counter >> 32) & _MASK32
    h = _hash32(_hash32(lo ^ (key & _MASK32)) ^ hi ^ (key >> 32))
    return (h >> 8).to(torch.float32) * 2.0**-24


def _blocks(n: int, blocksize: int) -> int:
    return min(n, 1) if blocksize == 0 else -(-n // blocksize)


def block_absmax(x: Tensor, blocksize: int) -> Tensor:
    """Per-block absmax of flat fp32 ``x``; NaN for blocks with a NaN or Inf (blockwise.h)."""
    n = x.numel()
    nb = _blocks(n, blocksize)
    size = n if blocksize == 0 else blocksize
    bits = x.view(torch.int32) & 0x7FFFFFFF
    padded = torch.zeros(nb * size, dtype=torch.int32, device=x.device)
    padded[:n] = bits
    m = padded.view(nb, size).amax(dim=1) if nb else padded[:0]
    amax = m.view(torch.float32).clone()
    amax[m >= 0x7F800000] = float("nan")
    return amax


def _expand(per_block: Tensor, n: int, blocksize: int) -> Tensor:
    if blocksize == 0:
        return per_block.expand(n)
    return per_block.repeat_interleave(blocksize)[:n]


def _normalise(x: Tensor, amax_e: Tensor) -> Tensor:
    """blockwise.h's normalise: x * (1 / absmax) (x / absmax where the reciprocal overflows), exactly
    +-1 at +-absmax, clamped to [-1, 1]."""
    pos = amax_e > 0
    safe = torch.where(pos, amax_e, torch.ones_like(amax_e))
    inv = 1 / safe
    inv = torch.where(pos & torch.isfinite(inv), inv, torch.zeros_like(inv))
    q = torch.where(inv != 0, x * inv, x / safe).clamp(-1, 1)
    q = torch.where(x == amax_e, torch.ones_like(q), torch.where(x == -amax_e, -torch.ones_like(q), q))
    return torch.where(pos, q, torch.zeros_like(x))


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Bit-pack integer codes LSB first: code i fills bits [i*bits, (i+1)*bits) (pack.h)."""
    codes = codes.reshape(-1).to(torch.int64)
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    stream = ((codes[:, None] >> torch.arange(bits, device=codes.device)) & 1).reshape(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=codes.device)
    padded[: stream.numel()] = stream
    weights = 1 << torch.arange(8, device=codes.device)
    return (padded.view(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`, as int64 codes."""
    stream = ((packed.to(torch.int64)[:, None] >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    stream = stream[: n * bits].view(n, bits)
    return (stream << torch.arange(bits, device=packed.device)).sum(dim=1)


def _store(codes: Tensor, bits: int) -> Tensor:
    return codes.to(torch.uint8) if bits == 8 else pack_bits(codes, bits)


def _load(packed: Tensor, bits: int, n: int) -> Tensor:
    return packed.to(torch.int64) if bits == 8 else unpack_bits(packed, bits, n)


def quantize_blockwise(
    x: Tensor, code: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Twin of ``lowbit::quantize_blockwise``: ``(packed codes, absmax)``."""
    x = x.reshape(-1).float()
    n = x.numel()
    amax = block_absmax(x, blocksize)
    xn = _normalise(x, _expand(amax, n, blocksize))
    nmap = code.numel()
    lo = (torch.searchsorted(code, xn, right=True) - 1).clamp(min=0)
    hi = (lo + 1).clamp(max=nmap - 1)
    vlo, vhi = code[lo], code[hi]
    if stochastic:
        up = uniform01(seed, offset, n, x.device) * (vhi - vlo) < xn - vlo
    else:
        up = vhi - xn < xn - vlo
    return _store(torch.where(up, hi, lo), bits), amax


def dequantize_blockwise(
    packed: Tensor, absmax: Tensor, code: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Twin of ``lowbit::dequantize_blockwise``."""
    codes = _load(packed, bits, numel)
    return (code[codes] * _expand(absmax, numel, blocksize)).to(dtype)


def quantize_linear(
    x: Tensor, bits: int, blocksize: int, stochastic: bool, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Twin of ``lowbit::quantize_linear``: ``(packed codes, absmax)``."""
    x = x.reshape(-1).float()
    n = x.numel()
    qmax = float(2 ** (bits - 1) - 1)
    amax = block_absmax(x, blocksize)
    y = (_normalise(x, _expand(amax, n, blocksize)) * qmax).clamp(-qmax, qmax)
    if stochastic:
        f = torch.floor(y)
        q = f + (uniform01(seed, offset, n, x.device) < y - f).float()
    else:
        q = torch.round(y)
    return _store((q + qmax).to(torch.int64), bits), amax


def dequantize_linear(
    packed: Tensor, absmax: Tensor, bits: int, blocksize: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Twin of ``lowbit::dequantize_linear``."""
    qmax = float(2 ** (bits - 1) - 1)
    codes = _load(packed, bits, numel).float()
    return (((codes - qmax) / qmax) * _expand(absmax, numel, blocksize)).to(dtype)


def fewbit_encode(x: Tensor, boundaries: Tensor, bits: int) -> Tensor:
    """Twin of ``lowbit::fewbit_encode``: the number of boundaries < x (NaN: 0), bit-packed."""
    xf = x.reshape(-1).float()
    codes = torch.bucketize(xf, boundaries)
    codes = torch.where(torch.isnan(xf), torch.zeros_like(codes), codes)
    return pack_bits(codes, bits)


def fewbit_grad(grad: Tensor, packed: Tensor, levels: Tensor, bits: int) -> Tensor:
    """Twin of ``lowbit::fewbit_grad``: ``grad * levels[code]`` in fp32, rounded to grad's dtype."""
    codes = unpack_bits(packed, bits, grad.numel())
    return (grad.reshape(-1).float() * levels[codes]).to(grad.dtype).reshape(grad.shape)


def invact_grad(grad: Tensor, y: Tensor, bits: Tensor, coeffs: Tensor, params: Tensor) -> Tensor:
    """Twin of ``lowbit::invact_grad``: invact.h's invact_slope, one fp32 torch op per C++ operation."""
    n = grad.numel()
    right = unpack_bits(bits, 1, n).long()
    c = coeffs.reshape(2, -1, 16)
    d0 = y.reshape(-1).float() - params[0]
    d = torch.where(d0 < 0, torch.zeros_like(d0), d0)
    u = _sqrt32(d) * params[1 + right]
    inside = u < 16
    piece = torch.where(inside, u, torch.full_like(u, 15.0)).floor()
    z = u - piece
    idx = piece.long()
    p = c[right, -1, idx]
    for k in range(c.shape[1] - 2, -1, -1):
        p = p * z + c[right, k, idx]
    q = torch.where(u >= 16, params[3 + right], p)
    return (grad.reshape(-1).float() * q).to(grad.dtype).reshape(grad.shape)


def _blpa_split(grid: Tensor, shape: Sequence[int]) -> tuple[Tensor, ...]:
    view = (1, -1) + (1,) * (len(shape) - 2)
    return tuple(row.reshape(view) for row in grid)


def blpa_encode(x: Tensor, a2: Tensor, mean: Tensor, invstd: Tensor, grid: Tensor, bits: int) -> Tensor:
    """Twin of ``lowbit::blpa_encode`` (include/lowbit/blpa.h: blpa_code), one fp32 op per C++ operation."""
    t, o, h, side = _blpa_split(grid, x.shape)
    view = t.shape
    a1 = (x.float() - mean.reshape(view)) * invstd.reshape(view)
    raw = torch.ceil((a1 - t) / h) - 1 + o
    raw = torch.where(torch.isnan(raw), torch.zeros_like(raw), raw)
    upper = (a2.float() > 0) ^ (side < 0)
    lo = torch.where(side == 0, 0.0, torch.where(upper, o, 0.0))
    hi = torch.where(side == 0, float(2**bits - 1), torch.where(upper, float(2**bits - 1), o - 1))
    codes = torch.minimum(torch.maximum(raw, lo), hi)
    return pack_bits(codes.to(torch.uint8).reshape(-1), bits)


def _blpa_codes(packed: Tensor, grid: Tensor, beta: Tensor, shape: Sequence[int], bits: int) -> tuple[Tensor, Tensor]:
    t, o, h, side = _blpa_split(grid, shape)
    codes = unpack_bits(packed, bits, math.prod(shape)).reshape(shape).float()
    a1 = t + ((codes - o) + 0.5) * h
    mask = torch.where(side == 0, beta.reshape(t.shape) > 0, (codes >= o) ^ (side < 0))
    return a1, mask


def blpa_decode(
    packed: Tensor, grid: Tensor, gamma: Tensor, beta: Tensor, shape: Sequence[int], bits: int, dtype: torch.dtype
) -> Tensor:
    """Twin of ``lowbit::blpa_decode``: relu(gamma * a1 + beta) where the exact mask is set, else 0."""
    a1, mask = _blpa_codes(packed, grid, beta, shape, bits)
    view = (1, -1) + (1,) * (len(shape) - 2)
    v = (gamma.reshape(view) * a1 + beta.reshape(view)).clamp_min(0)
    return torch.where(mask, v, torch.zeros_like(v)).to(dtype)


def blpa_backward(
    packed: Tensor,
    grad: Tensor,
    grid: Tensor,
    gamma: Tensor,
    beta: Tensor,
    invstd: Tensor,
    bits: int,
    batch_stats: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Twin of ``lowbit::blpa_backward`` (eqs. 6-8) in float64 sums; equal to the kernel to fp32 rounding."""
    shape = grad.shape
    a1, mask = _blpa_codes(packed, grid, beta, shape, bits)
    dims = [0] + list(range(2, len(shape)))
    view = (1, -1) + (1,) * (len(shape) - 2)
    g_a2 = torch.where(mask, grad.double(), torch.zeros_like(a1, dtype=torch.float64))
    g_beta = g_a2.sum(dims)
    g_gamma = (a1.double() * g_a2).sum(dims)
    g_a1 = gamma.double().reshape(view) * g_a2
    if batch_stats:
        g_a1 = g_a1 - g_a1.mean(dims, keepdim=True) - a1.double() * (a1.double() * g_a1).mean(dims, keepdim=True)
    g_x = invstd.double().reshape(view) * g_a1
    return g_x.to(grad.dtype), g_gamma.float(), g_beta.float()


def nearest_oracle(xn: Tensor, code: Tensor) -> Tensor:
    """Brute force: the smallest |code[j] - xn| for every element (used to check true argmin)."""
    return (code[None, :] - xn.reshape(-1, 1)).abs().min(dim=1).values


# Optimizer rules (include/lowbit/optim_rules.h), elementwise in fp32: each torch op rounds once, as
# each C++ operation does, so results agree bit for bit when no norm mode is used.
_RULE_ADAM, _RULE_SGD, _RULE_LION, _RULE_RMSPROP, _RULE_ADAGRAD, _RULE_LAMB, _RULE_AMSGRAD, _RULE_CENTERED = range(8)
_DECOUPLED, _NESTEROV, _MAXIMIZE = 1, 2, 4


def _sqrt32(x: Tensor) -> Tensor:
    """Correctly rounded fp32 sqrt, as sqrtf is. torch's vectorised fp32 sqrt can be one ulp off;
    the square root of a float computed in double and rounded once is exact."""
    return torch.sqrt(x.double()).to(torch.float32)


def _torch_lerp(m: Tensor, g: Tensor, w: float) -> Tensor:
    """optim_rules.h's torch_lerp: ATen's lerp formula, which switches form at |w| = 0.5."""
    f32 = torch.float32
    if abs(float(torch.tensor(w, dtype=f32))) < 0.5:
        return m + torch.tensor(w, dtype=f32) * (g - m)
    return g + (torch.tensor(w, dtype=f32) - 1.0) * (g - m)


def _rule_step(
    rule: int,
    h: list[float],
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
    lr, b1, b2, omb1, omb2, eps, wd = (float(v) for v in h[:7])
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
    rule: int, h: list[float], flags: int, sc: Tensor, p: Tensor, g: Tensor, s1: Tensor, s2: Tensor, s3: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(u, s1, s2, s3) of optim_rules.h's rules that keep up to three states."""
    lr, b1, b2, omb1, omb2, eps, wd = (float(v) for v in h[:7])
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
    u, s1, s2 = _rule_step(rule, h, flags, sc, p, g, s1, s2)
    return u, s1, s2, s3


def _second_moment_slot(rule: int) -> int:
    """state_form.h: second_moment_slot, the state stored as its root at low precision (-1: none)."""
    return {
        _RULE_ADAM: 1,
        _RULE_LAMB: 1,
        _RULE_AMSGRAD: 1,
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


def optimizer_step_(
    params: list[Tensor],
    grads: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    state3: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    absmax3: list[Tensor],
    scalars: list[float],
    grad_scales: Tensor | None,
    map1: Tensor,
    map2: Tensor,
    map3: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
) -> None:
    """Twin of ``lowbit::optimizer_step_`` (same arguments, same in-place updates)."""
    states, absmaxes, maps = [state1, state2, state3], [absmax1, absmax2, absmax3], [map1, map2, map3]
    f32 = torch.float32
    for i, p in enumerate(params):
        n = p.numel()
        eight = n_states > 0 and states[0][i].dtype == torch.uint8
        values = []
        for k in range(3):
            if k >= n_states:
                values.append(torch.zeros(n, dtype=f32))
            elif eight:
                stored = dequantize_blockwise(
                    states[k][i].reshape(-1), absmaxes[k][i], maps[k], 8, block_size, n, torch.float32
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
        u, *updated = _rule_step(rule, hyper, flags, sc, pf, g, *values)
        scale = 1.0
        if norm_mode != 0:
            p_norm, u_norm = float(pf.double().norm()), float(u.double().norm())
            lr, max_unorm = float(hyper[0]), float(hyper[8])
            if math.isnan(p_norm) or math.isnan(u_norm):
                scale = math.nan
            elif norm_mode == 1 and p_norm > 0 and u_norm > 0:
                scale = p_norm * lr / u_norm
            elif norm_mode == 2 and p_norm > 0 and u_norm > max_unorm * p_norm * lr:
                scale = max_unorm * p_norm * lr / u_norm
        if float(hyper[6]) != 0 and flags & _DECOUPLED:
            pf = pf * torch.tensor(float(hyper[7]), dtype=f32)
        pf = pf - torch.tensor(scale, dtype=f32) * u
        p.data.copy_(pf.reshape(p.shape).to(p.dtype))
        new_states = updated[:n_states]
        if eight and new_states:
            new_states = _restart_nonfinite(new_states)
        for k, value in enumerate(new_states):
            if eight:
                codes, amax = quantize_blockwise(
                    _sqrt32(value) if _root_slot(rule, k) else value, maps[k], 8, block_size, False, 0, 0
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


def lpmm_step_(
    params: list[Tensor],
    param_absmax: list[Tensor],
    grads: list[Tensor],
    grad_absmax: list[Tensor],
    state1: list[Tensor],
    state2: list[Tensor],
    absmax1: list[Tensor],
    absmax2: list[Tensor],
    numels: list[int],
    scalars: list[float],
    map1: Tensor,
    map2: Tensor,
    rule: int,
    hyper: list[float],
    flags: int,
    n_states: int,
    group_size: int,
    param_bits: int,
    grad_bits: int,
    state_bits: int,
    stochastic_param: bool,
    stochastic_state: bool,
    seed: int,
) -> None:
    """Twin of ``lowbit::lpmm_step_`` (same arguments, same in-place updates)."""
    f32 = torch.float32
    states, absmaxes, maps = [state1, state2], [absmax1, absmax2], [map1, map2]
    root = _second_moment_slot(rule)
    offset = 0
    for i, n in enumerate(numels):
        p = dequantize_linear(params[i], param_absmax[i], param_bits, group_size, n, f32)
        g = dequantize_linear(grads[i], grad_absmax[i], grad_bits, group_size, n, f32)
        values = [
            dequantize_blockwise(states[k][i], absmaxes[k][i], maps[k], state_bits, group_size, n, f32)
            if k < n_states
            else torch.zeros(n, dtype=f32)
            for k in range(2)
        ]
        values[root] = values[root] * values[root] if root >= 0 else values[root]
        sc = torch.tensor(scalars[3 * i : 3 * i + 3], dtype=f32)
        u, s1, s2 = _rule_step(rule, hyper, flags, sc, p, g, values[0], values[1])
        if float(hyper[6]) != 0 and flags & _DECOUPLED:
            p = p * torch.tensor(float(hyper[7]), dtype=f32)
        p = p - u
        codes, amax = quantize_linear(p, param_bits, group_size, stochastic_param, _lpmm_stream_seed(seed, 0), offset)
        params[i].copy_(codes)
        param_absmax[i].copy_(amax)
        for k, value in enumerate(_restart_nonfinite([s1, s2])[:n_states]):
            codes, amax = quantize_blockwise(
                _sqrt32(value) if k == root else value,
                maps[k],
                state_bits,
                group_size,
                stochastic_state,
                _lpmm_stream_seed(seed, 1 + k),
                offset,
            )
            states[k][i].copy_(codes)
            absmaxes[k][i].copy_(amax)
        grad_absmax[i].zero_()
        offset += n
