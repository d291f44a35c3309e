"""lowbit.nn.fewbit: the optimal few-bit backward tables (fewbit-backward.txt section 3) and their solver.

The shipped file is checked against a regeneration, against an independent optimiser written here
(2-point Gauss-Legendre prefix integrals on a 2**-12 grid, an exact DP on a uniform grid and an exhaustive
one-boundary-at-a-time search), against the paper's Table 1, and for its invariants.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lowbit.nn import _fewbit_gen, fewbit
from lowbit.nn.fewbit import solver

TABLE_KEYS = [
    (name, weight, bits) for name in fewbit.ACTIVATIONS for weight in fewbit.WEIGHTS for bits in fewbit.table_bits(name)
]

# f'(x) + f'(-x) = 1 because f(x) - f(-x) = x.
HALF_ODD = ["gelu", "gelu_tanh", "silu", "softplus", "hardswish"]

# The independent reference: 2-point Gauss-Legendre on a uniform grid whose nodes include every jump of f'
# (0 and +-3), so each cell's integrand is smooth.
REF_STEP = 2.0**-12
REF_CELLS = round(20 / REF_STEP)
REF_NODES = -10.0 + REF_STEP * np.arange(REF_CELLS + 1)
GAUSS_2 = np.array([-1.0, 1.0]) / math.sqrt(3.0)

TORCH_FNS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "selu": F.selu,
    "elu": F.elu,
    "softplus": F.softplus,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "leaky_relu": F.leaky_relu,
    "relu": F.relu,
}


def torch_derivative(name: str, x: np.ndarray) -> np.ndarray:
    """torch's own backward of the activation, written independently of lowbit.nn.fewbit."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    TORCH_FNS[name](xt).backward(torch.ones_like(xt))
    return xt.grad.numpy()


