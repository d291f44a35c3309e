"""Gradient release (lowbit.optim.step_in_backward): training with each parameter stepped inside backward
equals the ordinary ``backward(); step(); zero_grad()`` loop bit for bit, for every lowbit block-wise
optimizer and the LPMM ones, with schedulers and a tensor lr, micro-batch accumulation and FSDP2; no
gradient (or LPMM accumulator) survives backward; what cannot work (GradScaler, DDP) is refused. The
ordinary loop is the reference."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import lowbit.lpmm
import lowbit.optim
from lowbit.optim import step_in_backward

STEPS = 4

# Every block-wise state form and every per-tensor norm: 8-bit, 4-bit, fp32, AMSGrad, LAMB's and
# LARS's trust ratios, max_unorm, percentile clipping (clipping at the 50th percentile, so it scales).
SMALL = dict(min_8bit_size=64, min_4bit_size=64)
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Adam8bit": lambda p: lowbit.optim.Adam8bit(p, lr=1e-2, **SMALL),
    "AdamW8bit-amsgrad": lambda p: lowbit.optim.AdamW8bit(p, lr=1e-2, amsgrad=True, **SMALL),
    "Adam4bit": lambda p: lowbit.optim.Adam4bit(p, lr=1e-2, **SMALL),
    "AdamW-optim_bits=4-amsgrad": lambda p: lowbit.optim.AdamW(p, lr=1e-2, optim_bits=4, amsgrad=True, **SMALL),
    "SGD4bit": lambda p: lowbit.optim.SGD4bit(p, lr=5e-2, momentum=0.9, **SMALL),
    "SGD8bit-nesterov": lambda p: lowbit.optim.SGD8bit(p, lr=5e-2, momentum=0.9, nesterov=True, **SMALL),
    "AdamW32bit": lambda p: lowbit.optim.AdamW32bit(p, lr=1e-2),
    "Lion8bit": lambda p: lowbit.optim.Lion8bit(p, lr=1e-3, **SMALL),
    "RMSprop8bit": lambda p: lowbit.optim.RMSprop8bit(p, lr=1e-3, **SMALL),
    "Adagrad8bit": lambda p: lowbit.optim.Adagrad8bit(p, lr=1e-2, **SMALL),
    "LAMB8bit": lambda p: lowbit.optim.LAMB8bit(p, lr=1e-2, **SMALL),
    "LAMB32bit": lambda p: lowbit.optim.LAMB32bit(p, lr=1e-2),
    "LARS8bit": lambda p: lowbit.optim.LARS8bit(p, lr=1.0, weight_decay=1e-4, **SMALL),
    "Adam8bit-max_unorm": lambda p: lowbit.optim.Adam8bit(p, lr=1e-2, max_unorm=0.01, **SMALL),
    "Adam8bit-percentile_clipping": lambda p: lowbit.optim.Adam8bit(p, lr=1e-2, percentile_clipping=50, **SMALL),
    "Adam4bit-percentile_clipping": lambda p: lowbit.optim.Adam4bit(p, lr=1e-2, percentile_clipping=50, **SMALL),
    "AdEMAMix8bit-warmups": lambda p: lowbit.optim.AdEMAMix8bit(p, lr=1e-2, t_alpha=3, t_beta3=3, **SMALL),
    # Stochastic rounding: release steps one parameter per native call, whose draws must be the loop's.
    "Adam4bit-stochastic": lambda p: _seeded(lowbit.optim.Adam4bit, p, lr=1e-2, rounding="stochastic", **SMALL),
    "AdamW-optim_bits=4-amsgrad-rank1-stochastic": lambda p: _seeded(
        lowbit.optim.AdamW,
        p,
        lr=1e-2,
        optim_bits=4,
        amsgrad=True,
        rank1_normalization=True,
        rounding="stochastic",
        **SMALL,
    ),
    "SGD8bit-stochastic": lambda p: _seeded(
        lowbit.optim.SGD8bit, p, lr=5e-2, momentum=0.9, rounding="stochastic", **SMALL
    ),
}


def _seeded(cls: Callable[..., torch.optim.Optimizer], params: Any, **kw: Any) -> torch.optim.Optimizer:
    """``cls(params, **kw)`` with the rounding_seed that torch's generator seeded with 1 draws: both optimizers
    of a pair round alike."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return cls(params, **kw)


