"""The fused optimizer step: one native call per parameter group and state layout
(8bit-optimizers.txt section 2; include/lowbit/optim_rules.h; csrc/cpu/optim.cpp, csrc/cuda/optim.cu)."""

from __future__ import annotations

import array
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lowbit import _C
from lowbit._ops import _common
from lowbit._ops._common import DTYPE_CODES, FLOAT_DTYPES, Kernel, launch

# Column layout of the per-tensor tables (csrc/kernels.h: MetaCol, ScalarCol), owned by the native module.
META_COLS = _C.META_COLS
MAX_STATES = _C.MAX_STATES
SCALAR_COLS = _C.SCALAR_COLS
RANK1_COLS, MAX_RANK1_DIMS = _C.RANK1_COLS, _C.MAX_RANK1_DIMS
FACTORED_COLS = _C.FACTORED_COLS
ROUND_COLS = _C.ROUND_COLS
# include/lowbit/state_form.h: second_moment_slot of each rule code (-1: the rule has none).
SECOND_MOMENT_SLOTS: list[int] = list(_C.SECOND_MOMENT_SLOTS)

_STEP = Kernel(_C.optimizer_step_cpu, lambda: _C.optimizer_step_cuda)


class StepHyper(NamedTuple):
    """The hyperparameters of one fused step, by name: the native ``StepHyper`` (include/lowbit/optim_rules.h),
    whose float fields the op takes as the flat list :meth:`values`, in the order ``_C.STEP_HYPER_FIELDS``
    gives. Each rule reads the fields it needs; the others keep their defaults."""

    lr: float
    beta1: float = 0.0
    """Adam/Lion/LAMB beta1; SGD/RMSprop momentum."""
    beta2: float = 0.0
    """Adam/Lion/LAMB beta2; RMSprop alpha."""
    one_minus_beta1: float = 0.0
    """1 - beta1; SGD 1 - dampening."""
    one_minus_beta2: float = 0.0
    """1 - beta2; RMSprop 1 - alpha."""
    eps: float = 0.0
    weight_decay: float = 0.0
    """Coupled decay (added to the gradient), unless the decoupled flag is set."""
    decay: float = 1.0
    """1 - lr * weight_decay: the decoupled (AdamW-style) factor of the parameter."""
    max_unorm: float = 0.0
    """The bound of max_unorm clipping (norm mode 2), relative to the parameter's norm."""
    one_minus_beta3: float = 0.0
    """AdEMAMix: 1 - beta3, the slow EMA's weight (at the step's point of its warm-up)."""
    slow_step_size: float = 0.0
    """AdEMAMix: lr * alpha, the slow EMA's step size (at the step's point of its warm-up)."""

    @classmethod
    def with_betas(cls, lr: float, betas: tuple[float, float], **rest: float) -> StepHyper:
        """Adam's, Lion's and LAMB's form: both betas and their complements (``1 - beta`` in double, as
        torch.optim computes them); ``rest`` names the other fields."""
        b1, b2 = betas
        return cls(lr=lr, beta1=b1, beta2=b2, one_minus_beta1=1.0 - b1, one_minus_beta2=1.0 - b2, **rest)

    def values(self) -> list[float]:
        """The flat list the native step takes (the ops' ``hyper``)."""
        return [float(v) for v in self]


