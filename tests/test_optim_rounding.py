"""Stochastic rounding of 8-bit and 4-bit optimizer states (``rounding="stochastic"``,
include/lowbit/state_rounding.h): unbiased and directed codes, and the option's API.

The native step against its twin, bit for bit, is tests/test_optim_reference.py's; CPU against CUDA,
tests/test_cuda_emulation.py's; resumes and gradient release, tests/conformance and
tests/test_gradient_release.py's; FSDP2 shards against one process, tests/test_distributed.py's.
"""

from __future__ import annotations

import math

import pytest
import torch

import lowbit.optim as O
from lowbit._reference.quantize import _load
from lowbit.optim.state_storage import optimizer_state_map

BLOCK = 128  # the 4-bit states' default block size
BLOCKS = 64
SEEDS = range(4)


def _first_step_codes(x: float, seed: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's states after one step whose gradient is 1 at the first element of every block (its absmax) and
    ``x`` elsewhere: the stored m is ``(1 - beta1) g`` and the stored root of v is ``sqrt(1 - beta2) |g|``, so
    both normalise to ``x`` (to within fp32 rounding). The decoded normalised m and root of v of the other
    elements, by the twin's unpacking and the maps (not lowbit's decoder)."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(BLOCK * BLOCKS))
    opt = O.Adam([p], optim_bits=bits, block_size=BLOCK, min_8bit_size=0, min_4bit_size=0, rounding="stochastic")
    g = torch.full((BLOCKS, BLOCK), x)
    g[:, 0] = 1.0
    p.grad = g.reshape(-1)
    opt.step()
    state = opt.state[p]
    decoded = []
    for k, signed in ((1, True), (2, False)):
        codes = _load(state[f"state{k}"].reshape(-1), bits, p.numel())
        values = optimizer_state_map(signed, torch.device("cpu"), bits)[codes].reshape(BLOCKS, BLOCK)
        decoded.append(values[:, 1:].reshape(-1).double())
    return decoded[0], decoded[1]


def _bracket(code: torch.Tensor, x: float) -> tuple[float, float]:
    """The map values a <= x < b around x."""
    i = int(torch.searchsorted(code, torch.tensor(x), right=True)) - 1
    return float(code[i]), float(code[i + 1])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("x", [0.37, 0.1, 0.81])  # inside both maps (the 4-bit root map starts at 1/16)
def test_stochastic_codes_are_unbiased(bits, x):
    """The mean of the decoded draws approaches the value, for the signed map (m) and the zero-free map (the
    root of v); nearest rounding is biased by up to half a code gap at these values."""
    ms, ws = zip(*(_first_step_codes(x, seed, bits) for seed in SEEDS), strict=True)
    for signed, draws in ((True, torch.cat(ms)), (False, torch.cat(ws))):
        a, b = _bracket(optimizer_state_map(signed, torch.device("cpu"), bits), x)
        assert set(draws.unique().tolist()) <= {a, b}, "every draw is one of the two neighbouring codes"
        p = (x - a) / (b - a)
        # Each draw is a or b, b with probability p: the mean's standard error is (b - a) sqrt(p (1 - p) / n).
        # 5 standard errors (a false failure about once in 1.7 million runs), plus the bias of the 24-bit
        # uniform draws (at most 2^-24 of a gap) and the normalised value's fp32 rounding (a few 2^-24).
        se = (b - a) * math.sqrt(p * (1 - p) / draws.numel())
        tol = 5 * se + 4 * 2.0**-24
        assert abs(float(draws.mean()) - x) <= tol, (signed, float(draws.mean()), x, tol)


def test_values_nearer_the_upper_code_round_up_more_often():
    """Direction: the fraction rounded up grows with the value's place between two codes of the signed map,
    and is that place (within 5 binomial standard errors)."""
    code = optimizer_state_map(True, torch.device("cpu"), 4)
    a, b = _bracket(code, 0.3)
    ups = []
    for frac in (0.1, 0.5, 0.9):
        x = a + frac * (b - a)
        draws = torch.cat([_first_step_codes(x, seed)[0] for seed in SEEDS])
        up = float((draws == b).double().mean())
        assert abs(up - frac) <= 5 * math.sqrt(frac * (1 - frac) / draws.numel()), (frac, up)
        ups.append(up)
    assert ups[0] < ups[1] < ups[2]


