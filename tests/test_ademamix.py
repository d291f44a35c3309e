"""AdEMAMix8bit / AdEMAMix32bit / AdEMAMix against the pure-PyTorch formula (lowbit/_reference/ademamix.py),
the warm-up schedules against the paper's closed forms, and the argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lowbit.optim as O
from lowbit._reference.ademamix import ReferenceAdEMAMix
from lowbit.optim.ademamix import alpha_schedule, beta3_schedule


def _quadratic_grads(p: torch.Tensor, target: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The gradient of 0.5 ||p - target||^2 plus a fixed noise: it depends on p, so a drift feeds back."""
    return p.detach() - target + noise


def _run(opt_cls: type, kwargs: dict, n: int, steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    target = torch.randn(n, generator=gen)
    noises = [torch.randn(n, generator=gen) * 0.5 for _ in range(steps)]
    p = nn.Parameter(p0.clone())
    opt = opt_cls([p], **kwargs)
    for t in range(steps):
        p.grad = _quadratic_grads(p, target, noises[t])
        opt.step()
    return p0, p.detach().clone()


SCHEDULED = dict(lr=1e-2, betas=(0.9, 0.999, 0.999), alpha=5.0, t_alpha=20, t_beta3=30, weight_decay=0.1)


# The acceptance run: 50 steps on sizes that do not divide the 256-element block, with the alpha and
# beta3 warm-ups running; the 8-bit run's distance from the fp32 formula is under 5% of how far the formula
# moved the parameters (the total update norm). A run that did not step would be at 100%, one that stepped
# the wrong way near 200%.
@pytest.mark.parametrize("n", [4097, 65539])
@pytest.mark.parametrize("kwargs", [SCHEDULED, dict(lr=1e-2)], ids=["warmups", "defaults"])
def test_ademamix8bit_drifts_under_5_percent_of_the_update_norm_after_50_steps(n, kwargs):
    p0, ref = _run(ReferenceAdEMAMix, kwargs, n, 50, seed=n)
    _, got = _run(O.AdEMAMix8bit, kwargs, n, 50, seed=n)
    moved = float((ref - p0).double().norm())
    drift = float((got - ref).double().norm())
    assert moved > 0.1 * math.sqrt(n) * 1e-2  # the run moved: on average over 10% of 50 lr-sized steps
    assert drift < 0.05 * moved, (drift, moved)


# The fp32 states follow the formula to fp32 rounding: the native rule folds lr into the two EMAs'
# factors (lr / (1 - b1^t) and lr * alpha) and decays before stepping, where the formula scales the sum;
# each element's update then differs by a few fp32 roundings of itself (a relative 2^-24 each), and 50
# steps of a contracting quadratic add them up: 1e-5 of the movement is over a hundred times that.
@pytest.mark.parametrize("n", [4097, 300])
@pytest.mark.parametrize("kwargs", [SCHEDULED, dict(lr=1e-2)], ids=["warmups", "defaults"])
def test_ademamix32bit_follows_the_formula(n, kwargs):
    p0, ref = _run(ReferenceAdEMAMix, kwargs, n, 50, seed=1)
    _, got = _run(O.AdEMAMix32bit, kwargs, n, 50, seed=1)
    moved = float((ref - p0).double().norm())
    assert float((got - ref).double().norm()) < 1e-5 * moved


@pytest.mark.parametrize("bits", [4, 8, 32])
def test_without_the_slow_ema_it_is_adamw_bit_for_bit(bits):
    # alpha = 0 leaves (step_size m1 + 0 m2) / denom, which is AdamW's step_size m1 / denom exactly: every
    # width of the generic class then steps as lowbit's AdamW of that width (itself tested against
    # torch.optim.AdamW), however m2 is stored.
    def ademamix(params, **kw):
        return O.AdEMAMix(params, optim_bits=bits, betas=(0.9, 0.999, 0.99), alpha=0.0, **kw)

    def adamw(params, **kw):
        return O.AdamW(params, optim_bits=bits, betas=(0.9, 0.999), **kw)

    kw = dict(lr=1e-2, weight_decay=0.1, min_4bit_size=0)
    _, got = _run(ademamix, kw, 4097, 10, seed=5)
    _, want = _run(adamw, kw, 4097, 10, seed=5)
    assert torch.equal(got, want)


def test_4bit_drift_is_adamw4bits():
    # At 4 bits (16 codes) the drift from the formula is large whatever the optimizer: AdamW4bit ends 23%
    # of torch.optim.AdamW's movement away on this problem. AdEMAMix's third 4-bit state may add to it, by
    # at most a quarter here; a run that did not step would be at 100%.
    p0, ref = _run(ReferenceAdEMAMix, SCHEDULED, 4097, 30, seed=7)
    _, got = _run(lambda ps, **kw: O.AdEMAMix(ps, optim_bits=4, **kw), SCHEDULED, 4097, 30, seed=7)
    adamw = dict(lr=SCHEDULED["lr"], weight_decay=SCHEDULED["weight_decay"])
    a0, adamw_ref = _run(torch.optim.AdamW, adamw, 4097, 30, seed=7)
    _, adamw_got = _run(O.AdamW4bit, adamw, 4097, 30, seed=7)
    drift = float((got - ref).double().norm() / (ref - p0).double().norm())
    adamw_drift = float((adamw_got - adamw_ref).double().norm() / (adamw_ref - a0).double().norm())
    assert drift < 1.25 * adamw_drift, (drift, adamw_drift)


def test_8bit_states_are_uint8_codes_with_one_absmax_per_block():
    p = nn.Parameter(torch.randn(4097))
    opt = O.AdEMAMix8bit([p])
    p.grad = torch.randn(4097)
    opt.step()
    state = opt.state[p]
    for k in (1, 2, 3):
        assert state[f"state{k}"].dtype == torch.uint8 and state[f"state{k}"].shape == p.shape
        assert state[f"absmax{k}"].numel() == math.ceil(4097 / 256)
    # Small tensors keep fp32 states (min_8bit_size, as bitsandbytes).
    q = nn.Parameter(torch.randn(100))
    opt = O.AdEMAMix8bit([q])
    q.grad = torch.randn(100)
    opt.step()
    assert opt.state[q]["state1"].dtype == torch.float32


def test_slow_ema_weights_the_update_by_alpha():
    # One step from zero states with b1 = b3: m1 / (1 - b1) = g and m2 = (1 - b3) g, so the step is
    # lr * (1 + alpha (1 - b3)) * g / (|g| + eps') in direction -g; alpha = 0 is Adam's first step.
    g = torch.tensor([2.0, -0.5, 1.0])
    for alpha in (0.0, 5.0):
        p = nn.Parameter(torch.zeros(3))
        opt = O.AdEMAMix32bit([p], lr=0.1, betas=(0.5, 0.999, 0.5), alpha=alpha, eps=0.0, weight_decay=0.0)
        p.grad = g.clone()
        opt.step()
        want = -0.1 * (1 + alpha * 0.5) * g.sign()
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=0)


