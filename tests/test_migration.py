"""The migration guide (docs/migration.md) row by row: every row of docs/migration_table.py is constructed,
its claims checked against the lowbit class, and stepped; the page's table is the one the data renders; and
the state-dict section's claims (what loads, and the errors for bitsandbytes' and torchao's quantized states).
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import lowbit

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("migration_table", ROOT / "docs" / "migration_table.py")
table = importlib.util.module_from_spec(_spec)
sys.modules["migration_table"] = table  # dataclasses look their module up there
_spec.loader.exec_module(table)

ROWS = [r for r in table.ROWS if r.lowbit is not None]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 128 x 64 = 8192 weights: above min_8bit_size/min_4bit_size (4096), so their states are quantized;
    # the bias (128) keeps fp32 states.
    return torch.nn.Linear(64, 128)


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(8, 64)).square().mean().backward()


def test_page_holds_the_rendered_table():
    assert table.page_table(table.PAGE.read_text()) == table.render(), "run python docs/migration_table.py"


def test_every_source_class_has_a_row():
    sources = {r.source for r in table.ROWS}
    for name in ("Adam", "AdamW", "SGD", "Lion", "LAMB", "LARS", "RMSprop", "Adagrad", "AdEMAMix"):
        for suffix in ("", "8bit", "32bit"):
            assert f"bnb.optim.{name}{suffix}" in sources
    for name in ("Adam", "AdamW", "Lion", "AdEMAMix"):
        for suffix in ("", "8bit", "32bit"):
            assert f"bnb.optim.Paged{name}{suffix}" in sources
    torchao = ("AdamW8bit", "AdamW4bit", "Adam8bit", "Adam4bit", "AdamWFp8", "AdamFp8", "_AdamW", "CPUOffloadOptimizer")
    for name in torchao:
        assert f"torchao.optim.{name}" in sources


@pytest.mark.parametrize("row", ROWS, ids=[r.source for r in ROWS])
def test_row(row):
    cls = getattr(lowbit.optim, row.lowbit)
    model = _model()
    default = cls(model.parameters(), **row.required).param_groups[0]
    for key, value in row.same.items():
        assert default[key] == value, f"{row.lowbit}'s default {key}"
    for key, value in row.differ.items():
        assert default[key] != value, f"{row.source}: {key} is listed as a default that differs"
    for key in row.dropped:
        with pytest.raises(TypeError, match=key):
            cls(model.parameters(), **row.required, **{key: True})

    opt = cls(model.parameters(), **row.required, **row.differ, **row.accepted)
    group = opt.param_groups[0]
    for key, value in {**row.same, **row.differ, **row.accepted, **row.required}.items():
        assert group[key] == value, key
    bits = row.accepted.get("optim_bits", row.bits)
    assert group["optim_bits"] == bits

    before = model.weight.detach().clone()
    _backward(model)
    opt.step()
    assert torch.isfinite(model.weight).all()
    assert not torch.equal(model.weight, before), "one step changes the weights"
    stored = opt.state[model.weight]["state1"]
    assert stored.dtype == (torch.float32 if bits == 32 else torch.uint8)
    # 4-bit codes are packed two to a byte (state_storage.stored_width).
    assert stored.numel() == {32: 8192, 8: 8192, 4: 4096}[bits]


def test_stable_embedding_takes_bnb_arguments():
    # bnb.nn.StableEmbedding(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
    # scale_grad_by_freq, sparse, _weight, device, dtype)
    emb = lowbit.nn.StableEmbedding(
        50, 16, padding_idx=0, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False,
        device="cpu", dtype=torch.float32,
    )  # fmt: skip
    out = emb(torch.tensor([[0, 3, 7]]))
    assert out.shape == (1, 3, 16)
    ref = torch.nn.functional.layer_norm(torch.nn.functional.embedding(torch.tensor([[0, 3, 7]]), emb.weight), (16,))
    # The layer norm of the looked-up rows, with the identity affine of a fresh layer norm.
    torch.testing.assert_close(out, ref)


def test_torch_optim_state_dict_loads():
    model = _model()
    ref = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        _backward(model)
        ref.step()
    opt = lowbit.optim.AdamW8bit(model.parameters())
    opt.load_state_dict(ref.state_dict())
    got = opt.dequantized_state(model.weight)
    want = ref.state[model.weight]
    # 8-bit block-wise codes: the signed dynamic map's widest gap is 0.0211 of the block absmax, so exp_avg
    # decodes within 0.0105 of it; exp_avg_sq is stored as its root on the unsigned map (widest gap 0.0070),
    # so v = r^2 decodes within about 2 r x 0.0035 r_max <= 0.007 of its block max. 0.02 of the tensor's max
    # bounds both (F.create_dynamic_map(signed=...).sort().values.diff().max()).
    for key in ("exp_avg", "exp_avg_sq"):
        bound = 0.02 * want[key].abs().max()
        assert (got[key] - want[key]).abs().max() <= bound, key


def _bnb_entry(p, bits):
    """A state entry as bitsandbytes' Optimizer2State writes it (init_state): fp32 state1/state2 at 32 bits;
    uint8 codes with their maps and block scales (blocks of 256) at 8 bits."""
    torch.manual_seed(1)
    if bits == 32:
        return {"step": 3, "state1": torch.randn_like(p), "state2": torch.rand_like(p)}
    blocks = -(-p.numel() // 256)
    return {
        "step": 3,
        "state1": torch.randint(0, 256, p.shape, dtype=torch.uint8),
        "qmap1": torch.linspace(-1, 1, 256),
        "absmax1": torch.rand(blocks),
        "state2": torch.randint(0, 256, p.shape, dtype=torch.uint8),
        "qmap2": torch.linspace(0, 1, 256),
        "absmax2": torch.rand(blocks),
    }


def _bnb_state_dict(model, bits):
    params = list(model.parameters())
    return {
        "state": {i: _bnb_entry(p, bits) for i, p in enumerate(params)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "params": [0, 1]}],
    }


def test_bnb_32bit_state_dict_loads():
    model = _model()
    sd = _bnb_state_dict(model, 32)
    opt = lowbit.optim.AdamW32bit(model.parameters())
    opt.load_state_dict(sd)
    got = opt.dequantized_state(model.weight)
    # fp32 into fp32: bnb's state1 is torch's exp_avg and state2 its exp_avg_sq, kept exactly.
    torch.testing.assert_close(got["exp_avg"], sd["state"][0]["state1"], rtol=0, atol=0)
    torch.testing.assert_close(got["exp_avg_sq"], sd["state"][0]["state2"], rtol=0, atol=0)


def test_bnb_unorm_vec_raises_and_says_what_to_do():
    model = _model()
    sd = _bnb_state_dict(model, 32)
    sd["state"][0]["unorm_vec"] = torch.zeros(1)
    opt = lowbit.optim.AdamW8bit(model.parameters())
    with pytest.raises(ValueError, match="'unorm_vec' is bitsandbytes' max_unorm buffer.*delete the key"):
        opt.load_state_dict(sd)
    assert not opt.state


def test_bnb_8bit_state_dict_raises_and_says_what_to_do():
    model = _model()
    opt = lowbit.optim.AdamW8bit(model.parameters())
    _backward(model)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    with pytest.raises(ValueError, match=r"'qmap1' marks a bitsandbytes 8-bit optimizer state.*dequantize_blockwise"):
        opt.load_state_dict(_bnb_state_dict(model, 8))
    for key, value in before.items():
        assert torch.equal(opt.state[model.weight][key], value), "a failed load changes nothing"


class _TorchaoState(torch.Tensor):
    """Stands in for torchao.optim's OptimState8bit (a quantized tensor subclass), which is not installed here:
    the check keys on the subclass's module."""


_TorchaoState.__module__ = "torchao.optim.subclass_8bit"
_TorchaoState.__name__ = _TorchaoState.__qualname__ = "OptimState8bit"


def test_torchao_state_dict_raises_and_says_what_to_do():
    model = _model()
    ref = torch.optim.AdamW(model.parameters())
    _backward(model)
    ref.step()
    sd = ref.state_dict()
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].as_subclass(_TorchaoState)
    opt = lowbit.optim.AdamW8bit(model.parameters())
    with pytest.raises(ValueError, match=r"'exp_avg' is a torchao OptimState8bit.*dequantize\(\)"):
        opt.load_state_dict(sd)
    assert not opt.state
