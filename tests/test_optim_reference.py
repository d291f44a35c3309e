"""The fused optimizer op against its pure-PyTorch twin: bit-identical without a norm mode."""

from __future__ import annotations

import copy
import math
from typing import Optional

import pytest
import torch

from lowbit import _ops
from lowbit import _reference as R
from lowbit._reference.quantize import _normalise, _store, map_codes
from lowbit.functional import quantize_blockwise
from lowbit.optim.state_storage import optimizer_state_map

# rule, n_states, flags, hyper (lr, b1, b2, 1-b1, 1-b2, eps, wd, 1-lr*wd, max_unorm, 1-b3, lr*alpha)
RULES = {
    "adam": (0, 2, 0, [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.1, 1 - 1e-4, 0.0, 0.0, 0.0]),
    "adamw": (0, 2, 1, [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.1, 1 - 1e-4, 0.0, 0.0, 0.0]),
    "adam-max": (0, 2, 4, [1e-3, 0.8, 0.99, 0.2, 0.01, 1e-6, 0.0, 1.0, 0.0, 0.0, 0.0]),
    "sgd-nesterov": (1, 1, 2, [1e-2, 0.9, 0.0, 1.0, 0.0, 0.0, 1e-2, 1.0, 0.0, 0.0, 0.0]),
    "sgd-dampening": (1, 1, 0, [1e-2, 0.9, 0.0, 0.7, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]),
    "lion": (2, 1, 1, [1e-4, 0.9, 0.99, 0.1, 0.01, 0.0, 0.1, 1 - 1e-5, 0.0, 0.0, 0.0]),
    "rmsprop": (3, 2, 0, [1e-3, 0.9, 0.99, 0.0, 0.01, 1e-8, 1e-2, 1.0, 0.0, 0.0, 0.0]),
    "adagrad": (4, 1, 0, [1e-2, 0.0, 0.0, 0.0, 0.0, 1e-10, 0.0, 1.0, 0.0, 0.0, 0.0]),
    "lamb": (5, 2, 0, [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-6, 0.01, 1.0, 0.0, 0.0, 0.0]),
    # torch_lerp's second form (1 - beta1 >= 0.5) and maximize.
    "lamb-max": (5, 2, 4, [1e-3, 0.3, 0.99, 0.7, 0.01, 1e-6, 0.05, 1.0, 0.0, 0.0, 0.0]),
    "adam-amsgrad": (6, 3, 0, [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.1, 1 - 1e-4, 0.0, 0.0, 0.0]),
    "adamw-amsgrad-max": (6, 3, 5, [1e-3, 0.8, 0.99, 0.2, 0.01, 1e-6, 0.1, 1 - 1e-4, 0.0, 0.0, 0.0]),
    "rmsprop-centered": (7, 2, 0, [1e-3, 0.0, 0.99, 0.0, 0.01, 1e-8, 1e-2, 1.0, 0.0, 0.0, 0.0]),
    "rmsprop-centered-momentum": (7, 3, 4, [1e-3, 0.9, 0.9, 0.0, 0.1, 1e-8, 0.0, 1.0, 0.0, 0.0, 0.0]),
    "ademamix": (8, 3, 1, [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.1, 1 - 1e-4, 0.0, 1e-4, 5e-3]),
    "ademamix-warmup": (8, 3, 1, [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.0, 1.0, 0.0, 0.0123, 1e-4]),
}
# Signed (first moment) or unsigned (second moment) map of each state slot, per rule code.
SIGNED = {
    0: (True, False),
    1: (True,),
    2: (True,),
    3: (False, True),
    4: (False,),
    5: (True, False),
    6: (True, False, False),
    7: (False, True, True),
    8: (True, False, True),
}


# The quantized states' block size per width: the optimizers' defaults.
BLOCK = {8: 256, 4: 128}
# A stochastic rounding table for _tensors' four tensors (seed, counter offset): parameter positions as the
# optimizers give them, and a counter range that crosses 2^32 inside the third tensor (its carry).
ROUNDING = [12345, 0, 2**62 - 1, 1 << 40, 7, (2 << 40) + 2**32 - 1000, 99, 3 << 40]


