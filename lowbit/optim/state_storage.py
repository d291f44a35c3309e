"""How optimizer states are stored: the quantization maps, the second-moment format a state dict records,
DTensor wrapping of FSDP2 states, and the dtypes and block sizes of loaded states."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lowbit import _ops
from lowbit._ops.optim import SECOND_MOMENT_SLOTS
from lowbit.functional import QuantState, create_dynamic_map, dequantize_blockwise, quantize_blockwise
from lowbit.optim import factored, rank1

_MAPS: dict[tuple[bool, int, torch.device], Tensor] = {}


# The form of stored second moments, kept in every param group so that a state dict says which it holds:
# 1: v on the unsigned dynamic map (lowbit 0.1.0 before the zero-point fix); 2: sqrt(v) on the zero-free
# map (include/lowbit/state_form.h). Loading format 1 re-encodes the second moments.
STATE_FORMAT = 2


def four_bit_unsigned_map() -> Tensor:
    """The 4-bit map of second-moment roots: linear without zero, (i + 1) / 16 for i = 0..15 (Li, Chen,
    Zhu 2023, section 4.2, whose v-form this is; lowbit stores sqrt(v) on it, include/lowbit/state_form.h)."""
    return torch.arange(1, 17, dtype=torch.float32) / 16


def state_map(signed: bool, device: torch.device, bits: int = 8) -> Tensor:
    """The dynamic map of optimizer states, cached per device: signed for first moments; unsigned
    without its zero for second moments, which are stored as their square roots
    (include/lowbit/state_form.h), so that no decoded second moment of a non-zero block is 0."""
    key = (signed, bits, device)
    if key not in _MAPS:
        code = create_dynamic_map(signed=signed, total_bits=bits)
        if not signed:
            code[0] = code[1]  # DE-0 (Li, Chen, Zhu 2023, section 4.1): the smallest code is a floor
        _MAPS[key] = code.to(device)
    return _MAPS[key]


def optimizer_state_map(signed: bool, device: torch.device, width: int) -> Tensor:
    """The map of the block-wise optimizers' states of ``width`` bits, cached per device: :func:`state_map`,
    except for 4-bit second-moment roots, which use :func:`four_bit_unsigned_map` (zero-free too). The
    signed 4-bit map is the dynamic one, symmetric with both +-1, so that a block's absmax element decodes
    exactly whatever its sign; Li, Chen, Zhu 2023's map stops at -0.8875 and decodes a negative absmax 11%
    short (benchmarks/bench_state_forms.py --m-map: the two train alike). The LPMM optimizers keep
    :func:`state_map` at every width."""
    if width != 4 or signed:
        return state_map(signed, device, width)
    key = (signed, -4, device)
    if key not in _MAPS:
        _MAPS[key] = four_bit_unsigned_map().to(device)
    return _MAPS[key]


def quantize_state(x: Tensor, code: Tensor, width: int, block_size: int) -> tuple[Tensor, Tensor]:
    """(codes, absmax) of ``x`` quantized block-wise on the ``width``-bit map ``code`` with nearest rounding,
    as a state is stored. On the meta device (a meta-device step) the op's fake kernel gives their shapes and
    dtypes: the public :func:`~lowbit.functional.quantize_blockwise` refuses meta input."""
    if x.is_meta:
        packed, absmax = _ops.quantize_blockwise(x, code, width, block_size, False, 0, 0)
        return (packed.view(x.shape) if width == 8 else packed), absmax
    codes, qs = quantize_blockwise(x, code=code, blocksize=block_size)
    return codes, qs.absmax


def stored_width(codes: Tensor, numel: int) -> int:
    """The width of a stored state of ``numel`` elements: 32 (fp32 values), 8 (one uint8 code per element)
    or 4 (two codes per byte, ``ceil(numel / 2)`` bytes). 4-bit states exist only for ``numel >= 2``
    (:meth:`StoredStates._state_width`), so the two code layouts never have the same size."""
    if codes.dtype != torch.uint8:
        return 32
    return 8 if codes.numel() == numel else 4


def holds(codes: Tensor, numel: int) -> bool:
    """Whether ``codes`` is a state of ``numel`` elements in one of the stored layouts."""
    if codes.dtype != torch.uint8:
        return codes.numel() == numel
    return codes.numel() == numel or (numel >= 2 and codes.numel() == (numel + 1) // 2)


def upgrade_second_moment(codes: Tensor, absmax: Tensor, bits: int, block: int, numel: int) -> tuple[Tensor, Tensor]:
    """Codes and absmaxes of a format-1 second moment (flat, ``numel`` elements of ``bits``-bit codes in
    blocks of ``block``) re-encoded in the current format, rounded to nearest."""
    old_map = create_dynamic_map(signed=False, total_bits=bits).to(codes.device)
    v = _ops.dequantize_blockwise(codes.reshape(-1), absmax, old_map, bits, block, numel, torch.float32)
    new_codes, new_absmax = _ops.quantize_blockwise(
        v.sqrt(), state_map(False, codes.device, bits), bits, block, False, 0, 0
    )
    return new_codes.view(codes.shape), new_absmax


def check_state_format(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Refuse a loaded param group whose state format (1 when the state dict predates the marker) comes
    from a newer lowbit."""
    form = group.get("state_format", 1)
    if form not in (1, STATE_FORMAT):
        raise ValueError(
            f"lowbit: this {type(optimizer).__name__} state dict has state_format={form!r}, written by a newer "
            f"lowbit; this one reads formats 1 and {STATE_FORMAT}"
        )