def test_alpha_schedule_is_a_linear_warmup():
    assert [alpha_schedule(8.0, 4, t) for t in (1, 2, 4, 9)] == [2.0, 4.0, 8.0, 8.0]
    # 0 and None mean no warm-up (bitsandbytes#1382: a falsy t_alpha must not divide by 0).
    assert alpha_schedule(8.0, 0, 1) == alpha_schedule(8.0, None, 1) == 8.0


def test_beta3_schedule_interpolates_the_half_life():
    b1, b3, T = 0.9, 0.9999, 100

    def half_life(beta: float) -> float:
        return math.log(0.5) / math.log(beta) - 1

    # The official linear_hl_warmup_scheduler: the half-life is linear in t from b1's to b3's.
    for t in (1, 10, 50, 99):
        a = t / T
        want = 0.5 ** (1 / ((1 - a) * half_life(b1) + a * half_life(b3) + 1))
        assert beta3_schedule(b1, b3, T, t) == pytest.approx(want, rel=1e-12)
    assert beta3_schedule(b1, b3, T, T) == pytest.approx(b3, rel=1e-15)
    assert beta3_schedule(b1, b3, T, 10 * T) == b3
    assert beta3_schedule(b1, b3, 0, 1) == beta3_schedule(b1, b3, None, 1) == b3
    # b1 = 0: the limit b3^(T / t), defined where the paper's form divides infinities.
    assert beta3_schedule(0.0, b3, T, 50) == pytest.approx(b3**2, rel=1e-12)


def test_parameters_at_different_steps_take_their_own_schedule():
    # With warm-ups, one group's parameters at different step numbers are stepped with their own alpha and
    # beta3: each follows the formula run that started when it first got a gradient.
    gen = torch.Generator().manual_seed(3)
    a0, b0 = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    grads = [torch.randn(5000, generator=gen) for _ in range(6)]
    kw = dict(lr=1e-2, t_alpha=5, t_beta3=5, betas=(0.9, 0.999, 0.99))
    a, b = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())
    ra, rb = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())
    opt, ref = O.AdEMAMix32bit([a, b], **kw), ReferenceAdEMAMix([ra, rb], **kw)
    for t, g in enumerate(grads):
        for x, y in ((a, ra), (b, rb)):
            x.grad = y.grad = None
        a.grad, ra.grad = g.clone(), g.clone()
        if t >= 3:  # b starts three steps late
            b.grad, rb.grad = -g, -g.clone()
        opt.step()
        ref.step()
    assert opt.state[a]["step"].item() == 6 and opt.state[b]["step"].item() == 3
    for x, y, x0 in ((a, ra, a0), (b, rb, b0)):
        moved = float((y.detach() - x0).norm())
        assert float((x.detach() - y.detach()).norm()) < 1e-5 * moved


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(betas=(0.9, 0.999)), "betas"),
        (dict(betas=(0.9, 0.999, 1.0)), "betas"),
        (dict(alpha=-1.0), "alpha"),
        (dict(t_alpha=-3), "t_alpha"),
        (dict(t_beta3=2.5), "t_beta3"),
        (dict(lr=-1.0), "lr"),
        (dict(optim_bits=16), "optim_bits"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        O.AdEMAMix([nn.Parameter(torch.zeros(2))], **kwargs)


def test_a_bad_group_edit_raises_at_step_and_changes_nothing():
    p = nn.Parameter(torch.randn(5000))
    opt = O.AdEMAMix8bit([p])
    p.grad = torch.randn(5000)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    opt.param_groups[0]["t_beta3"] = -1
    with pytest.raises(ValueError, match="t_beta3"):
        opt.step()
    assert torch.equal(p.detach(), before[0])
    for k, v in before[1].items():
        assert torch.equal(opt.state[p][k], v), k


def test_fixed_bits_classes_refuse_optim_bits():
    with pytest.raises(TypeError, match="optim_bits"):
        O.AdEMAMix8bit([nn.Parameter(torch.zeros(2))], optim_bits=32)
