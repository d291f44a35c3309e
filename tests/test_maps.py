"""Quantization maps: structure of the dynamic, inverse dynamic, linear and quantile maps."""

from __future__ import annotations

import math

import pytest
import torch

from lowbit import functional as F
from tests.conftest import sample


def _check_sorted_table(m: torch.Tensor, bits: int) -> None:
    assert m.dtype == torch.float32 and m.shape == (2**bits,)
    assert bool((m[1:] >= m[:-1]).all())
    assert float(m.abs().max()) == 1.0


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("make", [F.create_dynamic_map, F.create_inverse_dynamic_map])
def test_signed_tree_maps_are_symmetric_with_exact_ends(make, bits):
    m = make(signed=True, total_bits=bits)
    _check_sorted_table(m, bits)
    assert torch.equal(m, -m.flip(0))
    assert m[0] == -1.0 and m[-1] == 1.0
    # 2**bits codes, symmetric and holding 0: the two sign patterns of zero both decode to 0.
    assert int((m == 0).sum()) == 2
    assert m.unique().numel() == 2**bits - 1


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("make", [F.create_dynamic_map, F.create_inverse_dynamic_map])
def test_unsigned_tree_maps_cover_zero_to_one(make, bits):
    m = make(signed=False, total_bits=bits)
    _check_sorted_table(m, bits)
    assert m[0] == 0.0 and m[-1] == 1.0
    assert m.unique().numel() == 2**bits


def test_signed_dynamic_map_decades():
    # Section 1.3: with d exponent (zero) bits, 6 - d fraction bits remain, i.e. 2**(6-d) values in
    # the decade (1e-(d+1), 1e-d]; the top decade trades its largest midpoint for exactly 1.0.
    m = F.create_dynamic_map().double()
    pos = m[m > 0]
    for d in range(7):
        inside = ((pos > 10.0 ** -(d + 1)) & (pos <= 10.0**-d)).sum()
        assert int(inside) == 2 ** (6 - d), d
    # 1e-6 * (0.1 + 1) / 2, built in float64 and rounded once to fp32: within 2**-24 relative (measured
    # 3.4e-8); one ulp, 2**-23, allows that twice (was pytest.approx's default rel=1e-6).
    assert float(pos.min()) == pytest.approx(0.55e-6, rel=2**-23)


def _bnb_dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' published construction (create_dynamic_map, 8 bits, 7 exponent bits), in fp32."""
    data = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2.0).tolist()
        data += [10 ** (-6 + i) * v for v in means]
        if signed:
            data += [-(10 ** (-6 + i)) * v for v in means]
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def test_unsigned_dynamic_map_matches_bitsandbytes():
    ours, theirs = F.create_dynamic_map(signed=False), _bnb_dynamic_map(signed=False)
    # Same values up to rounding: bitsandbytes rounds to fp32 three times (linspace, mean, final
    # tensor), lowbit once from float64; each rounding is within 2**-24 relative.
    torch.testing.assert_close(ours, theirs, rtol=4 * 2**-24, atol=0)


def test_signed_dynamic_map_differs_from_bitsandbytes_only_as_documented():
    ours, theirs = F.create_dynamic_map(signed=True).double(), _bnb_dynamic_map(signed=True).double()
    top = float(theirs[theirs < 1].max())  # 0.99297: the midpoint replaced by 1.0
    # Three fp32 roundings (linspace, mean, tensor) of 2**-24 each: 1.8e-7 (measured 1.2e-8); 1e-6 is 5x.
    assert top == pytest.approx(1 - 0.9 / 128, rel=1e-6)
    assert -1.0 not in theirs.tolist() and -1.0 in ours.tolist()
    # Drops exactly +-top: |x| - top is 0 for those, and at least the top decade's gap 0.9 / 128 for others.
    expected = theirs[(theirs.abs() - top).abs() > 1e-7].tolist() + [-1.0, 0.0]
    torch.testing.assert_close(ours, torch.tensor(sorted(expected), dtype=torch.float64), rtol=4 * 2**-24, atol=0)


def test_inverse_dynamic_map_gives_small_values_more_resolution():
    dyn, inv = F.create_dynamic_map(signed=False), F.create_inverse_dynamic_map(signed=False)
    small = 1e-3
    assert int(((inv > 0) & (inv < small)).sum()) > int(((dyn > 0) & (dyn < small)).sum())
    assert int((inv > 0.1).sum()) < int((dyn > 0.1).sum())


