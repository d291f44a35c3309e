"""LPMM: low-precision parameters and quantized gradient accumulators (lpmm.txt Algorithm 1;
csrc/cpu/lpmm.cpp, csrc/cuda/lpmm.cu)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lowbit import _C
from lowbit._checks import MAX_LINEAR_BITS, is_int_in
from lowbit._ops import _common
from lowbit._ops._common import DTYPE_CODES, FLOAT_DTYPES, MAX_MAP_BITS, Kernel, launch
from lowbit._ops.optim import SCALAR_COLS, StepHyper

# Column layout of the per-tensor table (csrc/kernels.h: LpmmCol), owned by the native module.
LP_COLS = _C.LP_COLS
_ACCUMULATE = Kernel(_C.lpmm_accumulate_cpu, lambda: _C.lpmm_accumulate_cuda)
_STEP = Kernel(_C.lpmm_step_cpu, lambda: _C.lpmm_step_cuda)

MIN_LPMM_BITS = 2


def _check_lpmm_bits(name: str, bits: int, low: int, high: int) -> None:
    _common.check(is_int_in(bits, low, high), f"{name} must be an int in {low}..{high}, got {bits!r}")


def _check_lpmm_tensor(
    name: str, codes: Tensor, absmax: Tensor, numel: int, bits: int, group_size: int, device: torch.device
) -> None:
    """Packed codes and group absmaxes of one quantized tensor (``name`` names it in errors)."""
    _common.check_codes(f"{name} codes", codes, numel, bits)
    _common.check_input(f"{name} absmax", absmax, (torch.float32,))
    groups = _common.num_blocks(numel, group_size)
    _common.check(
        absmax.numel() == groups, f"{name} absmax has {absmax.numel()} entries but {numel} elements need {groups}"
    )
    _common.check(codes.device == device and absmax.device == device, f"{name} codes and absmax must be on {device}")


@torch.library.custom_op("lowbit::lpmm_accumulate_", mutates_args=("codes", "absmax"))
def lpmm_accumulate_(
    grad: Tensor, codes: Tensor, absmax: Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> None:
    """Gradient accumulation into a quantized accumulator, ``g <- Q(g + grad)`` (lpmm.txt Algorithm 1, line 5).

    ``codes``/``absmax`` hold ``grad.numel()`` bit-packed linear codes of ``bits`` bits with one fp32
    absmax per group of ``group_size`` elements (an absmax of 0 reads as an all-zero group). Each group is
    decoded, ``grad`` added in fp32, and the sum re-encoded against its new absmax, with stochastic
    rounding (draws keyed by ``seed``) or round-to-nearest.
    """
    _common.check_input("grad", grad, FLOAT_DTYPES)
    _check_lpmm_bits("bits", bits, MIN_LPMM_BITS, MAX_LINEAR_BITS)
    _common.check_blocksize(group_size)
    _common.check(group_size > 0, "group_size must be positive")
    _common.check_rng(seed, 0)
    _check_lpmm_tensor("accumulator", codes, absmax, grad.numel(), bits, group_size, grad.device)
    if grad.numel() == 0:
        return
    launch(_ACCUMULATE, grad.device)(
        grad.data_ptr(),
        DTYPE_CODES[grad.dtype],
        grad.numel(),
        codes.data_ptr(),
        absmax.data_ptr(),
        bits,
        group_size,
        stochastic,
        seed,
    )


@lpmm_accumulate_.register_fake
def _(grad: Tensor, codes: Tensor, absmax: Tensor, bits: int, group_size: int, stochastic: bool, seed: int) -> None:
    return None


class LpmmStepArgs(NamedTuple):
    """The arguments of ``lowbit::lpmm_step_``, by name.

    Tensor i has ``numels[i]`` elements: bit-packed linear parameter codes ``params[i]`` (``param_bits``)
    and accumulator codes ``grads[i]`` (``grad_bits``), optimizer states ``state1[i]``/``state2[i]``
    bit-packed at ``state_bits`` into ``map1``/``map2`` (``2**state_bits`` entries each), and one fp32
    absmax per group of ``group_size`` elements for each. ``rule`` is Adam (0) or SGD (1); ``hyper``,
    ``flags`` and ``scalars`` are laid out as for ``lowbit::optimizer_step_`` (:class:`StepHyper`).
    Parameters and states are re-encoded with stochastic rounding where asked (draws keyed by ``seed``):
    element j of tensor i takes the draw at counter ``offsets[i] + j`` of each stream, so a tensor stepped
    alone with its offset rounds exactly as inside a larger call. ``offsets`` None: each tensor continues
    the counters where the previous one stopped (0, numels[0], numels[0] + numels[1], ...).
    """

    params: list[Tensor]
    param_absmax: list[Tensor]
    grads: list[Tensor]
    grad_absmax: list[Tensor]
    state1: list[Tensor]
    state2: list[Tensor]
    absmax1: list[Tensor]
    absmax2: list[Tensor]
    numels: list[int]
    scalars: list[float]
    map1: Tensor
    map2: Tensor
    rule: int
    hyper: list[float]
    flags: int
    n_states: int
    group_size: int
    param_bits: int
    grad_bits: int
    state_bits: int
    stochastic_param: bool
    stochastic_state: bool
    seed: int
    offsets: Optional[list[int]] = None

    def written(self) -> list[Tensor]:
        """The tensors a step writes in place."""
        return [
            *self.params,
            *self.param_absmax,
            *self.grad_absmax,
            *self.state1,
            *self.state2,
            *self.absmax1,
            *self.absmax2,
        ]


def counter_offsets(a: LpmmStepArgs) -> list[int]:
    """The counter offset of each tensor's first element in the rounding streams (see ``offsets``)."""
    if a.offsets is not None:
        return list(a.offsets)
    starts = [0]
    for n in a.numels[:-1]:
        starts.append(starts[-1] + n)
    return starts


