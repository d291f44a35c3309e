"""LPMM under FSDP2 in this process (a one-rank gloo group): the sharded storage layout, state dicts
that load across the whole and sharded layouts, and sharded training that is bit for bit the plain
one. Two-rank training, uneven splits and resharding checkpoints are in tests/test_distributed.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import lowbit.lpmm
import lowbit.optim
from lowbit.lpmm import LowPrecisionParameter, export_float, low_precision_parameters

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)

GROUP = 64


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _model(seed: int, shard: bool) -> nn.Module:
    # 70 * 40 = 2800 weights: 44 groups, the last one partial (48 of 64); the biases are single partial groups.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(40, 70), nn.GELU(), nn.LayerNorm(70), nn.Linear(70, 5))
    lowbit.lpmm.convert(model, param_bits=12, grad_bits=8, group_size=GROUP)
    if shard:
        fully_shard(model[0])
        fully_shard(model)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 7) -> list[float]:
    # The accumulation seeds come from torch's default generator: the same draws in the same order for
    # both layouts (one rank: no gradient averaging, so no rank-0 seed broadcast).
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 40, generator=data), torch.randint(0, 5, (16,), generator=data)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _flat_state(opt: torch.optim.Optimizer, lp: LowPrecisionParameter, key: str) -> torch.Tensor:
    value = opt.state[lp.handle][key]
    if isinstance(value, DTensor):
        value = value.full_tensor()
    # Sharded codes are [groups, bytes per group] rows; their flat prefix is the whole tensor's codes.
    return value.reshape(-1)[: (lp.numel() * 8 + 7) // 8] if value.dtype == torch.uint8 else value


def test_storage_is_sharded_in_whole_groups(one_rank):
    model = _model(0, shard=True)
    weight = model[0].weight
    assert isinstance(weight, LowPrecisionParameter) and weight.shards is not None
    assert isinstance(weight.codes, DTensor) and tuple(weight.codes.shape) == (44, GROUP * 12 // 8)
    assert isinstance(weight.absmax, DTensor) and tuple(weight.absmax.shape) == (44,)
    assert weight.local_numel == weight.numel() == 2800
    # The padding of the last group is zero, and the flat prefix holds one process's codes.
    plain = _model(0, shard=False)[0].weight
    assert torch.equal(weight.local_codes(), plain.codes)
    assert not weight.codes.to_local()[-1, 48 * 12 // 8 :].any()
    assert torch.equal(weight.dequantize(), plain.dequantize())


@pytest.mark.parametrize("optimizer", ["LPMMSGD", "LPMMAdamW"])
def test_sharded_training_is_bit_identical_to_plain(one_rank, optimizer):
    make = getattr(lowbit.optim, optimizer)
    plain, sharded = _model(0, shard=False), _model(0, shard=True)
    # The same rounding_seed for both optimizers (each draws its own when created).
    opt_plain, opt_sharded = (
        make(m.parameters(), lr=0.05, generator=torch.Generator().manual_seed(2)) for m in (plain, sharded)
    )
    assert _train(plain, opt_plain, 5) == _train(sharded, opt_sharded, 5)
    whole, split = export_float(plain), export_float(sharded)
    assert whole.keys() == split.keys()
    for key, value in whole.items():
        assert torch.equal(value, split[key]), key
    lps = low_precision_parameters(plain)
    for name, lp in low_precision_parameters(sharded).items():
        for key in opt_sharded.state[lp.handle]:
            if key != "step":
                assert torch.equal(_flat_state(opt_sharded, lp, key), _flat_state(opt_plain, lps[name], key))


def test_mixed_precision_policy_sets_the_compute_dtype(one_rank):
    # FSDP2 casts the handles it gathers for forward to param_dtype; the values follow them, as they
    # follow .to(torch.bfloat16) without FSDP2, and the gradients accumulate the same.
    plain = _model(0, shard=False).to(torch.bfloat16)
    sharded = _model(0, shard=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(sharded[0], mp_policy=policy)
    fully_shard(sharded, mp_policy=policy)
    x = torch.randn(16, 40)
    out = sharded(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, plain(x.bfloat16()))
    torch.manual_seed(3)
    out.float().square().mean().backward()
    torch.manual_seed(3)
    plain(x.bfloat16()).float().square().mean().backward()
    lps = low_precision_parameters(plain)
    for name, lp in low_precision_parameters(sharded).items():
        assert lp.dtype == torch.float32 and torch.equal(lp.grad, lps[name].grad.reshape(-1)), name
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        sharded[0].weight.dequantize(torch.int32)


def test_state_dicts_load_across_layouts(one_rank):
    trained = _model(0, shard=False)
    opt = lowbit.optim.LPMMAdamW(trained.parameters(), lr=0.05)
    _train(trained, opt, 2)
    want = export_float(trained)

    def same(model: nn.Module) -> bool:
        return all(torch.equal(v, want[k]) for k, v in export_float(model).items())

    # Whole -> sharded: model and optimizer (flat codes become this rank's rows).
    sharded = _model(1, shard=True)
    assert not same(sharded)
    sharded.load_state_dict(trained.state_dict())
    assert same(sharded)
    opt_sharded = lowbit.optim.LPMMAdamW(sharded.parameters(), lr=0.05)
    opt_sharded.load_state_dict(opt.state_dict())
    lps = low_precision_parameters(trained)
    for name, lp in low_precision_parameters(sharded).items():
        assert isinstance(opt_sharded.state[lp.handle]["state2"], DTensor)
        for key in ("state1", "absmax1", "state2", "absmax2"):
            assert torch.equal(_flat_state(opt_sharded, lp, key), _flat_state(opt, lps[name], key))
    # Sharded -> whole: the sharded state dict (DTensors) and the gathered full state dict (rows).
    for state in (sharded.state_dict(), get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))):
        plain = _model(2, shard=False)
        plain.load_state_dict(state)
        assert same(plain)
    # Both layouts continue identically from the loaded state.
    assert _train(sharded, opt_sharded, 2, seed=3) == _train(trained, opt, 2, seed=3)


def test_optimizer_made_before_fully_shard_raises(one_rank):
    model = _model(0, shard=False)
    opt = lowbit.optim.LPMMSGD(model.parameters(), lr=0.05)
    fully_shard(model)
    model(torch.randn(2, 40)).sum().backward()
    with pytest.raises(RuntimeError, match="create the optimizer after fully_shard"):
        opt.step()


def test_two_dimensional_mesh_raises(one_rank):
    model = _model(0, shard=False)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(NotImplementedError, match="HSDP is not supported"):
        fully_shard(model, mesh=mesh)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_of_sharded_storage_matches_plain(one_rank, norm_type):
    # lowbit.lpmm.clip_grad_norm_ all-reduces the sharded accumulators' norms (one rank: the all-reduce
    # runs, over one member); torch's clip_grad_norm_ sees no gradients on FSDP2 handles.
    plain, sharded = _model(0, shard=False), _model(0, shard=True)
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(1))
    for model in (plain, sharded):
        torch.manual_seed(3)  # the same accumulation rounding draws
        model(x).square().sum().backward()
    totals = [lowbit.lpmm.clip_grad_norm_(m, 0.5, norm_type=norm_type) for m in (plain, sharded)]
    # Exact: one rank, the same draws. 0.5 is max_norm, not a tolerance: above it the clipping acts.
    assert torch.equal(totals[0], totals[1]) and float(totals[0]) > 0.5
    lps = low_precision_parameters(plain)
    for name, lp in low_precision_parameters(sharded).items():
        assert torch.equal(lp.grad.reshape(-1)[: lp.numel()], lps[name].grad.reshape(-1)), name


@pytest.mark.parametrize("optimizer", ["LPMMSGD", "LPMMAdamW"])
@pytest.mark.parametrize("micro", [1, 2])
def test_gradient_release_of_sharded_storage_equals_the_ordinary_loop(one_rank, optimizer, micro):
    # FSDP2 gives a sharded handle no gradient, so release hooks the storage's release leaf: each rank
    # steps its groups once every use has been reduce-scattered into its accumulator, and frees the
    # accumulator. Bit for bit the ordinary loop (the step's draws depend on the seed, the step number
    # and the position only; the accumulation draws come in the same order). Two micro-batches: the first
    # accumulates inside release.accumulate() without stepping.
    make = getattr(lowbit.optim, optimizer)
    models = [_model(0, shard=True) for _ in range(2)]
    opts = [make(m.parameters(), lr=0.05, generator=torch.Generator().manual_seed(2)) for m in models]
    release = lowbit.optim.step_in_backward(opts[1], models[1])
    losses: list[list[float]] = [[], []]
    for k, (model, opt) in enumerate(zip(models, opts, strict=True)):
        torch.manual_seed(7)
        data = torch.Generator().manual_seed(0)
        start = {name: lp.codes.to_local().clone() for name, lp in low_precision_parameters(model).items()}
        for _ in range(4):
            x, y = torch.randn(16, 40, generator=data), torch.randint(0, 5, (16,), generator=data)
            for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
                loss = nn.functional.cross_entropy(model(xm), ym) / micro
                accumulating = k == 1 and i < micro - 1
                with release.accumulate() if accumulating else contextlib.nullcontext():
                    loss.backward()
                losses[k].append(loss.item())
            pending = [lp.has_grad for lp in low_precision_parameters(model).values()]
            # Released: stepped and freed inside backward; ordinary: every accumulator waits for step().
            assert not any(pending) if k == 1 else all(pending)
            opt.step()
            opt.zero_grad()
        moved = [not torch.equal(lp.codes.to_local(), start[n]) for n, lp in low_precision_parameters(model).items()]
        assert all(moved)  # the check below compares trained parameters, not two untouched ones
    assert losses[0] == losses[1]
    whole, released = export_float(models[0]), export_float(models[1])
    for key, value in whole.items():
        assert torch.equal(value, released[key]), key
    lps = low_precision_parameters(models[0])
    for name, lp in low_precision_parameters(models[1]).items():
        for key in opts[1].state[lp.handle]:
            assert torch.equal(_flat_state(opts[1], lp, key), _flat_state(opts[0], lps[name], key)), key
    release.remove()
    assert all(lp.release_leaf is None for lp in low_precision_parameters(models[1]).values())
