"""Multi-process training jobs for tests/test_distributed.py (gloo on the CPU, spawned processes).

Every job trains the same small byte-level transformer (lowbit.demo.TinyGPT) on the same global
batches; with world size W, rank r takes rows [r B / W, (r + 1) B / W) of each batch of B. The loss
recorded per step is the global mean (the all-reduced mean of the ranks' losses), so runs at different
world sizes are comparable. Rank 0 writes the result as JSON.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import lowbit.lpmm
import lowbit.nn
import lowbit.optim
from lowbit._reference import optim as reference_optim
from lowbit.demo import ModelConfig, build_model, load_text, windows
from lowbit.optim.rounding import COUNTER_BITS, stream_seed

# context 15: the position table has 15 rows, which two ranks shard unevenly (8 + 7).
CFG = ModelConfig(layers=2, d_model=32, heads=4, context=15, batch=8, lr=3e-3)
OPTIMIZERS = {
    "Adam8bit": lambda params: lowbit.optim.Adam8bit(params, lr=CFG.lr, min_8bit_size=256),
    "AdamW8bit": lambda params: lowbit.optim.AdamW8bit(params, lr=CFG.lr, min_8bit_size=256),
    "SGD8bit": lambda params: lowbit.optim.SGD8bit(params, lr=0.05, momentum=0.9, min_8bit_size=256),
    "AdamW32bit": lambda params: lowbit.optim.AdamW32bit(params, lr=CFG.lr),
    "AdamW4bit": lambda params: lowbit.optim.AdamW4bit(params, lr=CFG.lr, min_4bit_size=256),
    # The opt-in rank-1 second moments of matrices (the MAX all-reduce of their statistics).
    "AdamW4bit-rank1": lambda params: lowbit.optim.AdamW4bit(
        params, lr=CFG.lr, min_4bit_size=256, rank1_normalization=True
    ),
    # Whole-tensor norms of sharded tensors: LARS's trust ratio, percentile clipping's gradient norms,
    "LARS8bit": lambda params: lowbit.optim.LARS8bit(params, lr=5.0, weight_decay=1e-4, min_8bit_size=256),
    "Adam8bit-clip": lambda params: lowbit.optim.Adam8bit(params, lr=CFG.lr, min_8bit_size=256, percentile_clipping=50),
    # Norms of the update inside the fused step (LAMB's trust ratio; max_unorm takes the same path).
    "LAMB8bit": lambda params: lowbit.optim.LAMB8bit(params, lr=3e-2, min_8bit_size=256),
    "SGD4bit": lambda params: lowbit.optim.SGD4bit(params, lr=0.05, momentum=0.9, min_4bit_size=256),
    "Lion8bit": lambda params: lowbit.optim.Lion8bit(params, lr=3e-4, min_8bit_size=256),
    "RMSprop8bit": lambda params: lowbit.optim.RMSprop8bit(params, lr=1e-3, min_8bit_size=256),
    "Adagrad8bit": lambda params: lowbit.optim.Adagrad8bit(params, lr=1e-2, min_8bit_size=256),
    "AdEMAMix8bit": lambda params: lowbit.optim.AdEMAMix8bit(
        params, lr=CFG.lr, t_alpha=2, t_beta3=2, min_8bit_size=256
    ),
    # Factorized second moments of matrices (the sharded matrices' column sums and row means span the ranks).
    "AdamW4bit-factored": lambda params: lowbit.optim.AdamW4bit(params, lr=CFG.lr, min_4bit_size=256, factored=True),
    "LPMMSGD": lambda params: lowbit.optim.LPMMSGD(params, lr=0.05, momentum=0.9),
    "LPMMAdamW": lambda params: lowbit.optim.LPMMAdamW(params, lr=CFG.lr),
}


# Stochastic rounding under FSDP2 (_rounding_check). FSDP2 splits dim 0 as torch.chunk does: at world size 2,
# 15 x 32 into 8 + 7 rows (uneven; the boundary, element 256, is a block edge at 128 and 256), 64 x 64 into
# 32 + 32, and 9 x 100 into 5 + 4 rows, whose boundary, element 500, falls inside a block.
ROUNDING_SHAPES = [(15, 32), (64, 64), (9, 100)]
ROUNDING_SEED = 0x5EED_0F_A11  # every rank's rounding_seed, given through the param group
ROUNDING_OPTIMIZERS = {
    "AdamW4bit": lambda groups: lowbit.optim.AdamW4bit(
        groups, lr=1e-2, weight_decay=0.1, min_4bit_size=0, rounding="stochastic"
    ),
    "Adam8bit": lambda groups: lowbit.optim.Adam8bit(groups, lr=1e-2, min_8bit_size=0, rounding="stochastic"),
    # No rounding_seed given: each rank draws its own from torch's generator, seeded per rank (as a job that
    # shuffles its data per rank seeds it), and the optimizer takes rank 0's.
    "Adam8bit-own-seeds": lambda groups: lowbit.optim.Adam8bit(
        [{k: v for k, v in g.items() if k != "rounding_seed"} for g in groups],
        lr=1e-2,
        min_8bit_size=0,
        rounding="stochastic",
    ),
}


def _replay_step(opt: torch.optim.Optimizer, p: torch.Tensor, before: dict[str, Any], offset: int) -> dict[str, Any]:
    """The step of ``p``'s local shard from ``before`` (its parameter, gradient and state before the step), by
    the pure-PyTorch twin with the rounding table built here: the step's stream seed and the counter
    ``position * 2**COUNTER_BITS + offset`` of the shard's first element (``offset``: its index in the whole
    parameter, computed from torch.chunk's split, not by lowbit)."""
    config = opt._config(opt.param_groups[0], p)
    hyper, flags = opt._hyper(config)
    hyper = hyper._replace(max_unorm=config["max_unorm"])
    bits = config["optim_bits"]
    maps = [lowbit.optim.state_storage.optimizer_state_map(s, torch.device("cpu"), bits) for s in (True, False, True)]
    step = before["step"] + 1
    position = next(i for i, q in enumerate(opt.param_groups[0]["params"]) if q is p)
    param = before["param"].clone()
    states = [before["state1"].clone(), before["state2"].clone()]
    absmaxes = [before["absmax1"].clone(), before["absmax2"].clone()]
    none: list[torch.Tensor] = []
    args = lowbit._ops.StepArgs(
        params=[param],
        grads=[before["grad"]],
        state1=[states[0]],
        state2=[states[1]],
        state3=none,
        absmax1=[absmaxes[0]],
        absmax2=[absmaxes[1]],
        absmax3=none,
        scalars=list(opt._step_scalars(config, step)),
        grad_scales=None,
        map1=maps[0],
        map2=maps[1],
        map3=maps[2],
        rule=opt._rule_code(config),
        hyper=hyper.values(),
        flags=flags,
        norm_mode=0,
        n_states=2,
        block_size=config["block_size"],
        state_bits=bits,
        rounding=[stream_seed(config["rounding_seed"], step), (position << COUNTER_BITS) + offset],
    )
    reference_optim.optimizer_step_(*args)
    return {"param": param, "state1": states[0], "state2": states[1], "absmax1": absmaxes[0], "absmax2": absmaxes[1]}


