"""LPMM: training with the whole model memory in low precision (lpmm.txt).

:func:`convert` replaces every parameter of a model with a :class:`LowPrecisionParameter`: k-bit
group-wise absmax codes (linear map, section 5.1) plus a quantized gradient accumulator. A module's
parameters are dequantized into temporary full-precision tensors when its forward starts and dropped
when it ends (section 5.3); tensors that autograd saves for backward are not kept either, they are
dequantized again when backward needs them. Backward adds each gradient into the accumulator with
stochastic rounding, ``g <- Q(g + grad)`` (Algorithm 1, line 5), so no fp32 ``.grad`` persists, and
micro-batching is the usual gradient-accumulation loop. :class:`lowbit.optim.LPMMSGD` and
:class:`lowbit.optim.LPMMAdamW` then update the quantized parameters and momentum in one fused native
call (lines 7-8).

FSDP2: apply ``fully_shard`` after :func:`convert`. Each rank then keeps only its share of every
parameter's quantization groups (codes, absmaxes, accumulator and optimizer state, as DTensors of
``[groups, bytes per group]`` rows split like FSDP2 splits dim 0); forward gathers the codes, backward
reduce-scatters the gradient in fp32 and averages it over the ranks before accumulating, as FSDP2 does
for ordinary parameters. Group boundaries do not depend on the world size, so sharded storage holds the
same codes as one process's and distributed checkpoints reshard exactly. A ``MixedPrecisionPolicy``'s
``param_dtype`` sets the dtype of the values in forward; gradients are reduced in fp32 whatever its
``reduce_dtype``, and on every backward (``set_requires_gradient_sync(False)`` does not defer them).
Every rank must run the same forward and backward (the collectives are issued per parameter, in
autograd order).

Limits: a converted parameter must be read through its module's attribute inside that module's
forward, or passed to torch functions (``F.linear(x, emb.weight)`` works anywhere); modules that keep
their own references to parameters (``nn.RNN``/``nn.LSTM``/``nn.GRU``'s flat weights, parametrized
modules) cannot be converted and raise; FSDP2 meshes must be one-dimensional (no HSDP).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils import _pytree

from lowbit import _ops
from lowbit.functional import ROUNDING_MODES

__all__ = [
    "LowPrecisionParameter",
    "MemoryReport",
    "check_rounding",
    "clip_grad_norm_",
    "clip_grad_value_",
    "convert",
    "draw_seed",
    "export_float",
    "low_precision_parameters",
    "memory_report",
]

MIN_BITS = 4
MAX_BITS = _ops.MAX_LINEAR_BITS


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A seed for the counter-based rounding draws, taken from ``generator`` (torch's default if None)."""
    return int(torch.randint(0, 2**62, (), generator=generator).item())


def _check_bits(name: str, bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"lowbit.lpmm: {name} must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    return bits


def _check_group_size(group_size: object) -> int:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or not (64 <= group_size <= 4096 and group_size & (group_size - 1) == 0)
    ):
        raise ValueError(f"lowbit.lpmm: group_size must be a power of two in 64..4096, got {group_size!r}")
    return group_size


