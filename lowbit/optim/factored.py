"""Factorized second moments of the 4-bit Adam optimizers (``factored=True``; Shazeer & Stern 2018,
Adafactor, section 3 and algorithm 4; Li, Chen, Zhu 2023, "4-bit Factor").

For a parameter of 2 or more axes the second moment v is not stored element by element: two fp32 EMAs of
the squared gradient are kept instead, ``row{k+1}`` (the mean over the last axis, shape ``shape[:-1]``)
and ``col{k+1}`` (the mean over axis -2, shape ``shape[:-2] + shape[-1:]``), in place of
``state{k+1}``/``absmax{k+1}``, so that a matrix's v costs ``(R + C) * 4`` bytes. The step divides by
``v_hat = (row / mean(row over its last axis)) (outer) col``; a zero ``mean(row)`` (every squared gradient
so far was 0) gives ``v_hat = 0``, as the unfactored v would be. The first moment stays 4-bit block-wise.

The step is native (include/lowbit/factored.h; csrc/cpu/optim.cpp, csrc/cuda/optim.cu), in the fused call of the
parameter's group with the other parameters: the op takes the factors of every factorized parameter of the call
(lowbit/_ops/optim.py: StepArgs). Here are the conversions of whole states outside the step (layout changes,
loaded state dicts, ``dequantized_state``), with ``mean(row)`` summed in the step's fixed order so that a
reconstructed v is the step's v_hat bit for bit.

FSDP2 (DTensor parameters sharded on their first axis, ``Shard(0)``, possibly beside ``Replicate()`` mesh
dimensions): a rank holds rows ``[r0, r1)`` of axis 0. With 3 or more axes it holds whole R x C slices, so its
factors and means are local and the native step computes them as for a plain tensor; ``row2``/``col2`` are
DTensors sharded like the parameter. A matrix's ``row2`` (R,) is sharded like it too, but its ``col2`` (C,) is
replicated: the column sums and the mean of the rows span the ranks. For such a matrix :func:`given_factors`
computes the step's factors before the native call (which then runs only its element phase, ``kFacGiven``): the
local rows' EMAs, the partial column sums of factored.h's blocks of 64 rows summed over the ranks (an
all-reduce), the columns' EMAs, and the mean of the all-gathered rows. When the first row of every rank is a
multiple of ``kFactoredRowBlock`` (64), each block is one rank's, and the result is one process's bit for bit;
otherwise a block split between two ranks adds its two parts, which rounds differently (fp32 summation order).
A parameter some rank of which would hold fewer than 2 elements keeps the block-wise 4-bit v (4-bit states
need 2 elements per shard).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from lowbit import _ops
from lowbit._C import FACTORED_LANES, FACTORED_ROW_BLOCK, FLAG_DECOUPLED, FLAG_MAXIMIZE
from lowbit._ops import StepHyper

__all__ = [
    "factored_applies",
    "given_factors",
    "like_factor",
    "local_factor",
    "project",
    "reconstruct",
    "row_mean",
    "spans_ranks",
]


def _shard_dims(p: Tensor) -> list[int]:
    """The mesh dimensions a DTensor ``p`` is sharded on (its first axis), after refusing any other placement."""
    assert isinstance(p, DTensor)
    dims = []
    for d, placement in enumerate(p.placements):
        if type(placement) is Shard and placement.dim in (0, -p.dim()):  # not _StridedShard (FSDP2 with TP)
            dims.append(d)
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(
                f"lowbit: factored=True steps DTensor parameters sharded on their first axis (FSDP2's Shard(0)) or "
                f"replicated; got placements {p.placements}: use factored=False"
            )
    if len(dims) > 1:
        raise NotImplementedError(
            f"lowbit: factored=True steps DTensor parameters sharded on one mesh dimension; got {p.placements}"
        )
    return dims


def _row_range(p: DTensor, rank: Optional[int] = None) -> tuple[int, int]:
    """Rows ``[r0, r1)`` of axis 0 that rank ``rank`` of the shard dimension (this process's if None) holds: the
    chunks of torch.chunk, as Shard(0) and FSDP2 cut them."""
    dims = _shard_dims(p)
    n = p.shape[0]
    if not dims:
        return 0, n
    mesh = p.device_mesh
    world = mesh.size(dims[0])
    if rank is None:
        rank = mesh.get_local_rank(dims[0])
    chunk = -(-n // world)
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


def factored_applies(p: Tensor) -> bool:
    """Whether a factored layout stores the second moment of ``p``: 2 or more axes, and under FSDP2 every rank's
    shard of 2 or more elements (the 4-bit layout's condition, decided alike on every rank)."""
    if p.dim() < 2:
        return False
    if not isinstance(p, DTensor):
        return True
    dims = _shard_dims(p)
    if not dims:
        return True
    last = _row_range(p, p.device_mesh.size(dims[0]) - 1)
    return (last[1] - last[0]) * math.prod(p.shape[1:]) >= 2


def spans_ranks(p: Tensor) -> bool:
    """Whether the column factors and the mean of ``p`` (factorized) span ranks: a sharded matrix."""
    return isinstance(p, DTensor) and p.dim() == 2 and bool(_shard_dims(p))


def _factor_placements(p: DTensor, key: str) -> tuple[Placement, ...]:
    """The placements of factor ``key`` of ``p``: the parameter's (axis 0 is the factor's axis 0), except a matrix's
    column factors, replicated."""
    if key.startswith("col") and p.dim() == 2:
        return tuple(Replicate() for _ in p.placements)
    return tuple(p.placements)


def like_factor(p: Tensor, local: Tensor, key: str) -> Tensor:
    """The factor ``key`` (``row{k}`` or ``col{k}``) of ``p`` from its local values: a DTensor for an FSDP2
    parameter, sharded like it on axis 0, except a matrix's column factors, replicated; else ``local``."""
    if not isinstance(p, DTensor):
        return local
    shape = p.shape[:-1] if key.startswith("row") else p.shape[:-2] + p.shape[-1:]
    stride = torch.empty(shape, device="meta").stride()
    placements = _factor_placements(p, key)
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=shape, stride=stride)


def local_factor(p: Tensor, value: Tensor, key: str) -> Tensor:
    """The local values of factor ``key`` of ``p`` from ``value``: a DTensor (redistributed to the placements of
    :func:`like_factor` if it has others) or, for a DTensor ``p``, a plain tensor of the whole factor."""
    if not isinstance(p, DTensor):
        return _ops.local(value)
    if isinstance(value, DTensor):
        placements = _factor_placements(p, key)
        if tuple(value.placements) != placements:
            value = value.redistribute(p.device_mesh, placements)
        return value.to_local()
    if key.startswith("col") and p.dim() == 2:
        return value
    r0, r1 = _row_range(p)
    return value.narrow(0, r0, r1 - r0)


def _sum_over_shards(t: Tensor, p: DTensor) -> Tensor:
    for d in _shard_dims(p):
        dist.all_reduce(t, group=p.device_mesh.get_group(d))
    return t


def _all_rows(local: Tensor, p: DTensor) -> Tensor:
    """The whole of a 1-D tensor sharded like axis 0 of ``p`` (``local``: this rank's rows), all-gathered."""
    dims = _shard_dims(p)
    if not dims:
        return local
    mesh, d = p.device_mesh, dims[0]
    world = mesh.size(d)
    chunk = -(-p.shape[0] // world)
    padded = torch.zeros(chunk, dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=mesh.get_group(d))
    sizes = [r1 - r0 for r0, r1 in (_row_range(p, i) for i in range(world))]
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def project(v: Tensor, p: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(row, col) of a full second moment ``v`` (fp32, 2 or more axes; the local shard of ``p`` under FSDP2): its
    means over the last axis and over axis -2, Adafactor's factors of v (section 3: the row and column sums, here
    divided by the counts, which ``reconstruct`` cancels). A sharded matrix's column sums are summed over the ranks."""
    if p is not None and spans_ranks(p):
        assert isinstance(p, DTensor)
        total = _sum_over_shards(v.sum(dim=-2), p)
        return v.mean(dim=-1), total / p.shape[0]
    return v.mean(dim=-1), v.mean(dim=-2)


def row_mean(row: Tensor) -> Tensor:
    """The mean of ``row`` over its last axis (keeping it), summed in include/lowbit/factored.h's order: value i
    into lane i % FACTORED_LANES in index order, the lanes then in lane order, from 0 (zero padding adds +0,
    which changes no sum of non-negative values), divided by the count."""
    n = row.shape[-1]
    padded = torch.nn.functional.pad(row, (0, -n % FACTORED_LANES))
    lanes = padded.unflatten(-1, (-1, FACTORED_LANES))
    acc = torch.zeros_like(lanes[..., 0, :])
    for j in range(lanes.shape[-2]):
        acc += lanes[..., j, :]
    total = torch.zeros_like(acc[..., :1])
    for lane in range(FACTORED_LANES):
        total += acc[..., lane : lane + 1]
    return total / torch.tensor(n, dtype=torch.float32, device=row.device)  # a true division on CUDA too


def reconstruct(row: Tensor, col: Tensor, p: Optional[Tensor] = None) -> Tensor:
    """``v_hat = (row / mean(row over its last axis)) (outer) col``, 0 where ``mean(row)`` is 0: of the local shard
    of ``p`` under FSDP2 (``row``/``col``: its factors, DTensors or local), whose mean spans the ranks for a matrix."""
    if p is not None and isinstance(p, DTensor):
        row, col = local_factor(p, row, "row"), local_factor(p, col, "col")
        mean = row_mean(_all_rows(row, p)) if spans_ranks(p) else row_mean(row)
    else:
        mean = row_mean(row)
    # `mean == 0`, not `mean > 0`: a NaN mean (a non-finite gradient) must stay NaN, not become v_hat = 0.
    zero = mean == 0
    scaled = torch.where(zero, torch.zeros_like(row), row / torch.where(zero, torch.ones_like(mean), mean))
    return scaled.unsqueeze(-1) * col.unsqueeze(-2)


def given_factors(
    param: Tensor, grad: Tensor, row: Tensor, col: Tensor, hyper: StepHyper, flags: int, p: Tensor
) -> Tensor:
    """This step's factors of a sharded matrix ``p`` (``param``, ``grad``: its local shard, contiguous; ``row``,
    ``col``: its local factors), flat as the op takes a tensor whose factors are given (StepArgs: its new rows, its
    new columns, its mean), in include/lowbit/factored.h's operations and order: factored_grad, each local row's
    lane sum and EMA, each block of 64 global rows' column sums row by row (this rank's part of it), the blocks'
    sums over the ranks, added in block order, the columns' EMAs, and the mean of the all-gathered rows."""
    assert isinstance(p, DTensor)

    def f32(v: float) -> Tensor:  # the kernel's fp32 scalars
        return torch.tensor(v, dtype=torch.float32, device=param.device)

    x = grad.float()
    if flags & FLAG_MAXIMIZE:
        x = -x
    if hyper.weight_decay != 0 and not flags & FLAG_DECOUPLED:
        x = x + f32(hyper.weight_decay) * param.float()
    square = x * x
    rows, cols = p.shape
    beta2, rest = f32(hyper.beta2), f32(hyper.one_minus_beta2)
    new_row = row * beta2 + (row_sum(square) / f32(cols)) * rest
    r0, r1 = _row_range(p)
    block = FACTORED_ROW_BLOCK
    parts = torch.zeros(-(-rows // block), cols, dtype=torch.float32, device=param.device)
    # The local rows on the grid of blocks (zero rows before and after: +0 changes no sum of squares), each
    # block's rows added in row order from 0.
    first = r0 // block
    before, after = r0 - first * block, -(r1 - first * block) % block
    grid = torch.nn.functional.pad(square, (0, 0, before, after)) if before or after else square
    grid = grid.unflatten(0, (-1, block))
    for i in range(block):
        parts[first : first + grid.shape[0]] += grid[:, i]
    _sum_over_shards(parts, p)  # one part per block where shards start at multiples of 64: adds only zeros
    total = torch.zeros(cols, dtype=torch.float32, device=param.device)
    for k in range(parts.shape[0]):
        total += parts[k]
    new_col = col * beta2 + (total / f32(rows)) * rest
    mean = row_mean(_all_rows(new_row, p))
    return torch.cat([new_row, new_col, mean])


def row_sum(x: Tensor) -> Tensor:
    """The sum of ``x`` over its last axis in include/lowbit/factored.h's lanes (as :func:`row_mean`)."""
    n = x.shape[-1]
    pad = -n % FACTORED_LANES
    lanes = (torch.nn.functional.pad(x, (0, pad)) if pad else x).unflatten(-1, (-1, FACTORED_LANES))
    acc = torch.zeros_like(lanes[..., 0, :])
    for j in range(lanes.shape[-2]):
        acc += lanes[..., j, :]
    total = torch.zeros_like(acc[..., 0])
    for lane in range(FACTORED_LANES):
        total += acc[..., lane]
    return total