class Net(nn.Module):
    """Shapes around the block sizes, a layer used twice (its gradient has two contributions, final only
    after both), a parameter that forward never uses (no gradient, never stepped) and a bias below
    ``min_8bit_size`` (fp32 states beside 8-bit ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(24, 40)
        self.mid = nn.Linear(40, 40)
        self.out = nn.Linear(40, 7, bias=False)
        self.unused = nn.Parameter(torch.ones(300))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        return self.out(torch.tanh(self.mid(h)))


def _batches(n: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 24, generator=g), torch.randint(0, 7, (16,), generator=g)) for _ in range(n)]


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _pair(make: Callable[[Any], torch.optim.Optimizer]) -> tuple[nn.Module, Any, nn.Module, Any]:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    return ref, make(ref.parameters()), model, make(model.parameters())


def _assert_same(ref: nn.Module, ref_opt: torch.optim.Optimizer, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Parameters and every optimizer state tensor (codes, absmaxes, step, gnorm_vec) equal bit for bit."""
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
        sa, sb = ref_opt.state.get(a, {}), opt.state.get(b, {})
        assert sa.keys() == sb.keys(), name
        for key in sa:
            if isinstance(sa[key], Tensor):
                assert torch.equal(sa[key], sb[key]), (name, key)
            else:
                assert sa[key] == sb[key], (name, key)


