"""Per-tensor update scaling: LAMB's and LARS's trust ratios, max_unorm, percentile clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lowbit.optim as O


def _lamb_reference(
    p: torch.Tensor, grads: list[torch.Tensor], lr: float, betas, eps: float, wd: float
) -> torch.Tensor:
    """LAMB (You et al. 2020, Algorithm 2) in plain fp32 torch."""
    p = p.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m.lerp_(g, 1 - betas[0])
        v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
        r = (m / (1 - betas[0] ** t)) / (v.sqrt() / math.sqrt(1 - betas[1] ** t) + eps) + wd * p
        pn, rn = p.norm(), r.norm()
        trust = pn / rn if pn > 0 and rn > 0 else 1.0
        p -= lr * trust * r
    return p


def _lars_reference(p: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float, wd: float, eta: float):
    p = p.clone()
    buf = None
    for g in grads:
        pn, gn = p.norm(), g.norm()
        local = eta * pn / (gn + wd * pn + 1e-8) if pn > 0 and gn > 0 else 1.0
        scaled = (g + wd * p) * local
        buf = scaled.clone() if buf is None else buf * momentum + scaled
        p -= lr * buf
    return p


def _grads(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * (1 + t) for t in range(steps)]


def _run(opt_cls, p0: torch.Tensor, grads: list[torch.Tensor], **kw) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = nn.Parameter(p0.clone())
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_fp32_matches_reference(wd):
    p0 = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    grads = _grads(10000, 10)
    ours, _ = _run(O.LAMB32bit, p0, grads, lr=1e-2, weight_decay=wd)
    ref = _lamb_reference(p0, grads, 1e-2, (0.9, 0.999), 1e-6, wd)
    # 10 steps x ~6 differently ordered fp32 roundings (m, v, r, the trust ratio's norms: double sums in
    # lowbit, fp32 in torch) = 60 x 2^-24 = 3.6e-6 relative on |p| ~ 1 (atol for elements near 0).
    # Measured here: 4.8e-7 absolute, 3.8% of this allowance.
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_lamb_trust_ratio_sets_the_step_norm():
    # With the trust ratio ||p|| / ||r||, every step moves the tensor by exactly lr * ||p||, whatever
    # the gradient's scale; without it (bitsandbytes' LAMB8bit) the step would follow ||r||.
    gen = torch.Generator().manual_seed(2)
    for opt_cls in (O.LAMB32bit, O.LAMB8bit):
        p = nn.Parameter(torch.randn(20000, generator=gen))
        opt = opt_cls([p], lr=1e-2)
        for scale in (1e-3, 1.0, 1e3):
            before = p.detach().clone()
            p.grad = torch.randn(20000, generator=gen) * scale
            opt.step()
            # Exact but for rounding p: half an ulp of each element (2^-24 |p|) in a step of lr |p| is at most
            # 2^-24 / lr = 6e-6 relative. Measured over seeds 0-19 of this loop (120 steps): 5.4e-7.
            #
            assert float((p.detach() - before).norm() / before.norm()) == pytest.approx(1e-2, rel=1e-5)


@pytest.mark.parametrize("wd", [0.0, 1e-2])
def test_lars_fp32_matches_reference(wd):
    p0 = torch.randn(10000, generator=torch.Generator().manual_seed(3))
    grads = _grads(10000, 10, seed=4)
    ours, _ = _run(O.LARS32bit, p0, grads, lr=0.1, momentum=0.9, weight_decay=wd, trust_coefficient=0.02)
    ref = _lars_reference(p0, grads, 0.1, 0.9, wd, 0.02)
    # As LAMB above: 10 steps x ~5 fp32 roundings (norms, local lr, buf, p) = 3e-6 relative. Measured here:
    # 6e-8 absolute, 1.6% of this allowance.
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_lars_local_lr_makes_steps_scale_free():
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(8000, generator=gen)
    g = torch.randn(8000, generator=gen)
    small, _ = _run(O.LARS8bit, p0, [g * 1e-4], lr=1.0, trust_coefficient=0.01)
    large, _ = _run(O.LARS8bit, p0, [g * 1e4], lr=1.0, trust_coefficient=0.01)
    # The steps differ by eps = 1e-8 in local lr's denominator (1e-8 / ||g * 1e-4|| = 1.1e-6 relative) and
    # by rounding; p - p0 also carries the rounding of p itself, up to 2.4e-7 (half an ulp for |p| < 4),
    # which rtol covers on steps above 2.4e-3 and atol on the rest. Measured here: 47% of this allowance.
    torch.testing.assert_close(small - p0, large - p0, rtol=1e-4, atol=1e-7)
    # ||step|| = lr * eta * ||p|| * ||g|| / (||g|| + 1e-8): 1.1e-6 below 0.01 ||p|| plus rounding (2^-24 / 0.01
    # = 6e-6 at most, as LAMB's). Measured over seeds 0-19 of this setup: 1.4e-6.
    assert float((small - p0).norm() / p0.norm()) == pytest.approx(0.01, rel=1e-5)


def test_max_unorm_clips_the_update_norm():
    gen = torch.Generator().manual_seed(6)
    p0 = torch.randn(10000, generator=gen) * 0.01
    grads = [torch.randn(10000, generator=gen) for _ in range(3)]
    free, _ = _run(O.AdamW32bit, p0, grads, lr=1e-2)
    clipped, _ = _run(O.AdamW32bit, p0, grads, lr=1e-2, max_unorm=0.5)
    # Reference: the same steps with ||update / lr|| capped at 0.5 ||p|| (the p before each step).
    p = nn.Parameter(p0.clone())
    ref_opt = torch.optim.AdamW([p], lr=1e-2, foreach=False)
    for g in grads:
        before = p.detach().clone()
        p.grad = g.clone()
        ref_opt.step()
        with torch.no_grad():
            decayed = before * (1 - 1e-2 * 1e-2)
            update = decayed - p
            bound = 0.5 * before.norm() * 1e-2
            if update.norm() > bound:
                p.copy_(decayed - update * (bound / update.norm()))
    # 3 steps x ~8 fp32 roundings (AdamW's, the norm and the clip factor) = 24 x 2^-24 = 1.4e-6 relative,
    # on |p| ~ 0.01 (atol: 1.4e-6 x 0.04, rounded up). Measured here: 3.7e-9 absolute, 1.4% of this allowance.
    torch.testing.assert_close(clipped, p.detach(), rtol=1e-5, atol=1e-7)
    assert float((clipped - p0).norm()) < float((free - p0).norm())


def test_max_unorm_leaves_zero_parameters_free():
    p, _ = _run(O.Adam32bit, torch.zeros(100), [torch.ones(100)], lr=0.1, max_unorm=1.0)
    assert float(p.abs().min()) > 0


def test_percentile_clipping_scales_outlier_gradients():
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(5000, generator=gen)
    grads = [torch.randn(5000, generator=gen) for _ in range(10)]
    grads.append(torch.randn(5000, generator=gen) * 100)  # an outlier step
    clipped, opt = _run(O.SGD32bit, p0, grads, lr=0.1, percentile_clipping=50)
    history = opt.state[next(iter(opt.state))]["gnorm_vec"]
    norms = torch.stack([g.norm() for g in grads])
    # The same norms of 5000 fp32 squares, summed in another order (lowbit in double, torch in fp32): a
    # few ulps at most; rtol 1.3e-6 (11 x 2^-24, torch's fp32 default), no atol (norms ~70). Measured: equal.
    torch.testing.assert_close(history[:11], norms, rtol=1.3e-6, atol=0)
    # Reference: each gradient scaled to at most the median of the norms seen so far.
    p = p0.clone()
    for t, g in enumerate(grads, start=1):
        clip = torch.quantile(norms[:t], 0.5)
        p -= 0.1 * g * (clip / norms[t - 1] if norms[t - 1] > clip else 1.0)
    # 11 steps x ~4 fp32 roundings (clip factor from differently summed norms, lr * g, p -) = 44 x 2^-24 =
    # 2.6e-6 relative on |p| ~ 1. Measured here: 2.4e-7 absolute, 5.8% of this allowance.
    torch.testing.assert_close(clipped, p, rtol=1e-5, atol=1e-6)


def test_scaling_options_are_validated():
    params = [nn.Parameter(torch.randn(10))]
    with pytest.raises(ValueError, match="max_unorm"):
        O.LAMB8bit(params, max_unorm=1.0)
    with pytest.raises(ValueError, match="percentile_clipping"):
        O.Adam8bit(params, percentile_clipping=0)
    with pytest.raises(ValueError, match="max_unorm"):
        O.Adam8bit(params, max_unorm=-1.0)
    with pytest.raises(ValueError, match="trust_coefficient"):
        O.LARS(params, trust_coefficient=-1.0)
