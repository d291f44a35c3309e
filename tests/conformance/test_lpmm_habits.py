"""PyTorch training habits on an LPMM-converted model: gradient clipping, zero_grad, GradScaler and
failed steps behave as torch's, or raise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit.lpmm as lpmm
from lowbit.optim import LPMMSGD, LPMMAdamW

# fp32 unit roundoff.
U = 2.0**-24


def _model(seed: int = 0, grad_bits: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 96), nn.ReLU(), nn.Linear(96, 5))
    return lpmm.convert(
        model, param_bits=12, grad_bits=grad_bits, group_size=64, generator=torch.Generator().manual_seed(seed)
    )


def _batch(seed: int = 0, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)


def _lps(model: nn.Module) -> list[lpmm.LowPrecisionParameter]:
    return list(lpmm.low_precision_parameters(model).values())


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[object]:
    out: list[object] = []
    for lp in _lps(model):
        out += [lp.codes.clone(), lp.absmax.clone(), lp.grad_codes.clone(), lp.grad_absmax.clone(), lp.has_grad]
    for p in [p for g in opt.param_groups for p in g["params"]]:
        state = opt.state.get(p, {})
        out.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _backward(model: nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    x, y = _batch(seed)
    (F.cross_entropy(model(x), y) * scale).backward()


def _torch_clip(grads: list[torch.Tensor], max_norm: float, norm_type: float) -> tuple[torch.Tensor, list]:
    ps = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type)
    return total, [p.grad for p in ps]


# -- clip_grad_norm_ ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [1e-3, 0.1, 1e6])
@pytest.mark.parametrize("which", ["lowbit", "torch", "torch_foreach"])
def test_clip_grad_norm_matches_torch_on_the_dequantized_gradient(which, max_norm, norm_type):
    model = _model()
    _backward(model)
    grads = [lp.grad.clone() for lp in _lps(model)]
    want_total, want = _torch_clip(grads, max_norm, norm_type)
    if which == "lowbit":
        total = lpmm.clip_grad_norm_(model, max_norm, norm_type)
    else:
        total = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm, norm_type, foreach=True if which == "torch_foreach" else None
        )
    # Same per-tensor norms of the same fp32 values, combined the same way: the same total.
    assert torch.equal(total, want_total)
    # The clip scales each group's absmax by c (codes unchanged): fl(l * fl(a * c)) against torch's
    # fl(c * fl(l * a)) for the decoded level l (blockwise.h linear_decode); each is within (1 + U)^2 of
    # l * a * c, so they differ by at most 4U + O(U^2) < 5U of the reference.
    for lp, w in zip(_lps(model), want, strict=True):
        got = lp.grad
        assert torch.all((got - w).abs() <= 5 * U * w.abs()), (max_norm, norm_type)


def test_clip_grad_norm_error_if_nonfinite_and_params_without_gradients():
    model = _model()
    assert float(lpmm.clip_grad_norm_(model.parameters(), 1.0)) == 0.0  # no gradients yet, as torch
    _backward(model, scale=math.inf)
    with pytest.raises(RuntimeError, match="non-finite"):
        lpmm.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


# -- clip_grad_value_ --------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(clip=st.floats(1e-4, 0.2), seed=st.integers(0, 50), grad_bits=st.sampled_from([6, 8, 12]))
def test_clip_grad_value_matches_torch_within_one_quantization_step(clip, seed, grad_bits):
    model = _model(seed, grad_bits)
    _backward(model, seed)
    want = [lp.grad.clamp(-clip, clip) for lp in _lps(model)]
    lpmm.clip_grad_value_(model.parameters(), clip)
    qmax = 2 ** (grad_bits - 1) - 1
    for lp, w in zip(_lps(model), want, strict=True):
        pad = -w.numel() % 64
        got = F.pad(lp.grad.reshape(-1), (0, pad)).reshape(-1, 64)
        w = F.pad(w.reshape(-1), (0, pad)).reshape(-1, 64)
        # Re-encoded against the clamped group's absmax a' (<= clip) with stochastic rounding: within one
        # step a' / qmax of the clamped value (blockwise.h linear_code_stochastic), plus the fp32 rounding
        # of the decode (U relative).
        step = w.abs().amax(1, keepdim=True) / qmax
        assert torch.all((got - w).abs() <= step * (1 + 4 * U) + U * w.abs())
        # Codes decode to at most the group absmax, the clamped group's (torch's clamp bounds it by fp32(clip)).
        assert torch.all(got.abs().amax(1) <= w.abs().amax(1))


def test_torch_clip_grad_value_raises_and_names_the_lowbit_function():
    model = _model()
    _backward(model)
    before = [lp.grad.clone() for lp in _lps(model)]
    with pytest.raises(RuntimeError, match=r"lowbit\.lpmm\.clip_grad_value_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    assert all(torch.equal(b, lp.grad) for b, lp in zip(before, _lps(model), strict=True))


# -- zero_grad ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_cls", [LPMMAdamW, LPMMSGD])
@pytest.mark.parametrize("who", ["model", "optimizer"])
def test_zero_grad_set_to_none_discards_the_gradient(who, opt_cls):
    model = _model()
    opt = opt_cls(model.parameters(), lr=0.1)
    _backward(model)
    (model if who == "model" else opt).zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = _snapshot(model, opt)
    opt.step()
    # torch skips parameters whose .grad is None: nothing changes, not even the step counters.
    assert _same(before, _snapshot(model, opt))


@pytest.mark.parametrize("who", ["model", "optimizer"])
def test_zero_grad_set_to_false_steps_a_zero_gradient_as_torch(who):
    model = _model()
    ref = nn.Sequential(nn.Linear(20, 96), nn.ReLU(), nn.Linear(96, 5))
    ref.load_state_dict(lpmm.export_float(model))
    opt = LPMMAdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0)
    for m in (model, ref):
        _backward(m)
    (model if who == "model" else opt).zero_grad(set_to_none=False)
    ref_opt.zero_grad(set_to_none=False)
    assert all(float(lp.grad.abs().max()) == 0.0 for lp in _lps(model))
    codes = [lp.codes.clone() for lp in _lps(model)]
    opt.step()
    ref_opt.step()
    # A zero gradient on fresh moments: torch counts the step and moves nothing (update 0 / eps).
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"]) == 1.0
    assert all(torch.equal(c, lp.codes) for c, lp in zip(codes, _lps(model), strict=True))


# -- GradScaler --------------------------------------------------------------------------------------


def _run(scaled: bool, steps: int, bad: int) -> tuple[list[list[torch.Tensor]], list[float]]:
    model = _model(grad_bits=8)
    opt = LPMMAdamW(model.parameters(), lr=1e-2, generator=torch.Generator().manual_seed(7))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if scaled else None
    trace, scales = [], []
    for step in range(steps):
        inject = math.inf if step == bad else 1.0
        if scaler is None:
            _backward(model, step, inject)
            if step == bad:  # the unscaled run discards this step (same seeds drawn by its backward)
                opt.zero_grad()
            else:
                opt.step()
                opt.zero_grad()
        else:
            x, y = _batch(step)
            scaler.scale(F.cross_entropy(model(x), y) * inject).backward()
            before = _snapshot(model, opt)
            scaler.step(opt)
            scaler.update()
            if step == bad:
                after = _snapshot(model, opt)
                # Parameters and optimizer state unchanged (the accumulators, unscaled, are cleared below).
                n = 5 * len(_lps(model))
                keep = [i for i in range(len(before)) if i >= n or i % 5 in (0, 1)]
                assert _same([before[i] for i in keep], [after[i] for i in keep])
            scales.append(float(scaler.get_scale()))
            opt.zero_grad()
        trace.append([lp.codes.clone() for lp in _lps(model)])
    return trace, scales


def test_grad_scaler_unscales_and_skips_non_finite_steps():
    steps, bad = 6, 2
    scaled, scales = _run(True, steps, bad)
    plain, _ = _run(False, steps, bad)
    assert scales[bad - 1] == 2.0**16 and scales[bad] == 2.0**15
    # Scaling by 2^16 and unscaling by 2^-16 are exact in fp32 (powers of two, no overflow), and the
    # accumulator's codes are scale-invariant (normalised by the group absmax, same rounding draws):
    # the scaled run follows the unscaled one bit for bit, the skipped step included.
    for a, b in zip(scaled, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_grad_scaler_unscale_then_clip():
    model = _model()
    opt = LPMMAdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = _batch()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaled = [lp.grad.clone() for lp in _lps(model)]
    scaler.unscale_(opt)
    # Unscaling multiplies each group absmax by 2^-10: exact.
    assert all(torch.equal(lp.grad, s * 2.0**-10) for lp, s in zip(_lps(model), scaled, strict=True))


# -- failed steps change nothing ---------------------------------------------------------------------


ADAM_BAD = [
    ("lr", -1.0),
    ("lr", "x"),
    ("lr", math.nan),
    ("eps", -1e-8),
    ("betas", (2.0, 0.5)),
    ("betas", (0.9, -0.1)),
    ("betas", 0.9),
    ("weight_decay", -0.1),
    ("weight_decay", None),
]
SGD_BAD = [("lr", -1.0), ("momentum", 1.5), ("momentum", -0.1), ("weight_decay", -1.0), ("nesterov", "yes")]


@pytest.mark.parametrize("opt_cls,option,value", [(LPMMAdamW, *b) for b in ADAM_BAD] + [(LPMMSGD, *b) for b in SGD_BAD])
def test_bad_hyperparameter_in_a_later_group_raises_before_anything_changes(opt_cls, option, value):
    model = _model()
    opt = opt_cls([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
    opt.state.clear()  # states are then created by the step: a failed one must not leave any
    _backward(model)
    opt.param_groups[1][option] = value
    before = _snapshot(model, opt)
    n_state = len(opt.state)
    with pytest.raises((ValueError, TypeError), match=rf"param_groups\[1\].*{option}"):
        opt.step()
    assert len(opt.state) == n_state
    assert _same(before, _snapshot(model, opt))


def test_layout_mismatch_midway_changes_nothing():
    model = _model()
    opt = LPMMAdamW(model.parameters(), lr=0.1)
    _backward(model)
    # Corrupt the last parameter's state so that the layout check fails after the others were seen.
    last = list(model.parameters())[-1]
    opt.state[last]["absmax1"] = torch.zeros(opt.state[last]["absmax1"].numel() + 1)
    before = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match="layout"):
        opt.step()
    assert _same(before, _snapshot(model, opt))