def _local_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """The local shard of ``p`` and of its gradient and state, copied."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    state = opt.state.get(p, {})
    out = {"param": local(p), "grad": local(p.grad), "step": int(state["step"]) if state else 0}
    for k in (1, 2):
        if state:
            out[f"state{k}"], out[f"absmax{k}"] = local(state[f"state{k}"]), state[f"absmax{k}"].clone()
    return out


def _rounding_check(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Three steps of each of ROUNDING_OPTIMIZERS (rounding="stochastic") on the parameters of
    ROUNDING_SHAPES (sharded by fully_shard when job["parallel"] is "fsdp"), whose gradients are the same whole
    tensors on every rank (each takes its shard: no reduction rounds them, so the world sizes see the same
    values). For each optimizer and parameter: a hash of the gathered parameter and one of each gathered,
    dequantized state; the first element's index and the block size (to show where the shard boundaries fall);
    and whether the last step of the local shard equals the twin's replay of it (_replay_step); and each rank's
    rounding_seed, constructed (after torch.manual_seed(1000 + rank)) and after the steps."""
    out: dict[str, Any] = {}
    for name, make in ROUNDING_OPTIMIZERS.items():
        gen = torch.Generator().manual_seed(0)
        model = nn.ParameterList(nn.Parameter(torch.randn(shape, generator=gen) * 0.1) for shape in ROUNDING_SHAPES)
        if job["parallel"] == "fsdp":
            fully_shard(model)
        params = list(model.parameters())
        torch.manual_seed(1000 + rank)
        opt = make([{"params": params, "rounding_seed": ROUNDING_SEED}])
        drawn = opt.param_groups[0]["rounding_seed"]
        befores: list[dict[str, Any]] = []
        for step in range(3):
            for p in params:
                g = torch.randn(p.shape, generator=gen)
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
            if step == 2:
                befores = [_local_state(opt, p) for p in params]
            opt.step()
        seeds = [None] * world
        dist.all_gather_object(seeds, [drawn, opt.param_groups[0]["rounding_seed"]])
        results = []
        for p, before, shape in zip(params, befores, ROUNDING_SHAPES, strict=True):
            rows = [len(c) for c in torch.arange(shape[0]).chunk(world)]
            offset = sum(rows[:rank]) * shape[1] if isinstance(p, DTensor) else 0
            replay = _replay_step(opt, p, before, offset)
            now = _local_state(opt, p)
            equal = all(torch.equal(replay[key], now[key]) for key in replay)
            equal = torch.tensor(int(equal))
            if world > 1:
                dist.all_reduce(equal, op=dist.ReduceOp.MIN)

            def digest(t: torch.Tensor) -> str:
                t = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
                return hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

            states = opt.dequantized_state(p)
            results.append(
                {
                    "param": digest(p),
                    "states": {key: digest(v) for key, v in sorted(states.items()) if key != "step"},
                    "codes": str(opt.state[p]["state1"].dtype),
                    "offsets": [sum(rows[:r]) * shape[1] for r in range(world)],
                    "block_size": opt.param_groups[0]["block_size"],
                    "replayed": bool(equal),
                }
            )
        # Each rank's rounding_seed as constructed and after the steps.
        out[name] = {"params": results, "seeds": seeds}
    return out


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, h, use_reentrant=False)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = load_text(max_bytes=200_000)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - CFG.context - 1, (steps, CFG.batch), generator=g)
    return [windows(data, s, CFG.context) for s in starts]


