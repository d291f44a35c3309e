"""Numerics of low-bit optimizer states: no decoded second moment of a live block is zero, and the
non-finite policy (include/lowbit/state_form.h, README "Numerics").

Each case here failed on the code before second moments were stored as roots on the zero-free map:
a block-wise 8-bit v decoded as exactly 0 while m survived, and the next small gradient moved the
weight by about lr * m / eps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit.optim as O
from lowbit.functional import create_dynamic_map
from lowbit.optim.state_storage import state_map
from tests.blocks import adjacent_code_ratio, two_gradient_block


@pytest.mark.parametrize(("cls", "ref"), [(O.Adam8bit, torch.optim.Adam), (O.AdamW8bit, torch.optim.AdamW)])
def test_small_gradient_beside_a_large_one_in_its_block(cls, ref):
    # Step 1: g = 10 and 1e-4 in one block; step 2: g = 0. The old 8-bit v of element 1 (1e-10 of the
    # block's) decoded as 0, so step 2 moved it by lr * m / eps: p[1] = -4.2 against torch's -0.00167.
    # Now m and sqrt(v) of element 1 are both 1e-5 of their block absmax. Nearest rounding between
    # codes a < b keeps a value within a factor b / a, so step 2's m / sqrt(v) (and the step, which
    # step 1's exact one only adds to) is within a factor r = R^2 of torch's, R the largest ratio of
    # adjacent codes of either map between 1e-6 and 1e-4.
    r = adjacent_code_ratio(1e-6, 1e-4) ** 2
    got, want = (two_gradient_block(lambda ps, c=c: c(ps, lr=1e-3)) for c in (cls, ref))
    assert float(want[1].abs()) > 5e-4
    assert float((got[1] - want[1]).abs()) <= (r - 1) * float(want[1].abs())
    assert float((got[0] - want[0]).abs()) <= (r - 1) * float(want[0].abs())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_second_moment_map_has_no_zero(bits):
    # DE-0 (Li, Chen, Zhu 2023, section 4.1): the zero code of the unsigned map decodes as its
    # smallest non-zero value, so a second moment of a block with a non-zero scale never decodes as 0.
    code = state_map(False, torch.device("cpu"), bits)
    plain = create_dynamic_map(signed=False, total_bits=bits)
    assert float(code.min()) > 0 and float(code[0]) == float(plain[1])
    assert torch.equal(code[1:], plain[1:])
    assert bool((code[1:] >= code[:-1]).all())


def test_second_moment_state_round_trips_through_torch_layout():
    # load_dequantized_state / dequantized_state speak torch's exp_avg_sq, stored as its root.
    p = nn.Parameter(torch.zeros(8192))
    opt = O.Adam8bit([p])
    v = torch.logspace(-12, 2, 8192)
    opt.load_dequantized_state(p, {"step": torch.tensor(3.0), "exp_avg": torch.zeros(8192), "exp_avg_sq": v})
    back = opt.dequantized_state(p)["exp_avg_sq"]
    assert bool((back > 0).all())
    # v spans 0.44 decades per 256-block, so every root is in the map's top decade, where adjacent codes
    # are at most a factor 1.068 apart: each decoded v is within 1.068^2 of v.
    code = state_map(False, torch.device("cpu"))
    top = code[code >= 0.1]
    r = float((top[1:] / top[:-1]).max()) ** 2
    assert r < 1.15
    assert float((back / v).max()) <= r and float((back / v).min()) >= 1 / r


def _bad_then_ones(n: int, value: float) -> list[torch.Tensor]:
    """Gradients of ones for three steps, the first with ``value`` at element 300."""
    g = torch.ones(n)
    g[300] = value
    return [g, torch.ones(n), torch.ones(n)]


def _step_pair(opt, ref, p: nn.Parameter, twin: nn.Parameter, grad: torch.Tensor) -> None:
    p.grad, twin.grad = grad.clone(), grad.clone()
    opt.step()
    ref.step()


def test_nan_gradient_element_restarts_only_its_own_state():
    # Policy (state_form.h): the step is torch's, so the element with the NaN gradient is NaN in both;
    # its 8-bit states restart from zero and the rest of its block keeps its values. (The old policy
    # stored the block's absmax as NaN, so at the next step all 256 elements of the block were NaN.)
    n = 1024
    p, twin = nn.Parameter(torch.ones(n)), nn.Parameter(torch.ones(n))
    opt, ref = O.Adam8bit([p], lr=1e-2, min_8bit_size=0), torch.optim.Adam([twin], lr=1e-2)
    for grad in _bad_then_ones(n, float("nan")):
        _step_pair(opt, ref, p, twin, grad)
        assert torch.equal(p.isnan(), twin.isnan()) and int(p.isnan().sum()) == 1
        # All other elements got the same gradients: 8-bit states of a constant block are exact.
        torch.testing.assert_close(p[~p.isnan()], twin[~twin.isnan()], rtol=0, atol=1e-6)
    state = opt.dequantized_state(p)
    assert bool(state["exp_avg"].isfinite().all()) and bool(state["exp_avg_sq"].isfinite().all())
    assert bool(opt.state[p]["absmax1"].isfinite().all()) and bool(opt.state[p]["absmax2"].isfinite().all())


@pytest.mark.parametrize("cls", [O.Adam8bit, O.AdamW8bit])
def test_gradient_whose_square_overflows_spares_its_block(cls):
    # g = 1e21: g * g overflows fp32, v = inf, and torch.optim gives the element a zero update. The old
    # 8-bit v block then held an Inf, its absmax was stored as NaN, and the whole block went NaN.
    n = 1024
    ref_cls = torch.optim.AdamW if cls is O.AdamW8bit else torch.optim.Adam
    p, twin = nn.Parameter(torch.ones(n)), nn.Parameter(torch.ones(n))
    opt, ref = cls([p], lr=1e-2, min_8bit_size=0), ref_cls([twin], lr=1e-2)
    first, *rest = _bad_then_ones(n, 1e21)
    _step_pair(opt, ref, p, twin, first)
    decay = 1.0 - 1e-2 * opt.param_groups[0]["weight_decay"]
    assert torch.equal(p.detach(), twin.detach()) and p[300].item() == float(torch.tensor(1.0) * torch.tensor(decay))
    for grad in rest:
        _step_pair(opt, ref, p, twin, grad)
    assert bool(p.isfinite().all())
    # torch's element stays frozen by its infinite v, while lowbit's restarted (two steps of ones since);
    # all others agree.
    others = torch.arange(n) != 300
    torch.testing.assert_close(p[others], twin[others], rtol=0, atol=1e-6)


def test_lion_nan_gradient_shows_and_does_not_freeze_its_block():
    # sign(NaN) is NaN (torch.sign): the element becomes NaN instead of silently not moving, and the
    # rest of its block keeps stepping. The old code took sign(NaN) = 0 and then froze the whole
    # block, whose momentum absmax was NaN, forever.
    n = 1024
    p, twin = nn.Parameter(torch.zeros(n)), nn.Parameter(torch.zeros(n))
    opt, ref = O.Lion8bit([p], lr=1e-2, min_8bit_size=0), O.Lion32bit([twin], lr=1e-2)
    for grad in _bad_then_ones(n, float("nan")):
        _step_pair(opt, ref, p, twin, grad)
    assert torch.equal(p.isnan(), twin.isnan()) and bool(p[300].isnan()) and int(p.isnan().sum()) == 1
    # Every other element took three steps of -lr (sign of a positive momentum).
    torch.testing.assert_close(p[~p.isnan()], torch.full((n - 1,), -0.03), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls", [O.LAMB8bit, O.LAMB32bit, O.LARS8bit, O.LARS32bit])
def test_nan_in_trust_ratio_norms_shows_in_the_whole_tensor(cls):
    # A NaN gradient element makes ||u|| (LAMB) or ||g|| (LARS) NaN. The old code then selected a
    # trust ratio of 1, a step lr / ratio times too large for every element, from then on (p's norm
    # stays NaN). Now the NaN ratio makes the tensor's update NaN: the divergence shows.
    n = 5000
    p = nn.Parameter(torch.linspace(-1, 1, n))
    opt = cls([p], lr=1e-3, min_8bit_size=0)
    g = torch.linspace(-1, 1, n).flip(0)
    g[7] = float("nan")
    p.grad = g
    opt.step()
    assert bool(p.isnan().all())


# The audit's training patterns, run exactly as benchmarks/bench_numerics.py runs them (3 seeds).
# bitsandbytes 0.50.2's 8-bit optimizers on the same runs, measured with
#   python benchmarks/bench_numerics.py --json out.json
# (CPU, torch 2.13.0): mean |p - reference| after the last step, mean over the seeds. LAMB and LARS
# have no trust-ratio twin in bitsandbytes, so their bound is its Adam8bit's, as for everything in the
# issue. Max differences are not compared with bitsandbytes' where they tie within the run-to-run
# chaos of training (ReLU MLP, dense): there the 8-bit run must not end farther from the reference
# than the reference moved any parameter (a diverged run does: 77 times that, before the fix).
BNB_MEAN = {
    "ReLU MLP": {
        "Adam8bit": 1.7365e-4,
        "AdamW8bit": 1.7319e-4,
        "SGD8bit": 3.3206e-5,
        "RMSprop8bit": 1.3881e-3,
        "Adagrad8bit": 1.3196e-3,
        "Lion8bit": 9.6788e-5,
        "LAMB8bit": 1.7365e-4,
        "LARS8bit": 1.7365e-4,
    },
    "rare embedding rows": {"Adam8bit": 1.2549e-3, "AdamW8bit": 1.2544e-3, "LAMB8bit": 1.2549e-3},
    "dense": {"AdamW8bit": 7.61e-4, "LAMB8bit": 7.61e-4},
}
# Rare embedding rows, max |p - reference| of bitsandbytes' Adam8bit / AdamW8bit (same command).
BNB_MAX_RARE_ROWS = {"Adam8bit": 0.093996, "AdamW8bit": 0.095549, "LAMB8bit": 0.093996}


def _bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_numerics
    finally:
        sys.path.pop(0)
    return bench_numerics


@pytest.mark.parametrize(
    ("scenario", "name"), [(s, n) for s, names in BNB_MEAN.items() for n in names], ids=lambda v: str(v)
)
def test_training_patterns_stay_near_torch(scenario, name):
    bench = _bench()
    (run,) = [s for s in bench.SCENARIOS if s.name == scenario]
    (column,) = [c for c in bench.make_columns(None) if c.name == name]
    args = argparse.Namespace(seeds=3, block_size=256, min_8bit_size=4096)
    cell = bench.run_scenario(run, [column], args)[name]
    assert cell.error is None, cell.error
    mean = sum(cell.mean_abs) / len(cell.mean_abs)
    assert mean <= BNB_MEAN[scenario][name], (mean, BNB_MEAN[scenario][name])
    # A sign step flips whole lr steps where the momentum is near 0: two Lion runs can differ by
    # twice what either moved.
    reach = 2.0 if name == "Lion8bit" else 1.0
    for hi, moved in zip(cell.max_abs, cell.reference_moved, strict=True):
        assert hi <= reach * moved, (hi, moved)
    if scenario == "rare embedding rows":
        assert max(cell.max_abs) <= BNB_MAX_RARE_ROWS[name]


# LPMMAdamW with 16-bit parameters and gradients (its optimizer states 8-bit) against torch's AdamW,
# on the same runs; the bound is bitsandbytes' AdamW8bit's mean (above), whose parameters are fp32.
@pytest.mark.parametrize("scenario", ["rare embedding rows", "dense"])
def test_lpmm_adamw_stays_near_torch(scenario):
    bench = _bench()
    (run,) = [s for s in bench.SCENARIOS if s.name == scenario]
    cell = bench.run_lpmm(run, {"param_bits": 16, "grad_bits": 16}, seeds=3)
    assert cell.error is None, cell.error
    mean = sum(cell.mean_abs) / len(cell.mean_abs)
    assert mean <= BNB_MEAN[scenario]["AdamW8bit"], mean
    for hi, moved in zip(cell.max_abs, cell.reference_moved, strict=True):
        assert hi <= moved, (hi, moved)
