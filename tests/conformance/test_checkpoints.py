"""Checkpoint migration: a torch.optim state dict loads into its lowbit twin, and a lowbit state dict
saved in another layout (optim_bits, block_size) is converted to the loading optimizer's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit.optim as O
from lowbit.optim.state_storage import state_map
from tests.blocks import block_absmax

# (torch.optim class, lowbit name, hyperparameters)
TWINS = [
    (torch.optim.Adam, "Adam", dict(lr=1e-2)),
    (torch.optim.AdamW, "AdamW", dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.SGD, "SGD", dict(lr=1e-2, momentum=0.9)),
    (torch.optim.RMSprop, "RMSprop", dict(lr=1e-3)),
    (torch.optim.Adagrad, "Adagrad", dict(lr=1e-2)),
]


def _grads(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


def _steps(opt: torch.optim.Optimizer, p: nn.Parameter, grads: list[torch.Tensor]) -> None:
    for g in grads:
        p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize(("tcls", "name", "kw"), TWINS, ids=[t[1] for t in TWINS])
def test_torch_state_dict_loads_into_the_lowbit_twin(tcls, name, kw, bits):
    # Used to fail at the next step with KeyError: 'block_size' (torch's groups lack lowbit's options).
    n = 5000
    p = nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    ref = tcls([p], foreach=False, **kw)
    _steps(ref, p, _grads(n, 3, 1))
    q = nn.Parameter(p.detach().clone())
    opt = getattr(O, f"{name}{bits}bit")([q], **kw)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["optim_bits"] == bits and opt.param_groups[0]["block_size"] == 256
    assert (opt.state[q]["state1"].dtype == torch.uint8) == (bits == 8)
    before = p.detach().clone()
    more = _grads(n, 1, 2)
    _steps(ref, p, more)
    _steps(opt, q, more)
    if "step" in ref.state[p]:  # torch.optim.SGD counts no steps
        assert float(opt.state[q]["step"]) == 4
    step_ref, step_got = p.detach() - before, q.detach() - before
    if bits == 32:
        # The same fp32 formulas as torch's single-tensor path (tests/test_optim.py).
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)
    else:
        # One step from quantized states: the per-step bound of tests/test_optim.py (3% relative L2).
        assert float((step_got - step_ref).norm() / step_ref.norm()) < 0.03


def _half_gap(signed: bool) -> float:
    """Half the largest gap between adjacent codes of a state map: the most nearest rounding moves a
    normalised value."""
    return 0.5 * float(state_map(signed, torch.device("cpu")).diff().max())


def test_32bit_state_dict_keeps_an_8bit_optimizer_8bit():
    # Used to take optim_bits=32 from the checkpoint's param group: the Adam8bit silently ran 32-bit.
    n = 5000
    p = nn.Parameter(torch.randn(n))
    src = O.Adam32bit([p])
    _steps(src, p, _grads(n, 3, 1))
    opt = O.Adam8bit([p])
    opt.load_state_dict(src.state_dict())
    assert opt.param_groups[0]["optim_bits"] == 8
    assert opt.state[p]["state1"].dtype == torch.uint8 and opt.state[p]["state2"].dtype == torch.uint8
    want, got = src.dequantized_state(p), opt.dequantized_state(p)
    m, v = want["exp_avg"], want["exp_avg_sq"]
    assert bool(((got["exp_avg"] - m).abs() <= _half_gap(True) * block_absmax(m, 256) * (1 + 1e-6)).all())
    # v is stored as its root w: |w^2 - w'^2| <= |w - w'| (2 w + |w - w'|), with |w - w'| <= h * absmax(w).
    h = _half_gap(False)
    amax_w = block_absmax(v.sqrt(), 256)
    bound = h * amax_w * (2 * v.sqrt() + h * amax_w)
    assert bool(((got["exp_avg_sq"] - v).abs() <= bound * (1 + 1e-5)).all())


def test_state_dict_of_another_block_size_is_relaid_out():
    n = 5000
    p = nn.Parameter(torch.randn(n))
    src = O.Adam8bit([p], block_size=256)
    _steps(src, p, _grads(n, 3, 1))
    opt = O.Adam8bit([p], block_size=128)
    opt.load_state_dict(src.state_dict())
    assert opt.param_groups[0]["block_size"] == 128
    assert opt.state[p]["absmax1"].numel() == (n + 127) // 128
    # Re-encoding the decoded 256-block values into 128-blocks moves each by at most half a code gap.
    m = src.dequantized_state(p)["exp_avg"]
    got = opt.dequantized_state(p)["exp_avg"]
    assert bool(((got - m).abs() <= _half_gap(True) * block_absmax(m, 128) * (1 + 1e-6)).all())
