"""The few-bit backward ops (lowbit::fewbit_encode / fewbit_grad) against their reference twins."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowbit
from lowbit import _ops
from lowbit import _reference as R
from tests.conftest import DTYPES, sample

ops = torch.ops.lowbit
SIZES = [0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 5]


def _bounds(bits: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randn(2**bits - 1, generator=g) * 2).values.to(device)


def _input(n: int, bits: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    x = sample("heavy", n, seed=seed) * 0.3
    b = _bounds(bits, seed)
    # Values exactly on boundaries (ties go to the lower interval), and the non-finite values.
    special = torch.cat([b[: min(3, b.numel())], torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0])])
    k = min(n, special.numel())
    x[:k] = special[:k]
    return x.to(dtype).to(device)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_and_grad_match_reference(device, bits, dtype, cpu_kernels):
    for n in SIZES:
        x = _input(n, bits, dtype, seed=n + bits, device=device)
        b = _bounds(bits, n + bits, device)
        packed = ops.fewbit_encode(x, b, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == (n * bits + 7) // 8
        assert torch.equal(packed.cpu(), R.fewbit_encode(x.cpu(), b.cpu(), bits))
        levels = torch.randn(2**bits, generator=torch.Generator().manual_seed(n)).to(device)
        grad = torch.randn(n, generator=torch.Generator().manual_seed(n + 1)).to(dtype).to(device)
        got = ops.fewbit_grad(grad, packed, levels, bits)
        assert got.dtype == dtype and got.shape == grad.shape
        assert torch.equal(got.cpu(), R.fewbit_grad(grad.cpu(), packed.cpu(), levels.cpu(), bits))


def test_codes_are_interval_indices():
    b = torch.tensor([-1.0, 0.0, 2.0])
    x = torch.tensor([-5.0, -1.0, -0.5, 0.0, -0.0, 1.0, 2.0, 9.0, float("nan"), float("inf"), float("-inf")])
    codes = _ops.unpack_bits(ops.fewbit_encode(x, b, 2), 2, x.numel())
    assert codes.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 0, 3, 0]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("kind", ["repeated", "unsorted", "nan"])
def test_codes_count_the_boundaries_below_whatever_their_order(bits, kind, cpu_kernels):
    """The code is the number of boundaries < x (NaN: 0) also for boundaries that repeat, are out of order or
    hold a NaN: the AVX-512 encoder searches sorted ones (an error there would move codes by whole intervals)
    and counts the others. Reference: torch's count of the boundaries below each element."""
    g = torch.Generator().manual_seed(bits)
    b = torch.sort(torch.randn(2**bits - 1, generator=g)).values
    if kind == "repeated":
        b[1:3] = b[1]
        b[-2:] = b[-1]
    elif kind == "unsorted":
        b = b.flip(0)
    else:
        b[b.numel() // 2] = float("nan")
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0])
    for n in (16, 17, 4096 + 37):
        x = torch.cat([b, special, torch.randn(n, generator=g) * 1.5])
        got = _ops.unpack_bits(ops.fewbit_encode(x, b, bits), bits, x.numel())
        want = torch.where(x.isnan(), 0, (x[:, None] > b[None, :]).sum(1))
        assert torch.equal(got, want)


@given(
    n=st.integers(0, 2000),
    bits=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_grad_multiplies_by_the_level_of_each_interval(n, bits, seed):
    x = sample("normal", n, seed=seed) * 3
    b = _bounds(bits, seed)
    levels = torch.randn(2**bits, generator=torch.Generator().manual_seed(seed))
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    want = grad * levels[torch.searchsorted(b, x)]
    for avx512 in (True, False):  # the AVX-512 kernels (where the CPU has them) and the portable loops
        lowbit._C._set_cpu_avx512(avx512)
        try:
            got = ops.fewbit_grad(grad, ops.fewbit_encode(x, b, bits), levels, bits)
        finally:
            lowbit._C._set_cpu_avx512(True)
        assert torch.equal(got, want)


def test_opcheck(device):
    x = sample("normal", 1001, seed=3, dtype=torch.bfloat16, device=device)
    b = _bounds(3, 3, device)
    packed = ops.fewbit_encode(x, b, 3)
    torch.library.opcheck(ops.fewbit_encode.default, (x, b, 3))
    torch.library.opcheck(ops.fewbit_grad.default, (x, packed, torch.randn(8, device=device), 3))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ops.fewbit_encode(torch.randn(10), _bounds(3, 0), 0), "bits must be an int in 1..8"),
        (lambda: ops.fewbit_encode(torch.randn(10), _bounds(3, 0), 9), "bits must be an int in 1..8"),
        (lambda: ops.fewbit_encode(torch.randn(10), _bounds(2, 0), 3), "boundaries must hold 2\\*\\*bits - 1 = 7"),
        (lambda: ops.fewbit_encode(torch.randn(10), _bounds(3, 0).double(), 3), "boundaries has dtype"),
        (lambda: ops.fewbit_encode(torch.arange(10), _bounds(3, 0), 3), "x has dtype"),
        (lambda: ops.fewbit_encode(torch.randn(10, 4).t(), _bounds(3, 0), 3), "x must be contiguous"),
        (
            lambda: ops.fewbit_grad(torch.randn(10), torch.zeros(3, dtype=torch.uint8), torch.randn(8), 3),
            "packed has 3",
        ),
        (lambda: ops.fewbit_grad(torch.randn(10), torch.zeros(4, dtype=torch.uint8), torch.randn(4), 3), "levels must"),
        (lambda: ops.fewbit_grad(torch.randn(10), torch.zeros(4), torch.randn(8), 3), "packed has dtype"),
    ],
)
def test_bad_arguments_are_rejected(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