def _no_grads(model: nn.Module) -> bool:
    return all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_release_equals_the_ordinary_loop(name):
    ref, ref_opt, model, opt = _pair(OPTIMIZERS[name])
    release = step_in_backward(opt, model)
    for batch in _batches(STEPS):
        _loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _loss(model, batch).backward()
        assert _no_grads(model)
    _assert_same(ref, ref_opt, model, opt)
    assert not opt.state.get(model.unused)  # no gradient, never stepped
    assert any(s["state1"].dtype == torch.uint8 for s in opt.state.values() if "state1" in s) != name.endswith("32bit")
    release.remove()


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("name", ["Adam8bit", "LAMB8bit", "Adam4bit-percentile_clipping"])
def test_schedulers_and_param_groups_match(name, tensor_lr):
    # Two groups with their own lr and a per-parameter override; a scheduler stepping after each
    # iteration (after opt.step(), which is a no-op under release) and a tensor lr it fills in place.
    def make(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        lr = torch.tensor(1e-2) if tensor_lr else 1e-2
        groups = [{"params": params[:3]}, {"params": params[3:], "lr": torch.tensor(3e-3) if tensor_lr else 3e-3}]
        opt = OPTIMIZERS[name](groups)
        opt.param_groups[0]["lr"] = lr
        lowbit.optim.override(params[2], optim_bits=32)
        return opt

    ref, ref_opt, model, opt = _pair(make)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=[2e-2, 5e-3], total_steps=STEPS + 1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 5e-3], total_steps=STEPS + 1)
    release = step_in_backward(opt, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for batch in _batches(STEPS):
            _loss(ref, batch).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            _loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    _assert_same(ref, ref_opt, model, opt)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    release.remove()


@pytest.mark.parametrize("name", ["Adam8bit", "Adam4bit-stochastic"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_matches(backend, name):
    # torch.compile compiles forward (and, with aot_eager, backward) graphs; parameters stay leaves whose
    # gradients autograd's engine accumulates, so the hooks run as in eager mode.
    ref, ref_opt, model, opt = _pair(OPTIMIZERS[name])
    ref_c, model_c = torch.compile(ref, backend=backend), torch.compile(model, backend=backend)
    release = step_in_backward(opt, model)
    for batch in _batches(STEPS):
        _loss(ref_c, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _loss(model_c, batch).backward()
        assert _no_grads(model)
    _assert_same(ref, ref_opt, model, opt)
    release.remove()


def test_step_and_zero_grad_are_no_ops_under_release():
    _, _, model, opt = _pair(OPTIMIZERS["Adam8bit"])
    release = step_in_backward(opt, model)
    for batch in _batches(2):
        _loss(model, batch).backward()
    after = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    assert opt.step(lambda: 1.5) == 1.5  # a closure is still evaluated and its loss returned
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    assert calls == [1]  # step hooks run once per step() call, not per released parameter
    for a, b in zip(after[0], model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert str(after[1]) == str(opt.state_dict())
    release.remove()


def test_remove_restores_the_ordinary_loop_and_state_dict_round_trips():
    ref, ref_opt, model, opt = _pair(OPTIMIZERS["AdamW8bit-amsgrad"])
    release = step_in_backward(opt, model)
    batches = _batches(4)
    for i, batch in enumerate(batches):
        if i == 2:
            release.remove()
            release.remove()  # idempotent
            assert not release.active
            # A checkpoint taken under release loads into a fresh optimizer that continues identically.
            fresh = OPTIMIZERS["AdamW8bit-amsgrad"](model.parameters())
            fresh.load_state_dict(opt.state_dict())
            opt = fresh
        _loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _loss(model, batch).backward()
        assert _no_grads(model) == (i < 2)
        if i >= 2:
            opt.step()
            opt.zero_grad()
    _assert_same(ref, ref_opt, model, opt)
    assert not hasattr(opt, "_step_supports_amp_scaling")


def test_accumulation_over_micro_batches_matches():
    ref, ref_opt, model, opt = _pair(OPTIMIZERS["Adam8bit-percentile_clipping"])
    release = step_in_backward(opt, model)
    batches = _batches(3 * STEPS)
    for i in range(0, len(batches), 3):
        for batch in batches[i : i + 3]:
            _loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with release.accumulate():
            for batch in batches[i : i + 2]:
                _loss(model, batch).backward()
        assert not _no_grads(model)  # accumulated, not stepped
        _loss(model, batches[i + 2]).backward()
        assert _no_grads(model)
    _assert_same(ref, ref_opt, model, opt)
    release.remove()


@pytest.mark.parametrize("release", [False, True], ids=["ordinary", "released"])
def test_gradient_bytes_are_gone_during_backward(release):
    # The live .grad bytes, counted whenever a gradient becomes final: the ordinary loop ends backward
    # holding every gradient at once; under release each is freed right after its step, before the next
    # becomes final (release's hook, registered first, runs before the counting one).
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS["Adam8bit"](model.parameters())
    handle = step_in_backward(opt, model) if release else None
    params = list(model.parameters())
    live: list[int] = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: live.append(sum(q.grad.numel() * q.element_size() for q in params if q.grad is not None))
        )
    _loss(model, _batches(1)[0]).backward()
    # The model's used parameters: 24*40 + 40 + 40*40 + 40 + 40*7 = 2,920 fp32 values, 11,680 bytes.
    assert max(live) == (0 if release else 11680)
    assert len(live) == 5
    if handle is not None:
        handle.remove()


def test_refuses_grad_scaler_at_its_step():
    _, _, model, opt = _pair(OPTIMIZERS["Adam8bit"])
    step_in_backward(opt, model)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model, _batches(1)[0])).backward()
    with pytest.raises(RuntimeError, match="GradScaler cannot work with step_in_backward"):
        scaler.step(opt)
    opt.step()  # without the scaler, step() is the no-op again


def test_global_clipping_finds_no_gradient():
    # clip_grad_norm_ is torch's and cannot be intercepted: after a released backward it sees no
    # gradient and returns 0 (documented); per-tensor max_unorm/percentile_clipping are the way.
    _, _, model, opt = _pair(OPTIMIZERS["Adam8bit"])
    step_in_backward(opt, model)
    _loss(model, _batches(1)[0]).backward()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0


def test_refuses_other_optimizers_and_leftover_gradients():
    model = lowbit.lpmm.convert(nn.Sequential(nn.Linear(8, 8)), param_bits=12, grad_bits=8, group_size=64)
    lpmm_opt = lowbit.optim.LPMMAdamW(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="needs the gradients cleared first"):
        step_in_backward(lpmm_opt, model)
    lpmm_opt.zero_grad()
    model[0].weight.accumulate_(torch.ones(8, 8))  # by hand: no .grad on the handle, still a gradient
    assert model[0].weight.handle.grad is None
    with pytest.raises(RuntimeError, match="needs the gradients cleared first"):
        step_in_backward(lpmm_opt, model)
    plain = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="lowbit optimizers, got AdamW"):
        step_in_backward(torch.optim.AdamW(plain.parameters()))
    opt = lowbit.optim.Adam8bit(plain.parameters())
    plain(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="needs the gradients cleared first"):
        step_in_backward(opt, plain)
    opt.zero_grad()
    release = step_in_backward(opt, plain)
    with pytest.raises(RuntimeError, match="already on"):
        step_in_backward(opt, plain)
    release.remove()


def test_a_failed_step_keeps_the_gradient():
    # An invalid lr edited in after release: the step inside backward raises, like opt.step() would,
    # and leaves the parameter, its state and its gradient as they were.
    model = nn.Linear(4, 4)
    opt = lowbit.optim.Adam8bit(model.parameters())
    step_in_backward(opt, model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        model(torch.ones(1, 4)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state
    assert sum(p.grad is not None for p in model.parameters()) >= 1


# LPMM: 12-bit parameters, 8-bit accumulators, groups of 64 (Net's weights span several groups, its
# biases one partial group each), stochastic rounding everywhere (the draws are what release must keep);
# 8-bit and 4-bit moments.
LPMM_OPTIMIZERS: dict[str, Callable[[Any, torch.Generator], torch.optim.Optimizer]] = {
    "LPMMSGD": lambda p, g: lowbit.optim.LPMMSGD(p, lr=5e-2, momentum=0.9, generator=g),
    "LPMMSGD-nesterov-4bit": lambda p, g: lowbit.optim.LPMMSGD(
        p, lr=5e-2, momentum=0.9, nesterov=True, momentum_bits=4, generator=g
    ),
    "LPMMAdamW": lambda p, g: lowbit.optim.LPMMAdamW(p, lr=1e-2, generator=g),
    "LPMMAdamW-4bit": lambda p, g: lowbit.optim.LPMMAdamW(p, lr=1e-2, momentum_bits=4, generator=g),
}


def _lpmm_pair(name: str) -> tuple[nn.Module, Any, nn.Module, Any]:
    """Two identically converted Nets and their optimizers, each model with its own accumulation generator
    and each optimizer with its own, seeded alike: the two loops draw the same seeds in their own order."""
    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = lowbit.lpmm.convert(
            Net(), param_bits=12, grad_bits=8, group_size=64, generator=torch.Generator().manual_seed(1)
        )
        pairs += [model, LPMM_OPTIMIZERS[name](model.parameters(), torch.Generator().manual_seed(2))]
    return tuple(pairs)  # type: ignore[return-value]


def _assert_lpmm_same(ref: nn.Module, ref_opt: Any, model: nn.Module, opt: Any) -> None:
    """Stored parameters (codes and absmaxes) and every optimizer state tensor equal bit for bit."""
    lps = lowbit.lpmm.low_precision_parameters(model)
    for name, a in lowbit.lpmm.low_precision_parameters(ref).items():
        b = lps[name]
        assert torch.equal(a.codes, b.codes) and torch.equal(a.absmax, b.absmax), name
        sa, sb = ref_opt.state[a.handle], opt.state[b.handle]
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (name, key)


@pytest.mark.parametrize("name", list(LPMM_OPTIMIZERS))
def test_lpmm_release_equals_the_ordinary_loop(name):
    ref, ref_opt, model, opt = _lpmm_pair(name)
    storages = lowbit.lpmm.low_precision_parameters(model).values()
    release = step_in_backward(opt, model)
    # The accumulators are freed as soon as release starts, before any backward.
    assert not any(lp.accumulator_allocated for lp in storages)
    start = {k: v.codes.clone() for k, v in lowbit.lpmm.low_precision_parameters(model).items()}
    for batch in _batches(STEPS):
        _loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _loss(model, batch).backward()
        assert not any(lp.has_grad or lp.accumulator_allocated for lp in storages)
        opt.step()  # no gradient left: a no-op, as in the block-wise case
        opt.zero_grad()
    _assert_lpmm_same(ref, ref_opt, model, opt)
    # Trained (every used parameter moved), and `unused` never stepped: no gradient, step count 0.
    moved = {k for k, v in lowbit.lpmm.low_precision_parameters(model).items() if not torch.equal(v.codes, start[k])}
    assert moved == set(start) - {"unused"}
    assert float(opt.state[model.unused.handle]["step"]) == 0.0
    assert all(float(opt.state[p]["step"]) == STEPS for p in model.parameters() if p is not model.unused.handle)
    release.remove()


def test_lpmm_release_accumulates_micro_batches():
    ref, ref_opt, model, opt = _lpmm_pair("LPMMAdamW")
    storages = list(lowbit.lpmm.low_precision_parameters(model).values())
    release = step_in_backward(opt, model)
    batches = _batches(3 * STEPS)
    for i in range(0, len(batches), 3):
        for batch in batches[i : i + 3]:
            _loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with release.accumulate():
            for batch in batches[i : i + 2]:
                _loss(model, batch).backward()
        assert all(lp.has_grad for lp in storages if lp is not model.unused)  # accumulated, not stepped
        _loss(model, batches[i + 2]).backward()
        assert not any(lp.has_grad or lp.accumulator_allocated for lp in storages)
    _assert_lpmm_same(ref, ref_opt, model, opt)
    release.remove()
    # The ordinary loop again: the accumulators come back.
    _loss(model, batches[0]).backward()
    assert all(lp.accumulator_allocated for lp in storages if lp is not model.unused)


@pytest.mark.parametrize("release", [False, True], ids=["ordinary", "released"])
def test_lpmm_accumulator_bytes_are_gone_during_backward(release):
    # The live accumulator bytes, counted whenever a parameter's gradient is final (this hook is registered
    # after release's, so it runs after that parameter's step): the ordinary loop keeps every accumulator;
    # under release each is freed after its step, before the next parameter's gradient is final.
    _, _, model, opt = _lpmm_pair("LPMMAdamW")
    storages = list(lowbit.lpmm.low_precision_parameters(model).values())
    handle = step_in_backward(opt, model) if release else None
    live: list[int] = []
    for lp in storages:
        lp.handle.register_post_accumulate_grad_hook(
            lambda _: live.append(sum(x.grad_codes.nbytes + x.grad_absmax.nbytes for x in storages))
        )
    _loss(model, _batches(1)[0]).backward()
    # 8-bit codes and one fp32 absmax per 64 elements: 960 + 4 * 15, 40 + 4, 1600 + 4 * 25, 40 + 4,
    # 280 + 4 * 5, and `unused` (never used, still allocated in the ordinary loop) 300 + 4 * 5 = 3,428 bytes.
    # Released: at most the accumulator of mid.weight (1600 + 4 * 25 bytes) is alive at another parameter's
    # hook (mid runs twice, so its gradient is final only after both uses), and none at the last one.
    if release:
        assert max(live) <= 1700 and live[-1] == 0, live
    else:
        assert max(live) == 3428, live
    assert len(live) == 5
    if handle is not None:
        handle.remove()


if dist.is_available() and dist.is_gloo_available():
    from tests.dist_jobs import launch

    # Every optimizer class that steps FSDP2-sharded parameters: each rule at 8 bits, the 4-bit and 32-bit
    # state forms, the whole-tensor norms of sharded tensors inside the step (LAMB; LARS's trust ratio;
    # percentile clipping) and AdEMAMix's schedules. Not here: Muon, whose step refuses a sharded matrix
    # (lowbit/optim/muon.py); the LPMM optimizers are in test_fsdp2_release_of_lpmm_equals_the_ordinary_loop.
    FSDP2_CLASSES = [
        "Adam8bit", "AdamW8bit", "SGD8bit", "Lion8bit", "RMSprop8bit", "Adagrad8bit", "AdEMAMix8bit", "LAMB8bit",
        "LARS8bit", "Adam8bit-clip", "AdamW4bit", "SGD4bit", "AdamW32bit",
    ]  # fmt: skip

    def test_fsdp2_release_equals_the_ordinary_loop(tmp_path):
        # FSDP2 calls the sharded parameters' post-accumulate-grad hooks after its reduce-scatter: each
        # rank steps its shard on the reduced gradient, in the same order on every rank (LAMB's norms and
        # percentile clipping all-reduce inside the step). All classes in one pair of ranks per mode.
        job = {"parallel": "fsdp", "optimizers": FSDP2_CLASSES, "steps": 3, "variants": [{}, {"release": True}]}
        ordinary, released = launch(2, job, tmp_path)
        for name in FSDP2_CLASSES:
            assert released[name]["losses"] == ordinary[name]["losses"], name
            assert released[name]["digest"] == ordinary[name]["digest"], name
            assert released[name]["grads_left"] == 0 and ordinary[name]["grads_left"] > 0, name

    def test_fsdp2_release_accumulates_micro_batches(tmp_path):
        # FSDP2 reduce-scatters every micro-batch and adds the shards to .grad, running the hooks each
        # time: inside release.accumulate() they do not step, and the last micro-batch steps on the sum.
        job = {
            "parallel": "fsdp",
            "optimizer": "AdamW8bit",
            "steps": 2,
            "micro": 2,
            "variants": [{}, {"release": True}],
        }
        ordinary, released = launch(2, job, tmp_path)
        assert released["losses"] == ordinary["losses"]
        assert released["digest"] == ordinary["digest"]
        assert released["grads_left"] == 0

    @pytest.mark.parametrize("micro", [1, 2])
    def test_fsdp2_release_of_lpmm_equals_the_ordinary_loop(tmp_path, micro):
        # Sharded LPMM storage (12-bit parameters, 8-bit accumulators): backward reduce-scatters each use's
        # gradient into the rank's accumulator groups, and release steps them from the storage's release
        # leaf once the last use is in (tests/test_lpmm_fsdp.py: the same on one rank). Uneven splits
        # included (the layer norms' single group is 1 + 0).
        job = {
            "parallel": "fsdp",
            "optimizers": ["LPMMSGD", "LPMMAdamW"],
            "lpmm": [12, 8],
            "steps": 3,
            "micro": micro,
            "variants": [{}, {"release": True}],
        }
        ordinary, released = launch(2, job, tmp_path)
        for name in job["optimizers"]:
            assert released[name]["losses"] == ordinary[name]["losses"], name
            assert released[name]["digest"] == ordinary[name]["digest"], name
            assert released[name]["grads_left"] == 0 and ordinary[name]["grads_left"] > 0, name
            assert released[name]["losses"][-1] < released[name]["losses"][0], name  # it trains

    def test_refuses_ddp(tmp_path):
        # Without the model (the second variant), plain parameters in a distributed run could be DDP's:
        # refused, asking for it.
        job = {
            "parallel": "ddp",
            "optimizer": "Adam8bit",
            "steps": 1,
            "variants": [{"release": True}, {"release": "no-model"}],
        }
        with_model, without_model = launch(2, job, tmp_path)
        assert "cannot release gradients under DistributedDataParallel" in with_model["refused"]
        assert "needs model=" in without_model["refused"]
