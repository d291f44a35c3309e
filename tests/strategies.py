"""Hypothesis strategies for the quantizer property tests.

Hypothesis draws a few parameters (distribution, size, seed, features) and numpy generates the
array from them: element-by-element strategies mostly repeat a fill value (a median of 3 distinct
values per array), while nearly every element of these arrays is distinct, and they are cheap to make.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import BLOCKSIZES, DTYPES

KINDS = ("wide", "heavy", "normal")
# Odd sizes (one element, around a 4096 block, no multiple of a block) besides 64..3000; hypothesis
# favours an integer range's ends, so small sizes are listed rather than drawn from 1..3000.
SIZES = st.one_of(st.integers(64, 3000), st.sampled_from([4097, 4095, 8193, 4096, 65, 63, 7, 2, 1]))

# Decimal exponents of the finite magnitudes of each dtype, subnormals included.
_DECADES = {torch.float32: (-44.0, 38.0), torch.bfloat16: (-40.0, 38.0), torch.float16: (-7.0, 4.8)}


@dataclasses.dataclass(frozen=True)
class FloatCase:
    """Recipe of one test array; hypothesis prints these few fields for a failing example.

    kind: ``wide`` (magnitudes spread over up to 60 decades), ``heavy`` (Student-t, Cauchy included)
    or ``normal``. outliers: one element per block 10 to 10**6 times the block's absmax. sparse: about
    half of the blocks 90%, 99% or 100% zeros. ties: blocks scaled to absmax exactly 1.0 (so
    normalisation is the identity) and 30% of their elements set to exact tie points.
    """

    kind: str
    n: int
    seed: int
    outliers: bool
    sparse: bool
    ties: bool

    def tensor(self, dtype: torch.dtype, blocksize: int | None, tie_points: np.ndarray) -> torch.Tensor:
        """The array in ``dtype`` (finite), with blocks of ``blocksize`` (None: one block)."""
        rng = np.random.default_rng(self.seed)
        lo, hi = _DECADES[dtype]
        big = float(torch.finfo(dtype).max)
        x = _base(rng, self.kind, self.n, lo, hi)
        bs = blocksize or self.n
        blocks = [slice(s, min(s + bs, self.n)) for s in range(0, self.n, bs)]
        for b in blocks:
            m = b.stop - b.start
            if self.sparse and rng.random() < 0.5:
                x[b][rng.random(m) < rng.choice([0.9, 0.99, 1.0])] = 0.0
            if self.outliers:
                amax = np.abs(x[b]).max()
                x[b.start + rng.integers(m)] = rng.choice([-1.0, 1.0]) * (amax or 1.0) * 10 ** rng.uniform(1, 6)
            x[b] = np.clip(x[b], -big, big)
            amax = np.abs(x[b]).max()
            if self.ties and amax > 0 and tie_points.size:
                x[b] /= amax  # exact +-1.0 at the absmax element, which the ties must not replace
                at = rng.random(m) < 0.3
                at[np.abs(x[b]).argmax()] = False
                x[b][at] = rng.choice(tie_points, int(at.sum()))
        return torch.from_numpy(x).to(dtype)


def _base(rng: np.random.Generator, kind: str, n: int, lo: float, hi: float) -> np.ndarray:
    sign = rng.choice([-1.0, 1.0], n)
    if kind == "wide":
        centre, half = rng.uniform(lo, hi), rng.uniform(1.0, 30.0)
        return sign * 10 ** rng.uniform(max(lo, centre - half), min(hi, centre + half), n)
    scale = 10 ** rng.uniform(max(lo + 4, -5.0), min(hi - 4, 5.0))
    if kind == "heavy":
        return rng.standard_t(rng.choice([0.5, 1.0, 2.0, 4.0]), n) * scale
    return rng.standard_normal(n) * scale


def float_cases() -> st.SearchStrategy[FloatCase]:
    return st.builds(
        FloatCase,
        kind=st.sampled_from(KINDS),
        n=SIZES,
        seed=st.integers(0, 2**32 - 1),
        outliers=st.booleans(),
        sparse=st.booleans(),
        ties=st.booleans(),
    )


def _representable(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(v).to(dtype).double().numpy() == v


def map_ties(code: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Midpoints of adjacent distinct entries of the sorted map ``code`` that are exact in fp32 and
    in ``dtype``: at block absmax 1.0 such an element is exactly as far from both entries, in
    fp32 arithmetic too, and must go to the lower one."""
    c = code.double().numpy()
    mid = (c[1:] + c[:-1]) / 2
    mid = mid[c[1:] != c[:-1]]
    return mid[_representable(mid, torch.float32) & _representable(mid, dtype)]


def linear_ties(bits: int, dtype: torch.dtype) -> np.ndarray:
    """Normalised values xn, exact in ``dtype``, whose fp32 product xn * qmax is exactly k + 1/2:
    round-half-to-even decides their code."""
    qmax = 2 ** (bits - 1) - 1
    half = np.arange(-qmax, qmax, dtype=np.float64) + 0.5
    near = (half / qmax).astype(np.float32)
    # The fp32 neighbours of (k + 1/2) / qmax: one of them often lands on k + 1/2 after rounding.
    cand = np.concatenate([near, np.nextafter(near, np.float32(2)), np.nextafter(near, np.float32(-2))])
    hit = cand[np.isin(cand * np.float32(qmax), half.astype(np.float32))].astype(np.float64)
    return np.unique(hit[_representable(hit, dtype)])


def quantizer_examples(max_bits: int, **extra: st.SearchStrategy) -> Callable[[Callable], Callable]:
    """The ``@settings`` and ``@given`` of a quantizer property test: it gets ``case`` (:func:`float_cases`),
    ``dtype``, ``blocksize`` (one of tests/conftest.py's), ``bits`` (2 to ``max_bits``), ``extra``, then a
    rounding ``seed``, drawn in that order. Examples are cheap: five times the profile's budget (300 under the
    default profile)."""
    draws = dict(
        case=float_cases(),
        dtype=st.sampled_from(DTYPES),
        blocksize=st.sampled_from(BLOCKSIZES),
        bits=st.integers(2, max_bits),
        **extra,
        seed=st.integers(0, 2**63 - 2),
    )

    def decorate(test: Callable) -> Callable:
        return settings(max_examples=5 * settings().max_examples)(given(**draws)(test))

    return decorate
