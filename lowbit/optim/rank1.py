"""Rank-1 normalised 4-bit second moments in the optimizers' storage (include/lowbit/rank1.h; Li, Chen, Zhu
2023, section 4.2): which parameters use it, and the encoding and decoding of a whole state when it is
stored or read outside the step (layout changes, loaded state dicts, ``dequantized_state``). The step
itself encodes in the native call, against statistics from the native statistics pass.

A parameter's statistics are the maxima of its stored values (square roots of the second moment) along
each axis, ``sum(shape)`` fp32 values kept as ``axis_max{k+1}`` in place of ``absmax{k+1}``: the key
marks the layout in the state dict. Under FSDP2 each rank keeps the statistics of the whole parameter,
the MAX over the ranks of its shard's maxima (an all-reduce), so that they equal the unsharded ones.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lowbit._C import MAX_RANK1_DIMS

__all__ = ["axis_maxima", "decode", "encode", "max_over_shards", "rank1_layout"]


def rank1_layout(p: Tensor) -> Optional[tuple[int, list[int]]]:
    """(offset, dims): the local elements of ``p`` are elements ``offset ..`` of a global tensor of shape
    ``dims``; None where rank-1 normalisation does not apply: fewer than 2 or more than ``MAX_RANK1_DIMS``
    axes, or an FSDP2 shard that is not one run of the global tensor's elements (sharded on an axis other
    than the first)."""
    dims = list(p.shape)
    if not 2 <= len(dims) <= MAX_RANK1_DIMS:
        return None
    if not isinstance(p, DTensor):
        return 0, dims
    local_shape, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if list(local_shape[1:]) != dims[1:]:
        return None
    return offsets[0] * math.prod(dims[1:]), dims


def _index(offset: int, dims: list[int], n: int) -> list[Tensor]:
    """The multi-index (one int64 tensor per axis) of elements ``offset .. offset + n`` of shape ``dims``."""
    rest = torch.arange(offset, offset + n, dtype=torch.int64)
    index = []
    for d in reversed(dims):
        index.append(rest % d)
        rest = rest // d
    return index[::-1]


def axis_maxima(w: Tensor, offset: int, dims: list[int]) -> Tensor:
    """The statistics of stored values ``w`` (flat, elements ``offset ..`` of shape ``dims``): for each axis
    the max of |w| over the other axes, axis 0's first; 0 for indices the elements do not reach."""
    w = w.reshape(-1).abs().float()
    out = []
    for d, i in zip(dims, _index(offset, dims, w.numel()), strict=True):
        out.append(torch.zeros(d, dtype=torch.float32, device=w.device).scatter_reduce(0, i.to(w.device), w, "amax"))
    return torch.cat(out)


def max_over_shards(stats: Tensor, p: Tensor) -> Tensor:
    """``stats`` of the local shard of ``p``, made the statistics of the whole parameter: the MAX over the
    mesh dimensions ``p`` is sharded on (unchanged for a plain tensor)."""
    if isinstance(p, DTensor):
        for d, placement in enumerate(p.placements):
            if placement.is_shard():
                dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=p.device_mesh.get_group(d))
    return stats


def _scales(stats: Tensor, offset: int, dims: list[int], n: int) -> Tensor:
    """rank1.h's rank1_scale of each element: the min over the axes of its axis maxima."""
    scale: Optional[Tensor] = None
    base = 0
    for d, i in zip(dims, _index(offset, dims, n), strict=True):
        m = stats[base + i.to(stats.device)]
        scale = m if scale is None else torch.minimum(scale, m)
        base += d
    assert scale is not None
    return scale


def encode(w: Tensor, stats: Tensor, offset: int, dims: list[int], code: Tensor) -> Tensor:
    """Packed 4-bit codes (element 2i in the low nibble) of stored values ``w`` on the sorted map ``code``:
    each value normalised by its scale (blockwise.h's normalise: exactly 1 at its scale, 0 for a zero
    scale) and rounded to the nearest code."""
    w = w.reshape(-1).float()
    scale = _scales(stats, offset, dims, w.numel())
    pos = scale > 0
    xn = torch.where(pos, (w / torch.where(pos, scale, torch.ones_like(scale))).clamp(0, 1), torch.zeros_like(w))
    xn = torch.where(pos & (w == scale), torch.ones_like(xn), xn)
    lo = (torch.searchsorted(code, xn, right=True) - 1).clamp(min=0)
    hi = (lo + 1).clamp(max=code.numel() - 1)
    codes = torch.where(code[hi] - xn < xn - code[lo], hi, lo).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return codes[0::2] | (codes[1::2] << 4)


def decode(packed: Tensor, stats: Tensor, offset: int, dims: list[int], code: Tensor, n: int) -> Tensor:
    """The stored values of ``n`` elements from their packed codes (:func:`encode`'s inverse)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:n].long()
    return code[codes] * _scales(stats, offset, dims, n)