def _tensors(rule: int, n_states: int, dtype: torch.dtype, seed: int, bits: int = 8) -> list:
    gen = torch.Generator().manual_seed(seed)
    sizes = [5000, 300, 4097, 64 * 70]
    params = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    states, absmax = [[], [], []], [[], [], []]
    maps = [optimizer_state_map(s, torch.device("cpu"), bits) for s in (True, False)]
    for k in range(n_states):
        signed = SIGNED[rule][k]
        for n in sizes:
            value = torch.randn(n, generator=gen) * 0.1
            if not signed:
                value = value.abs()
            if n >= 4096:
                codes, qs = quantize_blockwise(value, code=maps[0] if signed else maps[1], blocksize=BLOCK[bits])
                states[k].append(codes)
                absmax[k].append(qs.absmax)
            else:
                states[k].append(value)
                absmax[k].append(torch.empty(0))
    signed = [k < len(SIGNED[rule]) and SIGNED[rule][k] for k in range(3)]
    map1, map2, map3 = (maps[0] if s else maps[1] for s in signed)
    scalars = []
    for i in range(len(sizes)):
        scalars += [1e-3 / (1 - 0.9 ** (i + 2)), (1 - 0.999 ** (i + 2)) ** 0.5, float(i == 0)]
    return [params, grads, *states, *absmax, scalars, map1, map2, map3]


