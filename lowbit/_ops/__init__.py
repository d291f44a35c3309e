"""Every lowbit tensor op, defined once as a ``torch.library`` custom op with a fake kernel beside it.

This package is the only place that turns tensors into raw pointers for ``lowbit._C``. Each op checks
dtype, device, contiguity and sizes before it does so; the native side trusts these checks. The ops
work on flat element streams; shapes, maps and argument policy live in :mod:`lowbit.functional`.
One file per native feature, as in ``csrc/``: :mod:`.quantize`, :mod:`.fewbit`, :mod:`.invact`,
:mod:`.blpa`, :mod:`.optim`, :mod:`.muon`, :mod:`.lpmm`; :mod:`._common` holds the dtype codes, the shared checks and
the launcher.
"""

from lowbit._checks import MAX_LINEAR_BITS
from lowbit._ops._common import (
    CUDA_NOT_BUILT,
    FLOAT_DTYPES,
    MAX_MAP_BITS,
    local,
    num_blocks,
    packed_bytes,
)
from lowbit._ops.blpa import blpa_backward, blpa_decode, blpa_encode
from lowbit._ops.fewbit import fewbit_encode, fewbit_grad
from lowbit._ops.invact import invact_grad
from lowbit._ops.lpmm import LpmmStepArgs, lpmm_accumulate_, lpmm_step_, lpmm_step_eager
from lowbit._ops.muon import check_muon_momentum, muon_momentum_
from lowbit._ops.optim import (
    FACTORED_GIVEN,
    StepArgs,
    StepHyper,
    check_optimizer_step,
    optimizer_norms,
    optimizer_norms_eager,
    optimizer_step_,
    optimizer_step_eager,
    rank1_statistics_,
    rank1_statistics_eager,
)
from lowbit._ops.quantize import (
    dequantize_blockwise,
    dequantize_linear,
    pack_bits,
    quantize_blockwise,
    quantize_linear,
    unpack_bits,
)

__all__ = [
    "CUDA_NOT_BUILT",
    "FACTORED_GIVEN",
    "FLOAT_DTYPES",
    "MAX_LINEAR_BITS",
    "MAX_MAP_BITS",
    "LpmmStepArgs",
    "StepArgs",
    "StepHyper",
    "blpa_backward",
    "blpa_decode",
    "blpa_encode",
    "check_muon_momentum",
    "check_optimizer_step",
    "dequantize_blockwise",
    "dequantize_linear",
    "fewbit_encode",
    "fewbit_grad",
    "invact_grad",
    "local",
    "lpmm_accumulate_",
    "lpmm_step_",
    "lpmm_step_eager",
    "muon_momentum_",
    "num_blocks",
    "optimizer_norms",
    "optimizer_norms_eager",
    "optimizer_step_",
    "optimizer_step_eager",
    "pack_bits",
    "rank1_statistics_",
    "rank1_statistics_eager",
    "packed_bytes",
    "quantize_blockwise",
    "quantize_linear",
    "unpack_bits",
]
