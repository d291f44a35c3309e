"""Checkpoint migration: every way a saved state reaches a lowbit optimizer in a form other than its own.

The paths: a torch.optim state dict into its lowbit twin (options that add a state included; Muon's, of a
matrix, and back), a lowbit
state dict of another ``optim_bits`` or ``block_size``, one written before an option added a state, and
one of state format 1 (second moments on the unsigned map, lowbit 0.1.0) for the block-wise and the LPMM
optimizers; a state dict of a newer format is refused. Each test checks the state right after the load
against what the checkpoint held (exactly, or within the half code gap of one encode), the loaded
hyperparameters against the checkpoint's (the loading optimizer is built with others), and the first
step after the load against torch.optim's step from the checkpoint's state.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

import lowbit._reference as R
import lowbit.optim as O
from lowbit import _ops
from lowbit.functional import create_dynamic_map
from lowbit.optim.state_storage import optimizer_state_map, state_map, stored_width
from tests.blocks import block_absmax, half_code_gap
from tests.test_optim import DEFAULT_BOUNDS, FOUR_BIT_BOUNDS, _relative

# One step from states that are an encode of torch's (as after every load here that converts a state):
# tests/test_optim.py's re-synced per-step bound, 3% relative L2 of the update (twice the worst measured
# there, which the 8-bit map's error of at most 1.05% of a block absmax gives).
STEP_BOUND = DEFAULT_BOUNDS[0]

# (torch.optim class, lowbit name, hyperparameters); the last four add a state (max_exp_avg_sq, grad_avg).
TWINS = [
    (torch.optim.Adam, "Adam", dict(lr=1e-2)),
    (torch.optim.AdamW, "AdamW", dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.SGD, "SGD", dict(lr=1e-2, momentum=0.9)),
    (torch.optim.RMSprop, "RMSprop", dict(lr=1e-3)),
    (torch.optim.Adagrad, "Adagrad", dict(lr=1e-2)),
    (torch.optim.Adam, "Adam", dict(lr=1e-2, amsgrad=True)),
    (torch.optim.AdamW, "AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (torch.optim.RMSprop, "RMSprop", dict(lr=1e-3, centered=True)),
    (torch.optim.RMSprop, "RMSprop", dict(lr=1e-3, centered=True, momentum=0.9)),
]
# Hyperparameters of the optimizer that loads, none of them the checkpoint's: a load that kept them would
# step differently from torch.
OTHERS = dict(lr=0.5, weight_decay=0.3)
# The opt-in rank-1 normalised second moments of 4-bit matrices (include/lowbit/rank1.h).
RANK1 = {"rank1_normalization": True}
# The opt-in factorized second moments of 4-bit matrices (lowbit/optim/factored.py).
FACTORED = {"factored": True}


def _grad(gen: torch.Generator, n: int, step: int) -> torch.Tensor:
    # Large gradients first, then small ones: exp_avg_sq falls below its running maximum, so AMSGrad
    # differs from Adam. The scale varies along the tensor so blocks have different absmax.
    scale = 3.0 if step < 5 else 0.3
    return scale * torch.randn(n, generator=gen) * (1 + 0.5 * torch.sin(torch.arange(n) / 50.0))


def _assert_encoded(got: torch.Tensor, want: torch.Tensor, signed: bool, block: int, bits: int = 8) -> None:
    """``got`` is ``want`` encoded once at ``bits`` bits in blocks of ``block`` and decoded: each element within
    h times its block's absmax, h = half_code_gap (1e-6 relative for fp32 rounding). A second moment
    (unsigned) is stored as its root w: |w'^2 - w^2| <= |w' - w| (2 w + |w' - w|), with |w' - w| <= h absmax(w)."""
    got, want = got.reshape(-1), want.reshape(-1)
    if signed:
        bound = half_code_gap(True, bits) * block_absmax(want, block)
    else:
        d = half_code_gap(False, bits) * block_absmax(want.sqrt(), block)
        bound = d * (2 * want.sqrt() + d)
    err = (got - want).abs()
    assert bool((err <= bound * (1 + 1e-5) + 1e-6 * want.abs()).all()), float((err - bound).max())


def _assert_loaded(opt: O.LowbitOptimizer, p: nn.Parameter, want: dict[str, torch.Tensor], block: int) -> None:
    """The state of ``p`` after a load is ``want`` (torch's layout): exactly at 32 bits, as one encode at 8 or
    4."""
    got = opt.dequantized_state(p)
    assert set(got) == set(want) | {"step"}, sorted(got)
    for k, name in enumerate(opt._state_names):
        if name not in want:
            continue
        width = stored_width(opt.state[p][f"state{k + 1}"], p.numel())
        if width != 32:
            _assert_encoded(got[name], want[name], opt._state_signed[k], block, width)
        else:
            assert torch.equal(got[name], want[name].float()), name


def _assert_same_hyperparameters(opt: torch.optim.Optimizer, ref: dict[str, Any]) -> None:
    group = opt.param_groups[0]
    for key, value in ref.items():
        if key not in ("params", "foreach", "fused", "capturable", "differentiable"):
            assert group[key] == value, (key, group[key], value)


def _torch_step(
    tcls: type, group: dict[str, Any], p0: torch.Tensor, state: dict[str, torch.Tensor], grad: torch.Tensor
) -> torch.Tensor:
    """The parameter after one step of ``tcls`` (single-tensor path) from ``p0`` and ``state`` (torch's
    layout) with ``group``'s hyperparameters."""
    p = nn.Parameter(p0.clone())
    ref = tcls([p], foreach=False)
    groups = [{**{k: v for k, v in group.items() if k in ref.param_groups[0]}, "params": [0]}]
    ref.load_state_dict({"state": {0: {k: v.clone() for k, v in state.items()}}, "param_groups": groups})
    p.grad = grad.clone()
    ref.step()
    return p.detach()


def _step(opt: torch.optim.Optimizer, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    p.grad = grad.clone()
    opt.step()
    return p.detach().clone()


def _stepped(opt: torch.optim.Optimizer, p: nn.Parameter, grad: torch.Tensor, released: bool) -> torch.Tensor:
    """:func:`_step`, or for an optimizer under gradient release (lowbit.optim.step_in_backward) a backward
    pass whose gradient is ``grad`` (d/dp sum(p * grad) = grad exactly), which steps ``p`` and frees it."""
    if not released:
        return _step(opt, p, grad)
    (p * grad).sum().backward()
    assert p.grad is None
    return p.detach().clone()


def _assert_step(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, exact: bool, bits: int = 8) -> None:
    if exact:
        # The same fp32 formulas as torch's single-tensor path (tests/test_optim.py).
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        bound = STEP_BOUND if bits == 8 else FOUR_BIT_BOUNDS[0]
        assert _relative(got - before, want - before) < bound, _relative(got - before, want - before)


# -- torch.optim state dicts --------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize(("tcls", "name", "kw"), TWINS, ids=[f"{t[1]}-{i}" for i, t in enumerate(TWINS)])
def test_torch_state_dict_loads_into_the_lowbit_twin(tcls, name, kw, bits):
    # Used to fail at the next step with KeyError: 'block_size' (torch's groups lack lowbit's options).
    # The twin is built without amsgrad / centered: the options, and their states (max_exp_avg_sq,
    # grad_avg), come from torch's state dict under their names.
    n = 5000
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(n, generator=gen))
    ref = tcls([p], foreach=False, **kw)
    for step in range(6):
        p.grad = _grad(gen, n, step)
        ref.step()
    q = nn.Parameter(p.detach().clone())
    opt = getattr(O, f"{name}{bits}bit")([q], **OTHERS)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["optim_bits"] == bits and opt.param_groups[0]["block_size"] == 256
    _assert_same_hyperparameters(opt, ref.param_groups[0])
    _assert_loaded(opt, q, {k: v for k, v in ref.state[p].items() if k != "step"}, 256)
    dtype = torch.uint8 if bits == 8 else torch.float32
    assert all(v.dtype == dtype for key, v in opt.state[q].items() if key.startswith("state"))
    before = p.detach().clone()
    grad = _grad(gen, n, 6)
    want, got = _step(ref, p, grad), _step(opt, q, grad)
    if "step" in ref.state[p]:  # torch.optim.SGD counts no steps
        assert float(opt.state[q]["step"]) == float(ref.state[p]["step"]) == 7
    _assert_step(got, want, before, exact=bits == 32)
    # And back: lowbit's state in torch's layout loads into torch.optim and steps as lowbit's 32-bit twin.
    twin = nn.Parameter(q.detach().clone())
    back = tcls([twin], foreach=False, **kw)
    back.load_state_dict({"state": {0: opt.dequantized_state(q)}, "param_groups": ref.state_dict()["param_groups"]})
    mine = getattr(O, f"{name}32bit")([nn.Parameter(q.detach().clone())], **OTHERS)
    mine.load_state_dict(back.state_dict())
    (r,) = mine.param_groups[0]["params"]
    grad = _grad(gen, n, 7)
    torch.testing.assert_close(_step(mine, r, grad), _step(back, twin, grad), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")
@pytest.mark.parametrize("bits", [8, 32])
def test_torch_muon_state_dict_loads_into_the_lowbit_twin_and_back(bits):
    # Muon steps matrices and takes no foreach, so it has its own case. Its steps after a load are
    # compared bit for bit: Muon32bit is torch.optim.Muon bit for bit (tests/test_muon.py), so once both
    # hold the same buffer values they step alike.
    shape = (64, 96)
    gen = torch.Generator().manual_seed(0)
    grads = [_grad(gen, shape[0] * shape[1], step).reshape(shape) for step in range(8)]
    p = nn.Parameter(torch.randn(shape, generator=gen))
    ref = torch.optim.Muon([p], lr=0.02)
    for g in grads[:6]:
        _step(ref, p, g)
    q = nn.Parameter(p.detach().clone())
    opt = getattr(O, f"Muon{bits}bit")([q], **OTHERS, min_8bit_size=0)
    opt.load_state_dict(ref.state_dict())
    _assert_same_hyperparameters(opt, ref.param_groups[0])
    _assert_loaded(opt, q, {"momentum_buffer": ref.state[p]["momentum_buffer"]}, 256)
    assert opt.state[q]["state1"].dtype == (torch.uint8 if bits == 8 else torch.float32)
    # The next step is torch's from the loaded buffer (exactly torch's at 32 bits).
    held = opt.dequantized_state(q)["momentum_buffer"]
    from_held = torch.optim.Muon([r := nn.Parameter(q.detach().clone())], lr=0.02)
    from_held.load_state_dict(
        {"state": {0: {"momentum_buffer": held.clone()}}, "param_groups": ref.state_dict()["param_groups"]}
    )
    assert torch.equal(_step(opt, q, grads[6]), _step(from_held, r, grads[6]))
    # And back: lowbit's state in torch's layout loads into torch.optim.Muon, which steps as lowbit's twin.
    twin = nn.Parameter(q.detach().clone())
    back = torch.optim.Muon([twin], lr=0.02)
    back.load_state_dict({"state": {0: opt.dequantized_state(q)}, "param_groups": ref.state_dict()["param_groups"]})
    mine = O.Muon32bit([nn.Parameter(q.detach().clone())], **OTHERS)
    mine.load_state_dict(back.state_dict())
    (m,) = mine.param_groups[0]["params"]
    assert torch.equal(_step(mine, m, grads[7]), _step(back, twin, grads[7]))


@pytest.mark.parametrize("release", [False, True], ids=["loop", "release"])
@pytest.mark.parametrize("bits", [8, 32])
def test_muon_state_dict_round_trips_and_resumes_bit_for_bit(bits, release):
    # With release, the checkpoint is written and resumed under gradient release: the run must still be the
    # ordinary loop's (opt) bit for bit.
    shape = (64, 96)
    gen = torch.Generator().manual_seed(1)
    grads = [_grad(gen, shape[0] * shape[1], step).reshape(shape) for step in range(6)]
    p = nn.Parameter(torch.randn(shape, generator=gen))
    mine = nn.Parameter(p.detach().clone())
    opt = getattr(O, f"Muon{bits}bit")([p], lr=0.02, min_8bit_size=0)
    saving = getattr(O, f"Muon{bits}bit")([mine], lr=0.02, min_8bit_size=0)
    if release:
        O.step_in_backward(saving)
    for g in grads[:3]:
        assert torch.equal(_step(opt, p, g), _stepped(saving, mine, g, release))
    saved = io.BytesIO()
    torch.save(saving.state_dict(), saved)
    q = nn.Parameter(mine.detach().clone())
    resumed = getattr(O, f"Muon{bits}bit")([q], **OTHERS, min_8bit_size=0)
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    if release:
        O.step_in_backward(resumed)
    for g in grads[3:]:
        assert torch.equal(_step(opt, p, g), _stepped(resumed, q, g, release))
    assert torch.equal(opt.state[p]["state1"], resumed.state[q]["state1"])
    assert float(resumed.state[q]["step"]) == 6


@pytest.mark.parametrize("release", [False, True], ids=["loop", "release"])
@pytest.mark.parametrize(
    ("bits", "rounding"), [(4, "nearest"), (8, "nearest"), (32, "nearest"), (4, "stochastic"), (8, "stochastic")]
)
def test_ademamix_state_dict_round_trips_and_resumes_bit_for_bit(bits, rounding, release):
    # bitsandbytes#1382: AdEMAMix8bit gave NaN after load_state_dict with t_alpha / t_beta3 set. The resumed
    # optimizer is built without the warm-ups and with other hyperparameters: the checkpoint's come back, and
    # its three states and step count continue the run exactly (the same codes, the same parameters). With
    # release, the checkpoint is written and resumed under gradient release, against the ordinary loop (opt).
    # Stochastic rounding: the resumed optimizer draws another rounding_seed and rounds to nearest until the
    # checkpoint's option and seed come back (a lost seed or step gives other draws, other codes).
    n = 5000
    gen = torch.Generator().manual_seed(2)
    grads = [_grad(gen, n, step) for step in range(8)]
    p = nn.Parameter(torch.randn(n, generator=gen))
    mine = nn.Parameter(p.detach().clone())
    kw = dict(lr=1e-2, betas=(0.8, 0.99, 0.999), alpha=4.0, t_alpha=6, t_beta3=6, weight_decay=0.1, rounding=rounding)
    size = {"min_4bit_size": 0} if bits == 4 else {}
    torch.manual_seed(5)  # the same rounding_seed for opt and saving
    opt = O.AdEMAMix([p], optim_bits=bits, **kw, **size)
    torch.manual_seed(5)
    saving = O.AdEMAMix([mine], optim_bits=bits, **kw, **size)
    if release:
        O.step_in_backward(saving)
    for g in grads[:3]:
        assert torch.equal(_step(opt, p, g), _stepped(saving, mine, g, release))
    saved = io.BytesIO()
    torch.save(saving.state_dict(), saved)
    q = nn.Parameter(mine.detach().clone())
    resumed = O.AdEMAMix([q], optim_bits=bits, **OTHERS, **size)
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    _assert_same_hyperparameters(resumed, kw)
    if release:
        O.step_in_backward(resumed)
    for g in grads[3:]:
        got = _stepped(resumed, q, g, release)
        assert bool(got.isfinite().all())
        assert torch.equal(_step(opt, p, g), got)
    for key in ("state1", "state2", "state3"):
        assert torch.equal(opt.state[p][key], resumed.state[q][key]), key
    assert float(resumed.state[q]["step"]) == 8


@pytest.mark.parametrize(("src_bits", "dst_bits"), [(32, 8), (8, 32)])
def test_ademamix_state_dict_of_other_optim_bits_is_converted(src_bits, dst_bits):
    # The three states are re-laid out like Adam's: each element within one encode of what was saved.
    n = 5000
    gen = torch.Generator().manual_seed(3)
    p = nn.Parameter(torch.randn(n, generator=gen))
    src = getattr(O, f"AdEMAMix{src_bits}bit")([p], lr=1e-2, t_alpha=10)
    for step in range(3):
        _step(src, p, _grad(gen, n, step))
    q = nn.Parameter(p.detach().clone())
    opt = getattr(O, f"AdEMAMix{dst_bits}bit")([q], **OTHERS)
    opt.load_state_dict(src.state_dict())
    assert opt.param_groups[0]["optim_bits"] == dst_bits and opt.param_groups[0]["t_alpha"] == 10
    assert all(stored_width(opt.state[q][f"state{k}"], n) == dst_bits for k in (1, 2, 3))
    held = src.dequantized_state(p)
    assert set(held) == {"step", "exp_avg_fast", "exp_avg_sq", "exp_avg_slow"}
    _assert_loaded(opt, q, {k: v for k, v in held.items() if k != "step"}, 256)


def test_torch_second_moment_under_the_maps_floor_steps_no_further_than_torchs():
    # One block whose largest root is 100 holds an element with v = 1e-12 (root 1e-6, 1e-8 of the block's,
    # under half the unsigned map's smallest non-zero code, 3.25e-7): its root encodes to code 0. Its first
    # moment is the block's absmax of m, which the signed map holds exactly (code 1). Code 0 decodes as the
    # map's smallest non-zero value (DE-0, state_storage.state_map), which is above the true root: the next
    # step's sqrt(v) can only be larger than torch's, so that element's step is at most torch's, with its
    # sign. Decoded as 0 instead, the step would be lr * m_hat / eps, about 1000 times torch's here.
    n = 256
    m, v = torch.zeros(n), torch.zeros(n)
    m[0], m[1], v[0], v[1] = 1e-4, 1e-4, 1e4, 1e-12
    p = nn.Parameter(torch.zeros(n))
    ref = torch.optim.Adam([p], lr=1e-3, foreach=False)
    ref.load_state_dict(
        {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": m, "exp_avg_sq": v}},
            "param_groups": ref.state_dict()["param_groups"],
        }
    )
    q = nn.Parameter(torch.zeros(n))
    opt = O.Adam8bit([q], min_8bit_size=0)
    opt.load_state_dict(ref.state_dict())
    want, got = _step(ref, p, torch.zeros(n)), _step(opt, q, torch.zeros(n))
    assert float(want[1]) < 0
    assert float(want[1]) * (1 + 1e-5) <= float(got[1]) < 0


# -- lowbit state dicts of another layout ---------------------------------------------------------------


def _trained(cls: type, n: int, steps: int, seed: int, **kw: Any) -> tuple[nn.Parameter, O.LowbitOptimizer]:
    gen = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(n, generator=gen))
    opt = cls([p], **kw)
    for step in range(steps):
        _step(opt, p, _grad(gen, n, step))
    return p, opt


@pytest.mark.parametrize(("src_bits", "dst_bits"), [(32, 8), (8, 32), (32, 4), (4, 32), (8, 4), (4, 8)])
def test_state_dict_of_other_optim_bits_is_converted(src_bits, dst_bits):
    # 32 -> 8 used to take optim_bits=32 from the checkpoint's param group: the Adam8bit silently ran 32-bit.
    n = 5000
    kw = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01)
    p, src = _trained(getattr(O, f"Adam{src_bits}bit"), n, 3, 1, **kw)
    q = nn.Parameter(p.detach().clone())
    opt = getattr(O, f"Adam{dst_bits}bit")([q], **OTHERS)
    opt.load_state_dict(src.state_dict())
    assert opt.param_groups[0]["optim_bits"] == dst_bits
    _assert_same_hyperparameters(opt, kw)
    assert stored_width(opt.state[q]["state1"], n) == stored_width(opt.state[q]["state2"], n) == dst_bits
    held = src.dequantized_state(p)
    _assert_loaded(opt, q, {k: v for k, v in held.items() if k != "step"}, opt.param_groups[0]["block_size"])
    # The next step is torch's from the state the checkpoint held: to rounding when that state is loaded
    # exactly (into fp32 states), within the one-encode step bound of the width when it is encoded.
    grad = _grad(torch.Generator().manual_seed(2), n, 3)
    want = _torch_step(torch.optim.Adam, src.param_groups[0], p.detach(), held, grad)
    _assert_step(_step(opt, q, grad), want, p.detach(), exact=dst_bits == 32, bits=dst_bits)
    assert float(opt.state[q]["step"]) == 4


@pytest.mark.parametrize(("src_block", "dst_block"), [(256, 128), (128, 2048)])
def test_state_dict_of_another_block_size_is_relaid_out(src_block, dst_block):
    n = 5000
    kw = dict(lr=1e-2, betas=(0.8, 0.99))
    p, src = _trained(O.Adam8bit, n, 3, 1, block_size=src_block, **kw)
    q = nn.Parameter(p.detach().clone())
    opt = O.Adam8bit([q], block_size=dst_block, **OTHERS)
    opt.load_state_dict(src.state_dict())
    assert opt.param_groups[0]["block_size"] == dst_block
    _assert_same_hyperparameters(opt, kw)
    assert opt.state[q]["absmax1"].numel() == opt.state[q]["absmax2"].numel() == (n + dst_block - 1) // dst_block
    # Re-encoding the decoded values into the new blocks moves each by at most half a code gap.
    held = src.dequantized_state(p)
    _assert_loaded(opt, q, {k: v for k, v in held.items() if k != "step"}, dst_block)
    grad = _grad(torch.Generator().manual_seed(2), n, 3)
    want = _torch_step(torch.optim.Adam, src.param_groups[0], p.detach(), held, grad)
    _assert_step(_step(opt, q, grad), want, p.detach(), exact=False)


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize(
    ("name", "tcls", "kw", "extra"),
    [
        ("Adam", torch.optim.Adam, dict(amsgrad=True), "max_exp_avg_sq"),
        ("RMSprop", torch.optim.RMSprop, dict(centered=True), "grad_avg"),
    ],
)
def test_lowbit_state_dicts_round_trip_and_old_ones_load(name, tcls, kw, extra, bits):
    n = 5000
    gen = torch.Generator().manual_seed(1)
    p = nn.Parameter(torch.randn(n, generator=gen))
    opt = getattr(O, f"{name}{bits}bit")([p], lr=1e-3, **kw)
    for step in range(3):
        p.grad = _grad(gen, n, step)
        opt.step()
    saved = opt.state_dict()
    assert "state3" in saved["state"][0]
    # A lowbit state dict round-trips bit for bit.
    q = nn.Parameter(p.detach().clone())
    other = getattr(O, f"{name}{bits}bit")([q], lr=1e-3, **kw)
    other.load_state_dict(saved)
    grad = _grad(gen, n, 3)
    p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    other.step()
    assert torch.equal(p.detach(), q.detach())
    # A state dict written before these options existed (no option in its group, no extra state)
    # loads into an optimizer that has the option on: the extra state starts at zero, as torch's.
    old = getattr(O, f"{name}{bits}bit")([nn.Parameter(p.detach().clone())], lr=1e-3)
    p.grad = _grad(gen, n, 4)
    (o,) = old.param_groups[0]["params"]
    o.grad = p.grad.clone()
    old.step()
    legacy = old.state_dict()
    for group in legacy["param_groups"]:
        group.pop("amsgrad", None)
        group.pop("centered", None)
    assert "state3" not in legacy["state"][0]
    fresh = nn.Parameter(o.detach().clone())
    new = getattr(O, f"{name}{bits}bit")([fresh], lr=1e-3, **kw)
    new.load_state_dict(legacy)
    # The old states are the checkpoint's exactly (the same codes, or the same fp32 values).
    held = old.dequantized_state(o)
    got = new.dequantized_state(fresh)
    assert all(torch.equal(got[k], v) for k, v in held.items()), sorted(held)
    assert not bool(got[extra].any())
    # The next step is torch's (with the option on) from the checkpoint's states and a zero extra state.
    # The states lowbit steps from decode to exactly those, and the step's update is computed in fp32
    # before it encodes the new states, so at 8 bits too it is torch's to rounding.
    grad = _grad(gen, n, 5)
    group = {**old.param_groups[0], **kw}
    want = _torch_step(tcls, group, o.detach(), {**held, extra: torch.zeros(n)}, grad)
    _assert_step(_step(new, fresh, grad), want, o.detach(), exact=True)
    assert new.state[fresh]["state3"].dtype == (torch.uint8 if bits == 8 else torch.float32)


def _assert_rank1_encoded(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` is the second moment ``want`` (a matrix) encoded once normalised rank-1 and decoded: each root w
    within h times its scale min(max of its row, max of its column) of the roots (h = half_code_gap of the
    4-bit root map), so |w'^2 - w^2| <= d (2 w + d) with d = h * scale (1e-6 relative for fp32 rounding)."""
    w = want.sqrt()
    scale = torch.minimum(w.amax(dim=1, keepdim=True), w.amax(dim=0, keepdim=True))
    d = half_code_gap(False, 4) * scale
    err = (got - want).abs()
    assert bool((err <= d * (2 * w + d) * (1 + 1e-5) + 1e-6 * want).all()), float((err - d * (2 * w + d)).max())


SOURCE_KW = dict(lr=1e-2, weight_decay=0.1)


def _three_adamw_steps(
    shape: tuple[int, int], seed: int, bits: int, options: dict
) -> tuple[nn.Parameter, torch.optim.Optimizer, dict, torch.Generator]:
    """A matrix of ``shape``, ``AdamW{bits}bit`` with SOURCE_KW and ``options`` after three steps on seeded
    gradients, its state dict and the generator, for the next gradient: the source checkpoint of the
    layout-conversion tests."""
    gen = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(shape, generator=gen))
    src = getattr(O, f"AdamW{bits}bit")([p], **SOURCE_KW, **options)
    for step in range(3):
        _step(src, p, _grad(gen, p.numel(), step).view(shape))
    return p, src, src.state_dict(), gen


@pytest.mark.parametrize(("src_bits", "src_kw"), [(32, {}), (8, {}), (4, {}), (4, RANK1)], ids=str)
def test_rank1_second_moments_load_from_every_layout_and_back(src_bits, src_kw):
    """With ``rank1_normalization=True`` a matrix's 4-bit second moment is normalised rank-1 (``axis_max2`` in
    place of ``absmax2``): a state dict of any layout, block-wise 4-bit ones (the default's) included, loads into it
    as one encode of what the checkpoint held, and steps as torch from that state; a rank-1 state dict resumes
    bit for bit and loads into the 32-bit class exactly."""
    shape = (40, 130)
    p, src, saved, gen = _three_adamw_steps(shape, 3, src_bits, src_kw)
    assert ("axis_max2" in saved["state"][0]) == (src_kw == RANK1)
    q = nn.Parameter(p.detach().clone())
    opt = O.AdamW4bit([q], **OTHERS, **RANK1)
    opt.load_state_dict(saved)
    assert opt.state[q]["axis_max2"].shape == (sum(shape),) and "absmax2" not in opt.state[q]
    held, got = src.dequantized_state(p), opt.dequantized_state(q)
    if src_kw == RANK1:
        assert all(torch.equal(got[k], v) for k, v in held.items())
    else:
        _assert_encoded(got["exp_avg"], held["exp_avg"], True, 128, 4)
        _assert_rank1_encoded(got["exp_avg_sq"], held["exp_avg_sq"])
    grad = _grad(gen, p.numel(), 3).view(shape)
    want = _torch_step(torch.optim.AdamW, src.param_groups[0], p.detach(), held, grad)
    stepped = _step(opt, q, grad)
    _assert_step(stepped, want, p.detach(), exact=False, bits=4)
    if src_kw == RANK1:
        assert torch.equal(_step(src, p, grad), stepped)
        assert torch.equal(src.state[p]["axis_max2"], opt.state[q]["axis_max2"])
    back = O.AdamW32bit([nn.Parameter(q.detach().clone())], **OTHERS)
    back.load_state_dict(opt.state_dict())
    (r,) = back.param_groups[0]["params"]
    held = opt.dequantized_state(q)
    assert all(torch.equal(back.dequantized_state(r)[k], v) for k, v in held.items())


# -- state format 1: second moments on the unsigned map ----------------------------------------------------


def _format1(code_v: torch.Tensor, block: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmaxes of v as lowbit 0.1.0 stored them (state format 1: v on the unsigned map)."""
    old_map = create_dynamic_map(signed=False, total_bits=bits)
    codes, absmax = _ops.quantize_blockwise(code_v.reshape(-1).float(), old_map, bits, block, False, 0, 0)
    return codes, absmax


def _trained_adam8bit() -> tuple[nn.Parameter, O.Adam8bit]:
    p = nn.Parameter(torch.randn(8192))
    opt = O.Adam8bit([p])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        p.grad = torch.randn(8192, generator=gen) * torch.logspace(-3, 1, 8192)
        opt.step()
    return p, opt


@pytest.mark.parametrize("marker", [None, 1])
def test_format1_checkpoint_second_moments_are_reencoded(marker):
    # A state dict written before second moments were stored as roots (no state_format in its groups)
    # holds codes of v; read as roots they would square every value. Loading re-encodes them.
    p, opt = _trained_adam8bit()
    v = opt.dequantized_state(p)["exp_avg_sq"]
    sd = opt.state_dict()
    codes, absmax = _format1(v, 256)
    sd["state"][0]["state2"], sd["state"][0]["absmax2"] = codes.view(p.shape), absmax
    for group in sd["param_groups"]:
        group.pop("state_format")
        if marker is not None:
            group["state_format"] = marker
    v_old = _ops.dequantize_blockwise(codes, absmax, create_dynamic_map(signed=False), 8, 256, 8192, torch.float32)
    q = nn.Parameter(p.detach().clone())
    fresh = O.Adam8bit([q], **OTHERS)
    fresh.load_state_dict(sd)
    got = fresh.dequantized_state(q)["exp_avg_sq"]
    assert fresh.param_groups[0]["state_format"] == 2
    _assert_same_hyperparameters(fresh, opt.param_groups[0])
    # Each re-encoded root is within one map step of the format-1 value's root: for v at least 1e-3 of
    # its block's largest, a factor below 1.07 (the unsigned map above 0.03), so v within 1.07^2.
    big = v_old >= 1e-3 * block_absmax(v_old, 256)
    ratio = got[big] / v_old[big]
    assert float(ratio.max()) < 1.15 and float(ratio.min()) > 1 / 1.15
    # Every element: one encode of the format-1 value's root.
    _assert_encoded(got, v_old, False, 256)
    m = opt.dequantized_state(p)["exp_avg"]
    assert bool((got > 0).all()) and torch.equal(fresh.dequantized_state(q)["exp_avg"], m)
    # The next step is torch's from what the checkpoint holds (m, and v as format 1 decodes it), within
    # the one-encode step bound. Every v of it is non-zero (torch would step a zero v by m / eps, where
    # lowbit's zero-free map gives its smallest code).
    assert bool((v_old > 0).all())
    grad = torch.randn(8192, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 1, 8192)
    held = {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v_old}
    want = _torch_step(torch.optim.Adam, opt.param_groups[0], p.detach(), held, grad)
    _assert_step(_step(fresh, q, grad), want, p.detach(), exact=False)


def test_state_dict_from_a_newer_format_is_refused():
    p, opt = _trained_adam8bit()
    sd = opt.state_dict()
    sd["param_groups"][0]["state_format"] = 3
    fresh = O.Adam8bit([p])
    with pytest.raises(ValueError, match="state_format=3"):
        fresh.load_state_dict(sd)
    assert not fresh.state


def test_lpmm_format1_checkpoint_second_moments_are_reencoded():
    from lowbit import lpmm
    from lowbit.optim.lpmm import storage_of

    model = lpmm.convert(nn.Linear(64, 64), param_bits=16, grad_bits=16, group_size=256, rounding="nearest")
    opt = O.LPMMAdamW(model.parameters(), rounding="nearest", lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().sum().backward()
        opt.step()
    handle = model.weight if isinstance(model.weight, torch.Tensor) else next(model.parameters())
    state = opt.state[handle]
    root = _ops.dequantize_blockwise(
        state["state2"], state["absmax2"], state_map(False, torch.device("cpu")), 8, 256, 4096, torch.float32
    )
    v = root.square()
    sd = opt.state_dict()
    index = [i for i, q in enumerate(opt.param_groups[0]["params"]) if q is handle][0]
    sd["state"][index]["state2"], sd["state"][index]["absmax2"] = _format1(v, 256)
    sd["param_groups"][0].pop("state_format")
    v_old = _ops.dequantize_blockwise(*_format1(v, 256), create_dynamic_map(signed=False), 8, 256, 4096, torch.float32)
    fresh = O.LPMMAdamW(model.parameters(), rounding="nearest", **OTHERS)
    fresh.load_state_dict(sd)
    _assert_same_hyperparameters(fresh, opt.param_groups[0])
    st = fresh.state[handle]
    got = _ops.dequantize_blockwise(
        st["state2"], st["absmax2"], state_map(False, torch.device("cpu")), 8, 256, 4096, torch.float32
    ).square()
    big = v >= 1e-3 * block_absmax(v, 256)
    ratio = got[big] / v[big]
    assert float(ratio.max()) < 1.15 and float(ratio.min()) > 1 / 1.15
    _assert_encoded(got, v_old, False, 256)
    # The next step is torch's AdamW from the checkpoint's state (m, v as format 1 decodes it), on the
    # stored weight with the accumulated gradient, within the one-encode step bound plus the rounding of
    # the new weight to its 16-bit linear codes (at most half a code step, absmax / (2^15 - 1) / 2 < 2^-15
    # absmax of its group, per element).
    assert bool((v_old > 0).all())
    m = _ops.dequantize_blockwise(
        st["state1"], st["absmax1"], state_map(True, torch.device("cpu")), 8, 256, 4096, torch.float32
    )
    lp = storage_of(handle)
    fresh.zero_grad()
    model(torch.randn(8, 64)).square().sum().backward()
    w0, grad = lp.dequantize(torch.float32).reshape(-1), lp.grad.reshape(-1)
    held = {"step": st["step"].clone(), "exp_avg": m, "exp_avg_sq": v_old}
    want = _torch_step(torch.optim.AdamW, opt.param_groups[0], w0, held, grad)
    fresh.step()
    got_w = lp.dequantize(torch.float32).reshape(-1)
    rounding = float((2.0**-15 * block_absmax(got_w, 256)).norm() / (want - w0).norm())
    assert _relative(got_w - w0, want - w0) < STEP_BOUND + rounding


@pytest.mark.parametrize(("src_bits", "src_kw"), [(32, {}), (8, {}), (4, {}), (4, RANK1), (4, FACTORED)], ids=str)
def test_factored_second_moments_load_from_every_layout_and_back(src_bits, src_kw):
    """With ``factored=True`` a matrix's second moment is its row and column means (``row2``/``col2`` in place
    of ``state2``/``absmax2``): a state dict of any layout loads into it as exactly the means of the v it held
    (and m encoded once), steps as the twin (lowbit/_reference/factored.py) steps from that state, resumes
    bit for bit from a factored state dict, and loads into the 32-bit class as v_hat exactly."""
    shape = (40, 130)
    p, src, saved, gen = _three_adamw_steps(shape, 5, src_bits, src_kw)
    assert ("row2" in saved["state"][0]) == (src_kw == FACTORED)
    q = nn.Parameter(p.detach().clone())
    opt = O.AdamW4bit([q], **OTHERS, **FACTORED)
    opt.load_state_dict(saved)
    state = opt.state[q]
    assert "state2" not in state and "absmax2" not in state
    held = src.dequantized_state(p)
    if src_kw == FACTORED:  # the factors themselves (v_hat's means equal them only in exact arithmetic)
        assert all(torch.equal(state[k], src.state[p][k]) for k in ("row2", "col2"))
        assert torch.equal(opt.dequantized_state(q)["exp_avg"], held["exp_avg"])
    else:
        assert torch.equal(state["row2"], held["exp_avg_sq"].mean(-1))
        assert torch.equal(state["col2"], held["exp_avg_sq"].mean(-2))
        _assert_encoded(opt.dequantized_state(q)["exp_avg"], held["exp_avg"], True, 128, 4)
    grad = _grad(gen, p.numel(), 3).view(shape)
    twin_p, twin_state = q.detach().clone(), {k: v.clone() for k, v in state.items() if k != "step"}
    stepped = _step(opt, q, grad)
    group = src.param_groups[0]
    R.factored_adam_step_(
        twin_p,
        grad,
        twin_state,
        4,
        lr=group["lr"],
        betas=group["betas"],
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled=True,
        maximize=False,
        m_map=optimizer_state_map(True, p.device, 4),
        block_size=128,
    )
    assert torch.equal(stepped, twin_p)
    if src_kw == FACTORED:
        assert torch.equal(_step(src, p, grad), stepped)
        assert all(torch.equal(src.state[p][k], v) for k, v in opt.state[q].items())
        full = O.AdamW32bit([nn.Parameter(p.detach().clone())], **SOURCE_KW)
        full.load_state_dict(src.state_dict())
        v_hat = R.factored_v_hat(src.state[p]["row2"], src.state[p]["col2"])
        assert torch.equal(next(iter(full.state.values()))["state2"], v_hat)