class StepArgs(NamedTuple):
    """The arguments of ``lowbit::optimizer_step_`` (and of ``lowbit::optimizer_norms``), by name.

    ``scalars`` holds 3 floats per tensor (step size, sqrt of Adam's second bias correction, 1.0 on the
    first step); ``grad_scales`` (optional, fp32, one per tensor, on the params' device) multiplies each
    gradient; ``hyper`` is :meth:`StepHyper.values`; ``norm_mode`` selects LAMB's trust ratio (1) or
    max_unorm clipping (2), or (3, ``optimizer_norms`` only) the sums of p^2 and g^2 for LARS. Each of the
    ``n_states`` states (up to 3, in the rule's slot order) is either uint8 codes into its map (``map1``..``map3``,
    ``2**state_bits`` entries) with one fp32 absmax per block of ``block_size`` elements, or an fp32 tensor (then
    its absmax entry is unused). ``state_bits`` is 8 (one code per byte, a state of as many elements as its
    parameter) or 4 (two codes per byte, element ``2i`` in the low nibble: ``ceil(n / 2)`` bytes for ``n``
    elements). ``update_scales`` (optional, fp32, one per tensor, on the params' device) replaces the norm mode's
    own per-tensor scales: the step of tensors whose norms span ranks (see :func:`optimizer_norms`).

    ``rank1`` (optional) gives, for each tensor in turn, 0 where its second moment is block-wise, or the
    entries ``ndim, offset, *dims`` of a 4-bit second moment normalised rank-1 (include/lowbit/rank1.h): the
    tensor holds elements ``offset .. offset + numel`` of a global tensor of shape ``dims`` (2 to
    ``MAX_RANK1_DIMS`` axes; a shard under FSDP2). Such a tensor's second moment has no absmax (its
    ``absmax`` entry is ignored): its statistics are ``sum(dims)`` fp32 values, axis 0's maxima first, held
    in ``axis_max`` (flat fp32, the statistics of every such tensor in turn), and ``new_axis_max`` (laid out
    alike) holds the statistics of the step's new values, to which :func:`rank1_statistics_` raises it
    (pass zeros) and which the step encodes against.

    ``factored`` (optional) gives, for each tensor in turn, 1 where its second moment is factorized
    (include/lowbit/factored.h; Adam's rule, 4-bit states, 2 or more axes), 2 where it is factorized and its factors
    are this step's already (kFacGiven: an FSDP2 shard of a matrix, lowbit/optim/factored.py), else 0. Such a
    tensor has no ``state2``/``absmax2`` (their entries are ignored): its factors are in ``factors`` (flat fp32: for
    each such tensor in turn, its ``B * R`` row factors then its ``B * C`` column factors, for ``B x R x C`` the
    tensor seen as slices of its last two axes, then, where given, its ``B`` slices' means of their rows), which the
    step updates in place before the parameters (1), or reads as they are (2).

    ``rounding`` (optional) selects stochastic rounding of the quantized states (include/lowbit/
    state_rounding.h): two entries per tensor, its step seed (``0 <= seed < 2**63``) and the counter of its
    first element (``>= 0``); state ``k`` of element ``e`` then rounds with the draw at counter ``offset + e``
    of stream ``1 + k`` of the seed, as the LPMM step's states do. None rounds to nearest.
    """

    params: list[Tensor]
    grads: list[Tensor]
    state1: list[Tensor]
    state2: list[Tensor]
    state3: list[Tensor]
    absmax1: list[Tensor]
    absmax2: list[Tensor]
    absmax3: list[Tensor]
    scalars: list[float]
    grad_scales: Optional[Tensor]
    map1: Tensor
    map2: Tensor
    map3: Tensor
    rule: int
    hyper: list[float]
    flags: int
    norm_mode: int
    n_states: int
    block_size: int
    update_scales: Optional[Tensor] = None
    state_bits: int = 8
    rank1: Optional[list[int]] = None
    axis_max: Optional[Tensor] = None
    new_axis_max: Optional[Tensor] = None
    rounding: Optional[list[int]] = None
    factored: Optional[list[int]] = None
    factors: Optional[Tensor] = None

    def written(self) -> list[Tensor]:
        """The tensors a step writes in place."""
        states = [*self.state1, *self.state2, *self.state3, *self.absmax1, *self.absmax2, *self.absmax3]
        return [*self.params, *states, *([self.factors] if self.factors is not None else [])]


# Tensor types that are plain tensors (no subclass wrapping them): the common case of the checks, tested first.
_PLAIN = (Tensor, torch.nn.Parameter)

_MUTATED = ("params", "state1", "state2", "state3", "absmax1", "absmax2", "absmax3", "factors")