@pytest.mark.parametrize("bits", range(2, 9))
def test_linear_maps(bits):
    m = F.create_linear_map(signed=True, total_bits=bits).double()
    qmax = 2 ** (bits - 1) - 1
    assert torch.equal(m, -m.flip(0)) and int((m == 0).sum()) == 2
    levels = torch.tensor([k / qmax for k in range(-qmax, qmax + 1)], dtype=torch.float64).float().double()
    assert torch.equal(m.unique(), levels)
    u = F.create_linear_map(signed=False, total_bits=bits)
    assert torch.equal(u, torch.linspace(0, 1, 2**bits, dtype=torch.float64).float())


def test_quantile_map_follows_eq5():
    x = sample("normal", 100_000, seed=3)
    m = F.create_quantile_map(x, total_bits=8).double()
    probs = torch.arange(257, dtype=torch.float64) / 257
    q = torch.quantile(x.double(), probs)
    mids = (q[:-1] + q[1:]) / 2
    # The same float64 quantiles, then one cast to fp32 (half an ulp, 2**-24 relative); one ulp allowed.
    torch.testing.assert_close(m, (mids / mids.abs().max()), rtol=2**-23, atol=0)


def _code_entropy(codes: torch.Tensor) -> float:
    p = torch.bincount(codes.reshape(-1).long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum())


def test_quantile_map_uses_codes_more_evenly_than_dynamic():
    # Appendix E.2: a quantile map is a lossy minimum-entropy code, each code used about equally.
    x = sample("normal", 1 << 20, seed=4)
    qmap = F.create_quantile_map(x)
    c_quant, _ = F.quantize_blockwise(x, code=qmap, blocksize=None)
    c_dyn, _ = F.quantize_blockwise(x, blocksize=None)
    h_quant, h_dyn = _code_entropy(c_quant), _code_entropy(c_dyn)
    assert h_quant > 7.9  # of 8 bits: nearly uniform use
    assert h_quant > h_dyn + 0.5


def test_map_arguments_are_validated():
    with pytest.raises(ValueError, match="total_bits"):
        F.create_dynamic_map(total_bits=9)
    with pytest.raises(ValueError, match="total_bits"):
        F.create_linear_map(signed=True, total_bits=1)
    with pytest.raises(ValueError, match="max_exponent_bits"):
        F.create_dynamic_map(max_exponent_bits=0)
    with pytest.raises(TypeError, match="signed"):
        F.create_dynamic_map(signed=1)
    with pytest.raises(TypeError, match="total_bits"):
        F.create_dynamic_map(total_bits=8.0)
    with pytest.raises(ValueError, match="NaN"):
        F.create_quantile_map(torch.tensor([1.0, math.nan]))
    with pytest.raises(TypeError, match="floating-point"):
        F.create_quantile_map(torch.arange(10))


@pytest.mark.parametrize(
    "x",
    [torch.full((100,), 3.0), torch.full((100,), -0.25, dtype=torch.float64), torch.zeros(10), torch.tensor([2.0])],
    ids=["positive", "negative", "zeros", "one-element"],
)
def test_quantile_map_of_constant_data_is_rejected(x):
    # Used to return 2**bits copies of 1.0: every value would quantize to the same code.
    with pytest.raises(ValueError, match=r"^lowbit: x must hold at least two distinct finite values"):
        F.create_quantile_map(x)


@pytest.mark.parametrize("fill", [0.0, 3.0])
def test_quantile_map_of_one_value_with_rare_others_is_rejected(fill):
    # Two distinct values, but every quantile (probabilities up to 256/257) is the common one: the map
    # would again hold one value only (2**bits copies of 1.0 for a non-zero fill).
    with pytest.raises(ValueError, match="quantiles are all equal"):
        F.create_quantile_map(torch.cat([torch.full((1000,), fill), torch.full((1,), 5.0)]))


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_quantile_map_of_two_values(bits):
    x = torch.tensor([-2.0, 0.5]).repeat_interleave(torch.tensor([300, 700]))
    m = F.create_quantile_map(x, total_bits=bits)
    _check_sorted_table(m, bits)
    # The larger magnitude is negative, and the upper quantiles all sit on the positive value.
    assert m[0] == -1.0 and m[-1] > 0 and m.unique().numel() >= 2
