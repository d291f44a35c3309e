"""Bit packing: exact sizes, LSB-first layout, round trips for every width."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowbit import _reference as R
from lowbit import functional as F

SIZES = [0, 1, 7, 8, 9, 63, 4095, 4097, 100_003]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_and_size(device, bits, n):
    g = torch.Generator().manual_seed(n + bits)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.uint8).to(device)
    packed = F.pack_bits(codes, bits)
    assert packed.numel() == math.ceil(n * bits / 8) and packed.dtype == torch.uint8
    assert torch.equal(packed.cpu(), R.pack_bits(codes.cpu(), bits))
    assert torch.equal(F.unpack_bits(packed, bits, n), codes)


def test_layout_is_lsb_first():
    codes = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    # 2-bit codes 1,2,3,0 fill byte 0 from its lowest bits: 0b00_11_10_01; code 3 starts byte 1.
    assert F.pack_bits(codes, 2).tolist() == [0b00111001, 0b00000011]
    assert F.pack_bits(torch.tensor([5, 6], dtype=torch.uint8), 3).tolist() == [0b110101]


def test_multidimensional_codes_are_flattened():
    codes = torch.randint(0, 8, (3, 5, 7), dtype=torch.uint8)
    assert torch.equal(F.unpack_bits(F.pack_bits(codes, 3), 3, codes.numel()), codes.reshape(-1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="does not fit in 2 bits"):
        F.pack_bits(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(TypeError, match="uint8"):
        F.pack_bits(torch.tensor([1], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="bits"):
        F.pack_bits(torch.tensor([1], dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="packed has 3 bytes but 3 codes of 3 bits take 2"):
        F.unpack_bits(torch.zeros(3, dtype=torch.uint8), 3, 3)


@given(
    codes=hnp.arrays(np.uint8, st.integers(0, 600), elements=st.integers(0, 255)),
    bits=st.integers(1, 8),
)
def test_property_round_trip(codes, bits):
    c = torch.from_numpy(codes) & ((1 << bits) - 1)
    packed = F.pack_bits(c, bits)
    assert torch.equal(packed, R.pack_bits(c, bits))
    assert torch.equal(F.unpack_bits(packed, bits, c.numel()), c)
