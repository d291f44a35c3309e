"""The learning rate of the demo's ``muon8bit`` configuration (``lowbit.demo.MUON_LR``): its final train and
held-out losses for each of ``--lrs``, trained exactly as ``python -m lowbit demo --configs muon8bit`` trains
it (the demo's model, batches, schedule and the AdamW part's lr), one after another in this process.

    python benchmarks/sweep_demo_muon_lr.py [--lrs 0.005,0.01,0.02,0.04,0.08] [--seed 0] [--steps 300]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch
from common import environment, parse

from lowbit import demo

CPU = torch.device("cpu")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default="0.005,0.01,0.02,0.04,0.08", help="comma-separated Muon learning rates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=None)
    args = parse(p, argv)
    lrs = [float(v) for v in args.lrs.split(",")]
    cfg = demo.ModelConfig()
    train, heldout, starts = demo.split_and_sample(demo.load_text(), cfg, args.steps, args.seed, CPU)
    print(" ".join(f"{k}={v}" for k, v in environment("cpu", seed=args.seed, steps=args.steps).items()))
    print(f"{'Muon lr':>8}{'train loss':>12}{'held-out':>10}")
    for lr in lrs:
        # make_config reads the module's MUON_LR when it builds the configuration.
        demo.MUON_LR = lr
        r = demo.train_config("muon8bit", cfg, args.seed, CPU, train, heldout, starts)
        print(f"{lr:>8g}{r.train_loss:>12.4f}{r.heldout_loss:>10.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
