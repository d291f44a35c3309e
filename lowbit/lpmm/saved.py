"""Saved-tensor recipes: autograd keeps no full-precision copy of a low-precision parameter.

While a temporary parameter value is in use (a module's forward, a torch function given the storage),
tensors that autograd saves from it are stored as recipes and dequantized again when backward unpacks
them (lpmm.txt section 5.3: full-precision copies only while in use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lowbit.lpmm.parameter import LowPrecisionParameter

__all__ = ["RecomputeSaved"]


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
    offset: Union[int, torch.SymInt]


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


class RecomputeSaved:
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

    def __enter__(self) -> RecomputeSaved:
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)