def _model(job: dict[str, Any]) -> nn.Module:
    """The model of ``job``: job["stable"] takes lowbit's StableEmbedding for the token table,
    job["compress"] swaps in inverted activations, job["lpmm"] = [param_bits, grad_bits] converts it,
    job["checkpoint"] recomputes each block in backward; then job["parallel"]."""
    table = lowbit.nn.StableEmbedding if job.get("stable") else nn.Embedding
    model = build_model(CFG, 0, lambda: table(256, CFG.d_model), torch.device("cpu"))
    if job.get("compress"):
        lowbit.nn.compress_activations(model, method="invact")
    if job.get("lpmm"):
        lowbit.lpmm.convert(model, param_bits=job["lpmm"][0], grad_bits=job["lpmm"][1], group_size=64)
    if job["parallel"] == "fsdp":
        for block in model.blocks:
            fully_shard(block)
    if job.get("checkpoint"):
        model.blocks = nn.ModuleList(Checkpointed(block) for block in model.blocks)
    if job["parallel"] == "fsdp":
        fully_shard(model)
    elif job["parallel"] == "ddp":
        model = DistributedDataParallel(model)
    return model


def _in_sync(model: nn.Module) -> bool:
    """Whether every rank holds the same parameter values (plain or low-precision)."""
    values = [t.detach().double().sum() for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    mine = torch.stack(values)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, mine) for g in gathered)