# LAMB's step is checked with given update scales (its trust ratios; one of 1, which the native loops skip), its
# pre-pass by test_norm_sums_are_bit_identical_to_reference.
LAMB_SCALES = [0.75, 2.0, 1.0, 0.3]


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_scale", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_fused_step_is_bit_identical_to_reference(name, dtype, grad_scale, bits, stochastic, cpu_kernels):
    rule, n_states, flags, hyper = RULES[name]
    tensors = _tensors(rule, n_states, dtype, seed=len(name), bits=bits)
    params, grads, s1, s2, s3, a1, a2, a3, scalars, map1, map2, map3 = tensors
    scales = torch.tensor([0.5, 1.0, 2.0, 0.25]) if grad_scale else None
    update_scales = torch.tensor(LAMB_SCALES) if rule == 5 else None
    ours = copy.deepcopy((params, s1, s2, s3, a1, a2, a3))
    ref = copy.deepcopy((params, s1, s2, s3, a1, a2, a3))
    args = (scalars, scales, map1, map2, map3, rule, hyper, flags, 0, n_states, BLOCK[bits], update_scales, bits)
    if stochastic:
        args = (*args, None, None, None, ROUNDING)
    _ops.optimizer_step_(ours[0], grads, *ours[1:], *args)
    R.optimizer_step_(ref[0], grads, *ref[1:], *args)
    for got, want in zip(ours, ref, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    ("name", "norm_mode"), [("lamb", 1), ("lamb-max", 1), ("adam", 2), ("ademamix", 2), ("sgd-nesterov", 3)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_scale", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_norm_sums_are_bit_identical_to_reference(name, norm_mode, dtype, grad_scale, bits, cpu_kernels):
    # The norm pre-pass alone (optimizer_norms): per tensor, the double sums of p^2 and u^2 (of g^2 for norm_mode
    # 3) in norm_order.h's order, bit for bit with the twin's (the twin's u and its fixed-order sums). The values
    # span seven decades, so that another order of the additions gives other bits.
    rule, n_states, flags, hyper = RULES[name]
    params, grads, s1, s2, s3, a1, a2, a3, scalars, map1, map2, map3 = _tensors(
        rule, n_states, dtype, seed=5, bits=bits
    )
    gen = torch.Generator().manual_seed(6)
    params = [(p.float() * 10.0 ** torch.randint(-3, 4, p.shape, generator=gen)).to(dtype) for p in params]
    scales = torch.tensor([0.5, 1.0, 2.0, 0.25]) if grad_scale else None
    args = (params, grads, s1, s2, s3, a1, a2, a3, scalars, scales, map1, map2, map3, rule, hyper, flags, norm_mode)
    args = (*args, n_states, BLOCK[bits], None, bits)
    got = _ops.optimizer_norms(*args)
    want = R.optimizer_norms(*args)
    assert torch.equal(got, want), (got, want)
    assert bool((want > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_lamb_with_an_overflowing_second_moment_matches_reference(dtype, bits, cpu_kernels):
    # An element whose g^2 overflows (v = +inf, its root +inf) steps by lr * weight_decay * p alone (m / inf = 0),
    # so the norms stay finite, as the twin's; the element's states restart (state_form.h). The fused norm pass
    # once divided that root by bias2_sqrt with divide_by_constant16, whose residual inf - inf is NaN: NaN norms,
    # and LAMB8bit's whole tensor NaN where LAMB32bit stayed finite. The element sits in each tensor's first block
    # (a fused one where the states are quantized).
    rule, n_states, flags, hyper = RULES["lamb"]
    tensors = _tensors(rule, n_states, dtype, seed=8, bits=bits)
    params, grads, s1, s2, s3, a1, a2, a3, scalars, map1, map2, map3 = tensors
    for g in grads:
        g[5] = 1e21
    args = (params, grads, s1, s2, s3, a1, a2, a3, scalars, None, map1, map2, map3, rule, hyper, flags, 1, n_states)
    args = (*args, BLOCK[bits], None, bits)
    want = R.optimizer_norms(*args)
    assert bool(want.isfinite().all())
    assert torch.equal(_ops.optimizer_norms(*args), want)
    ours = copy.deepcopy((params, s1, s2, s3, a1, a2, a3))
    ref = copy.deepcopy((params, s1, s2, s3, a1, a2, a3))
    step = (scalars, None, map1, map2, map3, rule, hyper, flags, 0, n_states, BLOCK[bits], torch.tensor(LAMB_SCALES))
    _ops.optimizer_step_(ours[0], grads, *ours[1:], *step, bits)
    R.optimizer_step_(ref[0], grads, *ref[1:], *step, bits)
    for got, expected in zip(ours, ref, strict=True):
        for g, w in zip(got, expected, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert all(bool(p.float().isfinite().all()) for p in ours[0])


@pytest.mark.parametrize(
    ("name", "norm_mode"),
    [
        ("lamb", 1),
        ("adam", 2),
        ("sgd-nesterov", 2),
        ("adam-amsgrad", 2),
        ("rmsprop-centered-momentum", 2),
        ("ademamix", 2),
    ],
)
def test_norm_modes_match_reference(name, norm_mode):
    rule, n_states, flags, hyper = RULES[name]
    hyper = list(hyper)
    hyper[8] = 0.01 if norm_mode == 2 else 0.0
    params, grads, s1, s2, s3, a1, a2, a3, scalars, map1, map2, map3 = _tensors(rule, n_states, torch.float32, seed=3)
    ours = copy.deepcopy((params, s1, s2, s3, a1, a2, a3))
    ref = copy.deepcopy((params, s1, s2, s3, a1, a2, a3))
    args = (scalars, None, map1, map2, map3, rule, hyper, flags, norm_mode, n_states, 256)
    _ops.optimizer_step_(ours[0], grads, *ours[1:], *args)
    R.optimizer_step_(ref[0], grads, *ref[1:], *args)
    # The per-tensor norms are summed in a different order (blocks vs whole tensor, both in double),
    # so the scale can differ in its last fp32 bit: parameters agree to a few ulps.
    for g, w in zip(ours[0], ref[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    for k in range(1, 7):
        for g, w in zip(ours[k], ref[k], strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def _adam_step_matches_reference(
    grads: list[torch.Tensor],
    hyper: list,
    bits: int,
    gen: torch.Generator,
    bias2_sqrt: Optional[list[float]] = None,
) -> tuple:
    """One Adam step of the fused op and of the twin on fp32 parameters with gradients ``grads``, from states of
    ``bits`` quantized from random values, each tensor with its bias correction ``bias2_sqrt`` (that of step 2 if
    None): bit-identical results. Returns the op's (params, state1, state2, absmax1, absmax2) and the parameters
    before the step."""
    rule, n_states, flags, _ = RULES["adam"]
    block = BLOCK[bits]
    params = [torch.randn(g.numel(), generator=gen) for g in grads]
    maps = [optimizer_state_map(s, torch.device("cpu"), bits) for s in (True, False)]
    states, absmax = [[], [], []], [[], [], []]
    for k, m in enumerate(maps):
        for g in grads:
            value = torch.randn(g.numel(), generator=gen) * 0.1
            codes, qs = quantize_blockwise(value if k == 0 else value.abs(), code=m, blocksize=block)
            states[k].append(codes)
            absmax[k].append(qs.absmax)
    scalars = []
    for b in bias2_sqrt or [(1 - 0.999**2) ** 0.5] * len(grads):
        scalars += [1e-3 / (1 - 0.9**2), b, 0.0]
    ours = copy.deepcopy((params, *states, *absmax))
    ref = copy.deepcopy((params, *states, *absmax))
    args = (scalars, None, maps[0], maps[1], maps[1], rule, hyper, flags, 0, n_states, block, None, bits)
    _ops.optimizer_step_(ours[0], grads, *ours[1:], *args)
    R.optimizer_step_(ref[0], grads, *ref[1:], *args)
    for got, want in zip(ours, ref, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    return ours, params


def _codes(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of a state as stored, one per element (4-bit: the low nibble first, pack.h)."""
    if bits == 8:
        return stored.long()
    return torch.stack([stored & 15, stored >> 4], dim=1).flatten().long()


@pytest.mark.parametrize("bits", [8, 4])
def test_adam_codes_of_exact_ties_and_block_edges_match_reference(bits, cpu_kernels):
    """Adam's block loops on the values where a fast encoder can go wrong, for both moments: exact ties between
    two map entries, the floats next to every midpoint (where the nearest code steps up), the map entries
    themselves, +-absmax, -0, an all-zero block, a poisoned (NaN) block and a
    block whose absmax is subnormal (no finite inverse). With beta1 = beta2 = 0 the new moments are m = g and
    v = g * g, whose stored root is |g| exactly, so the gradients are the values both encoders see; every block's
    absmax is exactly 1. Blocks of whole groups of 64 take the fused loops (adam_moments_vbmi and
    adam_encode_step_sums for 8-bit states where the CPU has VBMI, adam_moments_u4 and adam_encode_step_u4 for
    4-bit ones; adam_block_avx2's with the AVX2 kernels), the 48-element tail, the poisoned block and the
    subnormal one the others."""
    hyper = list(RULES["adam"][3])
    hyper[1], hyper[2], hyper[3], hyper[4] = 0.0, 0.0, 1.0, 1.0  # beta1 = beta2 = 0
    hyper[6], hyper[7] = 0.0, 1.0  # no weight decay
    block = BLOCK[bits]
    maps = [optimizer_state_map(s, torch.device("cpu"), bits) for s in (True, False)]

    def ties_of(m: torch.Tensor) -> torch.Tensor:
        lo, hi = m[:-1], m[1:]
        mid = (lo + hi) / 2
        return mid[((hi - mid) == (mid - lo)) & (hi > lo)]

    def steps_of(m: torch.Tensor) -> torch.Tensor:
        """The floats one and two ulps either side of each midpoint: where the nearest code steps up (the
        least x of each code, the key a register search compares with) lies among them and the midpoint."""
        mid = (m[:-1] + m[1:]) / 2
        up, down = torch.full_like(mid, math.inf), torch.full_like(mid, -math.inf)
        near = [torch.nextafter(mid, up), torch.nextafter(mid, down)]
        return torch.cat(near + [torch.nextafter(near[0], up), torch.nextafter(near[1], down)])

    signed_ties, unsigned_ties = ties_of(maps[0]), ties_of(maps[1])
    assert signed_ties.numel() >= 8 and unsigned_ties.numel() >= 8, "the maps should have exact midpoints"
    gen = torch.Generator().manual_seed(0)
    values = torch.cat(
        [signed_ties, maps[0], maps[1], unsigned_ties, -unsigned_ties, torch.tensor([-0.0, 0.0])]
        + [steps_of(maps[0]), steps_of(maps[1]), -steps_of(maps[1])]
    )
    n = 40 * block + 48
    grad = values[torch.randint(values.numel(), (n,), generator=gen)]
    grad[::block] = 1.0  # every block's absmax is exactly 1 ...
    grad[block // 2 :: 4 * block] = -1.0  # ... and some reach it from below too
    grad[3 * block : 4 * block] = 0.0
    grad[7 * block : 8 * block] = -0.0
    grad[5 * block + 7] = float("nan")
    grad[9 * block : 10 * block] *= 1e-39  # a subnormal absmax
    ours, _ = _adam_step_matches_reference([grad], hyper, bits, gen)
    # Direction: a tie of either moment stored the lower of its two entries.
    m_codes, root_codes = _codes(ours[1][0], bits), _codes(ours[2][0], bits)
    clean = (torch.arange(n) // block != 5) & (torch.arange(n) // block != 9)
    m_tie = torch.isin(grad, signed_ties) & clean
    assert m_tie.any()
    assert torch.equal(m_codes[m_tie], torch.searchsorted(maps[0], grad[m_tie], right=True) - 1)
    root_tie = torch.isin(grad.abs(), unsigned_ties) & clean
    assert root_tie.any()
    assert torch.equal(root_codes[root_tie], torch.searchsorted(maps[1], grad[root_tie].abs(), right=True) - 1)


@pytest.mark.parametrize("bits", [8, 4])
def test_adam_bias_correction_quotients_match_reference(bits, cpu_kernels):
    """Adam's AVX-512 fused loops divide the root of v by the bias correction sqrt(1 - beta2^t) through its
    reciprocal and two FMA corrections (optim.cpp: reciprocal_divides), which must give the division's bits.
    With beta1 = beta2 = 0 and eps = 0 the stored root is |g| exactly and the update is step_size * g / (|g| / b),
    so every bit of the quotient reaches the parameter. Each tensor has its own b: bias corrections of real steps, the
    ends of the range, significands of all ones, and b outside it (left to the division); the gradients'
    magnitudes span 2^-60..2^60 with random significands, one binade per block."""
    hyper = list(RULES["adam"][3])
    hyper[1], hyper[2], hyper[3], hyper[4] = 0.0, 0.0, 1.0, 1.0  # beta1 = beta2 = 0
    hyper[5], hyper[6], hyper[7] = 0.0, 0.0, 1.0  # eps = 0, no weight decay
    block = BLOCK[bits]
    gen = torch.Generator().manual_seed(1)
    real = [(1 - beta2**t) ** 0.5 for beta2 in (0.999, 0.99, 0.95) for t in (1, 2, 3, 10, 1000)]
    ones = torch.tensor([0x3F7FFFFF, 0x3EFFFFFF, 0x207FFFFF], dtype=torch.int32).view(torch.float32).tolist()
    edges = [1.0, 0.5, 2.0**-60, float(torch.tensor(2.0**-60).nextafter(torch.tensor(1.0))), 2.0**-61, 1.5]
    # Outside the range the reciprocal would not divide: no finite reciprocal, and quotients below the normals.
    beyond = [1e-39, 2.0**100]
    bias2_sqrt = real + ones + edges + beyond + torch.rand(8, generator=gen).tolist()
    blocks = 8
    exponents = torch.linspace(-60, 60, blocks).round().repeat_interleave(block)
    grads = []
    for _ in bias2_sqrt:
        significand = 1 + torch.rand(blocks * block, generator=gen)
        sign = torch.where(torch.rand(blocks * block, generator=gen) < 0.5, -1.0, 1.0)
        grads.append(sign * significand * 2.0**exponents)
    ours, before = _adam_step_matches_reference(grads, hyper, bits, gen, bias2_sqrt)
    # Size and direction: each parameter moved against its gradient by step_size * b. The update rounds three
    # times (|g| / b, step_size * g, their quotient) and the expected value once, each by at most 2^-24
    # relative: below 2.4e-7, hence rtol 1e-6. Subtracting it rounds the parameter by half an ulp, at most
    # 2^-24 |p|, which atol covers twice over. (Beyond the range, |g| / b overflows or underflows in some blocks.)
    step_size = 1e-3 / (1 - 0.9**2)
    for p, p0, g, b in zip(ours[0], before, grads, bias2_sqrt, strict=True):
        if b in beyond:
            continue
        torch.testing.assert_close(p0 - p, step_size * b * g.sign(), rtol=1e-6, atol=2.0**-23 * p0.abs().max().item())


def _rank1_case(rule: int, n_states: int, shape: tuple[int, ...], seed: int, nan: bool = False) -> tuple:
    """One fp32 tensor of ``shape`` with 4-bit states whose second moment is normalised rank-1 (statistics
    from the twin's maxima of the stored roots), as the op's arguments."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    # Rows and columns of very different scales, as rank-1 normalisation assumes (Li, Chen, Zhu 2023, 4.2).
    spread = torch.logspace(-3, 0, shape[0])[:, None] * torch.logspace(0, -2, n // shape[0])[None, :]
    params = [torch.randn(n, generator=gen)]
    grads = [(torch.randn(n, generator=gen) * spread.reshape(-1)).contiguous()]
    if nan:
        grads[0][n // 3] = float("nan")
    maps = [optimizer_state_map(s, torch.device("cpu"), 4) for s in (True, False)]
    slot = _ops.optim.SECOND_MOMENT_SLOTS[rule]
    states, absmax = [[], [], []], [[], [], []]
    axis_max = new_axis_max = torch.empty(0)
    for k in range(n_states):
        signed = SIGNED[rule][k]
        value = torch.randn(n, generator=gen) * 0.1 * spread.reshape(-1)
        if k == slot:
            w = value.abs()
            axis_max = R.optim._rank1_maxima(w, 0, list(shape))
            scale = R.optim._rank1_scales(axis_max, 0, list(shape), n)
            states[k].append(_store(map_codes(_normalise(w, scale), maps[1]), 4))
            absmax[k].append(torch.empty(0))
            new_axis_max = torch.zeros_like(axis_max)
            continue
        codes, qs = quantize_blockwise(
            value if signed else value.abs(), code=maps[0] if signed else maps[1], blocksize=128
        )
        states[k].append(codes)
        absmax[k].append(qs.absmax)
    signed = [k < len(SIGNED[rule]) and SIGNED[rule][k] for k in range(3)]
    map1, map2, map3 = (maps[0] if s else maps[1] for s in signed)
    scalars = [1e-3 / (1 - 0.9**3), (1 - 0.999**3) ** 0.5, 0.0]
    return params, grads, states, absmax, scalars, (map1, map2, map3), axis_max, new_axis_max


@pytest.mark.parametrize(
    ("name", "shape", "nan", "rounding"),
    [
        ("adamw", (96, 130), False, None),
        ("adamw", (96, 130), True, None),
        ("adam-max", (7, 1, 33, 5), False, None),
        ("rmsprop", (40, 3, 50), False, None),
        ("adagrad", (130, 96), False, None),
        ("adam-amsgrad", (33, 65), False, None),
        ("adamw", (96, 130), False, [321, 5 << 40]),
        ("adam-amsgrad", (33, 65), False, [2**62 - 5, 2**32 - 700]),
        ("rmsprop", (40, 3, 50), False, [8, 0]),
    ],
)
def test_rank1_statistics_and_step_are_bit_identical_to_reference(name, shape, nan, rounding, cpu_kernels):
    """Rank-1 normalised 4-bit second moments (include/lowbit/rank1.h): the statistics pass and the step that
    encodes against its statistics, against the twin's (whose maxima are a reshape and amax per axis and whose
    scales a torch.minimum: a max in place of the min, or one axis left out, changes codes)."""
    rule, n_states, flags, hyper = RULES[name]
    params, grads, states, absmax, scalars, maps, axis_max, new_axis_max = _rank1_case(
        rule, n_states, shape, len(name), nan
    )
    rank1 = [len(shape), 0, *shape]
    ours = copy.deepcopy((params, *states, *absmax, [new_axis_max]))
    ref = copy.deepcopy((params, *states, *absmax, [new_axis_max]))
    for impl, t in ((_ops, ours), (R, ref)):
        args = (scalars, None, *maps, rule, hyper, flags, 0, n_states, 128, None, 4, rank1, axis_max, t[7][0], rounding)
        impl.rank1_statistics_(t[0], grads, *t[1:7], *args)
        impl.optimizer_step_(t[0], grads, *t[1:7], *args)
    assert bool((ours[7][0] > 0).all()), "every row and column has a non-zero second moment"
    for got, want in zip(ours, ref, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_rank1_statistics_of_shards_max_to_the_whole_tensor(cpu_kernels):
    """FSDP2's reduction on one process: the statistics of two row shards (each at its offset in the global
    tensor), MAX'd elementwise, equal the whole tensor's bit for bit, and each shard's step then writes the
    whole tensor's codes for its elements."""
    rule, n_states, flags, hyper = RULES["adamw"]
    shape = (50, 130)
    params, grads, states, absmax, scalars, maps, axis_max, new_axis_max = _rank1_case(rule, n_states, shape, 1)
    whole = copy.deepcopy((params, *states, *absmax, [new_axis_max]))
    args = (scalars, None, *maps, rule, hyper, flags, 0, n_states, 128, None, 4, [2, 0, *shape], axis_max, whole[7][0])
    _ops.rank1_statistics_(whole[0], grads, *whole[1:7], *args)
    cut = 23 * shape[1]  # not a multiple of the block: the second shard's blocks start mid-row
    cut -= cut % 128
    parts = []
    for lo, hi in ((0, cut), (cut, math.prod(shape))):
        p = [params[0][lo:hi].clone()]
        s = [[states[k][0][lo // 2 : (hi + 1) // 2].clone()] if k < n_states else [] for k in range(3)]
        a = [[absmax[0][0][lo // 128 : -(-hi // 128)].clone()], [torch.empty(0)], []]
        new = torch.zeros_like(axis_max)
        part = (scalars, None, *maps, rule, hyper, flags, 0, n_states, 128, None, 4, [2, lo, *shape], axis_max, new)
        _ops.rank1_statistics_(p, [grads[0][lo:hi].contiguous()], *s, *a, *part)
        parts.append((p, s, a, new, part, lo, hi))
    reduced = torch.maximum(parts[0][3], parts[1][3])
    assert torch.equal(reduced, whole[7][0])
    assert not torch.equal(parts[0][3], whole[7][0]), "a shard alone sees only part of the columns' maxima"
    _ops.optimizer_step_(whole[0], grads, *whole[1:7], *args)
    for p, s, a, new, part, lo, hi in parts:
        new.copy_(reduced)
        _ops.optimizer_step_(p, [grads[0][lo:hi].contiguous()], *s, *a, *part)
        assert torch.equal(p[0], whole[0][0][lo:hi])
        assert torch.equal(s[1][0], whole[2][0][lo // 2 : hi // 2])