def test_nearest_is_the_default_and_draws_no_seed():
    p = torch.nn.Parameter(torch.zeros(8))
    torch.manual_seed(0)
    opt = O.Adam4bit([p])
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4)), "a nearest-rounding optimizer leaves torch's generator as it was"
    assert opt.param_groups[0]["rounding"] == "nearest"


@pytest.mark.parametrize("bad", ["up", "Stochastic", None, 1])
def test_invalid_rounding_names_the_argument_and_changes_nothing(bad):
    p = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match=r"rounding.*'nearest', 'stochastic'"):
        O.AdamW4bit([p], rounding=bad)
    opt = O.AdamW4bit([p])
    q = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match=r"rounding.*'nearest', 'stochastic'"):
        opt.add_param_group({"params": [q], "rounding": bad})
    assert len(opt.param_groups) == 1


def test_factored_refuses_stochastic_rounding():
    p = torch.nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="factored=True and rounding='stochastic'"):
        O.AdamW4bit([p], factored=True, rounding="stochastic")


def test_rounding_seed_is_drawn_saved_and_kept_from_older_state_dicts():
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, ()).item())
    p = torch.nn.Parameter(torch.randn(300))
    torch.manual_seed(3)
    opt = O.Adam4bit([p], rounding="stochastic", min_4bit_size=0)
    assert opt.param_groups[0]["rounding_seed"] == seed, "drawn once from torch's default generator"
    p.grad = torch.randn(300)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["rounding_seed"] == seed
    other = O.Adam4bit([p], rounding="stochastic", min_4bit_size=0)
    own = other.param_groups[0]["rounding_seed"]
    assert own != seed
    other.load_state_dict(sd)
    assert other.param_groups[0]["rounding_seed"] == seed
    del sd["param_groups"][0]["rounding_seed"]
    older = O.Adam4bit([p], rounding="stochastic", min_4bit_size=0)
    kept = older.param_groups[0]["rounding_seed"]
    older.load_state_dict(sd)
    assert older.param_groups[0]["rounding_seed"] == kept, "an older state dict keeps the loader's seed"
    # A group added later asking for stochastic rounding of a nearest optimizer draws its own seed.
    mixed = O.Adam4bit([torch.nn.Parameter(torch.zeros(4))])
    mixed.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))], "rounding": "stochastic"})
    assert mixed.param_groups[0]["rounding_seed"] == 0 and mixed.param_groups[1]["rounding_seed"] > 0


def test_draws_depend_on_the_step_and_the_seed():
    """Two steps, or two seeds, give other codes: the seed and the step key the draws (a constant key would
    round every step alike)."""

    def codes(seed: int, steps: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = O.SGD4bit([p], lr=0.0, momentum=0.5, rounding="stochastic")
        out = []
        for _ in range(steps):
            p.grad = torch.linspace(-1, 1, 4096)
            opt.step()
            out.append(opt.state[p]["state1"].clone())
        return out

    one, two = codes(0, 2), codes(1, 1)
    assert torch.equal(codes(0, 1)[0], one[0]), "the same seed and step give the same codes"
    assert not torch.equal(one[0], two[0])
    # With lr 0 and momentum 0.5 the decoded buffer of step 2 is 0.5 * decoded + g: other draws, other codes.
    assert not torch.equal(one[0], one[1])


def test_each_parameter_draws_its_own_counters():
    """Two parameters with the same values and gradients round differently: each takes its own counter range
    (its position times 2^40), so their rounding errors are independent, not repeated."""
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.zeros(4096)) for _ in range(2))
    opt = O.SGD4bit([a, b], lr=0.0, momentum=0.5, rounding="stochastic")
    a.grad, b.grad = torch.linspace(-1, 1, 4096), torch.linspace(-1, 1, 4096)
    opt.step()
    assert not torch.equal(opt.state[a]["state1"], opt.state[b]["state1"])


