"""The factorized second moment of the 4-bit Adam optimizers (``factored=True``; lowbit/optim/factored.py, stepped
natively by include/lowbit/factored.h): the optimizer against its pure-PyTorch twin (lowbit/_reference/factored.py),
the twin's fixed-order sums against torch's, the twin's estimator against Adafactor's formula in float64, the
direction of the first step, the bytes of a matrix's v, one native call per group, and the refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

import lowbit._reference as R
import lowbit.optim as O
from lowbit import _C
from lowbit.optim.state_storage import optimizer_state_map


def _twin_states(opt: O.LowbitOptimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state[p].items() if k != "step"}


@pytest.mark.parametrize(
    "shape",
    [(48, 160), (3, 40, 72), (67, 131), (2, 3, 5, 33), (129, 1), (1, 70)],
    ids=["matrix", "3d", "odd", "4d", "one-column", "one-row"],
)
@pytest.mark.parametrize("cls,decoupled", [(O.AdamW4bit, True), (O.Adam4bit, False)], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factored_step_matches_the_twin_bit_for_bit(shape, cls, decoupled, maximize, dtype):
    """Five steps of the optimizer (the native fused step) and of the twin from the same start: parameters,
    4-bit codes, absmaxes and factors equal exactly (the twin does the same fp32 operations in the same order,
    its sums in factored.h's fixed order, and codes m with lowbit._reference.quantize's independent block-wise
    coder); bf16 parameters keep fp32 math and factors. The shapes end in partial lanes (131, 33, 70 columns),
    partial blocks of m, single rows and columns, and slices of 3 and 4-axis tensors."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
    twin = p.detach().clone()
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt = cls([p], factored=True, min_4bit_size=0, maximize=maximize, **kw)
    m_map = optimizer_state_map(True, p.device, 4)
    state = None
    for step in range(1, 6):
        g = (torch.randn(shape) * (1 + torch.arange(shape[-1]) / 10)).to(dtype)  # columns of different scales
        p.grad = g.clone()
        if state is None:
            state = {k: v.clone() for k, v in opt.state[p].items() if k != "step"} if opt.state[p] else None
        opt.step()
        if state is None:  # the initial factored state is zero; take its layout from the optimizer's
            state = {k: torch.zeros_like(v) for k, v in _twin_states(opt, p).items()}
            state["absmax1"].zero_()
            state["state1"].fill_(0x77)  # code 7 of the symmetric signed map is 0 (checked below)
        R.factored_adam_step_(
            twin, g, state, step, decoupled=decoupled, maximize=maximize, m_map=m_map, block_size=128, **kw
        )
        assert torch.equal(p.detach(), twin), f"step {step}"
        for k, v in _twin_states(opt, p).items():
            assert torch.equal(v, state[k]), f"{k} at step {step}"
    assert float(m_map[7]) == 0.0
    assert p.dtype == dtype and opt.state[p]["row2"].dtype == torch.float32


def test_twin_sums_are_torchs_sums_to_rounding():
    """The twin's fixed-order sums (factored.h's lanes over a row, row order over a column) are sums of the same
    values as torch's: against float64 sums they are within (n - 1) u relative for n positive terms (u = 2**-24,
    any order), 130 u for the 131-term rows and 66 u for the 67-term columns. Reordering shows: a sum of values
    of seven decades in the lanes' order differs from the plain running sum (so the order is not a no-op)."""
    torch.manual_seed(7)
    x = torch.rand(67, 131) + 0.01
    assert torch.allclose(R.lane_sum(x, _C.FACTORED_LANES).double(), x.double().sum(-1), rtol=130 * 2**-24, atol=0)
    assert torch.allclose(R.column_sum(x).double(), x.double().sum(-2), rtol=66 * 2**-24, atol=0)
    wide = 10.0 ** torch.linspace(-3, 4, 64)
    running = torch.zeros(())
    for value in wide:
        running = running + value
    assert not torch.equal(R.lane_sum(wide, _C.FACTORED_LANES), running)