def _state_dtypes(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
    """The dtypes of the non-scalar optimizer states of ``p``."""
    return sorted({str(v.dtype) for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim()})


def _lpmm_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of a converted model's whole low-precision storage: every parameter's value and momentum
    codes and absmaxes, gathered from the ranks when sharded (every rank must call it)."""

    def whole(t: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
        t = t.full_tensor() if isinstance(t, DTensor) else t
        return t.reshape(-1)[: (numel * bits + 7) // 8] if t.dtype == torch.uint8 else t

    digest = hashlib.sha256()
    for _, lp in sorted(lowbit.lpmm.low_precision_parameters(model).items()):
        digest.update(lp.dequantize().numpy().tobytes())
        state = opt.state[lp.handle]
        for key in ("state1", "absmax1"):
            digest.update(whole(state[key], lp.numel(), 8).numpy().tobytes())
    return digest.hexdigest()


def _rank1_inputs(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """What the statistics pass of the next step reads, for each parameter with rank-1 statistics whose local
    shards are even and whole blocks of 128 (so the ranks' exp_avg blocks, concatenated, are the whole
    tensor's; the same parameters on every rank)."""
    out = []
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        state = opt.state.get(p, {})
        shard = p.to_local() if isinstance(p, DTensor) else p
        if "axis_max2" not in state or p.shape[0] % dist.get_world_size() or shard.numel() % 128:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local = {k: state[k].to_local() if isinstance(state[k], DTensor) else state[k] for k in ("state1", "state2")}
        out.append(
            {"index": i, "shape": list(p.shape), "param": shard.detach().clone(), "grad": grad.detach().clone()}
            | {k: v.clone() for k, v in local.items()}
            | {"absmax1": state["absmax1"].clone(), "axis_max2": state["axis_max2"].clone(), "step": int(state["step"])}
        )
    return out


def _statistics(
    t: dict[str, Any], offset: int, dims: list[int], old: torch.Tensor, scalars: list[float], hyper: Any, flags: int
) -> torch.Tensor:
    """The rank-1 statistics pass of AdamW4bit's step on ``t``'s tensors, elements ``offset ..`` of ``dims``."""
    maps = [lowbit.optim.state_storage.optimizer_state_map(s, torch.device("cpu"), 4) for s in (True, False, False)]
    new = torch.zeros(sum(dims))
    none: list[torch.Tensor] = []
    args = lowbit._ops.StepArgs(
        params=[t["param"].clone()],
        grads=[t["grad"]],
        state1=[t["state1"]],
        state2=[t["state2"]],
        state3=none,
        absmax1=[t["absmax1"]],
        absmax2=[torch.empty(0)],
        absmax3=none,
        scalars=scalars,
        grad_scales=None,
        map1=maps[0],
        map2=maps[1],
        map3=maps[2],
        rule=0,
        hyper=hyper.values(),
        flags=flags,
        norm_mode=0,
        n_states=2,
        block_size=128,
        state_bits=4,
        rank1=[len(dims), offset, *dims],
        axis_max=old,
        new_axis_max=new,
    )
    lowbit._ops.rank1_statistics_(*args)
    return new


def _rank1_check(opt: torch.optim.Optimizer, inputs: list[dict[str, Any]]) -> dict[str, int]:
    """The statistics every rank holds after the step against those of one process: the statistics pass on
    the whole tensors (the ranks' shards concatenated, offset 0), bit for bit; and how many differ from the
    rank's own shard's maxima (those the all-reduce had to complete)."""
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, inputs)
    params = [p for g in opt.param_groups for p in g["params"]]
    config = opt._config(opt.param_groups[0], params[0])
    hyper, flags = opt._hyper(config)
    equal = partial_differs = 0
    for j, mine in enumerate(inputs):
        parts = [r[j] for r in ranks]
        whole = {k: torch.cat([part[k] for part in parts]) for k in ("param", "grad", "state1", "state2", "absmax1")}
        dims = mine["shape"]
        scalars = list(opt._step_scalars(config, mine["step"] + 1))
        held = opt.state[params[mine["index"]]]["axis_max2"]
        equal += int(torch.equal(_statistics(whole, 0, dims, mine["axis_max2"], scalars, hyper, flags), held))
        rank = dist.get_rank()
        offset = sum(parts[r]["param"].numel() for r in range(rank))
        partial = _statistics(mine, offset, dims, mine["axis_max2"], scalars, hyper, flags)
        partial_differs += int(not torch.equal(partial, held))
    return {"checked": len(inputs), "equal": equal, "partial_differs": partial_differs}


# factored_check's parameters, each rank's shard starting at a multiple of the 4-bit m's 128-element blocks (so that
# m is quantized in the one-process blocks): matrices whose second shard starts at a multiple of 64 rows (256 and
# 128 rows: at 128 and 64) or not (160: at 80; 161: at 81, the ranks' shards uneven), 3-axis tensors split
# evenly (4 slices: 2 + 2) or not (5 slices: 3 + 2).
FACTORED_SHAPES = [(256, 40), (128, 96), (160, 128), (161, 128), (5, 64, 8), (4, 70, 64)]


def factored_check(world: int) -> dict[str, Any]:
    """AdamW4bit(factored=True) on FSDP2 parameters of FACTORED_SHAPES, and HSDP-style ones (mesh (1, world),
    placements (Replicate(), Shard(0))) of its first and fourth shapes, against the same optimizer on plain copies
    (every rank steps both with the same whole gradients), over 4 steps: per parameter, whether the gathered
    parameter, row2, col2 and the dequantized v_hat equal the plain ones bit for bit, the factors' and v_hat's largest
    relative differences and the parameter's largest absolute one. "fallback": how many ranks keep factors and
    block-wise states for a (1, 300) matrix, whose second rank's shard is empty."""
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(s, generator=gen) for s in FACTORED_SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in FACTORED_SHAPES] for _ in range(4)]
    module = nn.ParameterList([nn.Parameter(v.clone()) for v in values])
    fully_shard(module)
    hsdp = init_device_mesh("cpu", (1, world))
    names = [str(list(s)) for s in FACTORED_SHAPES] + [f"hsdp {list(FACTORED_SHAPES[i])}" for i in (0, 3)]
    values += [values[0], values[3]]
    grads = [step + [step[0], step[3]] for step in grads]
    sharded = [*module] + [nn.Parameter(distribute_tensor(v, hsdp, [Replicate(), Shard(0)])) for v in values[-2:]]
    plain = [nn.Parameter(v.clone()) for v in values]
    options = {"lr": 1e-2, "weight_decay": 0.1, "min_4bit_size": 0, "factored": True}
    opts = [lowbit.optim.AdamW4bit(sharded, **options), lowbit.optim.AdamW4bit(plain, **options)]
    for step in grads:
        for p, q, g in zip(sharded, plain, step, strict=True):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            q.grad = g.clone()
        for opt in opts:
            opt.step()

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())

    def absolute(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    out: dict[str, Any] = {}
    for name, p, q in zip(names, sharded, plain, strict=True):
        mine, ref = opts[0].state[p], opts[1].state[q]
        pairs = {"param": (p.detach().full_tensor(), q.detach())}
        pairs |= {key: (mine[key].full_tensor(), ref[key]) for key in ("row2", "col2")}
        # v_hat as the state's dequantized form (a matrix's mean over the all-gathered rows).
        v_hat = opts[0].dequantized_state(p)["exp_avg_sq"].full_tensor()
        pairs["v_hat"] = (v_hat, opts[1].dequantized_state(q)["exp_avg_sq"])
        out[name] = {
            "equal": {k: torch.equal(a, b) for k, (a, b) in pairs.items()},
            "difference": {k: (absolute if k == "param" else relative)(a, b) for k, (a, b) in pairs.items()},
            "placements": [str(mine[key].placements) for key in ("row2", "col2")],
        }
    tiny = nn.ParameterList([nn.Parameter(torch.randn(1, 300, generator=gen))])
    fully_shard(tiny)
    tiny[0].grad = distribute_tensor(torch.randn(1, 300, generator=gen), tiny[0].device_mesh, tiny[0].placements)
    opt = lowbit.optim.AdamW4bit(list(tiny), **options)
    opt.step()
    kept = torch.tensor([float("row2" in opt.state[tiny[0]]), float("state2" in opt.state[tiny[0]])])
    dist.all_reduce(kept)
    return {"shapes": out, "fallback": {"factors": int(kept[0]), "block_wise": int(kept[1])}}


def _digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of the parameters (LPMM storage: its values, gathered), and the optimizer states (every rank
    must call it)."""
    digest = hashlib.sha256()
    params = [p for g in opt.param_groups for p in g["params"]]
    # In param-group order: opt.state's order is the order in which states were created.
    lpmm_values = [lp.dequantize() for _, lp in sorted(lowbit.lpmm.low_precision_parameters(model).items())]
    tensors = list(model.parameters()) + lpmm_values + [v for p in params for _, v in sorted(opt.state[p].items())]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
            digest.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Train job["steps"] steps (from job["start"], default 0) with job["optimizer"] on the model of
    _model(job) under job["parallel"] ("fsdp", "ddp" or "none": plain data parallelism). Loads a DCP
    checkpoint from job["load"] first (the model only with job["load_optimizer"] False) and saves one
    to job["save"] after job["save_after"] steps, if given. job["release"] steps in backward
    (lowbit.optim.step_in_backward, given the model unless it is "no-model"); a refusal is the result,
    as {"refused": message}. job["micro"] splits each rank's batch into that many micro-batches whose
    gradients are summed before the step."""
    model = _model(job)
    opt = OPTIMIZERS[job["optimizer"]](model.parameters())
    start = job.get("start", 0)
    if job.get("load"):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        if not job.get("load_optimizer", True):  # the weights only (to show what the state is worth)
            del state["optim"]
        dcp.load(state, checkpoint_id=job["load"])
        set_model_state_dict(model, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(model, opt, state["optim"])
    release = None
    if job.get("release"):  # gradient release (lowbit.optim.gradient_release); DDP is refused
        try:
            release = lowbit.optim.step_in_backward(opt, None if job["release"] == "no-model" else model)
        except ValueError as exc:
            return {"refused": str(exc)}
    micro = job.get("micro", 1)
    grads_left = 0
    digests = {}
    if job.get("lpmm") and job.get("load"):
        digests["loaded"] = _lpmm_digest(model, opt)
    rank1: dict[str, int] = {}
    losses = []
    per_rank = CFG.batch // world
    for step, (x, y) in enumerate(_batches(start + job["steps"])[start:], start=start):
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        loss = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            part = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / micro
            # Under release, the micro-batches before the last accumulate without stepping.
            with release.accumulate() if release is not None and i < micro - 1 else contextlib.nullcontext():
                part.backward()
            loss += part.detach()
        # Gradients left after backward: .grad tensors and (LPMM) filled accumulators.
        lps = lowbit.lpmm.low_precision_parameters(model).values()
        left = sum(p.grad is not None for p in model.parameters()) + sum(lp.has_grad for lp in lps)
        grads_left = max(grads_left, left)
        last = step + 1 == start + job["steps"]
        rank1_inputs = _rank1_inputs(opt) if job.get("rank1_check") and last else None
        opt.step()
        if rank1_inputs is not None:
            rank1 = _rank1_check(opt, rank1_inputs)
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if job.get("save") and step + 1 == job["save_after"]:
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.save(state, checkpoint_id=job["save"])
            if job.get("lpmm"):
                digests["saved"] = _lpmm_digest(model, opt)
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    # 8-bit states, and those of parameters that the ranks shard unevenly (dim 0 not a multiple of world).
    eight_bit = [v for v in states if v.dtype == torch.uint8]
    uneven = [v for v in eight_bit if v.dim() > 0 and v.shape[0] % world != 0]
    in_sync = None if job["parallel"] == "fsdp" else _in_sync(model)  # FSDP2 ranks hold different shards
    # The optimizer's whole-tensor norms of sharded parameters, and the norms of the gathered tensors.
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)] if hasattr(opt, "_norms") else []
    with torch.no_grad():
        norms = [float(n) for n in opt._norms([p.to_local() for p in sharded], sharded)] if sharded else []
        full_norms = [float(p.full_tensor().norm()) for p in sharded]
    return {
        # Parameters (gathered) and optimizer states (codes gathered, rank 0's absmaxes), hashed.
        "digest": _digest(model, opt),
        "grads_left": grads_left,
        "norms": norms,
        "full_norms": full_norms,
        "losses": losses,
        "eight_bit_states": len(eight_bit),
        "uneven_eight_bit_states": len(uneven),
        "in_sync": in_sync,
        # The dtypes of the StableEmbedding's optimizer states.
        "token_state_dtypes": _state_dtypes(opt, model.tok.weight) if job.get("stable") else [],
        # Bytes of parameters, gradients and optimizer state that rank 0 holds.
        "model_bytes": lowbit.lpmm.memory_report(model, opt).total,
        # LPMM storage digests after saving and after loading a checkpoint.
        "digests": digests,
        # job["rank1_check"]: rank-1 statistics after the last step against one process's (_rank1_check).
        "rank1": rank1,
    }


