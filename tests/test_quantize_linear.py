"""Group-wise linear absmax quantization (LPMM eq. 6) for 2..16 bits."""

from __future__ import annotations

import io
import math

import pytest
import torch

from lowbit import _ops
from lowbit import _reference as R
from lowbit import functional as F
from tests.conftest import DTYPES, sample
from tests.strategies import linear_ties, quantizer_examples

BITS = list(range(2, 17))


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _expanded_absmax(state: F.LinearQuantState, n: int) -> torch.Tensor:
    a = state.absmax.double().cpu()
    return a.repeat_interleave(state.blocksize)[:n] if state.blocksize else a.expand(n)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("blocksize", [64, 2048, None])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_matches_reference_and_packs_exactly(device, bits, blocksize, rounding):
    n = 4097
    x = sample("heavy", n, seed=bits, device=device)
    g = torch.Generator(device=device).manual_seed(5) if rounding == "stochastic" else None
    codes, state = F.quantize_linear(x, bits=bits, blocksize=blocksize, rounding=rounding, generator=g)
    assert codes.numel() == (n if bits == 8 else math.ceil(n * bits / 8))
    seed = 0
    if g is not None:
        g2 = torch.Generator(device=device).manual_seed(5)
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=g2, device=device).item())
    ref, ref_absmax = R.quantize_linear(x.cpu(), bits, blocksize or 0, rounding == "stochastic", seed, 0)
    assert torch.equal(codes.cpu().reshape(-1), ref)
    _exact(state.absmax.cpu(), ref_absmax)
    y = F.dequantize_linear(codes, state)
    _exact(y.cpu(), R.dequantize_linear(ref, ref_absmax, bits, blocksize or 0, n, x.dtype))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_error_bound_and_exact_absmax(device, bits, dtype, rounding):
    x = sample("normal", 3000, seed=21, dtype=dtype, device=device)
    codes, state = F.quantize_linear(x, bits=bits, blocksize=256, rounding=rounding)
    y = F.dequantize_linear(codes, state)
    amax = _expanded_absmax(state, x.numel())
    delta = amax / (2 ** (bits - 1) - 1)
    # Nearest: |error| <= delta / 2; stochastic: < delta. The output cast adds half an ulp.
    ulp = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    bound = delta * (0.5 if rounding == "nearest" else 1.0) * (1 + 1e-6)
    err = (y.double().cpu() - x.double().cpu()).abs()
    assert bool((err <= bound + y.double().cpu().abs() * ulp).all())
    for b in range(state.absmax.numel()):
        xb = x[b * 256 : (b + 1) * 256]
        i = int(xb.float().abs().argmax())
        assert y[b * 256 + i] == xb[i]


@pytest.mark.parametrize("bits", [2, 4, 8, 12])
def test_stochastic_rounding_is_unbiased(device, bits):
    g = torch.Generator().manual_seed(3)
    x = torch.rand(2048, generator=g) * 2 - 1
    x[0] = 1.0
    x = x.to(device)
    trials = 400
    gen = torch.Generator(device=device).manual_seed(77)
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(trials):
        codes, state = F.quantize_linear(x, bits=bits, blocksize=None, rounding="stochastic", generator=gen)
        total += F.dequantize_linear(codes, state).double().cpu()
    delta = 1.0 / (2 ** (bits - 1) - 1)
    z = (total / trials - x.double().cpu()) / (delta / (2 * math.sqrt(trials)))
    assert float(z.abs().max()) < 6.0
    assert float((z**2).mean()) < 1.2


def test_deterministic_rounding_stalls_small_updates_and_stochastic_does_not():
    # lpmm.txt section 3.2: updates below delta / 2 vanish under round-to-nearest; stochastic
    # rounding keeps them in expectation. 8-bit parameters; element 0 pins the absmax at 1, so
    # delta = 1/127 throughout and each update of 1e-3 is 0.13 delta.
    p0 = torch.linspace(-0.5, 0.5, 4096)
    p0[0] = -1.0
    update = torch.full_like(p0, 1e-3)
    update[0] = 0.0
    steps = 200
    trajectory = {}
    for rounding in ("nearest", "stochastic"):
        g = torch.Generator().manual_seed(0) if rounding == "stochastic" else None
        p, history = p0.clone(), []
        for _ in range(steps):
            codes, state = F.quantize_linear(p + update, bits=8, blocksize=None, rounding=rounding, generator=g)
            p = F.dequantize_linear(codes, state)
            history.append(p)
        trajectory[rounding] = history
    assert torch.equal(trajectory["nearest"][0], trajectory["nearest"][-1])  # stalled after one step
    moved = (trajectory["stochastic"][-1] - p0)[1:]
    # Each step adds zero-mean rounding noise of std <= delta/2, so the mean over 4095 elements of
    # 200 steps has std <= sqrt(200) * delta / 2 / sqrt(4095) = 1e-3, i.e. 0.5% of the 0.2 moved.
    assert float(moved.mean()) == pytest.approx(steps * 1e-3, rel=0.03)


def test_non_finite_and_zero_groups(device):
    x = sample("normal", 700, seed=4, device=device)
    x[10] = math.nan
    x[400:512] = 0
    codes, state = F.quantize_linear(x, bits=12, blocksize=256)
    y = F.dequantize_linear(codes, state)
    assert bool(y[:256].isnan().all()) and bool(state.absmax[0].isnan())
    assert bool(y[256:].isfinite().all())
    assert torch.equal(y[400:512], torch.zeros(112, device=device))


def test_state_round_trip_and_empty():
    x = sample("normal", 1000, seed=5, dtype=torch.float16)
    codes, state = F.quantize_linear(x, bits=10, blocksize=128)
    buf = io.BytesIO()
    torch.save((codes, state), buf)
    buf.seek(0)
    c2, s2 = torch.load(buf, weights_only=True)
    assert isinstance(s2, F.LinearQuantState)
    assert torch.equal(F.dequantize_linear(c2, s2), F.dequantize_linear(codes, state))
    codes, state = F.quantize_linear(torch.empty(0), bits=12)
    assert codes.numel() == 0 and F.dequantize_linear(codes, state).numel() == 0


@quantizer_examples(max_bits=16)
def test_property_matches_reference(case, dtype, blocksize, bits, seed):
    x = case.tensor(dtype, blocksize, linear_ties(bits, dtype))
    bs = blocksize or 0
    # Both roundings of every array: a drawn flag would leave many tie cases to stochastic rounding.
    for stochastic in (False, True):
        packed, absmax = _ops.quantize_linear(x, bits, bs, stochastic, seed, 0)
        ref, ref_absmax = R.quantize_linear(x, bits, bs, stochastic, seed, 0)
        assert torch.equal(packed, ref)
        _exact(absmax, ref_absmax)
        y = _ops.dequantize_linear(packed, absmax, bits, bs, x.numel(), dtype)
        _exact(y, R.dequantize_linear(ref, ref_absmax, bits, bs, x.numel(), dtype))