def test_one_native_call_steps_a_group_with_factored_and_block_wise_parameters(monkeypatch):
    """A group of two factorized matrices, a 3-axis tensor and a vector is one native call (no per-parameter
    Python step), and factorizes exactly the tensors of 2 or more axes."""
    from lowbit import _ops
    from lowbit.optim import optimizer

    calls = []
    step = _ops.optimizer_step_eager
    monkeypatch.setattr(optimizer._ops, "optimizer_step_eager", lambda *a, **k: calls.append(a) or step(*a, **k))
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 80), (33, 7), (2, 9, 40), (500,)]]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = O.AdamW4bit(params, factored=True, min_4bit_size=0)
    opt.step()
    assert len(calls) == 1
    assert calls[0][0].factored == [1, 1, 1, 0]
    assert ["row2" in opt.state[p] for p in params] == [True, True, True, False]


def _factored_args(factors: torch.Tensor, rule: str = "adam"):
    """The op's arguments for one factorized (8, 300) fp32 parameter, AdamW's hyperparameters."""
    from lowbit import _C, _ops

    p, g = torch.randn(8, 300), torch.randn(8, 300)
    hyper = _ops.StepHyper.with_betas(1e-3, (0.9, 0.999), eps=1e-8, weight_decay=0.01, decay=1 - 1e-5)
    maps = [optimizer_state_map(s, p.device, 4) for s in (True, False, True)]
    empty8, empty32 = torch.empty(0, dtype=torch.uint8), torch.empty(0)
    return _ops.StepArgs(
        [p], [g], [torch.full((1200,), 0x77, dtype=torch.uint8)], [empty8], [empty8],
        [torch.zeros(19)], [empty32], [empty32], [1e-3 / 0.1, 0.001**0.5, 1.0], None, *maps,
        _C.RULES[rule], hyper.values(), _C.FLAG_DECOUPLED, 0, 2, 128, state_bits=4, factored=[1], factors=factors,
    )  # fmt: skip


@pytest.mark.parametrize(
    "factors,rule,match",
    [
        (torch.zeros(307), "adam", (ValueError, "factors must hold 308")),
        (torch.zeros(308, dtype=torch.float64), "adam", (TypeError, "factors has dtype torch.float64")),
        (torch.zeros(308), "lion", (ValueError, "only Adam's rule")),
    ],
)
def test_the_op_refuses_bad_factors_and_changes_nothing(factors, rule, match):
    from lowbit import _ops

    args = _factored_args(factors, rule)
    before = [t.clone() for t in (args.params[0], args.state1[0], args.absmax1[0], factors)]
    with pytest.raises(match[0], match=match[1]):
        _ops.optimizer_step_(*args)
    after = (args.params[0], args.state1[0], args.absmax1[0], factors)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    good = _factored_args(torch.zeros(308))
    start = good.params[0].clone()
    _ops.optimizer_step_(*good)  # the call with the factors it needs steps: every factor and element moves
    assert bool((good.factors > 0).all()) and bool((good.params[0] != start).all())


def test_twin_estimator_is_adafactors_formula():
    """The twin's v_hat from the row and column means equals Adafactor's estimator written with sums in
    float64 (Shazeer & Stern 2018, section 3: V_hat = R C / (1^T R)), and is exact for a rank-1 v.
    Tolerance (worst case, positive terms, u = 2**-24): an fp32 sum of n terms is within (n - 1) u relative,
    so the row means (29 terms) 28 u, the column means (17) 16 u, the mean of the row means 16 u plus their
    28 u, then the division and the product 1 u each: 89 u; 96 u bounds it."""
    torch.manual_seed(1)
    v = torch.rand(3, 17, 29) + 0.01
    v64 = v.double()
    want = v64.sum(-1).unsqueeze(-1) * v64.sum(-2).unsqueeze(-2) / v64.sum(dim=(-2, -1), keepdim=True)
    got = R.factored_v_hat(v.mean(-1), v.mean(-2)).double()
    assert torch.allclose(got, want, rtol=96 * 2**-24, atol=0)
    a, b = torch.rand(17) + 0.5, torch.rand(29) + 0.5
    rank1 = torch.outer(a, b)
    got1 = R.factored_v_hat(rank1.mean(-1), rank1.mean(-2)).double()
    assert torch.allclose(got1, rank1.double(), rtol=96 * 2**-24, atol=0)
    assert torch.equal(R.factored_v_hat(torch.zeros(4), torch.zeros(5)), torch.zeros(4, 5))  # no 0/0