def check_rounding(rounding: object) -> str:
    """``rounding`` if it is 'stochastic' or 'nearest'; raises ValueError otherwise."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"lowbit.lpmm: rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    return str(rounding)


# torch >= 2.13 renames the tensor collectives; older releases only have the first names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: Optional[Tensor]) -> int:
    """Bytes of ``t`` held by this process (a DTensor's local shard)."""
    return 0 if t is None else _ops.local(t).numel() * t.element_size()


def _packed(codes: Tensor, numel: int, bits: int) -> Tensor:
    """The bit-packed codes of ``numel`` elements as a flat view: of whole flat codes, or of the local
    shard of sharded ``[groups, bytes per group]`` rows (groups are whole bytes, so rows concatenate)."""
    return _ops.local(codes).reshape(-1)[: _ops.packed_bytes(numel, bits)]


def _as_rows(packed: Tensor, groups: int, row_bytes: int) -> Tensor:
    """Bit-packed codes as ``[groups, row_bytes]`` rows, the last group zero-padded to a whole row."""
    rows = packed.new_zeros(groups * row_bytes)
    rows[: packed.numel()] = packed
    return rows.view(groups, row_bytes)


def _chunk_rows(groups: int, world: int, rank: int) -> tuple[int, int]:
    """(first, count): the groups that rank ``rank`` of ``world`` holds, FSDP2's / ``torch.chunk``'s dim-0
    split of ``groups`` rows (``ceil(groups / world)`` per rank, the last ranks short or empty)."""
    per_rank = -(-groups // world)
    first = min(rank * per_rank, groups)
    return first, min(per_rank, groups - first)


@dataclass(frozen=True)
class _Shards:
    """This rank's part of a sharded parameter: ``count`` groups (of at most ``per_rank``) holding elements
    ``[start, start + numel)``, over ``group`` (the FSDP2 mesh's process group of ``world`` ranks)."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    world: int
    per_rank: int
    count: int
    start: int
    numel: int


class _Materialize(torch.autograd.Function):
    """The full-precision value of a low-precision parameter; backward feeds its accumulator."""

    @staticmethod
    def forward(ctx: Any, handle: Tensor, lp: LowPrecisionParameter) -> Tensor:
        ctx.lp = lp
        return lp.dequantize(handle.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        lp = ctx.lp
        lp.accumulate_(grad)
        # An empty gradient for the empty handle marks it as used, as DDP's reducer expects; FSDP2 cannot
        # reduce-scatter empty gradients, and the sharded accumulator already holds the reduced one.
        return (torch.zeros_like(lp.handle) if lp.shards is None else None), None


_TENSOR_GRAD = torch._C.TensorBase.grad


def _grad_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"lowbit.lpmm: {what} cannot be applied to the .grad of a converted parameter: its gradient lives in a "
        "low-precision accumulator and .grad is an empty placeholder. Use lowbit.lpmm.clip_grad_norm_ or "
        "lowbit.lpmm.clip_grad_value_ to clip, or LowPrecisionParameter.grad to read the value"
    )


def _storage(t: Any) -> Optional[LowPrecisionParameter]:
    return t._lpmm_storage if isinstance(t, _AccumulatorGrad) else None


def _split(tensors: Any) -> tuple[list[int], list[Any]]:
    """Positions of placeholders in ``tensors`` and the other entries."""
    tensors = list(tensors)
    mine = [i for i, t in enumerate(tensors) if isinstance(t, _AccumulatorGrad)]
    return mine, [t for t in tensors if not isinstance(t, _AccumulatorGrad)]


def _plain(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _grad_norm(t: _AccumulatorGrad, ord: float = 2.0, dtype: Optional[torch.dtype] = None) -> Tensor:
    lp = t._lpmm_storage
    g = lp.grad
    value = torch.zeros((), device=lp.device) if g is None else torch.linalg.vector_norm(g, ord)
    return value.to(dtype or t.dtype)


def _vector_norm(x: Tensor, ord: float = 2.0, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
    if dim is not None or keepdim:
        raise _grad_error("torch.linalg.vector_norm with dim or keepdim")
    return _grad_norm(x, ord, dtype)  # type: ignore[arg-type]


def _foreach_norm(tensors: Any, ord: float = 2.0, dtype: Any = None) -> list[Tensor]:
    tensors = list(tensors)
    mine, other = _split(tensors)
    rest = iter(_plain(torch._foreach_norm, other, ord, dtype=dtype) if other else [])
    return [_grad_norm(t, ord, dtype) if i in mine else next(rest) for i, t in enumerate(tensors)]


def _check_scalar(factor: Any) -> Any:
    if isinstance(factor, Tensor) and factor.numel() != 1:
        raise _grad_error("an elementwise multiplication by a non-scalar")
    if not isinstance(factor, (Tensor, int, float)) or isinstance(factor, bool):
        raise _grad_error(f"a multiplication by {type(factor).__name__}")
    return factor


def _mul_(t: Tensor, factor: Any) -> Tensor:
    t._lpmm_storage._scale_grad_(_check_scalar(factor))  # type: ignore[attr-defined]
    return t


def _foreach_mul_(tensors: Any, factor: Any) -> None:
    tensors = list(tensors)
    mine, other = _split(tensors)
    if isinstance(factor, (list, tuple)):
        for i in mine:
            _mul_(tensors[i], factor[i])
        if other:
            _plain(torch._foreach_mul_, other, [f for i, f in enumerate(factor) if i not in mine])
        return
    for i in mine:
        _mul_(tensors[i], factor)
    if other:
        _plain(torch._foreach_mul_, other, factor)


def _zero_(t: Tensor) -> Tensor:
    t._lpmm_storage.zero_grad_(set_to_none=False)  # type: ignore[attr-defined]
    return t


def _foreach_zero_(tensors: Any) -> None:
    _, other = _split(tensors)
    for t in tensors:
        if isinstance(t, _AccumulatorGrad):
            _zero_(t)
    if other:
        _plain(torch._foreach_zero_, other)


def _unscale_(tensors: Any, found_inf: Tensor, inv_scale: Tensor) -> None:
    """GradScaler's ``unscale_``: flags a non-finite accumulated gradient in ``found_inf`` and multiplies the
    accumulators by ``inv_scale`` (exact for GradScaler's power-of-two scales: only group absmaxes change)."""
    tensors = list(tensors)
    _, other = _split(tensors)
    for t in tensors:
        lp = _storage(t)
        if lp is None or not lp.has_grad:
            continue
        if not bool(torch.isfinite(lp.grad_absmax).all()):
            found_inf.fill_(1.0)
        lp._scale_grad_(inv_scale)
    if other:
        _plain(torch._amp_foreach_non_finite_check_and_unscale_, other, found_inf, inv_scale)


_GRAD_OPS: dict[Any, Callable[..., Any]] = {
    Tensor.zero_: _zero_,
    torch._foreach_zero_: _foreach_zero_,
    Tensor.mul_: _mul_,
    torch._foreach_mul_: _foreach_mul_,
    torch.linalg.vector_norm: _vector_norm,
    torch._foreach_norm: _foreach_norm,
    torch._amp_foreach_non_finite_check_and_unscale_: _unscale_,
}
# Metadata and autograd bookkeeping that zero_grad, GradScaler and torch.compile (wrapping the placeholder
# while tracing model.zero_grad) read; everything else raises.
_GRAD_PASSTHROUGH = {
    "__get__", "requires_grad_", "detach_", "__repr__", "__format__", "size", "dim", "numel",
    "stride", "storage_offset", "untyped_storage", "_is_view", "is_conj", "is_neg",
}  # fmt: skip
_GRAD_CLAMPS = {"clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "clip", "clip_"}


class _AccumulatorGrad(Tensor):
    """What ``handle.grad`` returns for a converted parameter: an empty tensor standing for the accumulated
    gradient. The in-place operations of ``zero_grad``, ``clip_grad_norm_`` and ``GradScaler`` act on the
    accumulator; anything else raises rather than silently reading an empty tensor."""

    _lpmm_storage: LowPrecisionParameter

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _GRAD_OPS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in _GRAD_PASSTHROUGH:
            return _plain(func, *args, **kwargs)
        if name.lstrip("_").removeprefix("foreach_") in _GRAD_CLAMPS:
            raise _grad_error(f"torch.{name} (clip_grad_value_)")
        raise _grad_error(f"torch.{name}")


class _Handle(nn.Parameter):
    """The parameter that stands for a :class:`LowPrecisionParameter` in ``model.parameters()``. Its
    ``.grad`` is None or an :class:`_AccumulatorGrad` placeholder, and setting it to None (``zero_grad``)
    empties the accumulator, so a discarded gradient is never applied."""

    @property  # type: ignore[override]
    def grad(self) -> Optional[Tensor]:
        g = _TENSOR_GRAD.__get__(self)
        lp = self.__dict__.get("_lpmm")
        if g is None or lp is None:
            return g
        placeholder = torch.Tensor._make_subclass(_AccumulatorGrad, g)
        placeholder._lpmm_storage = lp
        return placeholder

    @grad.setter
    def grad(self, value: Optional[Tensor]) -> None:
        lp = self.__dict__.get("_lpmm")
        if value is not None and lp is not None:
            if _storage(value) is not lp:
                raise TypeError(
                    "lowbit.lpmm: cannot assign a gradient to a converted parameter: its gradient lives in a "
                    "low-precision accumulator (LowPrecisionParameter.accumulate_ adds to it)"
                )
            return
        _TENSOR_GRAD.__set__(self, value)
        if lp is not None:
            lp.zero_grad_()

    @grad.deleter
    def grad(self) -> None:
        self.grad = None


# Every live storage, so that checks that only matter once a model is converted cost nothing before.
_LIVE: weakref.WeakSet[LowPrecisionParameter] = weakref.WeakSet()


def any_alive() -> bool:
    """Whether any :class:`LowPrecisionParameter` exists in this process."""
    return len(_LIVE) > 0


class LowPrecisionParameter(nn.Module):
    """One parameter stored as bit-packed k-bit linear codes with one fp32 absmax per group.

    Buffers: ``codes`` (bit-packed uint8) and ``absmax`` (fp32, one per group): the value, in the state
    dict. Attributes ``grad_codes`` and
    ``grad_absmax``: the gradient accumulator (not saved). ``handle`` is an empty ``nn.Parameter`` that
    stands for this tensor in ``model.parameters()`` and optimizer param groups.

    Under FSDP2 (``fully_shard`` of a module holding it) ``codes`` becomes a DTensor of ``[groups,
    group_size * bits / 8]`` rows (the last group zero-padded) and ``absmax`` one of ``[groups]``, both
    sharded on dim 0 over the mesh; the accumulator holds this rank's groups only (see the module docstring).

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
        _LIVE.add(self)
        if isinstance(value, DTensor):
            raise TypeError("lowbit.lpmm: value is a DTensor; convert the model before fully_shard")
        self.bits = _check_bits("bits", bits)
        self.grad_bits = _check_bits("grad_bits", grad_bits)
        self.group_size = _check_group_size(group_size)
        self.rounding = check_rounding(rounding)
        self.shape = torch.Size(value.shape)
        self.dtype = value.dtype
        self.generator = generator
        self.shards: Optional[_Shards] = None
        # Bumped whenever the value changes; a backward pass refuses values saved before a change.
        self.version = 0
        self.has_grad = False
        n = value.numel()
        codes, absmax = self._encode(value)
        self.register_buffer("codes", codes)
        self.register_buffer("absmax", absmax)
        # Plain attributes, not buffers: wrappers that broadcast buffers (DDP, at every forward) must not
        # overwrite a rank's partly accumulated gradient.
        self.grad_codes = torch.zeros(_ops.packed_bytes(n, grad_bits), dtype=torch.uint8, device=value.device)
        self.grad_absmax = torch.zeros(_ops.num_blocks(n, group_size), dtype=torch.float32, device=value.device)
        self.handle = _Handle(torch.empty(0, dtype=value.dtype, device=value.device), requires_grad=requires_grad)

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

    def _encode(self, value: Tensor) -> tuple[Tensor, Tensor]:
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
        return _packed(codes, self.local_numel, bits)

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
        if isinstance(value, DTensor):
            same_mesh = isinstance(like, DTensor) and value.device_mesh == like.device_mesh
            if same_mesh and value.placements == like.placements:
                return value
            value = value.full_tensor()
        rows = (self.num_groups, self._row_bytes(bits))
        flat = (_ops.packed_bytes(self.numel(), bits),)
        if value.dtype == torch.uint8 and value.shape == rows:
            value = value.reshape(-1)[: flat[0]]
        if not isinstance(like, DTensor):
            return value
        if like.dim() == 2 and value.shape == flat:
            value = _as_rows(value, *rows)
        if value.shape != like.shape:
            return value
        mesh = like.device_mesh
        first, count = _chunk_rows(like.shape[0], mesh.size(), mesh.get_local_rank())
        part = value[first : first + count].to(_ops.local(like).device, copy=True)
        return DTensor.from_local(part, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())

    def local_absmax(self) -> Tensor:
        """The group absmaxes of this process's groups (the local shard of ``absmax``)."""
        return _ops.local(self.absmax)

    def new_state(self, bits: int) -> tuple[Tensor, Tensor]:
        """Zeroed codes and absmaxes of a ``bits``-bit tensor in this parameter's layout (optimizer state):
        flat, or sharded ``[groups, group_size * bits / 8]`` rows and ``[groups]`` like ``codes``."""
        if self.shards is None:
            codes = torch.zeros(_ops.packed_bytes(self.numel(), bits), dtype=torch.uint8, device=self.device)
            return codes, torch.zeros(self.num_groups, dtype=torch.float32, device=self.device)
        rows = (self.num_groups, self._row_bytes(bits))
        codes = torch.zeros((self.shards.count, rows[1]), dtype=torch.uint8, device=self.device)
        absmax = torch.zeros(self.shards.count, dtype=torch.float32, device=self.device)
        place, mesh = (Shard(0),), self.shards.mesh
        return (
            DTensor.from_local(codes, mesh, place, run_check=False, shape=rows, stride=(rows[1], 1)),
            DTensor.from_local(absmax, mesh, place, run_check=False, shape=rows[:1], stride=(1,)),
        )

    def _whole_storage(self) -> tuple[Tensor, Tensor]:
        """Flat codes and absmaxes of the whole tensor; sharded, gathered from all ranks (one collective)."""
        if self.shards is None:
            return self.codes, self.absmax
        s = self.shards
        row = self._row_bytes(self.bits)
        # Each rank's codes rows with their absmax bytes appended, padded to the same number of rows.
        mine = torch.zeros((s.per_rank, row + 4), dtype=torch.uint8, device=self.device)
        mine[: s.count, :row] = _ops.local(self.codes)
        mine[: s.count, row:] = _ops.local(self.absmax).view(torch.uint8).view(s.count, 4)
        gathered = mine.new_empty((s.world * s.per_rank, row + 4))
        _all_gather(gathered, mine, group=s.group)
        # Rank r's rows start at r * per_rank, their global index: the first `groups` rows are the tensor.
        whole = gathered[: self.num_groups]
        codes = whole[:, :row].reshape(-1)[: _ops.packed_bytes(self.numel(), self.bits)]
        return codes, whole[:, row:].contiguous().view(torch.float32).reshape(-1)

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
            return _Materialize.apply(self.handle, self)
        return self.dequantize(self.handle.dtype)

    # -- sharding (FSDP2) ---------------------------------------------------------------------------

    def _shard(self, mesh: DeviceMesh) -> None:
        """Keep only this rank's groups of the storage and accumulator (called when FSDP2 shards the handle)."""
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"lowbit.lpmm: low-precision parameters shard over a 1-D device mesh, got a {mesh.ndim}-D mesh "
                "(HSDP is not supported)"
            )
        group = mesh.get_group()
        world = mesh.size()
        pending = None
        if self.has_grad:  # gradients accumulated before sharding: the ranks' mean, as backward would give
            pending = self.grad.float()
            dist.all_reduce(pending, group=group)
            pending.div_(world)
        first, count = _chunk_rows(self.num_groups, world, mesh.get_local_rank())
        start = first * self.group_size
        self.shards = _Shards(
            mesh=mesh,
            group=group,
            world=world,
            per_rank=-(-self.num_groups // world),
            count=count,
            start=start,
            numel=max(0, min(self.numel(), start + count * self.group_size) - start),
        )
        codes = _as_rows(self.codes, self.num_groups, self._row_bytes(self.bits))
        for name, whole in (("codes", codes), ("absmax", self.absmax)):
            part = whole[first : first + count].clone()
            self._buffers[name] = DTensor.from_local(
                part, mesh, (Shard(0),), run_check=False, shape=whole.shape, stride=whole.stride()
            )
        lo = _ops.packed_bytes(start, self.grad_bits)
        self.grad_codes = self.grad_codes[lo : lo + _ops.packed_bytes(self.shards.numel, self.grad_bits)].clone()
        self.grad_absmax = self.grad_absmax[first : first + count].clone()
        self.zero_grad_()
        if pending is not None:
            self._accumulate_local(pending.reshape(-1)[start : start + self.shards.numel], draw_seed(self.generator))

    def _reduce_scatter(self, grad: Tensor) -> Tensor:
        """This rank's elements of the mean of ``grad`` over the ranks, in fp32."""
        s = self.shards
        assert s is not None
        span = s.per_rank * self.group_size
        padded = torch.zeros(s.world * span, dtype=torch.float32, device=grad.device)
        padded[: grad.numel()] = grad.reshape(-1)
        mine = padded.new_empty(span)
        _reduce_scatter(mine, padded, group=s.group)
        return mine[: s.numel].div_(s.world)

    # -- gradient accumulator -------------------------------------------------------------------

    def _accumulate_local(self, grad: Tensor, seed: int) -> None:
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
        part = grad.reshape(-1) if self.shards is None else self._reduce_scatter(grad)
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

    def _scale_grad_(self, factor: Tensor | float) -> None:
        """Multiply the accumulated gradient by the scalar ``factor``: each group's absmax is multiplied (in
        fp32, rounded to nearest) and the codes stay, so no element is re-rounded."""
        if isinstance(factor, Tensor):
            factor = factor.to(device=self.grad_absmax.device, dtype=torch.float32)
        self.grad_absmax.mul_(factor)

    def _clamp_grad_(self, clip_value: float) -> None:
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
            t = self._buffers[name]
            self._buffers[name] = torch.empty_like(t, device=probe.device) if t.is_meta else t.to(probe.device)
        if self.grad_codes.is_meta:
            self.grad_codes = torch.zeros_like(self.grad_codes, device=probe.device)
            self.grad_absmax = torch.zeros_like(self.grad_absmax, device=probe.device)
            self.has_grad = False
        self.grad_codes = self.grad_codes.to(probe.device)
        self.grad_absmax = self.grad_absmax.to(probe.device)
        handle = self._parameters["handle"]
        if handle.is_meta:  # a new handle, as torch's to_empty gives a meta parameter
            self.handle = _Handle(torch.empty(0, dtype=self.dtype, device=probe.device), handle.requires_grad)
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
            buf = self._buffers[name]
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
                state_dict[prefix + name] = self.in_layout(value, self._buffers[name], self.bits)
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
        with _RecomputeSaved(temps):
            return func(*args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"shape={tuple(self.shape)}, bits={self.bits}, grad_bits={self.grad_bits}, "
            f"group_size={self.group_size}, rounding={self.rounding!r}, dtype={self.dtype}"
        )


def _top_saved_hooks() -> Optional[tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]]]:
    """The saved-tensor hooks in force, which ours must pass other tensors to (private torch API)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


@dataclass
class _Recipe:
    """A saved view of a temporary parameter value, recomputed from the codes when backward unpacks it."""

    lp: LowPrecisionParameter
    version: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Passed:
    """A tensor saved by the hooks that were in force before ours (``unpack`` None: saved as is)."""

    value: Any
    unpack: Optional[Callable[[Any], Tensor]]


def _unpack(packed: Any) -> Tensor:
    # Autograd keeps the unpack hook of every saved tensor until backward; a plain function, so that
    # it keeps no temporary alive.
    if isinstance(packed, _Recipe):
        if packed.lp.version != packed.version:
            raise RuntimeError(
                "lowbit.lpmm: a low-precision parameter changed between forward and backward "
                "(an optimizer step or load ran in between); run backward before stepping"
            )
        return packed.lp.dequantize(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)
    return packed.unpack(packed.value) if packed.unpack is not None else packed.value


class _RecomputeSaved:
    """Saved-tensor hooks under which autograd saves the temporaries ``temps`` as recipes.

    Tensors sharing storage with a temporary (the temporary or a view of it) are stored as
    :class:`_Recipe` and dequantized again in backward (lpmm.txt section 5.3: full-precision copies
    only while in use). Everything else goes to the hooks that were in force before, if any. The
    temporaries are alive while the hooks are (the caller holds them), so their storage addresses
    identify them; only the addresses are kept.
    """

    def __init__(self, temps: list[tuple[LowPrecisionParameter, Tensor]]) -> None:
        self.temps = {t.untyped_storage().data_ptr(): (lp, t.dtype, t.device) for lp, t in temps if t.numel() > 0}
        self.outer = _top_saved_hooks()
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def pack(self, t: Tensor) -> Any:
        entry = self.temps.get(t.untyped_storage().data_ptr()) if t.numel() > 0 else None
        if entry is not None and t.dtype == entry[1] and t.device == entry[2]:
            lp = entry[0]
            return _Recipe(lp, lp.version, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if self.outer is None:
            return _Passed(t, None)
        return _Passed(self.outer[0](t), self.outer[1])

    def __enter__(self) -> _RecomputeSaved:
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)


def _load_float_entries(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook of a converted module: float tensors under a converted parameter's
    own name (an ordinary or exported state dict) become its codes, rounded to nearest."""
    for name in module._lpmm_names:
        key = prefix + name
        value = state_dict.get(key)
        lp = module._modules[name]
        if isinstance(value, DTensor):  # an FSDP2 model's sharded float state dict
            value = value.full_tensor()
        if not isinstance(value, Tensor) or not value.is_floating_point() or tuple(value.shape) != tuple(lp.shape):
            continue  # left for load_state_dict to report (unexpected or missing keys)
        del state_dict[key]
        state_dict[key + ".codes"], state_dict[key + ".absmax"] = lp._encode(value.to(lp.device))
        state_dict[key + "._extra_state"] = lp.get_extra_state()


def _enter_forward(module: nn.Module, args: Any) -> None:
    temps = []
    for name in module._lpmm_names:
        lp = module._modules[name]
        t = lp.materialize()
        module.__dict__[name] = t
        temps.append((lp, t))
    ctx = _RecomputeSaved(temps)
    ctx.__enter__()
    module.__dict__.setdefault("_lpmm_active", []).append(ctx)


def _leave_forward(module: nn.Module, args: Any, output: Any) -> None:
    active = module.__dict__.get("_lpmm_active")
    if not active:
        return
    active.pop().__exit__(None, None, None)
    if not active:
        for name in module._lpmm_names:
            module.__dict__.pop(name, None)


# Modules that hold references to their parameters beyond attribute access.
_UNSUPPORTED = (nn.RNNBase,)


def convert(
    model: nn.Module,
    param_bits: int = 12,
    grad_bits: int = 8,
    group_size: int = 2048,
    rounding: str = "stochastic",
    *,
    generator: Optional[torch.Generator] = None,
) -> nn.Module:
    """Store every parameter of ``model`` in low precision, in place (lpmm.txt sections 3 and 5).

    Each parameter becomes a :class:`LowPrecisionParameter` submodule under the same name (so
    ``model.fc.weight`` is its storage outside forward), initialised from the current weights. Shared
    (tied) parameters share one storage. ``model.parameters()`` then yields the storages' handles,
    which :class:`lowbit.optim.LPMMSGD`/:class:`lowbit.optim.LPMMAdamW` optimize.

    Args:
        model: the model; works for any module whose forward reads its parameters as attributes
            (Linear, Conv, Embedding, norm layers, attention, custom modules).
        param_bits: bits per parameter element, 4..16 (paper: 12).
        grad_bits: bits per gradient-accumulator element, 4..16 (paper: 8).
        group_size: elements per quantization group, a power of two in 64..4096 (paper: 2048).
        rounding: ``"stochastic"`` (paper) or ``"nearest"`` for the accumulator and parameter updates.
        generator: source of rounding seeds (torch's default generator if None).

    Returns:
        ``model``, converted.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"lowbit.lpmm: model must be an nn.Module, got {type(model).__name__}")
    _check_bits("param_bits", param_bits)
    _check_bits("grad_bits", grad_bits)
    _check_group_size(group_size)
    check_rounding(rounding)
    for name, m in model.named_modules():
        where = f"{name!r} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
        if isinstance(m, LowPrecisionParameter):
            raise ValueError(f"lowbit.lpmm: {where} is already converted")
        if isinstance(m, _UNSUPPORTED):
            raise TypeError(
                f"lowbit.lpmm: cannot convert {where}: it keeps its own references to its parameters "
                "(flat weights), so they cannot be stored in low precision; convert its sibling modules instead"
            )
        if torch.nn.utils.parametrize.is_parametrized(m):
            raise TypeError(f"lowbit.lpmm: cannot convert {where}: parametrized modules are not supported")
        for pname, p in m._parameters.items():
            if isinstance(p, DTensor):
                raise TypeError(
                    f"lowbit.lpmm: parameter {pname!r} of {where} is a DTensor: convert the model before "
                    "fully_shard (FSDP2 then shards the low-precision storage)"
                )
            if p is not None and p.dtype not in _ops.FLOAT_DTYPES:
                raise TypeError(
                    f"lowbit.lpmm: parameter {pname!r} of {where} has dtype {p.dtype}; "
                    "expected float32, float16 or bfloat16"
                )
    storages: dict[int, LowPrecisionParameter] = {}
    for m in list(model.modules()):
        names = [n for n, p in m._parameters.items() if p is not None]
        if not names:
            continue
        for n in names:
            p = m._parameters.pop(n)
            lp = storages.get(id(p))
            if lp is None:
                lp = LowPrecisionParameter(
                    p.detach(),
                    bits=param_bits,
                    grad_bits=grad_bits,
                    group_size=group_size,
                    rounding=rounding,
                    requires_grad=p.requires_grad,
                    generator=generator,
                )
                storages[id(p)] = lp
            m._modules[n] = lp
        m._lpmm_names = names
        m.register_forward_pre_hook(_enter_forward)
        m.register_forward_hook(_leave_forward, always_call=True)
        m._register_load_state_dict_pre_hook(_load_float_entries, with_module=True)
    return model


def low_precision_parameters(model: nn.Module) -> dict[str, LowPrecisionParameter]:
    """The distinct low-precision parameters of ``model`` by qualified name (first name of a tied one)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LowPrecisionParameter)}


