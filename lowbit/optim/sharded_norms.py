"""The norm modes of FSDP2 shards: per-tensor sums of p^2 and u^2 add up over the ranks that hold a
parameter's shards, and the update scales follow from the sums (include/lowbit/optim_rules.h:
update_scale)."""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lowbit._C import NORM_TRUST
from lowbit._ops import StepHyper


def sum_over_shards(rows: Tensor, originals: list[Tensor]) -> Tensor:
    """``rows`` (one row per tensor, of per-shard sums) with the rows of FSDP2 parameters summed over the
    mesh dimensions their parameter is sharded on: one all-reduce per mesh dimension and layout."""
    layouts: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(originals):
        if isinstance(p, DTensor):
            dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard())
            layouts.setdefault((id(p.device_mesh), *dims), []).append(i)
    if not layouts:
        return rows
    rows = rows.clone()
    for (_, *mesh_dims), members in layouts.items():
        index = torch.tensor(members, device=rows.device)
        part = rows.index_select(0, index)
        mesh = cast(DTensor, originals[members[0]]).device_mesh  # the layouts hold DTensors only
        for d in mesh_dims:
            dist.all_reduce(part, group=mesh.get_group(d))
        rows.index_copy_(0, index, part)
    return rows


def update_scales(sums: Tensor, hyper: StepHyper, norm_mode: int) -> Tensor:
    """optim_rules.h's update_scale for per-tensor sums of p^2 and u^2, in the same double operations."""

    def f32(v: float) -> float:  # the kernel's fp32 hyperparameters
        return float(torch.tensor(v, dtype=torch.float32))

    lr, max_unorm = f32(hyper.lr), f32(hyper.max_unorm)
    p_norm, u_norm = sums[:, 0].double().sqrt(), sums[:, 1].double().sqrt()
    ones = torch.ones_like(p_norm)
    if norm_mode == NORM_TRUST:
        scale = torch.where((p_norm > 0) & (u_norm > 0), p_norm * lr / u_norm, ones)
    else:
        bound = max_unorm * p_norm * lr
        scale = torch.where((p_norm > 0) & (u_norm > bound), bound / u_norm, ones)
    return torch.where(p_norm.isnan() | u_norm.isnan(), p_norm + u_norm, scale).float()