def _tensor_widths(
    params: list[Any],
    grads: list[Any],
    states: Sequence[list[Any]],
    absmaxes: Sequence[list[Any]],
    block_size: int,
    state_bits: int,
    rank1: dict[int, tuple[int, list[int]]],
    rank1_slot: int,
    factored: frozenset[int] = frozenset(),
    known: Optional[list[int]] = None,
) -> list[int]:
    """Checks every tensor of a step (parameters, gradients, and the states and absmaxes in use) and returns
    each one's state width, ``state_bits`` or 32. Each rule is one condition, written out inline (this runs for every
    tensor of every step); the message, and the type check that names what is wrong, are built only when it
    fails. ``known``: the widths an earlier check of these very states returned; then only the parameters and
    gradients are checked, and ``known`` is returned."""
    device = params[0].device
    num_blocks = _common.num_blocks
    widths = []
    for i, p in enumerate(params):
        g = grads[i]
        if not (
            (type(p) in _PLAIN or (isinstance(p, Tensor) and not is_traceable_wrapper_subclass(p)))
            and (type(g) in _PLAIN or (isinstance(g, Tensor) and not is_traceable_wrapper_subclass(g)))
            and p.dtype in DTYPE_CODES
            and g.dtype == p.dtype
            and g.shape == p.shape
            and p.device == device
            and g.device == device
            and p.is_contiguous()
            and g.is_contiguous()
        ):
            _common.check_input(f"params[{i}]", p, FLOAT_DTYPES)
            _common.check_input(f"grads[{i}]", g, (p.dtype,))
            _common.check(
                g.shape == p.shape, f"grads[{i}] has shape {tuple(g.shape)} but params[{i}] has {tuple(p.shape)}"
            )
            _common.check(False, f"params[{i}] and grads[{i}] must be on {device}")
        if known is not None:
            continue
        n = p.numel()
        eight = bool(states) and isinstance(states[0][i], Tensor) and states[0][i].dtype == torch.uint8
        size = (n * state_bits + 7) // 8 if eight else n
        for k, state in enumerate(states):
            if k == rank1_slot and i in factored:
                continue  # a factorized second moment: its factors are checked by _check_factored
            s = state[i]
            if not (
                isinstance(s, Tensor)
                and not is_traceable_wrapper_subclass(s)
                and s.dtype == (torch.uint8 if eight else torch.float32)
                and s.numel() == size
                and s.device == device
                and s.is_contiguous()
            ):
                _common.check_input(f"state{k + 1}[{i}]", s, (torch.uint8, torch.float32))
                what = f"{size} bytes of {state_bits}-bit codes" if eight else f"{n} elements"
                _common.check(
                    s.numel() == size and s.device == device, f"state{k + 1}[{i}] must have {what} on {device}"
                )
                _common.check(False, f"the states of params[{i}] must all be {state_bits}-bit or all 32-bit")
            a = absmaxes[k][i]
            if (
                eight
                and not (k == rank1_slot and i in rank1)
                and not (
                    isinstance(a, Tensor)
                    and a.dtype == torch.float32
                    and a.numel() == num_blocks(n, block_size)
                    and a.device == device
                    and a.is_contiguous()
                )
            ):
                _common.check_input(f"absmax{k + 1}[{i}]", a, (torch.float32,))
                blocks = num_blocks(n, block_size)
                _common.check(False, f"absmax{k + 1}[{i}] must have {blocks} entries")
        widths.append(state_bits if eight else 32)
    if known is not None:
        _common.check(len(known) == len(params), f"{len(known)} known widths for {len(params)} tensors")
        return known
    return widths


def check_optimizer_step(args: StepArgs, known_widths: Optional[list[int]] = None) -> list[int]:
    """The checks of ``lowbit::optimizer_step_``; returns each tensor's state width (``state_bits`` or 32).
    An optimizer that steps several fused calls checks every one before the first one writes.

    ``known_widths``: what this function returned for a step of the very same state tensors (the same objects,
    unchanged since, as :mod:`lowbit.optim.step_plan` makes sure); the per-tensor checks of the states are then
    skipped, and everything else is checked as always."""
    count = len(args.params)
    _common.check(args.state_bits in (8, 4), f"state_bits must be 8 or 4, got {args.state_bits}")
    _common.check(0 <= args.n_states <= MAX_STATES, f"n_states must be 0 to {MAX_STATES}, got {args.n_states}")
    _common.check(args.norm_mode in (0, 1, 2, 3), f"norm_mode must be 0, 1, 2 or 3, got {args.norm_mode}")
    _common.check_blocksize(args.block_size)
    _common.check(args.block_size > 0, "block_size must be positive for optimizer states")
    _common.check(
        len(args.hyper) == len(StepHyper._fields),
        f"hyper must hold {len(StepHyper._fields)} values, got {len(args.hyper)}",
    )
    _common.check(len(args.scalars) == SCALAR_COLS * count, "scalars must hold 3 values per tensor")
    for name in ("grad_scales", "update_scales"):
        t = getattr(args, name)
        if t is not None:
            _common.check_input(name, t, (torch.float32,))
            _common.check(t.numel() == count, f"{name} must hold one value per tensor")
    states = (args.state1, args.state2, args.state3)[: args.n_states]
    absmaxes = (args.absmax1, args.absmax2, args.absmax3)[: args.n_states]
    lists = [("grads", args.grads)]
    lists += [(f"state{k + 1}", lst) for k, lst in enumerate(states)]
    lists += [(f"absmax{k + 1}", lst) for k, lst in enumerate(absmaxes)]
    for name, lst in lists:
        _common.check(len(lst) == count, f"{name} has {len(lst)} tensors but params has {count}")
    if not count:
        return []
    rank1 = rank1_layouts(args)
    slot = SECOND_MOMENT_SLOTS[args.rule] if 0 <= args.rule < len(SECOND_MOMENT_SLOTS) else -1
    factored = factored_tensors(args)
    _check_factored_rule(args, factored)
    widths = _tensor_widths(
        args.params,
        args.grads,
        states,
        absmaxes,
        args.block_size,
        args.state_bits,
        rank1,
        slot,
        factored,
        known_widths,
    )
    _check_rank1(args, rank1, widths, slot)
    _check_factored(args, factored, rank1, widths)
    _check_rounding(args.rounding, count)
    maps = {"map1": args.map1, "map2": args.map2, "map3": args.map3}
    scales = {name: getattr(args, name) for name in ("grad_scales", "update_scales") if getattr(args, name) is not None}
    _common.check_same_device("params[0]", args.params[0], **maps, **scales)
    for t in maps.values():
        _common.check_map(t, args.state_bits)
    return widths