def test_first_step_moves_against_the_gradient_by_lr():
    """With a rank-1 g^2 the factored v_hat is g^2 itself, so the first step is torch.optim.AdamW's:
    -lr * g / (|g| + eps) per element, i.e. -lr * sign(g) up to eps / |g| <= 1e-8 / 0.25 relative (and
    the fp32 roundings of the bias corrections, ~1e-6 relative)."""
    torch.manual_seed(2)
    a = (torch.rand(64) + 0.5) * torch.where(torch.rand(64) < 0.5, -1.0, 1.0)
    b = torch.rand(256) + 0.5
    g = torch.outer(a, b)
    p = torch.nn.Parameter(torch.zeros(64, 256))
    p.grad = g.clone()
    opt = O.AdamW4bit([p], lr=1e-3, weight_decay=0.0, factored=True)
    opt.step()
    assert torch.allclose(p.detach(), -1e-3 * g.sign(), rtol=2e-6, atol=0)


def test_a_1024_by_4096_matrix_keeps_r_plus_c_floats_of_v():
    """The factored v of a 1024 x 4096 matrix is (1024 + 4096) * 4 bytes, with no element-wise v; m stays
    4-bit block-wise (half a byte per element plus one fp32 absmax per 128). A vector keeps its 4-bit v."""
    w = torch.nn.Parameter(torch.zeros(1024, 4096))
    b = torch.nn.Parameter(torch.zeros(8192))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt = O.AdamW4bit([w, b], factored=True)
    opt.step()
    s = opt.state[w]
    assert "state2" not in s and "absmax2" not in s
    v_bytes = sum(s[k].numel() * s[k].element_size() for k in ("row2", "col2"))
    assert v_bytes == (1024 + 4096) * 4
    assert s["state1"].numel() == 1024 * 4096 // 2 and s["absmax1"].numel() == 1024 * 4096 // 128
    assert opt.state[b]["state2"].numel() == 8192 // 2 and "row2" not in opt.state[b]


def test_state_dict_round_trip_resumes_bit_exactly():
    """Saved after 3 steps and loaded into a fresh optimizer, 3 more steps give exactly the parameters and
    states of 6 uninterrupted steps."""
    torch.manual_seed(3)
    grads = [torch.randn(40, 96) for _ in range(6)]
    start = torch.randn(40, 96)

    def fresh():
        p = torch.nn.Parameter(start.clone())
        return p, O.AdamW4bit([p], factored=True, min_4bit_size=0)

    p, opt = fresh()
    for g in grads:
        p.grad = g.clone()
        opt.step()
    q, first = fresh()
    for g in grads[:3]:
        q.grad = g.clone()
        first.step()
    sd = first.state_dict()
    r = torch.nn.Parameter(q.detach().clone())
    second = O.AdamW4bit([r], factored=True, min_4bit_size=0)
    second.load_state_dict(sd)
    for g in grads[3:]:
        r.grad = g.clone()
        second.step()
    assert torch.equal(r.detach(), p.detach())
    for k, v in opt.state[p].items():
        assert torch.equal(second.state[r][k], v), k