def weight_of(weight: str, x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if weight == "normal" else np.ones_like(x)


def gauss_2(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points and weights of 2-point Gauss-Legendre on each cell between sorted ``edges``, shape (cells, 2)."""
    mid, half = (edges[1:] + edges[:-1]) / 2, np.diff(edges) / 2
    return mid[:, None] + half[:, None] * GAUSS_2, np.repeat(half[:, None], 2, axis=1)


@functools.cache
def reference_prefix(name: str, weight: str) -> np.ndarray:
    """Prefix integrals of w, f' w, f'^2 w at REF_NODES (eq. 8)."""
    x, qw = gauss_2(REF_NODES)
    fx = torch_derivative(name, x)
    wq = weight_of(weight, x) * qw
    cells = np.stack([wq.sum(1), (wq * fx).sum(1), (wq * fx * fx).sum(1)])
    return np.concatenate([np.zeros((3, 1)), np.cumsum(cells, axis=1)], axis=1)


def segment_cost(prefix: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """T(a, b) of eq. 8 between node indices; clipped to [0, F2 difference] where the weight underflows."""
    a, b = np.broadcast_arrays(a, b)
    dw, df, d2 = prefix[:, b] - prefix[:, a]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = d2 - df * df / dw
    return np.where(dw > 0, np.clip(cost, 0.0, np.maximum(d2, 0.0)), np.maximum(d2, 0.0))


def exhaustive_refine(prefix: np.ndarray, nodes: np.ndarray, max_sweeps: int = 50) -> tuple[np.ndarray, float]:
    """Moves each boundary in turn to the best node between its neighbours (levels by eq. 4) until none moves."""
    e = np.concatenate([[0], nodes, [REF_CELLS]])
    for _ in range(max_sweeps):
        moved = False
        for m in range(1, e.size - 1):
            cand = np.arange(e[m - 1] + 1, e[m + 1])
            cost = segment_cost(prefix, e[m - 1], cand) + segment_cost(prefix, cand, e[m + 1])
            best = int(np.argmin(cost))
            if cost[best] < cost[e[m] - e[m - 1] - 1]:
                e[m] = cand[best]
                moved = True
        if not moved:
            break
    return e[1:-1], float(segment_cost(prefix, e[:-1], e[1:]).sum())


def uniform_grid_dp(prefix: np.ndarray, max_pieces: int) -> dict[int, np.ndarray]:
    """Exact DP (eq. 7) on every 80th reference node (spacing 0.0195): boundaries for K = 2, 4, ..., max_pieces."""
    nodes = np.arange(0, REF_CELLS + 1, 80)
    n = nodes.size
    cost = segment_cost(prefix, nodes[:, None], nodes[None, :])
    cost[np.arange(n)[:, None] >= np.arange(n)[None, :]] = np.inf
    best = np.full(n, np.inf)
    best[0] = 0.0
    back = []
    for _ in range(max_pieces):
        total = best[:, None] + cost
        arg = np.argmin(total, axis=0)
        back.append(arg)
        best = total[arg, np.arange(n)]
    out = {}
    for k in (2**b for b in range(1, int(math.log2(max_pieces)) + 1)):
        i, path = n - 1, []
        for layer in range(k - 1, 0, -1):
            i = back[layer][i]
            path.append(i)
        out[k] = nodes[np.array(path[::-1], dtype=np.int64)]
    return out


def reference_moments(name: str, weight: str, boundaries: np.ndarray, levels: np.ndarray) -> tuple[float, np.ndarray]:
    """Eq. 3 and the eq. 4 level of every piece, on the reference grid split at the boundaries."""
    x, qw = gauss_2(np.union1d(REF_NODES, boundaries))
    x, qw = x.reshape(-1), qw.reshape(-1)
    fx, wq, piece = torch_derivative(name, x), weight_of(weight, x) * qw, np.searchsorted(boundaries, x)
    mean = np.bincount(piece, wq * fx, levels.size) / np.bincount(piece, wq, levels.size)
    return float(np.sum(wq * (fx - levels[piece]) ** 2)), mean


def shipped_data() -> dict:
    return json.loads(resources.files("lowbit.nn").joinpath(fewbit.TABLE_FILE).read_text(encoding="utf-8"))


def arrays(t: fewbit.FewBitTable) -> tuple[np.ndarray, np.ndarray]:
    return t.boundaries.double().numpy(), t.levels.double().numpy()


# ---------------------------------------------------------------------------------------------
# The shipped file is what the generator writes
# ---------------------------------------------------------------------------------------------


def test_shipped_file_is_complete_and_in_generator_format():
    data = shipped_data()
    assert data["interval"] == list(fewbit.TABLE_INTERVAL)
    assert data["grid_cells"] == fewbit.TABLE_GRID_CELLS
    assert {(n, w, int(b)) for n, ws in data["tables"].items() for w, bs in ws.items() for b in bs} == set(TABLE_KEYS)
    text = resources.files("lowbit.nn").joinpath(fewbit.TABLE_FILE).read_text(encoding="utf-8")
    assert _fewbit_gen.render(data) == text


@pytest.mark.parametrize("name", fewbit.ACTIVATIONS)
@pytest.mark.parametrize("weight", fewbit.WEIGHTS)
def test_regenerated_tables_match_shipped(name, weight):
    # Bits 1-4 of every table plus GELU's 8 bits (the largest DP) keep this to a few seconds; the full
    # comparison is `python -m lowbit.nn._fewbit_gen --check`.
    bits = [b for b in fewbit.table_bits(name) if b <= 4] + ([8] if (name, weight) == ("gelu", "normal") else [])
    for b, new in solver._builtin_tables(name, weight, bits).items():
        old = fewbit.table(name, b, weight)
        assert torch.equal(new.boundaries, old.boundaries) and torch.equal(new.levels, old.levels), (name, weight, b)
        # The error is float64 quadrature of transcendental functions whose last bits may differ between CPUs.
        assert new.error == pytest.approx(old.error, rel=1e-12, abs=1e-300)


def test_optimal_levels_is_the_generators_path():
    shipped = fewbit.table("silu", 3, "uniform")
    for fprime in ("silu", fewbit.autograd_derivative(F.silu)):
        t = fewbit.optimal_levels(fprime, 3, "uniform")
        assert torch.equal(t.boundaries, shipped.boundaries) and torch.equal(t.levels, shipped.levels)
        assert (t.bits, t.weight, t.interval) == (3, "uniform", (-10.0, 10.0))


# ---------------------------------------------------------------------------------------------
# Optimality, checked by an independent optimiser
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", fewbit.ACTIVATIONS)
@pytest.mark.parametrize("weight", fewbit.WEIGHTS)
def test_shipped_tables_are_within_one_percent_of_optimal(name, weight):
    """Every table against the best of: exhaustive search from it, and (bits <= 5) from a global DP.

    The search moves one boundary at a time to the best node of the reference grid between its
    neighbours, so it stops at a local optimum; the exact DP on a uniform 0.0195 grid is global on that
    grid and guards against a table stuck in a poor local optimum. For 6-8 bits that grid is too coarse to
    say anything; there the global check was made offline, by a DP on 2048-4096 adaptive nodes (worst
    ratio 1.0022). The bound is the issue's acceptance criterion; measured, the worst ratio here is 1 + 4e-13.
    """
    prefix = reference_prefix(name, weight)
    dp = uniform_grid_dp(prefix, 32)
    for bits in fewbit.table_bits(name):
        s, y = arrays(fewbit.table(name, bits, weight))
        shipped = reference_moments(name, weight, s, y)[0]
        start = np.clip(np.round((s + 10.0) / REF_STEP).astype(np.int64), 1, REF_CELLS - 1)
        candidates = [exhaustive_refine(prefix, start)[1]]
        if bits <= 5:
            candidates.append(exhaustive_refine(prefix, dp[1 << bits])[1])
        # 1e-18 absolute: the exact 1-bit ReLU-type tables, where only fp32 rounding of 0.01 is left.
        assert shipped <= 1.01 * min(candidates) + 1e-18, (name, weight, bits, shipped, candidates)


@pytest.mark.parametrize("key", TABLE_KEYS, ids=lambda k: f"{k[0]}-{k[1]}-{k[2]}")
def test_error_and_levels_agree_with_independent_quadrature(key):
    name, weight, bits = key
    t = fewbit.table(name, bits, weight)
    s, y = arrays(t)
    error, mean = reference_moments(name, weight, s, y)
    # The two quadratures agree to 3.2e-12 relative at worst (measured over all tables); 1e-10 leaves room
    # for the last bits of transcendental functions on other CPUs.
    assert error == pytest.approx(t.error, rel=1e-10, abs=1e-30)
    # Eq. 4 for the shipped boundaries: the level is the weighted mean rounded to a multiple of 2**-30 and
    # then to fp32, so within 2**-31 + half an ulp (2**-24 relative; measured 5.9e-8 at worst) of it, plus
    # the quadrature difference (1e-11 relative, 5e-17 absolute where the mean is 0).
    np.testing.assert_allclose(y, mean, rtol=2.0**-24 + 1e-11, atol=2.0**-30)


# ---------------------------------------------------------------------------------------------
# The paper's numbers
# ---------------------------------------------------------------------------------------------

# fewbit-backward.txt Table 1: error (3) with w = 1 on [-10, 10] (eq. 10), for 1-4 bits.
TABLE_1 = {
    "gelu": [0.1410, 0.0406, 0.0119, 0.0031],
    "silu": [0.2150, 0.0479, 0.0170, 0.0045],
    "sigmoid": [0.0181, 0.0038, 0.0009, 0.0002],
    "tanh": [0.1584, 0.0319, 0.0073, 0.0017],
    "selu": [0.2554, 0.1010, 0.0184, 0.0039],
    "softplus": [0.2902, 0.0541, 0.0121, 0.0029],
}


@pytest.mark.parametrize("name", list(TABLE_1))
def test_table_1_of_the_paper(name):
    for bits, paper in enumerate(TABLE_1[name], start=1):
        if name in ("sigmoid", "tanh"):
            # Section 3, Fig. 3: the derivative is even, so the paper quantizes |x| on [0, 10] with 2**bits
            # pieces and mirrors them; the error over [-10, 10] is twice that over [0, 10].
            ours = 2 * fewbit.optimal_levels(name, bits, "uniform", (0.0, 10.0)).error
        else:
            ours = fewbit.table(name, bits, "uniform").error
        # 5% as the issue asks, plus half a unit of the paper's fourth decimal (0.0002 covers [0.00015, 0.00025)).
        assert abs(ours - paper) <= 0.05 * paper + 0.5e-4, (name, bits, ours, paper)


def test_relu_row_of_table_1_is_exact():
    t = fewbit.table("relu", 1)
    assert t.boundaries.tolist() == [0.0] and t.levels.tolist() == [0.0, 1.0] and t.error == 0.0
    x = torch.tensor([-3.0, -1e-30, 0.0, 1e-30, 2.0])
    x.requires_grad_(True)
    F.relu(x).sum().backward()
    assert torch.equal(t(x.detach()), x.grad)


def test_leaky_relu_one_bit_matches_torch_in_fp32():
    t = fewbit.table("leaky_relu", 1)
    assert t.boundaries.tolist() == [0.0]
    x = torch.linspace(-5, 5, 1001)
    x.requires_grad_(True)
    F.leaky_relu(x).sum().backward()
    assert torch.equal(t(x.detach()), x.grad)
    # The only error left is (fp32(0.01) - 0.01)**2 = (2.2e-10)**2 over the left half's weight, 1/2.
    # approximation_error is one np.sum (pairwise, blocks of 128) of 2**17 positive float64 terms (2**14
    # cells x 8 nodes): within (128 + 10) * 2**-53 = 1.5e-14 relative, plus a few roundings per term; 1e-13
    # leaves 6x. Measured 2.2e-16 (was rel=1e-9).
    assert t.error == pytest.approx((float(np.float32(0.01)) - 0.01) ** 2 / 2, rel=1e-13)


def test_gelu_3_bit_normal_weight_is_the_optimum():
    # Both numbers are error (3) with the standard-normal density as w (not its square root), given to
    # three digits: the optimum is about 1.91e-3, and FewBit's published 3-bit table scores 3.38e-3. FewBit
    # fits its tables with w = 1 on [-100, 100] (fewbit/cli.py, domain=(-100, 100)); the optimum for that
    # weight, scored with the normal one, reproduces its 3.38e-3.
    assert fewbit.table("gelu", 3, "normal").error == pytest.approx(1.91e-3, abs=0.005e-3)
    fewbit_like = fewbit.optimal_levels("gelu", 3, "uniform", (-100.0, 100.0))
    error = fewbit.approximation_error("gelu", fewbit_like.boundaries, fewbit_like.levels, "normal")
    assert error == pytest.approx(3.38e-3, abs=0.005e-3)


# ---------------------------------------------------------------------------------------------
# Invariants of the shipped tables
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", TABLE_KEYS, ids=lambda k: f"{k[0]}-{k[1]}-{k[2]}")
def test_table_invariants(key):
    name, weight, bits = key
    t = fewbit.table(name, bits, weight)
    assert (t.bits, t.weight, t.interval) == (bits, weight, fewbit.TABLE_INTERVAL)
    assert t.boundaries.dtype == t.levels.dtype == torch.float32
    assert t.boundaries.shape == (2**bits - 1,) and t.levels.shape == (2**bits,)
    s, y = arrays(t)
    assert (np.diff(s) > 0).all() and s[0] > -10 and s[-1] < 10
    # Eq. 4 makes each level a weighted mean of f' over its piece; 2**-23 covers the fp32 rounding.
    edges = np.concatenate([[-10.0], s, [10.0]])
    fx = torch_derivative(name, edges[:-1, None] + np.diff(edges)[:, None] * np.linspace(0, 1, 257))
    assert (fx.min(1) - 2.0**-23 <= y).all() and (y <= fx.max(1) + 2.0**-23).all()
    if bits > 1:
        assert t.error <= fewbit.table(name, bits - 1, weight).error


@pytest.mark.parametrize("name", HALF_ODD)
def test_mirrored_derivative_has_the_same_optimum(name):
    # x -> -x, f' -> 1 - f' maps these problems onto themselves, so the optimum value is unchanged, whether
    # the solver returns a symmetric table or one of two mirror-image optima (GELU at 4 bits). The errors
    # can differ only through the fp32 rounding of the two tables, a second-order effect: (2**-24)**2 times
    # the weight over errors >= 1e-4, below 1e-10 (measured: 4e-16).
    fprime = fewbit.derivative(name)
    for bits in range(1, 6):
        mirrored = fewbit.optimal_levels(lambda x: 1 - fprime(-x), bits, breakpoints=[-3.0, 0.0, 3.0])
        assert mirrored.error == pytest.approx(fewbit.table(name, bits).error, rel=1e-9)


@pytest.mark.parametrize("name", ["softplus", "elu"])
def test_monotone_derivatives_give_sorted_levels(name):
    for weight in fewbit.WEIGHTS:
        for bits in fewbit.table_bits(name):
            assert (np.diff(arrays(fewbit.table(name, bits, weight))[1]) > 0).all()


# ---------------------------------------------------------------------------------------------
# Derivatives, weights and the solver on known answers
# ---------------------------------------------------------------------------------------------

SELU_ALPHA, SELU_SCALE = 1.6732632423543772, 1.0507009873554805


def closed_form(name: str, x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    one, zero = torch.ones_like(x), torch.zeros_like(x)
    forms = {
        "gelu": lambda: 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi),
        "silu": lambda: s * (1 + x * (1 - s)),
        "sigmoid": lambda: s * (1 - s),
        "tanh": lambda: 1 - torch.tanh(x) ** 2,
        "selu": lambda: SELU_SCALE * torch.where(x > 0, one, SELU_ALPHA * torch.exp(x)),
        "elu": lambda: torch.where(x > 0, one, torch.exp(x)),
        "softplus": lambda: s,
        "mish": lambda: torch.tanh(F.softplus(x)) + x * s * (1 - torch.tanh(F.softplus(x)) ** 2),
        "hardswish": lambda: torch.where(x < -3, zero, torch.where(x > 3, one, x / 3 + 0.5)),
        "leaky_relu": lambda: torch.where(x > 0, one, 0.01 * one),
        "relu": lambda: torch.where(x > 0, one, zero),
    }
    return forms[name]()


@pytest.mark.parametrize("name", [n for n in fewbit.ACTIVATIONS if n != "gelu_tanh"])
def test_derivatives_match_closed_forms(name):
    # Points avoid the jumps at 0 and +-3, where torch picks a side.
    x = torch.linspace(-9.99, 9.99, 4001, dtype=torch.float64)
    assert torch.equal(fewbit.derivative(name)(x), torch.tensor(torch_derivative(name, x.numpy())))
    # Different formulas for the same function: float64 rounding, a few ulps (2.2e-16 each below 2) of
    # values up to 1.8. Measured worst 2.0e-15 (mish, 9 ulps) on these 4001 points.
    torch.testing.assert_close(fewbit.derivative(name)(x), closed_form(name, x), rtol=0, atol=1e-14)


def test_gelu_tanh_is_torchs_tanh_approximation():
    x = torch.linspace(-9.99, 9.99, 4001, dtype=torch.float64)
    k = math.sqrt(2 / math.pi)
    u = torch.tanh(k * (x + 0.044715 * x**3))
    expected = 0.5 * (1 + u) + 0.5 * x * (1 - u * u) * k * (1 + 3 * 0.044715 * x * x)
    # As above: float64 rounding of two formulas, measured worst 5.1e-15 (23 ulps of values up to 1.13).
    torch.testing.assert_close(fewbit.derivative("gelu_tanh")(x), expected, rtol=0, atol=1e-14)


@given(
    cuts=st.lists(st.integers(-79, 79), min_size=1, max_size=7, unique=True),
    values=st.lists(st.floats(-2, 2, allow_nan=False), min_size=8, max_size=8),
    weight=st.sampled_from(fewbit.WEIGHTS),
)
def test_piecewise_constant_derivative_is_recovered_exactly(cuts, values, weight):
    # f' a step function with k <= 8 pieces, breakpoints on multiples of 1/8 (exact in fp32) in [-10, 10].
    s = np.array(sorted(cuts), dtype=np.float64) / 8
    y = np.array(values[: s.size + 1])
    bits = max(1, math.ceil(math.log2(y.size)))

    def fprime(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(y)[torch.bucketize(x, torch.from_numpy(s))]

    t = fewbit.optimal_levels(fprime, bits, weight, breakpoints=s.tolist(), grid_cells=4096)
    assert fewbit.approximation_error(fprime, s, y, weight, breakpoints=s.tolist()) == 0.0
    # Only fp32 rounding of the levels remains: at most (2**-23)**2 (|y| <= 2) times the weight's mass (<= 20).
    assert t.error <= 20 * (2.0**-23) ** 2
    if weight == "uniform":
        # Every piece has weight, so the table equals f' everywhere, up to that rounding.
        x = torch.linspace(-12, 12, 2401, dtype=torch.float64)
        torch.testing.assert_close(t(x), fprime(x), rtol=0, atol=2.0**-23)


@given(
    x=st.lists(st.floats(-12, 12, allow_nan=False, width=32), min_size=1, max_size=50),
    name=st.sampled_from(["gelu", "tanh", "hardswish"]),
    bits=st.integers(1, 4),
)
def test_table_call_is_eq_2(x, name, bits):
    t = fewbit.table(name, bits)
    xs = torch.tensor(x, dtype=torch.float32)
    expected = [t.levels[int((t.boundaries < v).sum())] for v in xs]
    assert torch.equal(t(xs), torch.stack(expected))
    assert torch.equal(t(xs.double()), torch.stack(expected).double())


@given(bits=st.integers(1, 3), scale=st.floats(0.25, 4.0))
def test_error_scales_with_the_square_of_the_derivative(bits, scale):
    base = fewbit.table("gelu", bits)
    s, y = arrays(base)
    scaled = fewbit.approximation_error(lambda x: scale * fewbit.derivative("gelu")(x), s, scale * y)
    # Each term gains two roundings (the scaled f' and level); the pairwise np.sum of 2**17 positive terms
    # is within (128 + 10) * 2**-53 = 1.5e-14 relative; 1e-13 leaves 6x. Measured worst 3.3e-16 over bits
    # 1-3 x 16 scales in [0.25, 4] (was rel=1e-12).
    assert scaled == pytest.approx(scale**2 * base.error, rel=1e-13)


def test_custom_weight_matches_the_named_one():
    normal = fewbit.table("tanh", 2, "normal")
    t = fewbit.optimal_levels("tanh", 2, lambda x: torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))
    assert t.weight == "custom"
    assert torch.equal(t.boundaries, normal.boundaries) and torch.equal(t.levels, normal.levels)


# ---------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"bits": 0}, ValueError, "bits"),
        ({"bits": 9}, ValueError, "bits"),
        ({"bits": 2.0}, TypeError, "bits"),
        ({"bits": True}, TypeError, "bits"),
        ({"weight": "laplace"}, ValueError, "weight"),
        ({"weight": 3}, TypeError, "weight"),
        ({"interval": (1.0, 1.0)}, ValueError, "interval"),
        ({"interval": (2.0, -2.0)}, ValueError, "interval"),
        ({"interval": (-math.inf, 1.0)}, ValueError, "interval"),
        ({"interval": (0.0, math.nan)}, ValueError, "interval"),
        ({"interval": (0.0,)}, TypeError, "interval"),
        ({"interval": ("a", 1.0)}, TypeError, "interval"),
        ({"breakpoints": [math.inf]}, ValueError, "breakpoints"),
        ({"breakpoints": 0.5}, TypeError, "breakpoints"),
        ({"grid_cells": 8}, ValueError, "grid_cells"),
        ({"grid_cells": 4096.0}, TypeError, "grid_cells"),
        ({"fprime": "swish"}, ValueError, "fprime"),
        ({"fprime": 1.0}, TypeError, "fprime"),
        ({"fprime": lambda x: x.sum()}, ValueError, "fprime"),
        ({"fprime": lambda x: x.numpy()}, TypeError, "fprime"),
        ({"fprime": lambda x: 1 / (x - x)}, ValueError, "fprime"),
        ({"weight": lambda x: -torch.ones_like(x)}, ValueError, "weight"),
        ({"weight": lambda x: torch.zeros_like(x)}, ValueError, "weight"),
    ],
)
def test_optimal_levels_rejects_bad_arguments(kwargs, exc, match):
    args = {"fprime": "gelu", "bits": 2, "grid_cells": 4096} | kwargs
    with pytest.raises(exc, match=match):
        fewbit.optimal_levels(**args)


def test_table_rejects_bad_arguments():
    with pytest.raises(ValueError, match="name"):
        fewbit.table("swish", 3)
    with pytest.raises(TypeError, match="name"):
        fewbit.table(None, 3)
    with pytest.raises(ValueError, match="bits must be 1"):
        fewbit.table("relu", 2)
    with pytest.raises(ValueError, match="bits"):
        fewbit.table("gelu", 9)
    with pytest.raises(ValueError, match="weight"):
        fewbit.table("gelu", 3, "custom")
    with pytest.raises(TypeError, match="weight"):
        fewbit.table("gelu", 3, None)


def test_approximation_error_rejects_bad_tables():
    with pytest.raises(ValueError, match="one more"):
        fewbit.approximation_error("gelu", [0.0], [0.0, 0.5, 1.0])
    with pytest.raises(ValueError, match="sorted"):
        fewbit.approximation_error("gelu", [1.0, 0.0], [0.0, 0.5, 1.0])
    with pytest.raises(ValueError, match="one-dimensional"):
        fewbit.approximation_error("gelu", [[0.0]], [0.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        fewbit.approximation_error("gelu", [math.nan], [0.0, 1.0])


def test_table_dataclass_checks_its_fields():
    good = fewbit.table("gelu", 1)
    fields = {"boundaries": good.boundaries, "levels": good.levels, "bits": 1, "error": 0.1, "weight": "normal"}
    fields["interval"] = (-10.0, 10.0)
    bad = [
        ({"boundaries": good.boundaries.double()}, ValueError, "boundaries"),
        ({"levels": torch.zeros(3)}, ValueError, "levels"),
        ({"levels": [0.0, 1.0]}, TypeError, "levels"),
        ({"bits": 2}, ValueError, "boundaries"),
        ({"error": -1.0}, ValueError, "error"),
        ({"levels": torch.tensor([0.0, math.inf])}, ValueError, "levels"),
    ]
    for change, exc, match in bad:
        with pytest.raises(exc, match=match):
            fewbit.FewBitTable(**(fields | change))
    with pytest.raises(ValueError, match="sorted"):
        fewbit.FewBitTable(
            **(fields | {"bits": 2, "boundaries": torch.tensor([1.0, 0.0, 2.0]), "levels": torch.zeros(4)})
        )
    with pytest.raises(AttributeError):
        good.bits = 2  # frozen