def rank1_layouts(args: StepArgs) -> dict[int, tuple[int, list[int]]]:
    """The tensors of ``args.rank1`` whose second moment is normalised rank-1: index -> (offset, dims)."""
    if args.rank1 is None:
        return {}
    out: dict[int, tuple[int, list[int]]] = {}
    pos, entries = 0, list(args.rank1)
    for i in range(len(args.params)):
        _common.check(pos < len(entries), f"rank1 ends before the entry of params[{i}]")
        ndim = entries[pos]
        if ndim == 0:
            pos += 1
            continue
        _common.check(
            2 <= ndim <= MAX_RANK1_DIMS and pos + 2 + ndim <= len(entries),
            f"rank1 entry of params[{i}]: ndim must be 0 or 2..{MAX_RANK1_DIMS} and followed by offset and dims, "
            f"got {entries[pos : pos + 2 + max(ndim, 0)]}",
        )
        out[i] = (entries[pos + 1], entries[pos + 2 : pos + 2 + ndim])
        pos += 2 + ndim
    _common.check(pos == len(entries), f"rank1 has {len(entries) - pos} entries beyond the last tensor's")
    return out


def _check_rounding(rounding: Optional[list[int]], count: int) -> None:
    """The checks of a step's ``rounding`` table (see :class:`StepArgs`)."""
    if rounding is None:
        return
    _common.check(len(rounding) == ROUND_COLS * count, f"rounding must hold {ROUND_COLS} entries per tensor")
    for i in range(count):
        seed, offset = rounding[ROUND_COLS * i : ROUND_COLS * i + ROUND_COLS]
        _common.check(0 <= seed < 2**63, f"rounding seed of params[{i}] must be in [0, 2**63), got {seed}")
        _common.check(0 <= offset < 2**63, f"rounding offset of params[{i}] must be in [0, 2**63), got {offset}")


