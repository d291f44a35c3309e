"""The low-precision parameter: k-bit group-wise codes, a quantized gradient accumulator, and the
empty handle that stands for it in ``model.parameters()`` (lpmm.txt sections 3 and 5.1).

See :mod:`lowbit.lpmm` for how converted models train and shard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree

from lowbit import _ops
from lowbit._checks import check_bits, check_group_size, check_rounding
from lowbit.lpmm.handle import Handle, Materialize
from lowbit.lpmm.saved import RecomputeSaved
from lowbit.lpmm.sharding import Shards, as_rows, in_layout, packed

__all__ = ["LowPrecisionParameter", "any_alive", "draw_seed"]


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A seed for the counter-based rounding draws, taken from ``generator`` (torch's default if None)."""
    return int(torch.randint(0, 2**62, (), generator=generator).item())


# How many storages are alive, so that checks that only matter once a model is converted cost nothing
# before. A count, not a WeakSet of them: torch.compile traces the global optimizer step pre-hook that reads
# it, and guards on a WeakSet's members, which fails when one dies while a graph is being built.
_LIVE = [0]


def _one_less() -> None:
    _LIVE[0] -= 1


def any_alive() -> bool:
    """Whether any :class:`LowPrecisionParameter` exists in this process."""
    return _LIVE[0] > 0


