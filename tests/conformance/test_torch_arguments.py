"""torch.optim arguments that add a state: ``amsgrad=True`` (Adam, AdamW: ``max_exp_avg_sq``) and
``centered=True`` (RMSprop: ``grad_avg``), at 32 bits against torch.optim, at 8 bits within the
quantization bounds. Before they were implemented these options raised. Their state dicts (torch.optim's,
and lowbit's written before the options existed) are tests/conformance/test_checkpoints.py's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit.optim as O
from lowbit import _ops
from lowbit.optim.optimizer import RULE_CODES
from lowbit.optim.state_storage import state_map
from tests.blocks import adjacent_code_ratio, two_gradient_block
from tests.test_optim import DEFAULT_BOUNDS, _resynced_step_error

# (lowbit name, torch.optim class, hyperparameters)
CASES = [
    ("Adam", torch.optim.Adam, dict(lr=1e-3, amsgrad=True)),
    ("Adam", torch.optim.Adam, dict(lr=1e-3, amsgrad=True, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)),
    ("Adam", torch.optim.Adam, dict(lr=1e-3, amsgrad=True, weight_decay=0.1, maximize=True)),
    ("AdamW", torch.optim.AdamW, dict(lr=1e-3, amsgrad=True, weight_decay=0.1)),
    ("AdamW", torch.optim.AdamW, dict(lr=1e-3, amsgrad=True, weight_decay=0.1, betas=(0.8, 0.99), maximize=True)),
    ("RMSprop", torch.optim.RMSprop, dict(lr=1e-3, centered=True)),
    ("RMSprop", torch.optim.RMSprop, dict(lr=1e-3, centered=True, alpha=0.9, weight_decay=1e-2, maximize=True)),
    ("RMSprop", torch.optim.RMSprop, dict(lr=1e-3, centered=True, momentum=0.9)),
    ("RMSprop", torch.optim.RMSprop, dict(lr=1e-3, centered=True, momentum=0.9, alpha=0.9, weight_decay=1e-2)),
]
IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(CASES)]


def _grad(gen: torch.Generator, n: int, step: int) -> torch.Tensor:
    # Large gradients first, then small ones: exp_avg_sq falls below its running maximum, so AMSGrad
    # differs from Adam. The scale varies along the tensor so blocks have different absmax.
    scale = 3.0 if step < 5 else 0.3
    return scale * torch.randn(n, generator=gen) * (1 + 0.5 * torch.sin(torch.arange(n) / 50.0))


def _pair(name: str, bits: int, tcls: type, kw: dict, p0: torch.Tensor) -> tuple:
    a, b = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    return a, b, getattr(O, f"{name}{bits}bit")([a], **kw), tcls([b], foreach=False, **kw)


@pytest.mark.parametrize(("name", "tcls", "kw"), CASES, ids=IDS)
@pytest.mark.parametrize("n", [1, 4095, 4097, 20000])
def test_fp32_states_match_torch(name, tcls, kw, n):
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen) * 0.1
    a, b, oa, ob = _pair(name, 32, tcls, kw, p0)
    plain = nn.Parameter(p0.clone())  # the option off, to show that it is in play
    off = tcls([plain], foreach=False, **{**kw, "amsgrad" if name != "RMSprop" else "centered": False})
    for step in range(30):
        a.grad = b.grad = plain.grad = _grad(gen, n, step)
        oa.step()
        ob.step()
        off.step()
    # The bound of tests/test_optim.py::test_fp32_states_match_torch: the same fp32 formulas as
    # torch.optim's single-tensor path, up to the order of a few products.
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(b.detach(), plain.detach())
    # fp32 states: rtol as above. A state near 0 is a sum that cancels terms of at most (1 - beta) |g|, about
    # 0.1 * 3 here, so its rounding over 30 steps stays under 30 * 0.3 * 2^-24 = 5.4e-7 absolute: atol 1e-6.
    for key, value in ob.state[b].items():
        torch.testing.assert_close(oa.dequantized_state(a)[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "tcls", "kw"), CASES, ids=IDS)
def test_8bit_states_per_step_error(name, tcls, kw):
    # As tests/test_optim.py::test_8bit_states_per_step_error: each step starts both optimizers from
    # torch's exact state, so the difference is the quantization error of one step, bounded by
    # DEFAULT_BOUNDS[0] = 3%: twice the worst measured there for Adam (1.5%), itself from the 8-bit
    # dynamic map's error of at most 1.05% of a block absmax. Measured here over 20 steps x 3 seeds:
    # at most 1.8% (AMSGrad), 1.2% (centered RMSprop).
    n = 20000
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        a, b, oa, ob = _pair(name, 8, tcls, kw, torch.randn(n, generator=gen) * 0.1)
        for step in range(20):
            assert _resynced_step_error(a, b, oa, ob, _grad(gen, n, step)) < DEFAULT_BOUNDS[0]
        extra = "max_exp_avg_sq" if name != "RMSprop" else "grad_avg"
        assert oa.state[a]["state3"].dtype == torch.uint8  # the extra state is 8-bit too
        assert set(oa.dequantized_state(a)) == set(ob.state[b])
        assert extra in oa.dequantized_state(a)


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
@pytest.mark.parametrize("steps", [2, 5])
def test_amsgrad_small_gradient_beside_a_large_one_in_its_block(cls, steps):
    # tests/test_optim_numerics.py's zero-point case with amsgrad: g = 10 and 1e-4 in one block,
    # then zeros. max_exp_avg_sq of element 1 is 1e-10 of its block's; stored as a root on the
    # zero-free map it decodes within a factor R of the truth (R the largest ratio of adjacent codes
    # between 1e-6 and 1e-4), never as 0, so each step's m / sqrt(max) stays within r = R^2 of
    # torch's instead of reaching lr * m / eps.
    r = adjacent_code_ratio(1e-6, 1e-4) ** 2
    got = two_gradient_block(lambda ps: getattr(O, f"{cls}8bit")(ps, lr=1e-3, amsgrad=True), steps)
    want = two_gradient_block(lambda ps: getattr(torch.optim, cls)(ps, lr=1e-3, amsgrad=True), steps)
    assert float(want[1].abs()) > 5e-4
    for i in (0, 1):
        assert float((got[i] - want[i]).abs()) <= (r - 1) * float(want[i].abs())


def test_centered_small_gradient_beside_a_large_one_in_its_block():
    # The same block for centered RMSprop: square_avg of element 1 (its root 1e-5 of the block's) is
    # floored by the zero-free map and grad_avg^2 is 1% of it, so the variance stays within a factor
    # r = R^2 of torch's (as above) and the step within sqrt(r) of torch's.
    code = state_map(False, torch.device("cpu")).unique()
    near = code[(code > 1e-6) & (code < 1e-4)]
    r = float((near[1:] / near[:-1]).max()) ** 2

    def run(make):
        p = nn.Parameter(torch.zeros(4096))
        opt = make([p])
        g = torch.zeros(4096)
        g[0], g[1] = 10.0, 1e-4
        for _ in range(2):
            p.grad = g.clone()
            opt.step()
        return p.detach()

    got = run(lambda ps: O.RMSprop8bit(ps, lr=1e-3, centered=True))
    want = run(lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True))
    for i in (0, 1):
        assert float((got[i] - want[i]).abs()) <= (r**0.5 - 1) * float(want[i].abs())


@settings(max_examples=20)
@given(seed=st.integers(0, 2**16), scale=st.floats(1e-4, 1e2))
def test_8bit_amsgrad_step_is_never_larger_than_adams(seed, scale):
    # From the same 8-bit exp_avg / exp_avg_sq codes, AMSGrad divides by the larger of the decoded
    # maximum (here random codes, often below v) and the current v: its step is never larger than
    # Adam's, so quantizing the maximum cannot make the denominator smaller than Adam's.
    gen = torch.Generator().manual_seed(seed)
    n = 4096 + 300
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * scale
    codes = [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for _ in range(3)]
    absmax = [torch.rand(_ops.num_blocks(n, 256), generator=gen) * scale for _ in range(3)]
    signed, unsigned = state_map(True, p.device), state_map(False, p.device)
    hyper = [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.0, 1.0, 0.0, 0.0, 0.0]
    moved = []
    for rule, n_states in ((RULE_CODES["adam"], 2), (RULE_CODES["adam_amsgrad"], 3)):
        q = [p.clone()]
        states = [[c.clone()] if k < n_states else [] for k, c in enumerate(codes)]
        scales = [[a.clone()] if k < n_states else [] for k, a in enumerate(absmax)]
        _ops.optimizer_step_(
            q,
            [g],
            *states,
            *scales,
            [1e-2, 0.3, 0.0],
            None,
            signed,
            unsigned,
            unsigned,
            rule,
            hyper,
            0,
            0,
            n_states,
            256,
        )
        moved.append((q[0] - p).abs())
    assert bool((moved[1] <= moved[0]).all())
    assert bool((moved[1] < moved[0]).any())  # the maximum is in play