def _rounding_table(rounding: Optional[list[int]], device: torch.device) -> Optional[Tensor]:
    """The native ``rounding`` table (include/lowbit/state_rounding.h: RoundCol), or None for nearest rounding."""
    if rounding is None:
        return None
    table = torch.tensor(rounding, dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type != "cpu" else table


def _check_rank1(args: StepArgs, rank1: dict[int, tuple[int, list[int]]], widths: list[int], slot: int) -> None:
    """The checks of the rank-1 tensors of a step (see :class:`StepArgs`)."""
    if not rank1:
        return
    _common.check(
        0 <= slot < args.n_states, f"rank1: rule {args.rule} with {args.n_states} states has no second moment"
    )
    device = args.params[0].device
    total = sum(sum(dims) for _, dims in rank1.values())
    for name in ("axis_max", "new_axis_max"):
        t = getattr(args, name)
        _common.check(t is not None, f"{name} must be given with rank1")
        _common.check_input(name, t, (torch.float32,))
        _common.check(
            t.numel() == total and t.device == device and t.is_contiguous(),
            f"{name} must hold {total} contiguous fp32 values (the sums of the rank-1 tensors' dims) on {device}",
        )
    for i, (offset, dims) in rank1.items():
        n = args.params[i].numel()
        _common.check(widths[i] == 4, f"rank1: the states of params[{i}] must be 4-bit to be normalised rank-1")
        _common.check(all(d > 0 for d in dims), f"rank1 entry of params[{i}]: dims must be positive, got {dims}")
        _common.check(
            0 <= offset and offset + n <= math.prod(dims),
            f"rank1 entry of params[{i}]: its {n} elements from offset {offset} do not fit in shape {dims}",
        )


# StepArgs.factored's entries: block-wise or rank-1 second moment, factors the step updates, factors given.
FACTORED_NONE, FACTORED_STEP, FACTORED_GIVEN = 0, 1, 2


def factored_tensors(args: StepArgs) -> frozenset[int]:
    """The tensors of ``args.factored`` whose second moment is factorized."""
    if args.factored is None:
        return frozenset()
    entries = list(args.factored)
    _common.check(
        len(entries) == len(args.params) and all(e in (0, 1, 2) for e in entries),
        f"factored must hold 0, 1 or 2 for each of the {len(args.params)} tensors, got {entries}",
    )
    return frozenset(i for i, e in enumerate(entries) if e)


def _factor_count(args: StepArgs, i: int) -> int:
    """How many fp32 values of ``factors`` tensor i (factorized) takes: B * (R + C), and B means if given."""
    b, r, c = _factor_shape(args.params[i])
    given = args.factored is not None and args.factored[i] == FACTORED_GIVEN
    return b * (r + c + (1 if given else 0))


def _factor_shape(p: Tensor) -> tuple[int, int, int]:
    """(B, R, C): a tensor of 2 or more axes as B slices of its last two axes, R x C."""
    return p.numel() // (p.shape[-2] * p.shape[-1]) if p.numel() else 0, p.shape[-2], p.shape[-1]


def _check_factored_rule(args: StepArgs, factored: frozenset[int]) -> None:
    """The rule and norm mode of a step with factorized tensors: Adam's, without a norm mode."""
    if not factored:
        return
    adam = _C.RULES["adam"]
    _common.check(
        args.rule == adam and args.n_states == 2,
        f"factored: only Adam's rule ({adam}, 2 states) factorizes its second moment, got rule {args.rule} "
        f"with {args.n_states} states",
    )
    _common.check(
        args.norm_mode == 0, f"factored: the norm modes do not apply to factorized tensors, got {args.norm_mode}"
    )


def _check_factored(args: StepArgs, factored: frozenset[int], rank1: dict[int, Any], widths: list[int]) -> None:
    """The checks of the factorized tensors of a step (see :class:`StepArgs`)."""
    if not factored:
        return
    total = 0
    for i in sorted(factored):
        p = args.params[i]
        _common.check(p.dim() >= 2 and p.numel() > 0, f"factored: params[{i}] must have 2 or more axes and elements")
        _common.check(widths[i] == 4, f"factored: the states of params[{i}] must be 4-bit to be factorized")
        _common.check(i not in rank1, f"params[{i}] cannot be both factorized and normalised rank-1")
        total += _factor_count(args, i)
    device = args.params[0].device
    t = args.factors
    _common.check(t is not None, "factors must be given with factored")
    assert t is not None
    _common.check_input("factors", t, (torch.float32,))
    _common.check(
        t.numel() == total and t.device == device and t.is_contiguous(),
        f"factors must hold {total} contiguous fp32 values (the row and column factors of the factorized tensors, "
        f"and the means of those whose factors are given) on {device}",
    )


def _factored_table(args: StepArgs, device: torch.device) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The native ``factored`` table (include/lowbit/factored.h: FactoredCol) and its scratch (one fp32 mean per
    slice, from torch's allocator on the step's stream), or None where no tensor is factorized."""
    factored = factored_tensors(args)
    if not factored:
        return None, None
    assert args.factors is not None  # _check_factored
    given = {i for i in factored if args.factored is not None and args.factored[i] == FACTORED_GIVEN}
    shapes = [_factor_shape(args.params[i]) for i in sorted(factored - given)]
    means = torch.empty(sum(b for b, _, _ in shapes), dtype=torch.float32, device=device)
    rows = []
    factors, mean, base, slices = args.factors.data_ptr(), means.data_ptr(), 0, 0
    for i in range(len(args.params)):
        if i not in factored:
            rows.append([0] * FACTORED_COLS)
            continue
        b, r, c = _factor_shape(args.params[i])
        row, col = factors + 4 * base, factors + 4 * (base + b * r)
        if i in given:  # the means follow the columns in ``factors``
            rows.append([b, r, c, row, col, factors + 4 * (base + b * (r + c)), 1])
        else:
            rows.append([b, r, c, row, col, mean + 4 * slices, 0])
            slices += b
        base += _factor_count(args, i)
    table = torch.tensor(rows, dtype=torch.int64)
    table = table.pin_memory().to(device, non_blocking=True) if device.type != "cpu" else table
    return table, means


def _rank1_table(args: StepArgs, rank1: dict[int, tuple[int, list[int]]], device: torch.device) -> Optional[Tensor]:
    """The native ``rank1`` table (include/lowbit/rank1.h: Rank1Col), or None when no tensor uses it."""
    if not rank1:
        return None
    assert args.axis_max is not None and args.new_axis_max is not None  # _check_rank1
    rows = []
    old, new, base = args.axis_max.data_ptr(), args.new_axis_max.data_ptr(), 0
    for i in range(len(args.params)):
        if i not in rank1:
            rows.append([0] * RANK1_COLS)
            continue
        offset, dims = rank1[i]
        pad = [0] * (MAX_RANK1_DIMS - len(dims))
        rows.append([len(dims), offset, old + 4 * base, new + 4 * base, *dims, *pad])
        base += sum(dims)
    table = torch.tensor(rows, dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type != "cpu" else table


def _norm_scratch(
    args: StepArgs, norm_sums: Optional[Tensor], total_blocks: int, device: torch.device
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The scratch of the native norm pre-pass (``OptimArgs::block_sums``, ``tensor_scales`` in
    csrc/kernels.h), or ``None`` where it does not run. It comes from torch's allocator, on the stream the
    step is launched on, so a failed launch leaks nothing and a GPU step needs no synchronisation: 2
    float64 sums per block and, unless ``norm_sums`` takes the per-tensor results, one fp32 update scale
    per tensor."""
    if args.norm_mode == 0 or args.update_scales is not None:
        return None, None
    block_sums = torch.empty(2 * total_blocks, dtype=torch.float64, device=device)
    tensor_scales = None if norm_sums is not None else torch.empty(len(args.params), dtype=torch.float32, device=device)
    return block_sums, tensor_scales


@dataclasses.dataclass
class MetaCache:
    """The tables of a CPU step (csrc/kernels.h: MetaCol, ScalarCol) kept for the next step of the same prepared
    call (:class:`lowbit.optim.step_plan.FusedLayout`). Building the meta table from Python ints costs about
    0.8 us per tensor, a third of the Python time of a 387-tensor step, and from one step to the next only the
    gradients usually move. So a step builds every other column as always, compares them with ``fixed``, and
    where they are equal writes the gradients' column and the scalars into the kept tables. The tables are
    tensors over Python arrays (``torch.frombuffer``), written through the arrays: no torch operation, each of
    which costs 20-75 us right after a step has streamed the parameters through the caches."""

    fixed: list[list[int]] = dataclasses.field(default_factory=list)
    """The columns of the meta table other than the gradients', as the step that built it computed them."""
    rows: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))
    """The meta table's int64 entries, row by row; ``meta`` is a tensor over them."""
    scalars: array.array[float] = dataclasses.field(default_factory=lambda: array.array("f"))
    """The scalar table's fp32 entries; ``scal`` is a tensor over them."""
    meta: Optional[Tensor] = None
    scal: Optional[Tensor] = None


