"""Non-contiguous and channels_last parameters step exactly like contiguous ones and keep their layout,
also under gradient release (lowbit.optim.step_in_backward, which steps on the gradient in the layout
autograd gives it), and a step that raises leaves the optimizer as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit.optim as O
from lowbit._reference.ademamix import ReferenceAdEMAMix

NAMES = [
    "Adam",
    "AdamW",
    "SGD",
    "Lion",
    "RMSprop",
    "Adagrad",
    "LAMB",
    "LARS",
    "Adam-amsgrad",
    "RMSprop-centered",
    "AdEMAMix",
    "AdamW-rank1",
    "AdamW-factored",
]
KW = {
    "SGD": dict(momentum=0.9),
    "LARS": dict(momentum=0.9),
    "Adam-amsgrad": dict(amsgrad=True),
    "RMSprop-centered": dict(centered=True, momentum=0.9),
    "AdEMAMix": dict(t_alpha=2, t_beta3=2),
    # The opt-in rank-1 second moment of 4-bit matrices (include/lowbit/rank1.h): its axis maxima follow the
    # logical axes, whatever the strides; 8 and 32 bits ignore it.
    "AdamW-rank1": dict(rank1_normalization=True),
    # The opt-in factorized second moment of 4-bit matrices (lowbit/optim/factored.py): its row and column
    # means follow the logical axes; 8 and 32 bits refuse it.
    "AdamW-factored": dict(factored=True),
}
# torch.optim twins of lowbit's 32-bit optimizers (Lion, LAMB and LARS have none; AdEMAMix's is the
# pure-PyTorch formula).
TORCH = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "SGD": torch.optim.SGD,
    "RMSprop": torch.optim.RMSprop,
    "AdEMAMix": ReferenceAdEMAMix,
}


def _layouts() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "channels_last": torch.randn(16, 8, 3, 3, generator=gen).to(memory_format=torch.channels_last),
        "transposed": torch.randn(40, 30, generator=gen).t(),
        "sliced": torch.randn(30, 80, generator=gen)[:, ::2],
    }


def _like(value: torch.Tensor, strides_of: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` with the strides of ``strides_of`` (gaps included), as autograd lays out a
    parameter's gradient."""
    return torch.empty_strided(strides_of.shape, strides_of.stride()).copy_(value)


def _train(
    cls: type, value: torch.Tensor, grads: list[torch.Tensor], release: bool = False, **kw
) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """The parameter after a step on each of ``grads``, and its optimizer. ``release``: under gradient
    release, each gradient comes from a backward pass (d/dp sum(p * g) = g exactly), in the layout
    autograd's AccumulateGrad gives it (the parameter's strides where they are dense, else contiguous)."""
    p = nn.Parameter(_like(value, value))
    opt = cls([p], **kw)
    if release:
        O.step_in_backward(opt)
    for g in grads:
        if release:
            (p * _like(g, value)).sum().backward()
            assert p.grad is None
        else:
            p.grad = _like(g, value)
            opt.step()
    return p.detach(), opt


@pytest.mark.parametrize("release", [False, True], ids=["loop", "release"])
@pytest.mark.parametrize("bits", [8, 4, 32])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
def test_strided_parameters_step_like_contiguous_ones(layout, name, bits, release):
    # Used to raise "parameters must be contiguous" (without naming the parameter), after the step
    # had already created state and counted the step. The reference is the ordinary loop on a contiguous
    # copy.
    value = _layouts()[layout]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(value.shape, generator=gen) for _ in range(3)]
    cls = getattr(O, name.split("-")[0])
    kw = dict(KW.get(name, {}), optim_bits=bits, min_8bit_size=0, min_4bit_size=0)
    if kw.get("factored") and bits != 4:
        with pytest.raises(ValueError, match="factored=True needs optim_bits=4"):
            cls([nn.Parameter(value.clone())], **kw)
        return
    got, opt = _train(cls, value, grads, release, **kw)
    want, _ = _train(cls, value.contiguous(), grads, **kw)
    assert got.stride() == value.stride()
    assert torch.equal(got, want)
    assert float(opt.state[opt.param_groups[0]["params"][0]]["step"]) == 3
    # The rank-1 case is one only where its statistics exist (4-bit states of these matrices).
    assert ("axis_max2" in opt.state[opt.param_groups[0]["params"][0]]) == (name.endswith("rank1") and bits == 4)
    assert ("row2" in opt.state[opt.param_groups[0]["params"][0]]) == (name.endswith("factored") and bits == 4)
    if bits == 32 and name.split("-")[0] in TORCH:
        # rank1_normalization is lowbit's own option (4-bit states only): torch.optim takes the rest.
        torch_kw = {k: v for k, v in KW.get(name, {}).items() if k != "rank1_normalization"}
        ref, _ = _train(TORCH[name.split("-")[0]], value, grads, foreach=False, **torch_kw)
        # The same fp32 formulas as torch's single-tensor path (tests/test_optim.py: 7e-6 derived for 30 steps).
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_failed_step_leaves_the_optimizer_as_it_was():
    # LAMB scales its update by the trust ratio, so max_unorm (here through an override of b) raises in
    # step(). The old step had already stepped a, created b's state and counted the steps.
    a, b = nn.Parameter(torch.randn(100)), nn.Parameter(torch.randn(100))
    opt = O.LAMB8bit([a, b], min_8bit_size=0)
    a.grad = torch.randn(100)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[a].items()}
    value_a, value_b = a.detach().clone(), b.detach().clone()
    O.override(b, max_unorm=1.0)
    try:
        a.grad, b.grad = torch.randn(100), torch.randn(100)
        with pytest.raises(ValueError, match="max_unorm"):
            opt.step()
    finally:
        O.clear_override(b)
    assert b not in opt.state
    assert opt.state[a].keys() == before.keys()
    assert all(torch.equal(opt.state[a][k], v) for k, v in before.items())
    assert torch.equal(a.detach(), value_a) and torch.equal(b.detach(), value_b)


@pytest.mark.parametrize("release", [False, True], ids=["loop", "release"])
@pytest.mark.parametrize("cls", [O.Muon8bit, O.Muon32bit], ids=lambda c: c.__name__)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_strided_matrices_step_like_contiguous_ones_with_muon(layout, cls, release):
    # Muon takes matrices only, so the two matrix layouts; its orthogonalization reads the whole matrix.
    value = _layouts()[layout]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(value.shape, generator=gen) for _ in range(3)]
    kw = dict(lr=0.02, weight_decay=0.1) | (dict(min_8bit_size=0) if cls is O.Muon8bit else {})
    got, opt = _train(cls, value, grads, release, **kw)
    want, _ = _train(cls, value.contiguous(), grads, **kw)
    assert got.stride() == value.stride()
    assert torch.equal(got, want)
    assert float(opt.state[opt.param_groups[0]["params"][0]]["step"]) == 3
    if cls is O.Muon32bit:
        ref, _ = _train(torch.optim.Muon, value, grads, lr=0.02, weight_decay=0.1)
        # Bit for bit, as tests/test_muon.py::test_muon32bit_is_torch_muon_bit_for_bit on contiguous ones.
        assert torch.equal(got, ref)