def _storages(model_or_params: nn.Module | Tensor | Any) -> list[LowPrecisionParameter]:
    """The distinct storages of a converted model, or of the handles among ``model_or_params``; ordinary
    parameters are refused (their gradients are clipped by torch.nn.utils)."""
    if isinstance(model_or_params, nn.Module):
        params: list[Any] = list(model_or_params.parameters())
    elif isinstance(model_or_params, Tensor):
        params = [model_or_params]
    else:
        params = list(model_or_params)
    out: dict[int, LowPrecisionParameter] = {}
    for i, p in enumerate(params):
        lp = getattr(p, "_lpmm", None)
        if not isinstance(lp, LowPrecisionParameter):
            raise TypeError(
                f"lowbit.lpmm: parameter {i} ({type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}) is not a "
                "converted parameter; clip ordinary parameters with torch.nn.utils"
            )
        out.setdefault(id(lp), lp)
    return list(out.values())


@torch.no_grad()
def clip_grad_norm_(
    model_or_params: nn.Module | Tensor | Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for the gradient accumulators of converted parameters.

    The total norm is torch's: the ``norm_type`` norm of the per-parameter norms of the accumulated (fp32,
    dequantized) gradients; under FSDP2 the sharded accumulators' contributions are all-reduced over
    their mesh, so every rank gets the global norm (every rank must call it). Each accumulator is then
    multiplied by ``min(max_norm / (total + 1e-6), 1)``: the factor multiplies its group absmaxes (fp32,
    round to nearest) and the codes stay, so the clipped gradient equals torch's clip of the dequantized
    one within 4 fp32 roundoffs relative (no element is re-rounded, stochastic rounding is not needed).
    ``torch.nn.utils.clip_grad_norm_`` on the handles of an unsharded model does the same.

    Args:
        model_or_params: a converted model, or handles of converted parameters (``model.parameters()``).
        max_norm: maximum norm of the gradients.
        norm_type: order of the norm (``math.inf`` for the max norm); sharded storage needs ``> 0``.
        error_if_nonfinite: raise if the total norm is NaN or infinite (the accumulators are left as they are).
        foreach: accepted for torch's signature; the accumulators are scaled per parameter either way.

    Returns:
        The total norm of the gradients, a 0-dim fp32 tensor.
    """
    if foreach not in (None, True, False):
        raise TypeError(f"lowbit.lpmm: foreach must be a bool or None, got {foreach!r}")
    max_norm, norm_type = float(max_norm), float(norm_type)
    lps = _storages(model_or_params)
    if not lps:
        return torch.tensor(0.0)
    device = lps[0].device
    whole: list[Tensor] = []
    sharded: dict[Any, list[Tensor]] = {}
    for lp in lps:
        g = lp.grad
        if lp.shards is not None:
            local = torch.zeros(0, device=lp.device) if g is None else g
            sharded.setdefault(lp.shards.group, []).append(torch.linalg.vector_norm(local, norm_type))
        elif g is not None:
            whole.append(torch.linalg.vector_norm(g, norm_type))
    if sharded and not norm_type > 0:
        raise ValueError(f"lowbit.lpmm: norm_type must be > 0 for sharded storage, got {norm_type}")
    norms = [n.to(device) for n in whole]
    for group, parts in sharded.items():
        local = torch.linalg.vector_norm(torch.stack(parts), norm_type)
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            norms.append(local.to(device))
        else:
            local = local.pow(norm_type)
            dist.all_reduce(local, group=group)
            norms.append(local.pow(1.0 / norm_type).to(device))
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"lowbit.lpmm: the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
            "clipped; to scale the gradients by the non-finite norm anyway, set error_if_nonfinite=False"
        )
    # torch.nn.utils.clip_grads_with_norm_'s factor, computed the same way.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for lp in lps:
        if lp.has_grad:
            lp._scale_grad_(coef)
    return total


@torch.no_grad()
def clip_grad_value_(
    model_or_params: nn.Module | Tensor | Any, clip_value: float, foreach: Optional[bool] = None
) -> None:
    """``torch.nn.utils.clip_grad_value_`` for the gradient accumulators of converted parameters.

    Each accumulated gradient is dequantized, clamped to ``[-clip_value, clip_value]`` and re-encoded
    against the clamped groups' absmaxes (at most ``clip_value``) with the parameter's rounding:
    stochastic (unbiased) or nearest, within one (stochastic) or half a (nearest) quantization step
    ``absmax / (2**(grad_bits - 1) - 1)`` of torch's clamp of the dequantized gradient. Elements
    clamped to the bound are exact. Local to each rank under FSDP2.

    Args:
        model_or_params: a converted model, or handles of converted parameters (``model.parameters()``).
        clip_value: maximum absolute value of the gradients (non-negative).
        foreach: accepted for torch's signature.
    """
    if foreach not in (None, True, False):
        raise TypeError(f"lowbit.lpmm: foreach must be a bool or None, got {foreach!r}")
    clip_value = float(clip_value)
    if not clip_value >= 0:
        raise ValueError(f"lowbit.lpmm: clip_value must be >= 0, got {clip_value}")
    for lp in _storages(model_or_params):
        lp._clamp_grad_(clip_value)


def export_float(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every low-precision parameter replaced by its dequantized value.

    The result loads into the unconverted model (and into a converted one, which quantizes it). Under
    FSDP2 every rank must call it (the codes are gathered) and gets the whole values.
    """
    lps = {name: m for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, LowPrecisionParameter)}
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        owner = key.rsplit(".", 1)[0] if "." in key else ""
        if owner in lps:
            if owner not in out:
                out[owner] = lps[owner].dequantize()
            continue
        out[key] = value
    return out


