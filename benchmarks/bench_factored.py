"""Step time of AdamW4bit's factored second moment (``factored=True``) on one matrix, against the block-wise
4-bit and the 8-bit AdamW steps of the same matrix, in one process (issue 28: the 4-bit step is to take at most
1.1x the 8-bit step).

Run from the repository root::

    python benchmarks/bench_factored.py
    python benchmarks/bench_factored.py --rows 1024 --cols 4096 --repeats 20 --threads 2 --json out/factored.json

Options: ``--rows``/``--cols`` (the matrix, default 1024 x 4096), ``--repeats`` (timed steps per optimizer, 20),
``--warmup`` (untimed steps per optimizer first, 3, at least 1), ``--threads`` (``torch.set_num_threads``),
``--dtype`` (float32 or bfloat16), ``--device`` (cpu or cuda), ``--sharded`` (one more row: the factored step of
the matrix as an FSDP2-style ``Shard(0)`` DTensor on a one-rank gloo mesh, whose factors lowbit/optim/factored.py
computes in PyTorch before the native element step; CPU only), ``--json PATH``.

Each optimizer steps its own copy of the matrix with a fixed random gradient; the optimizers take turns (each
round steps every one once), so a noisy neighbour slows them alike. The table gives the median and fastest
step and each median over the AdamW8bit median of the same run: the machine is shared, so that ratio is the
number to read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Optional

import common
import torch
from common import parse, time_once, write_json

import lowbit.optim

LR = 1e-3
BASELINE = "AdamW8bit"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FACTORIES = {
    BASELINE: lambda ps: lowbit.optim.AdamW8bit(ps, lr=LR),
    "AdamW4bit": lambda ps: lowbit.optim.AdamW4bit(ps, lr=LR),
    "AdamW4bit (factored v)": lambda ps: lowbit.optim.AdamW4bit(ps, lr=LR, factored=True),
}


SHARDED = "AdamW4bit (factored v, Shard(0))"


def run(
    rows: int, cols: int, dtype: torch.dtype, device: torch.device, warmup: int, repeats: int, sharded: bool = False
) -> dict[str, list[float]]:
    """Seconds of each timed step, by optimizer (with ``sharded``, the process group is initialised)."""
    torch.manual_seed(0)
    start = torch.randn(rows, cols, dtype=dtype, device=device)
    grad = torch.randn(rows, cols, dtype=dtype, device=device)
    optimizers = {}
    for name, factory in FACTORIES.items():
        p = torch.nn.Parameter(start.clone())
        p.grad = grad.clone()
        optimizers[name] = factory([p])
    if sharded:
        import tempfile

        import torch.distributed as dist
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        init = Path(tempfile.mkdtemp()) / "pg"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
        p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        optimizers[SHARDED] = FACTORIES["AdamW4bit (factored v)"]([p])
    for _ in range(warmup):
        for opt in optimizers.values():
            opt.step()
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for repeat in range(repeats):
        print(f"repeat {repeat + 1}/{repeats} ...", file=sys.stderr, flush=True)
        for name, opt in optimizers.items():
            times[name].append(time_once(opt.step, device))
    return times


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sharded", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = parse(p, argv)
    if args.warmup < 1:
        p.error("--warmup must be at least 1")
    if args.sharded and args.device != "cpu":
        p.error("--sharded runs on the CPU (a gloo mesh)")
    device = torch.device(args.device)
    env = common.environment(args.device, dtype=args.dtype, shape=[args.rows, args.cols])
    print(", ".join(f"{k}={v}" for k, v in env.items()))
    times = run(args.rows, args.cols, DTYPES[args.dtype], device, args.warmup, args.repeats, args.sharded)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{'optimizer':<34} {'median ms':>10} {'best ms':>10} {'x ' + BASELINE:>14}")
    for name, ts in times.items():
        ratio = medians[name] / medians[BASELINE]
        print(f"{name:<34} {medians[name] * 1e3:>10.2f} {min(ts) * 1e3:>10.2f} {ratio:>14.2f}")
    if args.json is not None:
        write_json(args.json, {"environment": env, "seconds": times})


if __name__ == "__main__":
    main()