# The position of the gradients' column in the meta table (csrc/kernels.h: MetaCol, kGrad).
_GRADS_COLUMN = 1


def _meta_table(
    args: StepArgs, columns: list[list[int]], device: torch.device, cache: Optional[MetaCache]
) -> tuple[Tensor, Tensor]:
    """The meta and scalar tables of a call (``_common.call_tables``); ``columns``: the meta table's columns.
    On the CPU, ``cache`` (when given) supplies the tables of the previous step where only the gradients' column
    and the scalars differ, and keeps this step's."""
    if cache is None or device.type != "cpu":
        return _common.call_tables(list(zip(*columns, strict=True)), META_COLS, args.scalars, device)
    grads = columns[_GRADS_COLUMN]
    fixed = columns[:_GRADS_COLUMN] + columns[_GRADS_COLUMN + 1 :]
    scalars = array.array("f", args.scalars)  # each rounded to nearest, as torch.tensor rounds it
    if cache.meta is not None and cache.scal is not None and cache.fixed == fixed:
        # The native call reads the tables synchronously on the CPU, so rewriting them for this step is safe.
        cache.rows[_GRADS_COLUMN::META_COLS] = array.array("q", grads)
        cache.scalars[:] = scalars
        return cache.meta, cache.scal
    cache.fixed = fixed
    cache.rows = array.array("q", itertools.chain.from_iterable(zip(*columns, strict=True)))
    cache.scalars = scalars
    cache.meta = torch.frombuffer(cache.rows, dtype=torch.int64).view(len(grads), META_COLS)
    cache.scal = torch.frombuffer(cache.scalars, dtype=torch.float32)
    return cache.meta, cache.scal