class LowPrecisionParameter(nn.Module):
    """One parameter stored as bit-packed k-bit linear codes with one fp32 absmax per group.

    Buffers: ``codes`` (bit-packed uint8) and ``absmax`` (fp32, one per group): the value, in the state
    dict. Attributes ``grad_codes`` and
    ``grad_absmax``: the gradient accumulator (not saved). ``handle`` is an empty ``nn.Parameter`` that
    stands for this tensor in ``model.parameters()`` and optimizer param groups.

    Under FSDP2 (``fully_shard`` of a module holding it) ``codes`` becomes a DTensor of ``[groups,
    group_size * bits / 8]`` rows (the last group zero-padded) and ``absmax`` one of ``[groups]``, both
    sharded on dim 0 over the mesh; the accumulator holds this rank's groups only (see :mod:`lowbit.lpmm`).

    Args:
        value: initial value (any float tensor; its dtype becomes the compute dtype).
        bits: bits per stored element, 4..16.
        grad_bits: bits per accumulator element, 4..16.
        group_size: elements per quantization group (a power of two, 64..4096).
        rounding: ``"stochastic"`` (unbiased, lpmm.txt section 3.3) or ``"nearest"`` for accumulation
            and updates; the initial value is always rounded to nearest.
        requires_grad: whether backward accumulates gradients for it.
        generator: source of rounding seeds (torch's default generator if None).
    """

    # The buffers, registered in __init__ (nn.Module's attribute lookup alone types them Tensor | Module).
    codes: Tensor
    absmax: Tensor

    def __init__(
        self,
        value: Tensor,
        *,
        bits: int = 12,
        grad_bits: int = 8,
        group_size: int = 2048,
        rounding: str = "stochastic",
        requires_grad: bool = True,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        if not isinstance(value, Tensor) or value.dtype not in _ops.FLOAT_DTYPES:
            got = value.dtype if isinstance(value, Tensor) else type(value).__name__
            raise TypeError(f"lowbit.lpmm: value must be a float32, float16 or bfloat16 tensor, got {got}")
        _LIVE[0] += 1
        weakref.finalize(self, _one_less)
        if isinstance(value, DTensor):
            raise TypeError("lowbit.lpmm: value is a DTensor; convert the model before fully_shard")
        self.bits = check_bits("bits", bits)
        self.grad_bits = check_bits("grad_bits", grad_bits)
        self.group_size = check_group_size(group_size)
        self.rounding = check_rounding(rounding)
        self.shape = torch.Size(value.shape)
        self.dtype = value.dtype
        self.generator = generator
        self.shards: Optional[Shards] = None
        # Set by gradient release of a sharded parameter (lowbit.optim.step_in_backward): an empty leaf that
        # each use's backward feeds, so that its post-accumulate-grad hook steps the parameter.
        self.release_leaf: Optional[Tensor] = None
        # Bumped whenever the value changes; a backward pass refuses values saved before a change.
        self.version = 0
        self.has_grad = False
        n = value.numel()
        codes, absmax = self.encode(value)
        self.register_buffer("codes", codes)
        self.register_buffer("absmax", absmax)
        # Plain attributes, not buffers: wrappers that broadcast buffers (DDP, at every forward) must not
        # overwrite a rank's partly accumulated gradient.
        self.grad_codes = torch.zeros(_ops.packed_bytes(n, grad_bits), dtype=torch.uint8, device=value.device)
        self.grad_absmax = torch.zeros(_ops.num_blocks(n, group_size), dtype=torch.float32, device=value.device)
        self.handle = Handle(torch.empty(0, dtype=value.dtype, device=value.device), requires_grad=requires_grad)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # FSDP2 swaps the handle for new Parameter objects (sharded DTensor, gathered tensor) through
        # setattr when a module overrides it: tag each with its storage, and shard the storage the first
        # time the handle arrives sharded (fully_shard).
        if name == "handle" and isinstance(value, Tensor):
            value._lpmm = self  # type: ignore[attr-defined]
            if isinstance(value, DTensor) and self.shards is None:
                self._shard(value.device_mesh)

    # -- values -----------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        """Number of quantization groups of the whole tensor."""
        return _ops.num_blocks(self.numel(), self.group_size)

    def _row_bytes(self, bits: int) -> int:
        return self.group_size * bits // 8

    def encode(self, value: Tensor) -> tuple[Tensor, Tensor]:
        """Whole (flat) codes and absmaxes of ``value``, rounded to nearest."""
        flat = value.detach().reshape(-1).contiguous()
        return _ops.quantize_linear(flat, self.bits, self.group_size, False, 0, 0)

    def numel(self) -> int:
        """Number of elements of the stored tensor (the whole tensor, also when sharded)."""
        return self.shape.numel()

    @property
    def local_numel(self) -> int:
        """Number of elements whose storage this process holds (all of them unless sharded)."""
        return self.numel() if self.shards is None else self.shards.numel

    @property
    def device(self) -> torch.device:
        """Device of the stored codes."""
        return _ops.local(self.codes).device

    def local_view(self, codes: Tensor, bits: int) -> Tensor:
        """This process's part of ``codes`` (a ``bits``-bit tensor in this parameter's layout, such as an
        optimizer state from :meth:`new_state`) as a flat view of its bit-packed bytes."""
        return packed(codes, self.local_numel, bits)

    def local_codes(self) -> Tensor:
        """The bit-packed codes of this process's elements: a flat view of (the local shard of) ``codes``."""
        return self.local_view(self.codes, self.bits)

    def in_layout(self, value: Tensor, like: Tensor, bits: int) -> Tensor:
        """``value`` (codes of a ``bits``-bit tensor in this parameter's groups, or their absmaxes) in the
        layout of ``like``: whole (flat codes, ``[groups]`` absmaxes) or sharded (a DTensor of ``[groups,
        group_size * bits / 8]`` rows or ``[groups]`` split on dim 0). ``value`` may come in either layout:
        a sharded DTensor (gathered from the ranks: every rank must call it), its gathered rows (a full
        state dict of an FSDP2 model), or flat codes. A value that fits neither is returned as is, for
        ``load_state_dict`` to report."""
        rows = (self.num_groups, self._row_bytes(bits))
        return in_layout(value, like, rows, _ops.packed_bytes(self.numel(), bits))

    def local_absmax(self) -> Tensor:
        """The group absmaxes of this process's groups (the local shard of ``absmax``)."""
        return _ops.local(self.absmax)

    def new_state(self, bits: int) -> tuple[Tensor, Tensor]:
        """Zeroed codes and absmaxes of a ``bits``-bit tensor in this parameter's layout (optimizer state):
        flat, or sharded ``[groups, group_size * bits / 8]`` rows and ``[groups]`` like ``codes``."""
        if self.shards is None:
            codes = torch.zeros(_ops.packed_bytes(self.numel(), bits), dtype=torch.uint8, device=self.device)
            return codes, torch.zeros(self.num_groups, dtype=torch.float32, device=self.device)
        return self.shards.zeros((self.num_groups, self._row_bytes(bits)), self.device)

    def _whole_storage(self) -> tuple[Tensor, Tensor]:
        """Flat codes and absmaxes of the whole tensor; sharded, gathered from all ranks (one collective)."""
        if self.shards is None:
            return self.codes, self.absmax
        rows, absmax = self.shards.gather(_ops.local(self.codes), _ops.local(self.absmax), self.num_groups)
        return packed(rows, self.numel(), self.bits), absmax

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """A new full-precision tensor (original shape) holding the stored value.

        Sharded, the codes are gathered from all ranks: every rank must call it.

        Args:
            dtype: float32, float16 or bfloat16 (default: the compute dtype).
        """
        dtype = self.dtype if dtype is None else dtype
        if dtype not in _ops.FLOAT_DTYPES:
            raise TypeError(f"lowbit.lpmm: dtype must be float32, float16 or bfloat16, got {dtype}")
        codes, absmax = self._whole_storage()
        flat = _ops.dequantize_linear(codes, absmax, self.bits, self.group_size, self.numel(), dtype)
        return flat.view(self.shape)

    def materialize(self) -> Tensor:
        """The value as a temporary tensor whose gradient (if any) flows into the accumulator.

        Its dtype is the handle's: the compute dtype, or under FSDP2 with a ``MixedPrecisionPolicy`` the
        policy's ``param_dtype`` (FSDP2 casts the handle it gathers for forward)."""
        if torch.is_grad_enabled() and self.handle.requires_grad:
            return Materialize.apply(self.handle, self, self.release_leaf)
        return self.dequantize(self.handle.dtype)

    # -- sharding (FSDP2) ---------------------------------------------------------------------------

    def _shard(self, mesh: DeviceMesh) -> None:
        """Keep only this rank's groups of the storage and accumulator (called when FSDP2 shards the handle)."""
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"lowbit.lpmm: low-precision parameters shard over a 1-D device mesh, got a {mesh.ndim}-D mesh "
                "(HSDP is not supported)"
            )
        shards = Shards.of(mesh, self.num_groups, self.group_size, self.numel())
        pending = self.grad  # None exactly when not self.has_grad
        if pending is not None:  # gradients accumulated before sharding: the ranks' mean, as backward would give
            pending = pending.float()
            dist.all_reduce(pending, group=shards.group)
            pending.div_(shards.world)
        self.shards = shards
        codes = as_rows(self.codes, self.num_groups, self._row_bytes(self.bits))
        for name, whole in (("codes", codes), ("absmax", self.absmax)):
            self._buffers[name] = shards.split(whole)
        # Emptied and of this rank's groups only; also after free_grad_, whose empty accumulator has no part.
        self.grad_codes, self.grad_absmax = self._new_accumulator()
        if pending is not None:
            part = pending.reshape(-1)[shards.start : shards.start + shards.numel]
            self._accumulate_local(part, draw_seed(self.generator))

    # -- gradient accumulator -------------------------------------------------------------------

    def _new_accumulator(self) -> tuple[Tensor, Tensor]:
        """An empty accumulator (zero absmaxes) for this process's elements."""
        n = self.local_numel
        groups = _ops.num_blocks(n, self.group_size) if self.shards is None else self.shards.count
        codes = torch.zeros(_ops.packed_bytes(n, self.grad_bits), dtype=torch.uint8, device=self.device)
        return codes, torch.zeros(groups, dtype=torch.float32, device=self.device)

    @property
    def accumulator_allocated(self) -> bool:
        """Whether the accumulator holds storage (False after :meth:`free_grad_` until the next gradient)."""
        return self.grad_absmax.numel() > 0 or self.local_numel == 0

    def free_grad_(self) -> None:
        """Discard the accumulated gradient and free the accumulator's storage, as setting a ``.grad`` to
        None frees it (gradient release: the accumulator of a parameter then exists only from its first
        gradient in a backward to its step). The next accumulation allocates it again, empty."""
        self.grad_codes = self.grad_codes.new_empty(0)
        self.grad_absmax = self.grad_absmax.new_empty(0)
        self.has_grad = False

    def _accumulate_local(self, grad: Tensor, seed: int) -> None:
        if not self.accumulator_allocated:
            self.grad_codes, self.grad_absmax = self._new_accumulator()
        _ops.lpmm_accumulate_(
            grad.contiguous(),
            self.grad_codes,
            self.grad_absmax,
            self.grad_bits,
            self.group_size,
            self.rounding == "stochastic",
            seed,
        )
        self.has_grad = True

    @torch.no_grad()
    def accumulate_(self, grad: Tensor, seed: Optional[int] = None) -> None:
        """``g <- Q(g + grad)`` (lpmm.txt Algorithm 1, line 5) with this tensor's rounding; the draws use
        ``seed`` (default: one from this parameter's generator).

        ``grad`` has the whole tensor's shape. Sharded, every rank must call it: the ranks' gradients are
        averaged and each rank accumulates its own groups."""
        if tuple(grad.shape) != tuple(self.shape):
            raise ValueError(f"lowbit.lpmm: grad has shape {tuple(grad.shape)}, expected {tuple(self.shape)}")
        part = grad.reshape(-1) if self.shards is None else self.shards.reduce_scatter_mean(grad, self.group_size)
        self._accumulate_local(part, draw_seed(self.generator) if seed is None else seed)

    @property
    def grad(self) -> Optional[Tensor]:
        """The accumulated gradient dequantized to fp32, or None when nothing was accumulated.

        Sharded: this rank's elements only, flat (elements ``shards.start`` onwards of the flattened tensor)."""
        if not self.has_grad:
            return None
        n = self.local_numel
        flat = _ops.dequantize_linear(
            self.grad_codes, self.grad_absmax, self.grad_bits, self.group_size, n, torch.float32
        )
        return flat if self.shards is not None else flat.view(self.shape)

    def zero_grad_(self, set_to_none: bool = True) -> None:
        """Empty the accumulator (an absmax of 0 reads as zeros). ``set_to_none=False`` keeps an accumulated
        gradient as zeros, which the next step applies, as torch steps a zeroed ``.grad``."""
        self.grad_absmax.zero_()
        if set_to_none:
            self.has_grad = False

    def mark_stepped(self) -> None:
        """Record an optimizer step that rewrote the value from the accumulated gradient and cleared the
        accumulator in the same native call (:class:`lowbit.optim.LPMMOptimizer`): tensors that autograd
        saved from the old value are refused from now on, and no gradient is pending."""
        self.version += 1
        self.has_grad = False

    def scale_grad_(self, factor: Tensor | float) -> None:
        """Multiply the accumulated gradient by the scalar ``factor``: each group's absmax is multiplied (in
        fp32, rounded to nearest) and the codes stay, so no element is re-rounded."""
        if isinstance(factor, Tensor):
            factor = factor.to(device=self.grad_absmax.device, dtype=torch.float32)
        self.grad_absmax.mul_(factor)

    def clamp_grad_(self, clip_value: float) -> None:
        """Clamp the accumulated gradient to ``[-clip_value, clip_value]`` and re-encode it against the
        clamped groups' absmaxes with this tensor's rounding (stochastic: unbiased, within one step)."""
        grad = self.grad
        if grad is None:
            return
        self.zero_grad_()
        self._accumulate_local(grad.reshape(-1).clamp_(-clip_value, clip_value), draw_seed(self.generator))

    # -- nn.Module plumbing -----------------------------------------------------------------------

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> LowPrecisionParameter:
        # .to()/.cuda()/.half() move the codes and change the compute dtype; codes and absmaxes keep
        # their own dtypes (uint8, fp32), which a generic _apply would cast.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        if probe.is_floating_point():
            if probe.dtype not in _ops.FLOAT_DTYPES:
                raise TypeError(f"lowbit.lpmm: compute dtype must be float32, float16 or bfloat16, got {probe.dtype}")
            self.dtype = probe.dtype
        # From the meta device (converted under torch.device("meta"), then to_empty) the storage stays
        # uninitialised, as to_empty leaves ordinary parameters (load a state dict next), and the gradient
        # accumulator starts empty (zero absmaxes).
        for name in ("codes", "absmax"):
            t = cast(Tensor, self._buffers[name])  # registered in __init__
            self._buffers[name] = torch.empty_like(t, device=probe.device) if t.is_meta else t.to(probe.device)
        if self.grad_codes.is_meta:
            self.grad_codes = torch.zeros_like(self.grad_codes, device=probe.device)
            self.grad_absmax = torch.zeros_like(self.grad_absmax, device=probe.device)
            self.has_grad = False
        self.grad_codes = self.grad_codes.to(probe.device)
        self.grad_absmax = self.grad_absmax.to(probe.device)
        handle = cast(nn.Parameter, self._parameters["handle"])  # registered in __init__
        if handle.is_meta:  # a new handle, as torch's to_empty gives a meta parameter
            self.handle = Handle(torch.empty(0, dtype=self.dtype, device=probe.device), handle.requires_grad)
        elif not isinstance(handle, DTensor):  # FSDP2 manages a sharded handle
            handle.data = torch.empty(0, dtype=self.dtype, device=probe.device)
        return self

    def get_extra_state(self) -> dict[str, Any]:
        """The storage format, checked when a state dict is loaded."""
        return {"shape": list(self.shape), "bits": self.bits, "group_size": self.group_size}

    def set_extra_state(self, state: Any) -> None:
        """Checks that a loaded state dict was saved with this storage format."""
        mine = self.get_extra_state()
        if state != mine:
            raise ValueError(f"lowbit.lpmm: the state dict stores {state} but this parameter is {mine}")

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        for name in ("codes", "absmax"):
            buf = cast(Tensor, self._buffers[name])  # registered in __init__
            destination[prefix + name] = buf if keep_vars else buf.detach()
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        stored = state_dict.get(prefix + "_extra_state")
        if stored is not None and stored != self.get_extra_state():
            error_msgs.append(
                f"lowbit.lpmm: {prefix[:-1]} was saved as {stored} but this parameter is {self.get_extra_state()}"
            )
            return
        # Whole or sharded storage loads into either layout (the groups are the same).
        for name in ("codes", "absmax"):
            value = state_dict.get(prefix + name)
            if isinstance(value, Tensor):
                state_dict[prefix + name] = self.in_layout(value, cast(Tensor, self._buffers[name]), self.bits)
        # The handle holds no data and is not saved.
        state_dict.setdefault(prefix + "handle", self.handle.detach())
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self.version += 1
        self.zero_grad_()

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        """Torch functions given a low-precision parameter (outside its module's forward) see its value."""
        temps: list[tuple[LowPrecisionParameter, Tensor]] = []

        def value(x: Any) -> Any:
            if isinstance(x, LowPrecisionParameter):
                t = x.materialize()
                temps.append((x, t))
                return t
            return x

        args, kwargs = _pytree.tree_map(value, (args, kwargs or {}))
        with RecomputeSaved(temps):
            return func(*args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"shape={tuple(self.shape)}, bits={self.bits}, grad_bits={self.grad_bits}, "
            f"group_size={self.group_size}, rounding={self.rounding!r}, dtype={self.dtype}"
        )