_MUTATED = ("params", "param_absmax", "grad_absmax", "state1", "state2", "absmax1", "absmax2")


def _check_step(a: LpmmStepArgs) -> None:
    """The checks of ``lowbit::lpmm_step_``."""
    count = len(a.params)
    _common.check(a.rule in (0, 1), f"rule must be 0 (Adam) or 1 (SGD), got {a.rule}")
    _common.check(0 <= a.n_states <= 2, f"n_states must be 0, 1 or 2, got {a.n_states}")
    _common.check_blocksize(a.group_size)
    _common.check(a.group_size > 0, "group_size must be positive")
    _check_lpmm_bits("param_bits", a.param_bits, MIN_LPMM_BITS, MAX_LINEAR_BITS)
    _check_lpmm_bits("grad_bits", a.grad_bits, MIN_LPMM_BITS, MAX_LINEAR_BITS)
    _check_lpmm_bits("state_bits", a.state_bits, 1, MAX_MAP_BITS)
    _common.check_rng(a.seed, 0)
    if a.offsets is not None:
        _common.check(len(a.offsets) == count, f"offsets has {len(a.offsets)} entries but params has {count}")
        for i, (offset, n) in enumerate(zip(a.offsets, a.numels, strict=True)):
            _common.check(
                isinstance(offset, int) and 0 <= offset and offset + n < 2**63,
                f"offsets[{i}] must be an int in [0, 2**63 - numels[{i}]), got {offset!r}",
            )
    _common.check(
        len(a.hyper) == len(StepHyper._fields), f"hyper must hold {len(StepHyper._fields)} values, got {len(a.hyper)}"
    )
    _common.check(len(a.scalars) == SCALAR_COLS * count, "scalars must hold 3 values per tensor")
    lists: dict[str, Sequence[object]] = {
        "param_absmax": a.param_absmax,
        "grads": a.grads,
        "grad_absmax": a.grad_absmax,
        "numels": a.numels,
    }
    for k, (s, m) in enumerate(((a.state1, a.absmax1), (a.state2, a.absmax2))[: a.n_states]):
        lists[f"state{k + 1}"], lists[f"absmax{k + 1}"] = s, m
    for name, lst in lists.items():
        _common.check(len(lst) == count, f"{name} has {len(lst)} entries but params has {count}")
    if count == 0:
        return
    device = a.params[0].device
    _common.check_map(a.map1, a.state_bits)
    _common.check_map(a.map2, a.state_bits)
    _common.check_same_device("params[0]", a.params[0], map1=a.map1, map2=a.map2)
    for i, n in enumerate(a.numels):
        _common.check(isinstance(n, int) and n >= 0, f"numels[{i}] must be a non-negative int, got {n!r}")
        _check_lpmm_tensor(f"params[{i}]", a.params[i], a.param_absmax[i], n, a.param_bits, a.group_size, device)
        _check_lpmm_tensor(f"grads[{i}]", a.grads[i], a.grad_absmax[i], n, a.grad_bits, a.group_size, device)
        for k, (s, m) in enumerate(((a.state1, a.absmax1), (a.state2, a.absmax2))[: a.n_states]):
            _check_lpmm_tensor(f"state{k + 1}[{i}]", s[i], m[i], n, a.state_bits, a.group_size, device)


