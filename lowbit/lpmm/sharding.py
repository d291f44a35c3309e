"""FSDP2 sharding of low-precision storage: rows of whole quantization groups split on dim 0.

A sharded parameter's codes are ``[groups, group_size * bits / 8]`` rows (the last group zero-padded)
and its absmaxes ``[groups]``, both split over a one-dimensional mesh as FSDP2 / ``torch.chunk`` split
dim 0. Group boundaries do not depend on the world size, so every layout holds the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lowbit import _ops

__all__ = ["Shards", "as_rows", "chunk_rows", "in_layout", "packed"]

# torch >= 2.13 renames the tensor collectives; older releases only have the first names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def packed(codes: Tensor, numel: int, bits: int) -> Tensor:
    """The bit-packed codes of ``numel`` elements as a flat view: of whole flat codes, or of the local
    shard of sharded ``[groups, bytes per group]`` rows (groups are whole bytes, so rows concatenate)."""
    return _ops.local(codes).reshape(-1)[: _ops.packed_bytes(numel, bits)]


def as_rows(packed: Tensor, groups: int, row_bytes: int) -> Tensor:
    """Bit-packed codes as ``[groups, row_bytes]`` rows, the last group zero-padded to a whole row."""
    rows = packed.new_zeros(groups * row_bytes)
    rows[: packed.numel()] = packed
    return rows.view(groups, row_bytes)


def chunk_rows(groups: int, world: int, rank: int) -> tuple[int, int]:
    """(first, count): the groups that rank ``rank`` of ``world`` holds, FSDP2's / ``torch.chunk``'s dim-0
    split of ``groups`` rows (``ceil(groups / world)`` per rank, the last ranks short or empty)."""
    per_rank = -(-groups // world)
    first = min(rank * per_rank, groups)
    return first, min(per_rank, groups - first)


def in_layout(value: Tensor, like: Tensor, rows: tuple[int, int], flat_bytes: int) -> Tensor:
    """``value`` (codes of ``rows[0]`` groups of ``rows[1]`` bytes, ``flat_bytes`` of them bit-packed, or
    their absmaxes) in the layout of ``like``: whole (flat codes, ``[groups]`` absmaxes) or sharded (a
    DTensor of ``rows`` or ``[groups]`` split on dim 0). ``value`` may come in either layout: a sharded
    DTensor (gathered from the ranks: every rank must call it), its gathered rows (a full state dict of
    an FSDP2 model), or flat codes. A value that fits neither is returned as is, for ``load_state_dict``
    to report."""
    if isinstance(value, DTensor):
        if isinstance(like, DTensor) and value.device_mesh == like.device_mesh and value.placements == like.placements:
            return value
        value = value.full_tensor()
    if value.dtype == torch.uint8 and value.shape == rows:
        value = value.reshape(-1)[:flat_bytes]
    if not isinstance(like, DTensor):
        return value
    if like.dim() == 2 and value.shape == (flat_bytes,):
        value = as_rows(value, *rows)
    if value.shape != like.shape:
        return value
    mesh = like.device_mesh
    first, count = chunk_rows(like.shape[0], mesh.size(), mesh.get_local_rank())
    part = value[first : first + count].to(_ops.local(like).device, copy=True)
    return DTensor.from_local(part, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


@dataclass(frozen=True)
class Shards:
    """This rank's part of a sharded parameter: ``count`` groups from group ``first`` (of at most
    ``per_rank``) holding elements ``[start, start + numel)``, over ``group`` (the FSDP2 mesh's process
    group of ``world`` ranks)."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    world: int
    per_rank: int
    first: int
    count: int
    start: int
    numel: int

    @classmethod
    def of(cls, mesh: DeviceMesh, groups: int, group_size: int, numel: int) -> Shards:
        """This rank's share of ``groups`` groups of ``group_size`` of ``numel`` elements over ``mesh``."""
        world = mesh.size()
        first, count = chunk_rows(groups, world, mesh.get_local_rank())
        start = first * group_size
        return cls(
            mesh=mesh,
            group=mesh.get_group(),
            world=world,
            per_rank=-(-groups // world),
            first=first,
            count=count,
            start=start,
            numel=max(0, min(numel, start + count * group_size) - start),
        )

    def split(self, whole: Tensor) -> DTensor:
        """This rank's rows of ``whole`` (a copy) as a DTensor sharded on dim 0 with ``whole``'s shape."""
        part = whole[self.first : self.first + self.count].clone()
        return DTensor.from_local(
            part, self.mesh, (Shard(0),), run_check=False, shape=whole.shape, stride=whole.stride()
        )

    def zeros(self, rows: tuple[int, int], device: torch.device) -> tuple[DTensor, DTensor]:
        """Zeroed codes of ``rows`` (groups, bytes per group) and their ``[groups]`` absmaxes, sharded: this
        rank's groups."""
        codes = torch.zeros((self.count, rows[1]), dtype=torch.uint8, device=device)
        absmax = torch.zeros(self.count, dtype=torch.float32, device=device)
        place = (Shard(0),)
        return (
            DTensor.from_local(codes, self.mesh, place, run_check=False, shape=torch.Size(rows), stride=(rows[1], 1)),
            DTensor.from_local(absmax, self.mesh, place, run_check=False, shape=torch.Size(rows[:1]), stride=(1,)),
        )

    def gather(self, codes: Tensor, absmax: Tensor, groups: int) -> tuple[Tensor, Tensor]:
        """The whole ``[groups, row bytes]`` code rows and ``[groups]`` absmaxes from every rank's local
        ``codes`` rows and ``absmax`` (one collective: every rank must call it)."""
        row = codes.shape[1]
        # Each rank's codes rows with their absmax bytes appended, padded to the same number of rows.
        mine = torch.zeros((self.per_rank, row + 4), dtype=torch.uint8, device=codes.device)
        mine[: self.count, :row] = codes
        mine[: self.count, row:] = absmax.view(torch.uint8).view(self.count, 4)
        gathered = mine.new_empty((self.world * self.per_rank, row + 4))
        _all_gather(gathered, mine, group=self.group)
        # Rank r's rows start at r * per_rank, their global index: the first `groups` rows are the tensor.
        whole = gathered[:groups]
        return whole[:, :row], whole[:, row:].contiguous().view(torch.float32).reshape(-1)

    def reduce_scatter_mean(self, grad: Tensor, group_size: int) -> Tensor:
        """This rank's elements of the mean of ``grad`` (the whole tensor's) over the ranks, in fp32."""
        span = self.per_rank * group_size
        padded = torch.zeros(self.world * span, dtype=torch.float32, device=grad.device)
        padded[: grad.numel()] = grad.reshape(-1)
        mine = padded.new_empty(span)
        _reduce_scatter(mine, padded, group=self.group)
        return mine[: self.numel].div_(self.world)