def test_turning_factored_on_and_off_converts_the_second_moment():
    """factored=False -> True projects the element-wise v onto its row and column means; back to False
    stores v_hat block-wise. dequantized_state gives v_hat as exp_avg_sq either way."""
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(32, 256))
    p.grad = torch.randn_like(p)
    opt = O.AdamW4bit([p])
    opt.step()
    v = opt.dequantized_state(p)["exp_avg_sq"]
    opt.param_groups[0]["factored"] = True
    p.grad = torch.zeros_like(p)
    opt.step()  # relayout, then a zero-gradient step: the factors are beta2 times v's means
    s = opt.state[p]
    # The zero gradient adds exact zeros: each factor is beta2 times v's mean, rounded once.
    assert torch.equal(s["row2"], v.mean(-1) * 0.999) and torch.equal(s["col2"], v.mean(-2) * 0.999)
    assert torch.equal(opt.dequantized_state(p)["exp_avg_sq"], R.factored_v_hat(s["row2"], s["col2"]))
    opt.param_groups[0]["factored"] = False
    opt.step()
    assert "row2" not in opt.state[p] and "state2" in opt.state[p]


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda ps: O.Adam(ps, factored=True), "optim_bits=4"),
        (lambda ps: O.AdamW8bit(ps, factored=True), "optim_bits=4"),
        (lambda ps: O.AdamW32bit(ps, factored=True), "optim_bits=4"),
        (lambda ps: O.AdamW4bit(ps, factored=True, rank1_normalization=True), "rank1_normalization"),
        (lambda ps: O.AdamW4bit(ps, factored=True, amsgrad=True), "amsgrad"),
        (lambda ps: O.AdamW4bit(ps, factored=True, max_unorm=1.0), "max_unorm"),
        (lambda ps: O.AdamW4bit(ps, factored=True, percentile_clipping=90), "percentile_clipping"),
        (lambda ps: O.SGD4bit(ps, lr=0.1, factored=True), "Adam and AdamW only"),
        (lambda ps: O.AdamW4bit(ps, factored=1), "factored"),
    ],
)
def test_refusals_name_the_option(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.nn.Parameter(torch.zeros(64, 64))])


def test_override_to_factored_is_checked_when_stepping_and_changes_nothing():
    p = torch.nn.Parameter(torch.zeros(64, 128))
    p.grad = torch.ones_like(p)
    opt = O.AdamW8bit([p])
    O.override(p, factored=True)
    with pytest.raises(ValueError, match="factored=True needs optim_bits=4"):
        opt.step()
    assert not opt.state[p] and torch.equal(p.detach(), torch.zeros(64, 128))


_THREADS = """
import torch, lowbit.optim as O
torch.set_num_threads({t})
torch.manual_seed(5)
p = torch.nn.Parameter(torch.randn(257, 1031))
opt = O.AdamW4bit([p], factored=True)
for _ in range(3):
    p.grad = torch.randn(257, 1031)
    opt.step()
torch.save([p.detach(), dict(opt.state[p])], {path!r})
"""


def test_one_and_two_threads_give_the_same_bits(tmp_path):
    out = []
    for t in (1, 2):
        path = str(tmp_path / f"t{t}.pt")
        subprocess.run([sys.executable, "-c", _THREADS.format(t=t, path=path)], check=True)
        out.append(torch.load(path))
    assert torch.equal(out[0][0], out[1][0])
    for k, v in out[0][1].items():
        assert torch.equal(v, out[1][1][k]), k