@dataclass
class MemoryReport:
    """Measured bytes of model memory (lpmm.txt section 3.1): parameters, gradients, optimizer state.

    Attributes:
        params: bytes of parameter storage (codes and absmaxes, or float tensors).
        grads: bytes of gradient storage (accumulators, or existing ``.grad`` tensors).
        optimizer_state: bytes of the optimizer's state tensors for these parameters.
        num_params: number of parameter elements.
        per_parameter: the same three byte counts per parameter name.
    """

    params: int = 0
    grads: int = 0
    optimizer_state: int = 0
    num_params: int = 0
    per_parameter: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """params + grads + optimizer_state."""
        return self.params + self.grads + self.optimizer_state

    @property
    def bytes_per_param(self) -> float:
        """total / num_params."""
        return self.total / max(self.num_params, 1)

    def __str__(self) -> str:
        n = max(self.num_params, 1)
        rows = [("parameters", self.params), ("gradients", self.grads), ("optimizer state", self.optimizer_state)]
        lines = [f"{'':<16}{'bytes':>14}{'bytes/param':>13}"]
        lines += [f"{label:<16}{b:>14,}{b / n:>13.3f}" for label, b in (*rows, ("total", self.total))]
        return "\n".join(lines + [f"{self.num_params:,} parameters"])


def memory_report(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> MemoryReport:
    """Measure the model memory of ``model`` (converted or not) and ``optimizer`` from their storage.

    Gradient bytes count accumulators of low-precision parameters (allocated for their whole life)
    and the ``.grad`` tensors that ordinary parameters hold at the time of the call.
    """
    state = optimizer.state if optimizer is not None else {}
    report = MemoryReport()

    def add(name: str, key: Tensor, n: int, params: int, grads: int) -> None:
        st = sum(_nbytes(v) for v in state.get(key, {}).values() if isinstance(v, Tensor))
        report.per_parameter[name] = {"params": params, "grads": grads, "optimizer_state": st}
        report.params += params
        report.grads += grads
        report.optimizer_state += st
        report.num_params += n

    handles = set()
    for name, lp in low_precision_parameters(model).items():
        handles.add(id(lp.handle))
        add(
            name,
            lp.handle,
            lp.numel(),
            _nbytes(lp.codes) + _nbytes(lp.absmax),
            _nbytes(lp.grad_codes) + _nbytes(lp.grad_absmax),
        )
    for name, p in model.named_parameters():
        if id(p) not in handles:
            add(name, p, p.numel(), _nbytes(p), _nbytes(p.grad))
    return report