def test_refused_param_group_leaves_torchs_generator_as_it_was():
    """A group torch.optim refuses (a parameter already in another group) is refused before the group's
    ``rounding_seed`` is drawn: a failed call changes nothing, the default generator included."""
    p = torch.nn.Parameter(torch.zeros(8))
    opt = O.Adam4bit([p])
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [p], "rounding": "stochastic"})
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4)), "the refused call drew from torch's generator"
    assert len(opt.param_groups) == 1


def _switched_codes(seed: int) -> tuple[O.SGD4bit, torch.nn.Parameter]:
    """An SGD4bit built with nearest rounding after ``torch.manual_seed(seed)``, switched to stochastic through
    ``param_groups`` and stepped once on a ramp (lr 0, so only its momentum codes change)."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = O.SGD4bit([p], lr=0.0, momentum=0.5)
    opt.param_groups[0]["rounding"] = "stochastic"
    p.grad = torch.linspace(-1, 1, 4096)
    opt.step()
    return opt, p


def test_group_switched_to_stochastic_draws_its_own_seed_at_its_first_step():
    """A group created with nearest rounding (``rounding_seed`` 0) and switched to stochastic draws its seed at
    the step that first rounds it, and keeps it: two such optimizers round independently (with seed 0 for
    both, their codes would be equal: same positions, steps and values)."""
    a, pa = _switched_codes(0)
    b, pb = _switched_codes(1)
    sa, sb = a.param_groups[0]["rounding_seed"], b.param_groups[0]["rounding_seed"]
    assert sa != 0 and sb != 0 and sa != sb
    assert not torch.equal(a.state[pa]["state1"], b.state[pb]["state1"])
    torch.manual_seed(0)
    drawn = int(torch.randint(0, 2**62, ()).item())
    assert sa == drawn, "drawn from torch's default generator, as the constructor's seed is"
    first = a.state[pa]["state1"].clone()
    # The seed is kept: a later step draws none, and the state dict carries it.
    torch.manual_seed(7)
    pa.grad = torch.linspace(-1, 1, 4096)
    a.step()
    assert a.param_groups[0]["rounding_seed"] == sa
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4)), "a seeded group draws nothing at its later steps"
    assert a.state_dict()["param_groups"][0]["rounding_seed"] == sa
    # The same seed for the same torch seed: the switched optimizer is reproducible.
    again, pagain = _switched_codes(0)
    assert again.param_groups[0]["rounding_seed"] == sa
    assert torch.equal(again.state[pagain]["state1"], first)


def test_a_step_that_raises_draws_no_seed():
    """A switched group whose step is refused (here by the next group's invalid learning rate, checked after
    the first group has drawn its seed) stores no seed and leaves torch's generator as it was."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4096))
    opt = O.SGD4bit([{"params": [p]}, {"params": [q]}], lr=0.0, momentum=0.5)
    opt.param_groups[0]["rounding"] = "stochastic"
    opt.param_groups[1]["lr"] = -1.0
    p.grad, q.grad = torch.ones(4096), torch.ones(4096)
    torch.manual_seed(3)
    with pytest.raises(ValueError, match=r"param_groups\[1\].*learning rate"):
        opt.step()
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4)), "the failed step drew from torch's generator"
    assert opt.param_groups[0]["rounding_seed"] == 0
    assert not opt.state[p] and not opt.state[q], "the failed step created no state"
    # The next valid step draws the seed the failed one would have drawn.
    opt.param_groups[1]["lr"] = 0.0
    torch.manual_seed(3)
    drawn = int(torch.randint(0, 2**62, ()).item())
    torch.manual_seed(3)
    opt.step()
    assert opt.param_groups[0]["rounding_seed"] == drawn
