"""lowbit's optimizers follow torch.optim's meta-device habit: a step of meta parameters (a model built under
``torch.device("meta")``, e.g. to size its training state without memory) creates the states a real step creates
(same keys, shapes and dtypes, on the meta device) and advances the step counters, as ``torch.optim.AdamW``
does. Every optimizer of the compile suite's list runs, the 4-bit rank-1 case included. (An optimizer must be
built after ``module.to_empty``, which replaces the parameters, for torch.optim's optimizers as for lowbit's.)"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import lowbit.optim as O
from tests.conformance.test_compile import OPTIMIZERS, ConvNet, _batches

LR = 1e-2


def _described(state: dict[str, object]) -> dict[str, tuple]:
    """Each tensor of a parameter's state as (shape, dtype, device type); other entries as they are."""
    return {k: (tuple(v.shape), v.dtype, v.device.type) if isinstance(v, Tensor) else v for k, v in state.items()}


def _loss(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).square().mean()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_meta_step_creates_the_states_of_a_real_step(name):
    with torch.device("meta"):
        meta_model = ConvNet().to(memory_format=torch.channels_last)
    real_model = ConvNet().to(memory_format=torch.channels_last)
    meta_opt = OPTIMIZERS[name](list(meta_model.parameters()), LR)
    real_opt = OPTIMIZERS[name](list(real_model.parameters()), LR)
    for x in _batches(2):
        for p in meta_model.parameters():
            p.grad = torch.empty_like(p)
        meta_opt.step()
        real_opt.zero_grad()
        _loss(real_model, x).backward()
        real_opt.step()
    stepped = 0
    for (pname, mp), rp in zip(meta_model.named_parameters(), real_model.parameters(), strict=True):
        assert mp.is_meta, pname
        if rp not in real_opt.state:
            assert mp not in meta_opt.state, pname  # a parameter the optimizer does not hold (Muon: matrices)
            continue
        want = _described(real_opt.state[rp])
        got = _described(meta_opt.state[mp])
        # The step counter stays on the CPU, as torch.optim's; every other state is on the meta device.
        want = {k: (v[0], v[1], "meta") if isinstance(v, tuple) and k != "step" else v for k, v in want.items()}
        assert got == want, pname
        assert float(meta_opt.state[mp]["step"]) == float(real_opt.state[rp]["step"]) == 2.0, pname
        stepped += 1
    assert stepped > 0


def test_meta_step_of_torch_adamw_is_the_habit():
    # The reference habit: torch.optim steps meta parameters, creating meta states.
    p = nn.Parameter(torch.empty(4, 5, device="meta"))
    p.grad = torch.empty_like(p)
    opt = torch.optim.AdamW([p])
    opt.step()
    assert opt.state[p]["exp_avg"].is_meta and float(opt.state[p]["step"]) == 1.0


def test_meta_and_real_parameters_in_one_step_are_refused_without_creating_state():
    real = nn.Parameter(torch.randn(64, 128))
    meta = nn.Parameter(torch.empty(64, 128, device="meta"))
    real.grad = torch.randn(64, 128)
    meta.grad = torch.empty_like(meta)
    opt = O.AdamW8bit([meta, real], min_8bit_size=0)
    before = real.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\] params\[1\] is not on the meta device"):
        opt.step()
    assert len(opt.state) == 0
    assert torch.equal(real, before)
