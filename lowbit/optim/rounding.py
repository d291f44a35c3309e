"""The draws of stochastic rounding of optimizer states, shared by the LPMM optimizers and lowbit's others.

An optimizer draws one ``rounding_seed`` (a param-group entry, saved in its state dict). Parameter ``i``
(its position in the optimizer, counting through the groups) at its step ``t`` takes the draws at counters
``i * 2**COUNTER_BITS`` onwards of the streams keyed by ``stream_seed(rounding_seed, t)`` (include/lowbit/
state_rounding.h: stream 0 for an LPMM parameter, ``1 + k`` for state ``k``): a pure function of the seed,
the step, the parameter and the element, whichever parameters share a native call. An FSDP2 shard's elements
draw at their indexes in the whole parameter (:func:`global_offset`), with the seed the block-wise optimizers
take from the first rank of the parameter's mesh (:func:`agree_seed`), so the ranks round as one process.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["COUNTER_BITS", "agree_seed", "global_offset", "stream_seed"]

# Each parameter's draws take a counter range of 2**40 elements of its own.
COUNTER_BITS = 40


def stream_seed(base: int, stream: int) -> int:
    """A seed for draw stream ``stream`` of a step whose base seed is ``base`` (same on every rank)."""
    return (base * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9) % 2**62


def global_offset(p: Tensor) -> int:
    """The index, in the whole parameter, of the first element of its local tensor: 0 for a plain tensor, the
    shard's offset for an FSDP2 DTensor, whose local elements must then be one run of the parameter's (sharded
    on the first axis, as FSDP2 shards), so that each element draws at its global index on any world size."""
    if not isinstance(p, DTensor):
        return 0
    local_shape, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if list(local_shape[1:]) != list(p.shape[1:]):
        raise ValueError(
            f"lowbit: stochastic rounding (rounding='stochastic') needs DTensor parameters sharded on their first "
            f"axis (one run of the parameter's elements per rank); got placements {p.placements}"
        )
    return int(offsets[0]) * math.prod(p.shape[1:]) if p.dim() else 0


def agree_seed(seed: int, p: DTensor) -> int:
    """The ``seed`` of the first rank of ``p``'s device mesh, on every rank of the mesh (a broadcast along each
    mesh dimension in turn from its first rank), so that the shards and replicas of a parameter draw with one
    seed whatever each rank's generator drew. Every rank of the mesh must call it."""
    mesh = p.device_mesh
    value = torch.tensor([seed], dtype=torch.int64, device=mesh.device_type)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value.item())