def _call(
    args: StepArgs,
    norm_sums: Optional[Tensor],
    widths: Optional[list[int]] = None,
    stats_only: bool = False,
    cache: Optional[MetaCache] = None,
) -> None:
    """The checks and the native call behind optimizer_step_, optimizer_norms and rank1_statistics_
    (``stats_only``); ``widths``: the result of ``check_optimizer_step(args)`` where the caller has just run it
    (the checks are then not repeated); ``cache``: see :class:`MetaCache`."""
    if widths is None:
        widths = check_optimizer_step(args)
    _common.check(
        args.norm_mode != _C.NORM_GRAD or norm_sums is not None,
        "norm_mode 3 (the gradient's norms) computes norms only; call optimizer_norms with it",
    )
    if not args.params:
        return
    states = (args.state1, args.state2, args.state3)
    absmaxes = (args.absmax1, args.absmax2, args.absmax3)
    n_states, block_size, num_blocks = args.n_states, args.block_size, _common.num_blocks
    # The table's columns (csrc/kernels.h: MetaCol), each built over all tensors at once.
    none = [0] * len(args.params)
    numels = [p.numel() for p in args.params]
    first_blocks, first_block = [], 0
    for n in numels:
        first_blocks.append(first_block)
        first_block += num_blocks(n, block_size)
    columns = [
        [p.data_ptr() for p in args.params],
        [g.data_ptr() for g in args.grads],
        *([s.data_ptr() for s in states[k]] if k < n_states else none for k in range(MAX_STATES)),
        *(
            [a.data_ptr() if w != 32 else 0 for a, w in zip(absmaxes[k], widths, strict=True)] if k < n_states else none
            for k in range(MAX_STATES)
        ),
        numels,
        [DTYPE_CODES[p.dtype] for p in args.params],
        widths,
        first_blocks,
    ]
    device = args.params[0].device
    meta, scal = _meta_table(args, columns, device, cache)
    block_sums, tensor_scales = _norm_scratch(args, norm_sums, first_block, device)
    rank1 = _rank1_table(args, rank1_layouts(args), device)
    if stats_only and rank1 is None:
        return
    factored, _means = _factored_table(args, device)  # _means: the table's scratch, alive until the call returns
    rounding = _rounding_table(args.rounding, device)
    launch(_STEP, device)(
        args.rule,
        args.hyper,
        args.flags,
        args.norm_mode,
        n_states,
        args.block_size,
        args.state_bits,
        args.map1.data_ptr(),
        args.map2.data_ptr(),
        args.map3.data_ptr(),
        meta.data_ptr(),
        scal.data_ptr(),
        args.grad_scales.data_ptr() if args.grad_scales is not None else 0,
        len(args.params),
        first_block,
        norm_sums.data_ptr() if norm_sums is not None else 0,
        args.update_scales.data_ptr() if args.update_scales is not None else 0,
        block_sums.data_ptr() if block_sums is not None else 0,
        tensor_scales.data_ptr() if tensor_scales is not None else 0,
        rank1.data_ptr() if rank1 is not None else 0,
        stats_only,
        factored.data_ptr() if factored is not None and not stats_only else 0,
        rounding.data_ptr() if rounding is not None else 0,
    )


def _step(*args: Any, **kwargs: Any) -> None:
    """One fused optimizer step over the tensors of :class:`StepArgs`, updating params and states."""
    _call(StepArgs(*args, **kwargs), None)