def test_dtensors_step_as_plain_tensors_and_other_placements_are_refused(tmp_path):
    """DTensor parameters sharded on their first axis (FSDP2's Shard(0)), on a one-rank mesh: a matrix takes the
    sharded-matrix path (its factors computed in Python, the native step told they are given: kFacGiven) and a
    3-axis tensor the local one, and both equal plain tensors' steps bit for bit, beside a plain matrix in the same
    fused call; row2/col2 are DTensors (a matrix's col2 replicated). A matrix sharded on its second axis is refused
    with an error naming the placement, and nothing changes. (Two ranks: tests/test_distributed.py.)"""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(3)
        shapes = [(130, 70), (3, 70, 33), (64, 80)]
        values = [torch.randn(s, generator=gen) for s in shapes]
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
        sharded = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, [Shard(0)])) for v in values[:2]]
        sharded.append(torch.nn.Parameter(values[2].clone()))
        plain = [torch.nn.Parameter(v.clone()) for v in values]
        options = {"weight_decay": 0.1, "min_4bit_size": 0, "factored": True}
        opts = [O.Adam4bit(sharded, **options), O.Adam4bit(plain, **options)]
        for step in grads:
            for params, opt in zip((sharded, plain), opts, strict=True):
                for p, g in zip(params, step, strict=True):
                    p.grad = distribute_tensor(g, mesh, [Shard(0)]) if isinstance(p, DTensor) else g.clone()
                opt.step()
        for p, q in zip(sharded, plain, strict=True):
            whole = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            assert torch.equal(whole, q.detach())
            for key in ("row2", "col2", "state1", "absmax1"):
                mine = opts[0].state[p][key]
                assert torch.equal(mine.full_tensor() if isinstance(mine, DTensor) else mine, opts[1].state[q][key])
        assert opts[0].state[sharded[0]]["row2"].placements == (Shard(0),)
        assert opts[0].state[sharded[0]]["col2"].placements == (Replicate(),)
        assert opts[0].state[sharded[1]]["col2"].placements == (Shard(0),)

        w = torch.nn.Parameter(distribute_tensor(torch.randn(64, 80), mesh, [Shard(1)]))
        w.grad = distribute_tensor(torch.randn(64, 80), mesh, [Shard(1)])
        before = w.detach().full_tensor().clone()
        opt = O.AdamW4bit([w], factored=True)
        with pytest.raises(NotImplementedError, match=r"sharded on their first axis .*Shard\(dim=1\)"):
            opt.step()
        assert not opt.state[w] and torch.equal(w.detach().full_tensor(), before)
    finally:
        dist.destroy_process_group()


def test_a_nan_gradient_element_makes_the_whole_matrix_nan_not_a_huge_step():
    """A NaN in g reaches mean(row) and so every v_hat: the matrix's update is NaN everywhere (stated in the
    README's Limitations), never the division by eps alone that a zero v_hat would give."""
    p = torch.nn.Parameter(torch.randn(8, 300))
    g = torch.randn(8, 300)
    g[2, 5] = float("nan")
    p.grad = g
    O.AdamW4bit([p], factored=True, min_4bit_size=0).step()
    assert bool(p.detach().isnan().all())


def test_gradient_release_and_a_per_parameter_override_step_as_the_plain_loop():
    """Under lowbit.optim.step_in_backward the factored step runs one parameter at a time inside backward and
    gives the ordinary loop's bits; ``override(p, factored=True)`` factors that parameter only."""
    torch.manual_seed(6)
    x = torch.randn(32, 64)
    nets = [torch.nn.Linear(64, 128) for _ in range(3)]
    for net in nets[1:]:
        net.load_state_dict(nets[0].state_dict())
    plain = O.AdamW4bit(nets[0].parameters(), factored=True, min_4bit_size=0)
    released = O.AdamW4bit(nets[1].parameters(), factored=True, min_4bit_size=0)
    O.step_in_backward(released)
    O.override(nets[2].weight, factored=True)
    overridden = O.AdamW4bit(nets[2].parameters(), min_4bit_size=0)
    for _ in range(3):
        for net, opt in zip(nets, (plain, released, overridden), strict=True):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters(), strict=True))
    assert torch.equal(nets[0].weight, nets[2].weight)
    assert "row2" in overridden.state[nets[2].weight] and "state2" in overridden.state[nets[2].bias]