def _call(a: LpmmStepArgs) -> None:
    """The checks and the native call behind lpmm_step_."""
    _check_step(a)
    count = len(a.params)
    if count == 0:
        return
    device = a.params[0].device
    pairs = ((a.state1, a.absmax1), (a.state2, a.absmax2))[: a.n_states]
    rows = []
    first_group = 0
    offsets = counter_offsets(a)
    for i, n in enumerate(a.numels):
        ptrs = [s[i].data_ptr() for s, _ in pairs] + [0] * (2 - a.n_states)
        amax = [m[i].data_ptr() for _, m in pairs] + [0] * (2 - a.n_states)
        rows.append(
            [
                a.params[i].data_ptr(),
                a.param_absmax[i].data_ptr(),
                a.grads[i].data_ptr(),
                a.grad_absmax[i].data_ptr(),
                *ptrs,
                *amax,
                n,
                first_group,
                offsets[i],
            ]
        )
        first_group += _common.num_blocks(n, a.group_size)
    meta, scal = _common.call_tables(rows, LP_COLS, a.scalars, device)
    launch(_STEP, device)(
        a.rule,
        a.hyper,
        a.flags,
        a.n_states,
        a.group_size,
        [a.param_bits, a.grad_bits, a.state_bits],
        a.map1.data_ptr(),
        a.map2.data_ptr(),
        [a.stochastic_param, a.stochastic_state],
        a.seed,
        meta.data_ptr(),
        scal.data_ptr(),
        count,
        first_group,
    )


def _step(*args: Any, **kwargs: Any) -> None:
    """One fused LPMM step (lpmm.txt Algorithm 1, lines 7-8) over the quantized tensors of
    :class:`LpmmStepArgs`; clears the accumulators (every accumulator absmax is set to 0)."""
    _call(LpmmStepArgs(*args, **kwargs))


_step.__signature__ = _common.op_signature(LpmmStepArgs)  # type: ignore[attr-defined]
lpmm_step_ = torch.library.custom_op("lowbit::lpmm_step_", _step, mutates_args=_MUTATED)


@lpmm_step_.register_fake
def _(*args: Any, **kwargs: Any) -> None:
    return None


def lpmm_step_eager(args: LpmmStepArgs) -> None:
    """``lowbit::lpmm_step_`` without the dispatcher's per-tensor bookkeeping (see
    :func:`lowbit._ops.optim.optimizer_step_eager`)."""
    _call(args)
    torch.autograd.graph.increment_version(args.written())