_step.__signature__ = _common.op_signature(StepArgs)  # type: ignore[attr-defined]
optimizer_step_ = torch.library.custom_op("lowbit::optimizer_step_", _step, mutates_args=_MUTATED)


@optimizer_step_.register_fake
def _(*args: Any, **kwargs: Any) -> None:
    return None


def optimizer_step_eager(args: StepArgs, widths: Optional[list[int]] = None, cache: Optional[MetaCache] = None) -> None:
    """``lowbit::optimizer_step_`` without the dispatcher, for eager optimizer steps over many tensors.

    The custom op's per-tensor bookkeeping (alias checks, list conversions) costs about 15 us per
    tensor, as much as stepping 100k parameters; outside tracing the optimizers call this instead. It
    bumps the version counters of the tensors it writes, as the op does, so autograd still sees the
    in-place update. ``widths``: what ``check_optimizer_step(args)`` returned for these very arguments, when
    the caller checked them itself (the per-tensor checks are a third of the step's Python time on a
    387-tensor model); None checks them here. ``cache``: the :class:`MetaCache` of a call prepared once and
    stepped many times.
    """
    _call(args, None, widths, cache=cache)
    torch.autograd.graph.increment_version(args.written())


def _norms(*args: Any, **kwargs: Any) -> Tensor:
    """The norm pre-pass of ``lowbit::optimizer_step_`` alone: for each tensor, the sums of p^2 and of u^2
    (u the step the rule would subtract; with ``norm_mode`` 3, the gradient as given, and no states are
    read), as a float64 tensor of shape (count, 2); nothing is updated.

    For tensors sharded over ranks (FSDP2), the caller all-reduces these sums and passes the resulting
    scales to the step as ``update_scales`` (which this pre-pass does not take).
    """
    call = StepArgs(*args, **kwargs)
    _common.check(call.update_scales is None, "optimizer_norms computes the update scales; update_scales must be None")
    return optimizer_norms_eager(call)


def optimizer_norms_eager(args: StepArgs) -> Tensor:
    """``lowbit::optimizer_norms`` without the dispatcher (see :func:`optimizer_step_eager`)."""
    _common.check(
        args.norm_mode in (1, 2, 3),
        f"norm_mode must be 1 (trust ratio), 2 (max_unorm) or 3 (the gradient's) for norms, got {args.norm_mode}",
    )
    device = args.params[0].device if args.params else torch.device("cpu")
    sums = torch.zeros(len(args.params), 2, dtype=torch.float64, device=device)
    _call(args, sums)
    return sums


_norms.__signature__ = _common.op_signature(StepArgs).replace(return_annotation=Tensor)  # type: ignore[attr-defined]
optimizer_norms = torch.library.custom_op("lowbit::optimizer_norms", _norms, mutates_args=())


@optimizer_norms.register_fake
def _(*args: Any, **kwargs: Any) -> Tensor:
    call = StepArgs(*args, **kwargs)
    return call.map1.new_empty(len(call.params), 2, dtype=torch.float64)


def _rank1_statistics(*args: Any, **kwargs: Any) -> None:
    """The statistics pass of the rank-1 normalised second moments of a step (include/lowbit/rank1.h): for each
    tensor that ``rank1`` names, raises each entry of ``new_axis_max`` (zeros from the caller) to the axis
    maxima of the stored second moments the step with the same arguments will compute (indices that a shard
    does not reach keep their value); nothing else is written.

    For shards of one tensor (FSDP2) the caller takes the elementwise MAX of the shards' results (an
    all-reduce) before the step: the maxima of the whole tensor, bit for bit."""
    call = StepArgs(*args, **kwargs)
    _common.check(call.rank1 is not None, "rank1_statistics_ needs rank1")
    _call(call, None, stats_only=True)


_rank1_statistics.__signature__ = _common.op_signature(StepArgs)  # type: ignore[attr-defined]
rank1_statistics_ = torch.library.custom_op(
    "lowbit::rank1_statistics_", _rank1_statistics, mutates_args=("new_axis_max",)
)


@rank1_statistics_.register_fake
def _(*args: Any, **kwargs: Any) -> None:
    return None


def rank1_statistics_eager(args: StepArgs, widths: Optional[list[int]] = None) -> None:
    """``lowbit::rank1_statistics_`` without the dispatcher, as :func:`optimizer_step_eager` is the step's."""
    _call(args, None, widths, stats_only=True)
    if args.new_axis_max is not None:
        torch.autograd.graph.increment_version([args.new_axis_max])