def run_job(rank: int, world: int, job: dict[str, Any]) -> Any:
    """train() for ``job``; with job["optimizers"], once per optimizer in the same ranks (which saves their
    start-up), as {name: result}, each saving and loading its checkpoint at job["save"] / job["load"] with
    "-{name}" appended."""
    if job.get("factored_check"):
        return {"factored_check": factored_check(world), **run_job(rank, world, {**job, "factored_check": False})}
    if "optimizers" in job:

        def own_checkpoints(name: str) -> dict[str, str]:
            return {key: f"{job[key]}-{name}" for key in ("save", "load") if job.get(key)}

        results = {
            name: train(rank, world, {**job, "optimizer": name, **own_checkpoints(name)}) for name in job["optimizers"]
        }
        if job.get("rounding_check"):  # in the same ranks too
            results["rounding_check"] = _rounding_check(rank, world, job)
        return results
    return train(rank, world, job)


def worker(rank: int, world: int, init_file: str, out: str, job: dict[str, Any]) -> None:
    """Process entry point: one rank of a gloo group running run_job(); rank 0 writes the result to out.
    job["variants"], a list of overrides of the job's other keys, runs each variant in turn in the same ranks
    (every train() builds its model, optimizer and batches from fixed seeds, so a variant gives what it
    would alone) and gives their results as a list."""
    faulthandler.enable()  # a native abort (heap corruption, gloo) prints where each rank was
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if "variants" in job:
            base = {k: v for k, v in job.items() if k != "variants"}
            result = [run_job(rank, world, {**base, **variant}) for variant in job["variants"]]
        else:
            result = run_job(rank, world, job)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
        Path(f"{out}.done{rank}").touch()
    finally:
        dist.destroy_process_group()


def launch(world: int, job: dict[str, Any], tmp: Path, timeout: float = 240.0) -> dict[str, Any]:
    """Run ``job`` on ``world`` spawned ranks; returns rank 0's result. Kills the ranks after ``timeout``."""
    import torch.multiprocessing as mp

    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    init_file, out = tmp / f"init-{tag}", tmp / f"out-{tag}.json"
    ctx = mp.start_processes(
        worker, args=(world, str(init_file), str(out), job), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed job {job} did not finish in {timeout} s")
    except mp.ProcessExitedException:
        # gloo can abort a rank while it tears down ("terminate called without an active exception"),
        # after every rank has passed the final barrier: the job itself finished.
        if not all(Path(f"{out}.done{rank}").exists() for rank in range(world)):
            raise
        for p in ctx.processes:
            p.join()
    return json.loads(out.read_text())