def like_param(p: Tensor, value: Tensor) -> Tensor:
    """``value``, a tensor shaped like the local shard of ``p``, as a DTensor with ``p``'s placements when
    ``p`` is one (the optimizer states of FSDP2 parameters), else unchanged."""
    if not isinstance(p, DTensor):
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def stored_block_size(numel: int, blocks: int) -> int:
    """The block size of a quantized state of ``numel`` elements with ``blocks`` absmax values."""
    for shift in range(6, 13):
        if _ops.num_blocks(numel, 1 << shift) == blocks:
            return 1 << shift
    raise ValueError(f"lowbit: a quantized state of {numel} elements cannot have {blocks} blocks")


def restore_state_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Undo torch.optim's cast of loaded floating-point state to the parameter dtype.

    lowbit states keep their own dtypes (fp32 states and absmaxes, uint8 codes) whatever the
    parameter's, so after ``torch.optim.Optimizer.load_state_dict`` they are restored from the saved
    tensors, on the parameter's device; ``step`` becomes an fp32 CPU tensor. All are copies: torch.optim
    keeps the loaded ``step`` tensor itself, which a live source optimizer would go on incrementing.
    """
    ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, p in zip(ids, params, strict=True):
        for key, value in state_dict["state"].get(pid, {}).items():
            if key == "step":
                optimizer.state[p][key] = torch.as_tensor(value).detach().to("cpu", torch.float32, copy=True)
            elif isinstance(value, Tensor):
                optimizer.state[p][key] = value.detach().to(p.device, copy=True)


class StoredStates:
    """The states of an optimizer's parameters as they are stored: 8-bit block-wise codes with absmaxes
    or fp32 tensors, FSDP2 states as DTensors, and their conversion to and from fp32 values in
    torch.optim's layout. :class:`~lowbit.optim.LowbitOptimizer` mixes it in and provides the state names
    and maps (``_state_names``, ``_state_signed``), each group's slots (``_slots``), initial values
    (``_init_value``) and per-parameter options (``_config``)."""

    _state_names: ClassVar[tuple[str, ...]]
    _state_signed: ClassVar[tuple[bool, ...]]
    param_groups: list[dict[str, Any]]
    state: defaultdict[Tensor, Any]
    _slots: Callable[[dict[str, Any]], tuple[int, ...]]
    _init_value: Callable[[int, dict[str, Any]], float]
    _config: Callable[[dict[str, Any], Tensor], dict[str, Any]]

    def _state_width(self, config: dict[str, Any], p: Tensor) -> int:
        """The width ``config`` asks for the states of ``p``: 8 or 4 from ``optim_bits`` at or above
        ``min_8bit_size`` / ``min_4bit_size`` elements (of the whole parameter under FSDP2), otherwise 32.
        4-bit states also need two elements in the local shard: one code would not fill its byte, and
        ``stored_width`` tells the layouts apart by size."""
        bits = config["optim_bits"]
        if bits == 8 and p.numel() >= config["min_8bit_size"]:
            return 8
        if bits == 4 and p.numel() >= config["min_4bit_size"] and _ops.local(p).numel() >= 2:
            return 4
        return 32

    def _rank1_state(self, config: dict[str, Any], p: Tensor, width: int) -> int:
        """The state k of ``p`` that ``config`` stores normalised rank-1 (lowbit/optim/rank1.py), or -1: the
        second moment of a 4-bit layout, with ``rank1_normalization`` on, for 2 to 8 axes."""
        if width != 4 or not config.get("rank1_normalization", False) or rank1.rank1_layout(p) is None:
            return -1
        slots = self._slots(config)
        rule = self._rule_code(config)  # type: ignore[attr-defined]
        slot = SECOND_MOMENT_SLOTS[rule]
        return slots[slot] if 0 <= slot < len(slots) else -1

    def _factored_state(self, config: dict[str, Any], p: Tensor, width: int) -> int:
        """The state k of ``p`` that ``config`` stores factorized (lowbit/optim/factored.py), or -1: the second
        moment of a 4-bit layout, with ``factored`` on, for 2 or more axes (under FSDP2: sharded on the first axis,
        each rank's shard of 2 or more elements; :func:`~lowbit.optim.factored.factored_applies`)."""
        if width != 4 or not config.get("factored", False) or not factored.factored_applies(p):
            return -1
        slots = self._slots(config)
        slot = SECOND_MOMENT_SLOTS[self._rule_code(config)]  # type: ignore[attr-defined]
        return slots[slot] if 0 <= slot < len(slots) else -1

    def _pack(self, k: int, value: Tensor, config: dict[str, Any], width: int) -> tuple[Tensor, Tensor]:
        """(state, absmax) of state k holding ``value`` in the layout of ``width`` bits (a second moment,
        on the unsigned map, as its square root: include/lowbit/state_form.h)."""
        if width != 32:
            signed = self._state_signed[k]
            x = value if signed else value.sqrt()
            return quantize_state(x, optimizer_state_map(signed, value.device, width), width, config["block_size"])
        return value, torch.empty(0, dtype=torch.float32, device=value.device)

    def _unpack(self, k: int, p: Tensor, state: dict[str, Any]) -> Tensor:
        """The fp32 values of state k of ``p``, whatever layout they are stored in (a factorized second
        moment gives its reconstruction v_hat)."""
        if f"row{k + 1}" in state:
            return factored.reconstruct(state[f"row{k + 1}"], state[f"col{k + 1}"], p)
        s = _ops.local(state[f"state{k + 1}"])
        shape = _ops.local(p).shape
        width = stored_width(s, shape.numel())
        if width == 32:
            return s
        if f"axis_max{k + 1}" in state:
            layout = rank1.rank1_layout(p)
            if layout is None:
                raise ValueError(f"axis_max{k + 1}: a parameter of shape {tuple(p.shape)} has no rank-1 statistics")
            code = optimizer_state_map(False, s.device, 4)
            w = rank1.decode(s, state[f"axis_max{k + 1}"], *layout, code, shape.numel())
            return w.square().reshape(shape)
        absmax = state[f"absmax{k + 1}"]
        signed = self._state_signed[k]
        qs = QuantState(
            absmax,
            optimizer_state_map(signed, s.device, width),
            stored_block_size(shape.numel(), absmax.numel()),
            shape,
            torch.float32,
            width,
        )
        value = dequantize_blockwise(s, qs)
        return value if signed else value.square()

    def _init_state(self, p: Tensor, config: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        self._relayout(p, state, config)
        return state

    def _layout_matches(self, p: Tensor, state: dict[str, Any], config: dict[str, Any]) -> bool:
        width = self._state_width(config, p)
        numel = _ops.local(p).numel()
        blocks = _ops.num_blocks(numel, config["block_size"])
        ranked = self._rank1_state(config, p, width)
        split = self._factored_state(config, p, width)
        for k in self._slots(config):
            if k == split:
                row, col = state.get(f"row{k + 1}"), state.get(f"col{k + 1}")
                if row is None or col is None or f"state{k + 1}" in state:
                    return False
                if not self._factor_shapes_match(p, row, col):
                    return False
                continue
            if f"row{k + 1}" in state:
                return False
            s = state.get(f"state{k + 1}")
            if s is None or stored_width(_ops.local(s), numel) != width:
                return False
            if k == ranked:
                if f"axis_max{k + 1}" not in state or state[f"axis_max{k + 1}"].numel() != sum(p.shape):
                    return False
            elif width != 32 and (f"absmax{k + 1}" not in state or state[f"absmax{k + 1}"].numel() != blocks):
                return False
        return True

    def _relayout(self, p: Tensor, state: dict[str, Any], config: dict[str, Any]) -> None:
        """Store the states of ``p`` as ``config`` asks (8-bit or fp32, block size), keeping their values.

        This is how a changed ``optim_bits`` or ``block_size`` (param group or override) is honoured
        for a parameter that already has state; missing states start at their initial value.
        """
        values = {}
        # Factors that stay factors (a loaded FSDP2 state) are kept as they are: a round trip through v_hat would
        # rescale them (the rows by mean(col) / mean(row)).
        split = self._factored_state(config, p, self._state_width(config, p))
        kept: dict[str, Tensor] = {}
        for k in self._slots(config):
            row, col = state.get(f"row{k + 1}"), state.get(f"col{k + 1}")
            if k == split and row is not None and col is not None and self._factor_shapes_match(p, row, col):
                kept[f"row{k + 1}"] = factored.local_factor(p, row, f"row{k + 1}").clone()
                kept[f"col{k + 1}"] = factored.local_factor(p, col, f"col{k + 1}").clone()
            elif row is not None:
                values[k] = self._unpack(k, p, state).clone()
            elif f"state{k + 1}" in state:
                held, numel = _ops.local(state[f"state{k + 1}"]), _ops.local(p).numel()
                if not holds(held, numel):
                    raise ValueError(f"state{k + 1} has {held.numel()} elements, the parameter {numel}")
                values[k] = self._unpack(k, p, state).clone()
            else:
                values[k] = self._initial(k, p, config)
        for k in self._slots(config):
            state.pop(f"absmax{k + 1}", None)
            state.pop(f"axis_max{k + 1}", None)
            state.pop(f"row{k + 1}", None)
            state.pop(f"col{k + 1}", None)
            state.pop(f"state{k + 1}", None)
        state.update(self._store(p, values, config))
        state.update({key: factored.like_factor(p, value, key) for key, value in kept.items()})

    @staticmethod
    def _factor_shapes_match(p: Tensor, row: Tensor, col: Tensor) -> bool:
        """Whether ``row``/``col`` have the (global) shapes of the factors of ``p``."""
        return row.shape == p.shape[:-1] and col.shape == p.shape[:-2] + p.shape[-1:]

    def _initial(self, k: int, p: Tensor, config: dict[str, Any]) -> Tensor:
        """State k of ``p`` before its first step, shaped like the local shard."""
        shard = _ops.local(p)
        return torch.full(shard.shape, self._init_value(k, config), dtype=torch.float32, device=shard.device)

    def _store(self, p: Tensor, values: dict[int, Tensor], config: dict[str, Any]) -> dict[str, Tensor]:
        """``state{k+1}``/``absmax{k+1}`` entries holding ``values[k]`` (fp32, shaped like the local shard
        of ``p``) in the layout ``config`` asks for. In 8-bit layout an element with a non-finite state
        restarts all its states from zero, as the step does (module docstring): one NaN would otherwise
        become its block's scale and spoil the block."""
        width = self._state_width(config, p)  # by the global element count of an FSDP2 parameter
        # Meta tensors (a meta-device step) hold no values to check.
        if width != 32 and values and not _ops.local(p).is_meta:
            bad = ~torch.stack([v.isfinite() for v in values.values()]).all(0)
            if bool(bad.any()):
                values = {k: v.masked_fill(bad, 0.0) for k, v in values.items()}
        out: dict[str, Tensor] = {}
        ranked = self._rank1_state(config, p, width)
        split = self._factored_state(config, p, width)
        for k, value in values.items():
            if k == split:
                row, col = factored.project(value, p)
                out[f"row{k + 1}"] = factored.like_factor(p, row, f"row{k + 1}")
                out[f"col{k + 1}"] = factored.like_factor(p, col, f"col{k + 1}")
                continue
            if k == ranked:
                offset, dims = rank1.rank1_layout(p)  # type: ignore[misc]  # not None: _rank1_state
                w = value.sqrt()
                stats = rank1.max_over_shards(rank1.axis_maxima(w, offset, dims), p)
                out[f"axis_max{k + 1}"] = stats
                out[f"state{k + 1}"] = rank1.encode(w, stats, offset, dims, optimizer_state_map(False, w.device, 4))
                continue
            codes, out[f"absmax{k + 1}"] = self._pack(k, value, config, width)
            # Packed 4-bit codes are not shaped like the parameter: they stay local, as absmaxes do.
            out[f"state{k + 1}"] = codes if width == 4 else like_param(p, codes)
        return out

    def _upgrade_second_moments(self, p: Tensor) -> None:
        state = self.state.get(p, {})
        for k, signed in enumerate(self._state_signed):
            codes = state.get(f"state{k + 1}")
            if signed or codes is None or stored_width(_ops.local(codes), _ops.local(p).numel()) != 8:
                continue  # format 1 had no 4-bit states
            local, absmax = _ops.local(codes), state[f"absmax{k + 1}"]
            block = stored_block_size(local.numel(), absmax.numel())
            new, state[f"absmax{k + 1}"] = upgrade_second_moment(local, absmax, 8, block, local.numel())
            state[f"state{k + 1}"] = like_param(p, new)

    def dequantized_state(self, p: Tensor) -> dict[str, Tensor]:
        """The state of ``p`` in torch.optim's layout and names, dequantized to fp32."""
        state = self.state[p]
        out: dict[str, Tensor] = {"step": state["step"].clone()}
        for k, name in enumerate(self._state_names):
            if f"state{k + 1}" in state or f"row{k + 1}" in state:
                out[name] = like_param(p, self._unpack(k, p, state).clone())
        return out

    def load_dequantized_state(self, p: Tensor, state: dict[str, Tensor]) -> None:
        """Set the state of ``p`` from torch.optim's layout (e.g. ``torch.optim.Adam().state[p]``)."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        config = self._config(group, p)
        # torch.optim.SGD keeps no step count; a momentum buffer means at least one step was taken.
        step = state.get("step", float(any(name in state for name in self._state_names)))
        new: dict[str, Any] = {"step": torch.as_tensor(step, dtype=torch.float32).detach().clone().cpu()}
        shard = _ops.local(p)
        values = {}
        for k in self._slots(config):
            saved = state.get(self._state_names[k])
            if saved is None:  # a state the saving optimizer did not use (amsgrad or centered turned on)
                values[k] = self._initial(k, p, config)
            else:
                values[k] = _ops.local(saved).detach().to(shard.device, torch.float32).reshape(shard.shape).clone()
        new.update(self._store(p, values, config))
        self.state[p] = new
