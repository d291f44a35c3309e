"""lowbit.nn.StableEmbedding / Embedding: forward and backward against F.embedding + F.layer_norm,
factory kwargs, Xavier init, the weakly held 32-bit optimizer-state override and its use by Adam8bit."""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit.optim
from lowbit.nn import Embedding, StableEmbedding
from lowbit.optim import config as optim_config
from tests.conftest import HAS_CUDA

CLASSES = [StableEmbedding, Embedding]


def ids(num_embeddings: int, shape: tuple[int, ...] = (4, 7), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_embeddings, shape, generator=g)


def randomize_norm(emb: StableEmbedding, seed: int = 1) -> None:
    """Non-trivial layer-norm parameters, so a reference that ignores them fails."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb.norm.weight.copy_(1 + 0.5 * torch.randn(emb.embedding_dim, generator=g))
        emb.norm.bias.copy_(0.5 * torch.randn(emb.embedding_dim, generator=g))


def reference(emb: StableEmbedding, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    e = F.embedding(x, emb.weight.to(dtype), emb.padding_idx)
    return F.layer_norm(e, (emb.embedding_dim,), emb.norm.weight.to(dtype), emb.norm.bias.to(dtype), emb.norm.eps)


def test_forward_matches_reference():
    torch.manual_seed(0)
    emb = StableEmbedding(50, 16, padding_idx=3)
    randomize_norm(emb)
    x = ids(50)
    # The module runs the reference's own fp32 ops (F.embedding, then F.layer_norm): bit-identical.
    torch.testing.assert_close(emb(x), reference(emb, x, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_is_fp32_layer_norm_rounded_once(dtype):
    torch.manual_seed(0)
    emb = StableEmbedding(50, 64, dtype=dtype)
    randomize_norm(emb)
    x = ids(50)
    out = emb(x)
    assert out.dtype == dtype
    # The norm runs in fp32 and is rounded once to dtype: half an ulp, 2**-8 relative for bf16 and
    # 2**-11 for fp16, plus fp32-vs-fp64 noise (atol) near zero.
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    torch.testing.assert_close(out.double(), reference(emb, x), rtol=rtol, atol=1e-5)


def test_backward_matches_reference():
    torch.manual_seed(0)
    emb = StableEmbedding(50, 16)
    randomize_norm(emb)
    x = ids(50)
    g = torch.randn(*x.shape, 16)
    (emb(x) * g).sum().backward()
    params = [emb.weight, emb.norm.weight, emb.norm.bias]
    grads = [p.grad.clone() for p in params]
    ref = torch.autograd.grad((reference(emb, x, torch.float32) * g).sum(), params)
    for got, want in zip(grads, ref, strict=True):
        assert got is not None and torch.isfinite(got).all()
        # The same fp32 ops as the forward's reference, differentiated by the same autograd: bit-identical.
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert emb.norm.weight.grad.abs().sum() > 0 and emb.norm.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("cls", CLASSES)
def test_padding_row_is_zero_and_gets_no_gradient(cls):
    torch.manual_seed(0)
    emb = cls(20, 8, padding_idx=5)
    assert torch.equal(emb.weight[5], torch.zeros(8))
    assert emb.weight[4].abs().sum() > 0
    x = torch.tensor([[5, 1, 5, 2], [3, 5, 4, 5]])
    out = emb(x)
    out.pow(2).sum().backward()
    assert torch.equal(emb.weight.grad[5], torch.zeros(8))
    assert emb.weight.grad[1].abs().sum() > 0
    if cls is StableEmbedding:  # LayerNorm(0) is the bias, not zero
        # (0 - mean 0) * rstd * weight + bias is the bias exactly.
        torch.testing.assert_close(out[0, 0], emb.norm.bias.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("cls", CLASSES)
def test_negative_padding_idx(cls):
    emb = cls(20, 8, padding_idx=-1)
    assert emb.padding_idx == 19 and torch.equal(emb.weight[19], torch.zeros(8))


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_factory_kwargs_cpu(cls, dtype):
    emb = cls(30, 12, padding_idx=0, device="cpu", dtype=dtype)
    params = list(emb.parameters())
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in params)
    assert len(params) == (3 if cls is StableEmbedding else 1)
    out = emb(ids(30))
    assert out.dtype == dtype and torch.isfinite(out).all()
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype and torch.isfinite(p.grad).all() for p in params)


@pytest.mark.parametrize("cls", CLASSES)
def test_meta_construction_then_materialize(cls):
    emb = cls(30, 12, padding_idx=2, device="meta", dtype=torch.bfloat16)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in emb.parameters())
    emb.reset_parameters()  # stays on meta, does not touch the default device
    assert all(p.device.type == "meta" for p in emb.parameters())
    assert emb(ids(30)).device.type == "meta"
    assert lowbit.optim.get_override(emb.weight) == {"optim_bits": 32}
    emb.to_empty(device="cpu")  # new Parameter objects: the override follows the weight
    emb.reset_parameters()
    assert lowbit.optim.get_override(emb.weight) == {"optim_bits": 32}
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in emb.parameters())
    assert torch.equal(emb.weight[2], torch.zeros(12, dtype=torch.bfloat16))
    assert emb.weight.abs().max() <= math.sqrt(6 / 42) * (1 + 2**-8)


def test_weight_argument_is_used_as_is_and_the_norm_follows_it():
    w = torch.randn(10, 6, dtype=torch.float64)
    emb = StableEmbedding(10, 6, _weight=w)
    assert torch.equal(emb.weight, w)
    assert emb.norm.weight.dtype == torch.float64
    assert emb(ids(10)).dtype == torch.float64
    pre = StableEmbedding.from_pretrained(w.float(), padding_idx=1)
    assert not pre.weight.requires_grad and torch.equal(pre.weight, w.float())
    assert lowbit.optim.get_override(pre.weight) == {"optim_bits": 32}


@pytest.mark.parametrize("cls", CLASSES)
def test_max_norm_renormalizes_looked_up_rows(cls):
    torch.manual_seed(0)
    emb = cls(40, 16, max_norm=0.1)
    x = ids(40)
    emb(x)
    norms = emb.weight.detach()[x.unique()].norm(dim=-1)
    # torch's renorm scales a row by max_norm / (norm + 1e-7), at or below max_norm; recomputing the norm
    # of 16 fp32 elements adds at most ~16 x 2^-24 = 1e-6 relative, bound 1e-5.
    assert norms.max() <= 0.1 * (1 + 1e-5)


def test_reset_parameters_resets_the_norm():
    emb = StableEmbedding(10, 6)
    randomize_norm(emb)
    emb.reset_parameters()
    assert torch.equal(emb.norm.weight, torch.ones(6)) and torch.equal(emb.norm.bias, torch.zeros(6))


@pytest.mark.parametrize("cls", CLASSES)
def test_xavier_uniform_init(cls):
    torch.manual_seed(0)
    n, d = 1000, 64
    w = cls(n, d).weight.detach()
    bound = math.sqrt(6 / (n + d))
    assert w.abs().max() <= bound
    # 64,000 draws: P(max |w| < 0.99 bound) = 0.99**64000, nil.
    assert w.abs().max() > 0.99 * bound
    # U(-a, a) has std a / sqrt(3); the sample std's relative standard error is sqrt((kurtosis - 1) / 4n)
    # = sqrt(0.2 / n) = 0.18 % for kurtosis 1.8 and n = 64,000; allow 5 standard errors.
    std = bound / math.sqrt(3)
    assert abs(w.std().item() / std - 1) < 5 * math.sqrt(0.2 / w.numel())
    assert abs(w.mean().item()) < 5 * std / math.sqrt(w.numel())


@pytest.mark.parametrize("cls", CLASSES)
def test_sparse_is_rejected(cls):
    with pytest.raises(ValueError, match="sparse=True"):
        cls(10, 4, sparse=True)
    emb = cls(10, 4)
    emb.sparse = True
    with pytest.raises(ValueError, match="sparse=True"):
        emb(torch.tensor([1, 2]))


@pytest.mark.parametrize("cls", CLASSES)
def test_override_is_registered_and_follows_the_weight(cls):
    emb = cls(10, 4)
    assert lowbit.optim.get_override(emb.weight) == {"optim_bits": 32}
    if cls is StableEmbedding:
        assert lowbit.optim.get_override(emb.norm.weight) == {}
    assert lowbit.optim.get_override(copy.deepcopy(emb).weight) == {"optim_bits": 32}
    target = cls(10, 4, device="meta")
    target.load_state_dict(emb.state_dict(), assign=True)
    assert target.weight.device.type == "cpu"
    assert lowbit.optim.get_override(target.weight) == {"optim_bits": 32}
    emb.weight = nn.Parameter(torch.zeros(10, 4))
    assert lowbit.optim.get_override(emb.weight) == {"optim_bits": 32}
    lowbit.optim.clear_override(emb.weight)  # a user's choice is kept through .to()
    emb.to(torch.float64)
    assert lowbit.optim.get_override(emb.weight) == {}


def test_override_dies_with_the_module():
    gc.collect()
    before = len(optim_config._OVERRIDES)
    modules = [cls(64, 8) for cls in CLASSES for _ in range(10)]
    assert len(optim_config._OVERRIDES) == before + 20
    refs = [weakref.ref(m) for m in modules] + [weakref.ref(m.weight) for m in modules]
    del modules
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(optim_config._OVERRIDES) <= before


def adam8bit_one_step(emb: nn.Module, device: str = "cpu") -> tuple[lowbit.optim.Adam8bit, nn.Linear]:
    torch.manual_seed(0)
    head = nn.Linear(emb.embedding_dim, 256, device=device, dtype=emb.weight.dtype)
    model = nn.Sequential(emb, head)
    opt = lowbit.optim.Adam8bit(model.parameters(), lr=1e-3)
    x = ids(emb.num_embeddings).to(device)
    F.cross_entropy(model(x).float().flatten(0, 1), x.flatten()).backward()
    opt.step()
    return opt, head


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam8bit_keeps_fp32_state_for_the_embedding(cls, dtype):
    emb = cls(256, 32, dtype=dtype)  # 8192 elements, above min_8bit_size = 4096
    opt, head = adam8bit_one_step(emb)
    assert opt.state[emb.weight]["state1"].dtype == torch.float32
    assert opt.state[emb.weight]["state2"].dtype == torch.float32
    assert opt.state[head.weight]["state1"].dtype == torch.uint8
    assert opt.state[head.weight]["state2"].dtype == torch.uint8


def test_without_the_override_the_embedding_would_get_8bit_state():
    emb = nn.Embedding(256, 32)
    opt, _ = adam8bit_one_step(emb)
    assert opt.state[emb.weight]["state1"].dtype == torch.uint8


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of lowbit")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda(dtype):
    emb = StableEmbedding(256, 32, padding_idx=0, device="cuda", dtype=dtype)
    assert all(p.device.type == "cuda" and p.dtype == dtype for p in emb.parameters())
    randomize_norm(emb)
    x = ids(256).cuda()
    out = emb(x)
    assert out.dtype == dtype
    # fp32: CUDA's fp32 layer norm of 32 elements against fp64, torch's fp32 default rtol (11 x 2^-24); bf16:
    # one rounding to bf16 (half an ulp, 2^-8), as test_low_precision_forward_is_fp32_layer_norm_rounded_once.
    rtol = 1.3e-6 if dtype == torch.float32 else 2.0**-8
    torch.testing.assert_close(out.double(), reference(emb, x), rtol=rtol, atol=1e-5)
    emb.zero_grad()
    opt, head = adam8bit_one_step(emb, device="cuda")
    assert opt.state[emb.weight]["state1"].dtype == torch.float32
    assert opt.state[emb.weight]["state1"].device.type == "cuda"
    assert opt.state[head.weight]["state1"].dtype == torch.uint8
    assert torch.equal(emb.weight.grad[0], torch.zeros(32, dtype=dtype, device="cuda"))
