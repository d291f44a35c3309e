"""Muon8bit / Muon32bit against torch.optim.Muon: arguments and errors, the fused momentum op against its
pure-PyTorch twin, exactness of the 32-bit twin, the 8-bit trajectory, state size, the usual recipe
(Muon on hidden matrices, AdamW on the rest) and FSDP2's sharded parameters. State dicts (torch.optim.Muon's
into Muon8bit and back, round trips) are in tests/conformance/test_checkpoints.py, the trajectory bound in
tests/test_optim_trajectories.py, the CUDA launcher in tests/test_cuda_emulation.py."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import lowbit.optim as O
from lowbit import _ops
from lowbit import _reference as R
from lowbit.functional import create_dynamic_map, quantize_blockwise
from lowbit.memory import memory_report

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")

SIZES = [1, 4095, 4097, 65539]


def _grads(shape: tuple[int, int], steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, shape[0])[:, None]  # rows of different magnitude: blocks differ
    return [torch.randn(shape, generator=gen) * scale for _ in range(steps)]


def _run(opt: torch.optim.Optimizer, p: nn.Parameter, grads: list[torch.Tensor]) -> torch.Tensor:
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach().clone()


# -- the fused op ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [64, 256, 4096, 0])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_op_is_its_twin_bit_for_bit(n, dtype, block, nesterov):
    # block 0: an fp32 buffer. Two steps, so the second decodes what the first encoded; one NaN gradient
    # element restarts its 8-bit buffer element from zero and leaves the rest of its block as it was.
    gen = torch.Generator().manual_seed(n)
    code = create_dynamic_map(signed=True)
    grad = (torch.randn(n, generator=gen) * 3).to(dtype)
    grad[n // 3] = float("nan")
    m = torch.randn(n, generator=gen)
    if block:
        state, qs = quantize_blockwise(m, code, blocksize=block)
        absmax = qs.absmax
    else:
        state, absmax = m, torch.empty(0)
    outs = []
    for step in (_ops.muon_momentum_, R.muon_momentum_):
        s, a, u = state.clone(), absmax.clone(), torch.empty(n)
        for _ in range(2):
            step(grad, s, a, code, u, 0.95, nesterov, block or 256)
        outs.append((s, a, u))
    for got, want in zip(*outs, strict=True):
        # Equal values; a NaN's sign and payload are not part of the contract (ATen's and fmaf's differ).
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    s, a, u = outs[0]
    assert u[n // 3].isnan()
    # 8-bit: no block absmax became NaN; fp32: the buffer element is NaN, as torch's.
    assert bool(a.isfinite().all()) if block else bool(s[n // 3].isnan())


def test_momentum_op_fp32_buffer_is_torchs_lerp():
    # torch.optim.Muon's two lerps, bit for bit: ATen's lerp is one fused multiply-add, as the op's.
    gen = torch.Generator().manual_seed(0)
    g, m = torch.randn(65539, generator=gen), torch.randn(65539, generator=gen)
    for nesterov in (True, False):
        buf, update = m.clone(), torch.empty(65539)
        _ops.muon_momentum_(g, buf, torch.empty(0), create_dynamic_map(), update, 0.95, nesterov, 256)
        want = m.clone().lerp_(g, 1 - 0.95)
        assert torch.equal(buf, want)
        assert torch.equal(update, g.lerp(want, 0.95) if nesterov else want)


def test_momentum_op_passes_opcheck():
    # Schema (which arguments it mutates), fake kernel and autograd registration, as torch.compile sees them.
    code = create_dynamic_map()
    state, qs = quantize_blockwise(torch.randn(300), code, blocksize=64)
    args = (torch.randn(300), state, qs.absmax, code, torch.empty(300), 0.95, True, 64)
    torch.library.opcheck(torch.ops.lowbit.muon_momentum_.default, args)


def test_momentum_op_checks_before_writing():
    code = create_dynamic_map()
    state, absmax, update = torch.zeros(300, dtype=torch.uint8), torch.zeros(2), torch.zeros(300)
    with pytest.raises(ValueError, match="absmax has 2 entries but 300 elements need 5"):
        _ops.muon_momentum_(torch.ones(300), state, absmax, code, update, 0.9, True, 64)
    with pytest.raises(TypeError, match="update has dtype torch.float16"):
        _ops.muon_momentum_(torch.ones(300), state, absmax, code, update.half(), 0.9, True, 256)
    with pytest.raises(ValueError, match="momentum must be a finite number"):
        _ops.muon_momentum_(torch.ones(300), state, absmax, code, update, float("nan"), True, 256)
    assert not state.any() and not absmax.any() and not update.any()


# -- the optimizer against torch.optim.Muon ---------------------------------------------------------------


def test_constructor_takes_torchs_arguments_and_defaults():
    ours = inspect.signature(O.Muon).parameters
    for name, param in inspect.signature(torch.optim.Muon).parameters.items():
        assert name in ours and ours[name].default == param.default, name
    assert O.Muon8bit([nn.Parameter(torch.zeros(2, 2))]).param_groups[0]["optim_bits"] == 8


@pytest.mark.parametrize(
    ("kw", "params"),
    [
        (dict(lr=-1.0), None),
        (dict(momentum=-0.1), None),
        (dict(weight_decay=-0.1), None),
        (dict(adjust_lr_fn="rms"), None),
        (dict(lr=torch.tensor([1e-3, 1e-3])), None),
        ({}, [nn.Parameter(torch.zeros(4))]),
        ({}, [nn.Parameter(torch.zeros(2, 2, 2))]),
    ],
)
def test_rejects_what_torch_rejects(kw, params):
    make = lambda: params or [nn.Parameter(torch.zeros(3, 4))]  # noqa: E731
    with pytest.raises(ValueError) as torch_error:
        torch.optim.Muon(make(), **kw)
    for cls in (O.Muon8bit, O.Muon32bit):
        with pytest.raises(type(torch_error.value)):
            cls(make(), **kw)


def test_a_group_that_is_not_2d_is_not_added():
    opt = O.Muon8bit([nn.Parameter(torch.zeros(3, 4))])
    with pytest.raises(ValueError, match="2D parameters"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(5))]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="ns_steps"):
        O.Muon8bit([nn.Parameter(torch.zeros(3, 4))], ns_steps=100)
    with pytest.raises(ValueError, match="max_unorm"):
        opt.param_groups[0]["max_unorm"] = 1.0
        opt.step()


def test_stochastic_rounding_is_refused_not_ignored():
    """Muon's momentum rounds to nearest: a group asking for stochastic rounding, added or edited in, is refused
    with the option named, and a refused step changes nothing (it used to round to nearest silently)."""
    w = nn.Parameter(torch.randn(16, 32))
    opt = O.Muon8bit([w], lr=0.02)
    with pytest.raises(ValueError, match="rounding='stochastic'"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(8, 8))], "rounding": "stochastic"})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["rounding"] = "stochastic"
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    with pytest.raises(ValueError, match="rounding='stochastic'"):
        opt.step()
    assert torch.equal(w, before) and not opt.state[w]


@pytest.mark.parametrize("shape", [(96, 160), (160, 96)])
@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=0.02),
        dict(lr=0.02, nesterov=False, weight_decay=0.0),
        dict(lr=0.05, momentum=0.3, adjust_lr_fn="match_rms_adamw", ns_steps=3),
    ],
)
def test_muon32bit_is_torch_muon_bit_for_bit(shape, kw):
    # Tolerance 0: the momentum op computes torch's lerps as ATen does (one fused multiply-add each, which
    # test_momentum_op_fp32_buffer_is_torchs_lerp shows bit for bit), and Newton-Schulz, the decay and the
    # update are the same torch ops in the same order; so "within fp32 rounding" is here no rounding at all.
    # momentum=0.3 takes the other branch of ATen's lerp (|1 - momentum| >= 0.5).
    grads = _grads(shape, 8, seed=1)
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    a, b = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    want = _run(torch.optim.Muon([a], **kw), a, grads)
    opt = O.Muon32bit([b], **kw)
    got = _run(opt, b, grads)
    assert torch.equal(got, want)
    assert not torch.equal(got, p0)


def test_muon8bit_follows_muon32bit():
    # Gradients that do not depend on the parameters, so the fp32 buffer is the exact reference at every
    # step. benchmarks/bench_muon_map.py measures, for this setting (rows of different scales, 50 steps),
    # 3.4e-2 relative L2 buffer error and 2.7e-2 parameter drift (mean of 3 seeds); the bounds 0.1 leave 3x
    # for the seed. A buffer that is not requantized or is stepped from the wrong block scale ends at >= 0.3
    # (a Nesterov blend of the stale buffer, or a momentum of 0), and one that steps the wrong way at ~2.
    shape = (512, 384)
    grads = _grads(shape, 50, seed=3)
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 0.02
    a, b = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    o32, o8 = O.Muon32bit([a], lr=0.02), O.Muon8bit([b], lr=0.02)
    want, got = _run(o32, a, grads), _run(o8, b, grads)
    assert o8.state[b]["state1"].dtype == torch.uint8
    m32, m8 = o32.state[a]["state1"], o8.dequantized_state(b)["momentum_buffer"]
    assert float((m8 - m32).norm() / m32.norm()) < 0.1
    assert float((got - want).norm() / (want - p0).norm()) < 0.1


@pytest.mark.parametrize("shape", [(1024, 1024), (4096, 1024), (1024, 4096)])
def test_8bit_state_is_at_most_1_02_bytes_per_parameter(shape):
    # The measured storage of every state tensor (codes, absmaxes, the step counter): 1 + 4/256 bytes per
    # parameter plus 4 bytes. ns_steps=0 skips Newton-Schulz, which the state does not depend on.
    model = nn.Linear(shape[1], shape[0], bias=False)
    opt = O.Muon8bit(model.parameters(), ns_steps=0)
    model.weight.grad = torch.ones(shape)
    opt.step()
    report = memory_report(model, opt)
    assert report.optimizer_state / report.num_params <= 1.02
    assert opt.state[model.weight]["state1"].dtype == torch.uint8


# -- failures change nothing -----------------------------------------------------------------------------


def test_a_failed_step_changes_nothing():
    # The second group's bad edit is found while preparing; the first group's matrix is then untouched.
    a, b = nn.Parameter(torch.randn(64, 80)), nn.Parameter(torch.randn(64, 80))
    opt = O.Muon8bit([{"params": [a]}, {"params": [b]}], min_8bit_size=0)
    a.grad, b.grad = torch.randn(64, 80), torch.randn(64, 80)
    opt.step()
    before = [t.clone() for t in (a, b, opt.state[a]["state1"], opt.state[a]["absmax1"], opt.state[a]["step"])]
    opt.param_groups[1]["ns_coefficients"] = (1.0, 2.0)
    with pytest.raises(ValueError, match="param_groups\\[1\\]: ns_coefficients must be a tuple of exactly 3"):
        opt.step()
    after = (a, b, opt.state[a]["state1"], opt.state[a]["absmax1"], opt.state[a]["step"])
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_a_sharded_dtensor_raises_and_changes_nothing(tmp_path):
    # FSDP2 shards a matrix by rows; Newton-Schulz needs all of it, so the step refuses (module docstring).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))
        opt = O.Muon8bit([p])
        p.grad = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
        before = p.detach().full_tensor().clone()
        with pytest.raises(NotImplementedError, match="Newton-Schulz orthogonalises the whole matrix"):
            opt.step()
        assert torch.equal(p.detach().full_tensor(), before) and not opt.state
    finally:
        dist.destroy_process_group()


# -- the usual recipe --------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.hidden = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32))
        self.head = nn.Linear(32, 50, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.embed(x)))


@pytest.mark.parametrize("tie", [False, True])
def test_muon_with_adamw_splits_one_model(tie):
    net = _Net(tie)
    muon, adamw = O.muon_with_adamw(net, muon=dict(lr=0.02), adamw=dict(lr=3e-4))
    hidden = {id(net.hidden[0].weight), id(net.hidden[2].weight)}
    assert {id(p) for p in muon.param_groups[0]["params"]} == hidden
    rest = {id(p) for p in net.parameters()} - hidden
    got = [id(p) for p in adamw.param_groups[0]["params"]]
    assert sorted(got) == sorted(rest) and len(got) == len(rest)
    assert muon.param_groups[0]["optim_bits"] == adamw.param_groups[0]["optim_bits"] == 8
    assert muon.param_groups[0]["lr"] == 0.02 and adamw.param_groups[0]["lr"] == 3e-4
    with pytest.raises(ValueError, match="head names no module"):
        O.muon_with_adamw(net, head=["nope"])


def _mlp_loss(make_muon: type, seed: int, steps: int = 50) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=gen)
    y = torch.sin(x @ torch.randn(16, 4, generator=gen))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    hidden = [model[2].weight]
    rest = [p for p in model.parameters() if p is not model[2].weight]
    opts = [make_muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mlp_with_muon8bit_hidden_matrices_ends_within_2_percent_of_torch_muon(seed):
    # The run: a 16-128-128-4 ReLU MLP regressing sin(x W) on 512 fixed points, full batch, 50 steps from
    # the same init; its 128x128 hidden matrix with Muon (lr 0.02, torch's other defaults), everything
    # else with torch.optim.AdamW (lr 3e-3) in both runs. The bound: issue 29's 2% of the final loss, per
    # seed. Why 50 steps: later this run enters a spiky regime where a 0.2% change of torch's own lr moves
    # the loss at step 150 by up to 11%, which would measure chaos, not the buffer. Measured at 50 steps
    # (seeds 0-3): Muon8bit within 0.8% of torch, the 0.2% lr change within 0.4%; a Muon that does not
    # step the matrix (lr 0) ends 170-200% higher.
    ours, torchs = _mlp_loss(O.Muon8bit, seed), _mlp_loss(torch.optim.Muon, seed)
    assert abs(ours - torchs) <= 0.02 * torchs, (ours, torchs)
