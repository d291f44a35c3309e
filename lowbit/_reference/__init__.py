"""Pure-PyTorch twins of the lowbit ops: the test oracle and the benchmark baseline.

Each function computes, with ordinary torch operations, the same fp32 arithmetic in the same order
as the native kernels, so results agree bit for bit (codes, absmax and dequantized values),
including the counter-based random stream of stochastic rounding. They are written for clarity, not
speed. One file per family, as in :mod:`lowbit._ops`: :mod:`.quantize`, :mod:`.activations`,
:mod:`.optim`, :mod:`.muon`, :mod:`.factored` (the factored 4-bit Adam step, lowbit/optim/factored.py), and
:mod:`.lanes` (the native loops' fixed-order sums).
:mod:`.ademamix` is not a twin but the formula oracle of AdEMAMix, a plain torch.optim optimizer (torch
has none).
"""

from lowbit._reference.activations import (
    blpa_backward,
    blpa_decode,
    blpa_encode,
    blpa_unit_backward,
    fewbit_encode,
    fewbit_grad,
    invact_grad,
)
from lowbit._reference.factored import column_sum, factored_adam_step_, factored_v_hat
from lowbit._reference.lanes import lane_sum
from lowbit._reference.muon import muon_momentum_
from lowbit._reference.optim import lpmm_accumulate_, lpmm_step_, optimizer_norms, optimizer_step_, rank1_statistics_
from lowbit._reference.quantize import (
    block_absmax,
    dequantize_blockwise,
    dequantize_linear,
    nearest_oracle,
    pack_bits,
    quantize_blockwise,
    quantize_linear,
    uniform01,
    unpack_bits,
)

__all__ = [
    "block_absmax",
    "blpa_backward",
    "blpa_decode",
    "blpa_encode",
    "blpa_unit_backward",
    "dequantize_blockwise",
    "dequantize_linear",
    "factored_adam_step_",
    "factored_v_hat",
    "lane_sum",
    "column_sum",
    "fewbit_encode",
    "fewbit_grad",
    "invact_grad",
    "lpmm_accumulate_",
    "lpmm_step_",
    "muon_momentum_",
    "nearest_oracle",
    "optimizer_norms",
    "optimizer_step_",
    "pack_bits",
    "quantize_blockwise",
    "quantize_linear",
    "rank1_statistics_",
    "uniform01",
    "unpack_bits",
]
