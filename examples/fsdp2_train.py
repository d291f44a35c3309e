"""FSDP2 training with a lowbit 8-bit optimizer or LPMM, and resharding checkpoints.

    torchrun --nproc_per_node 2 examples/fsdp2_train.py [--steps 20] [--lpmm] [--save DIR] [--load DIR]

Shards a small byte-level GPT (lowbit.demo.TinyGPT) over the ranks with ``fully_shard`` (gloo on the
CPU, NCCL on GPUs) and trains it with :class:`lowbit.optim.AdamW8bit`, which steps each rank's shards in
one fused call and keeps its 8-bit states as DTensors. ``--lpmm`` first converts the model with
:func:`lowbit.lpmm.convert` (12-bit parameters, 8-bit gradient accumulators) and trains it with
:class:`lowbit.optim.LPMMAdamW`: each rank then stores its share of the low-precision groups. ``--save``
writes a ``torch.distributed.checkpoint`` of the model and optimizer after the last step; ``--load``
resumes from one (written with the same ``--lpmm`` choice), which may have been written at another
world size. Rank 0 prints the global mean loss.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import lowbit.lpmm
import lowbit.nn
import lowbit.optim
from lowbit.demo import ModelConfig, build_model, load_text, windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--lpmm", action="store_true", help="12-bit parameters, 8-bit gradients, LPMMAdamW")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = ModelConfig(batch=16)
    model = build_model(cfg, 0, lambda: lowbit.nn.StableEmbedding(256, cfg.d_model), device)
    if args.lpmm:  # before fully_shard, which then shards the low-precision storage
        lowbit.lpmm.convert(model, param_bits=12, grad_bits=8, group_size=256)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    make = lowbit.optim.LPMMAdamW if args.lpmm else lowbit.optim.AdamW8bit
    opt = make(model.parameters(), lr=cfg.lr)
    start = 0
    if args.load:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=args.load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        start = int(next(iter(opt.state.values()))["step"].item())
    data = load_text(max_bytes=500_000).to(device)
    g = torch.Generator().manual_seed(1234)
    all_starts = torch.randint(0, len(data) - cfg.context - 1, (start + args.steps, cfg.batch), generator=g)
    per_rank = cfg.batch // world
    for step in range(start, start + args.steps):
        starts = all_starts[step, rank * per_rank : (rank + 1) * per_rank].to(device)
        x, y = windows(data, starts, cfg.context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step + 1}: loss {total.item() / world:.4f}")
    if args.save:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=args.save)
        if rank == 0:
            print(f"saved {args.save}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
