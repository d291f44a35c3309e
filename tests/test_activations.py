"""Few-bit activation layers: exact forward, table backward, exact saved bytes, compile, checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lowbit.nn.activations as A
from lowbit.memory import saved_tensor_bytes
from lowbit.nn import fewbit

LAYERS = {
    "gelu": (A.FewBitGELU, nn.GELU),
    "silu": (A.FewBitSiLU, nn.SiLU),
    "sigmoid": (A.FewBitSigmoid, nn.Sigmoid),
    "tanh": (A.FewBitTanh, nn.Tanh),
    "selu": (A.FewBitSELU, nn.SELU),
    "elu": (A.FewBitELU, nn.ELU),
    "softplus": (A.FewBitSoftplus, nn.Softplus),
    "mish": (A.FewBitMish, nn.Mish),
    "hardswish": (A.FewBitHardswish, nn.Hardswish),
    "leaky_relu": (A.FewBitLeakyReLU, nn.LeakyReLU),
    "relu": (A.FewBitReLU, nn.ReLU),
}


def _x(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    special = torch.tensor([0.0, -0.0, 1e-3])[:n]
    x[: special.numel()] = special
    return x.to(dtype)


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_torchs_and_backward_uses_the_table(name, dtype):
    ours_cls, torch_cls = LAYERS[name]
    layer = ours_cls()
    x = _x(4099, dtype).requires_grad_()
    y = layer(x)
    assert torch.equal(y, torch_cls()(x.detach()))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (grad,) = torch.autograd.grad(y, x, g)
    table = fewbit.table(name, layer.bits)
    want = (g.float() * table(x.detach().float())).to(dtype)
    assert torch.equal(grad, want)


@pytest.mark.parametrize("name", ["relu", "leaky_relu"])
def test_one_bit_relus_are_exact(name):
    ours_cls, torch_cls = LAYERS[name]
    x = _x(1000).requires_grad_()
    g = torch.randn(1000)
    (ours,) = torch.autograd.grad(ours_cls()(x), x, g)
    (want,) = torch.autograd.grad(torch_cls()(x), x, g)
    assert torch.equal(ours, want)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 1000, 4097])
def test_saved_bytes_are_exactly_the_packed_codes_and_the_table(bits, n):
    x = _x(n).requires_grad_()
    assert saved_tensor_bytes(nn.GELU(), x).total == 4 * n
    saved = saved_tensor_bytes(A.FewBitGELU(bits), x)
    assert saved.total == math.ceil(n * bits / 8) + 4 * 2**bits
    assert saved.by_module == {"": saved.total}


def test_saved_bytes_attribute_to_modules_and_skip_parameters():
    model = nn.Sequential(nn.Linear(64, 256), A.FewBitGELU(3), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    saved = saved_tensor_bytes(model, x)
    # Linear 0 saves its input (x); FewBitGELU its codes and levels; Linear 2 its input (the GELU output).
    assert saved.by_module == {"0": 32 * 64 * 4, "1": 32 * 256 * 3 // 8 + 4 * 8, "2": 32 * 256 * 4}
    assert saved.total == sum(saved.by_module.values())


def test_gradients_flow_through_a_model_under_torch_compile():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), A.FewBitGELU(4), nn.Linear(64, 4))
    x = torch.randn(8, 16)
    eager = model(x).square().sum()
    eager.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(x).square().sum()
    got.backward()
    assert torch.equal(got, eager)
    # The loss is bit-identical; the parameter gradients go through aot_eager's own decomposition of the
    # Linear backward, so they may differ by fp32 rounding of a few sums: torch's default fp32 tolerance
    # (rtol 1.3e-6, about 11 ulps; atol 1e-5).
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)


def test_checkpointing_recomputes_the_same_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), A.FewBitSiLU(3), nn.Linear(64, 4))
    x = torch.randn(8, 16, requires_grad=True)
    (plain,) = torch.autograd.grad(model(x).sum(), x)
    (ckpt,) = torch.autograd.grad(checkpoint(model, x, use_reentrant=False).sum(), x)
    assert torch.equal(plain, ckpt)


def test_functional_form_matches_the_module():
    x = _x(513).requires_grad_()
    g = torch.randn(513)
    (a,) = torch.autograd.grad(A.few_bit(x, "mish", 2), x, g)
    (b,) = torch.autograd.grad(A.FewBitMish(2)(x), x, g)
    assert torch.equal(a, b)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="name must be a known activation"):
        A.FewBitActivation("swish2")
    with pytest.raises(ValueError, match="bits must be 1"):
        A.FewBitReLU(3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        A.FewBitGELU()([1.0, 2.0])
    with pytest.raises(TypeError, match="model_or_fn"):
        saved_tensor_bytes(3, torch.randn(2))
