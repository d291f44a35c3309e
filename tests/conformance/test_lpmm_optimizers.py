"""An optimizer other than LPMM's on a converted model raises instead of silently skipping its
parameters (their gradients live in low-precision accumulators; ``.grad`` stays None)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit.optim as O
from lowbit import lpmm


@pytest.mark.parametrize(
    "make", [lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: O.AdamW8bit(ps)]
)
def test_other_optimizers_refuse_converted_parameters(make):
    model = lpmm.convert(nn.Linear(8, 4), param_bits=16, grad_bits=16, group_size=64)
    opt = make(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    before = lpmm.export_float(model)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\].*LPMMSGD or LPMMAdamW"):
        opt.step()
    after = lpmm.export_float(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_ordinary_parameters_beside_a_converted_model_still_step():
    lpmm.convert(nn.Linear(8, 4))
    plain = nn.Linear(8, 4)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.randn(2, 8)).sum().backward()
    before = plain.weight.detach().clone()
    opt.step()
    assert not torch.equal(plain.weight.detach(), before)
