"""Training-quality check: 8-bit Adam + StableEmbedding against torch Adam.

    python examples/train_lm_8bit.py [--steps 300] [--device cpu] [--seed 0]

Trains a small byte-level GPT-style language model three times on the same text, from the same
initial weights (apart from the token embedding), with the same batches: with ``torch.optim.Adam``
and ``nn.Embedding``; with ``torch.optim.Adam`` and ``lowbit.nn.StableEmbedding``; and with
``lowbit.optim.Adam8bit`` and ``lowbit.nn.StableEmbedding`` (8bit-optimizers.txt sections 2 and
2.3). The second run has the third's model, so comparing those two isolates the 8-bit optimizer
states; comparing the first and third gives the paper's recipe against the usual setup. The text is
the CPython standard library's top-level ``.py`` files in sorted order, the first 1.5 MB; the last
10 % is held out. Prints each run's final training loss (mean of the last 20 steps), held-out loss,
optimizer state bytes and time, and the relative differences.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import lowbit.nn
import lowbit.optim
from lowbit.demo import VOCAB, ModelConfig, TinyGPT, build_model, evaluate, load_text, windows

HOLDOUT = 0.1
FINAL_WINDOW = 20
EVAL_WINDOWS = 1024


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state (moments, absmax, step counters)."""
    return sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))


@dataclass
class Result:
    """What one run measured."""

    train_loss: float
    heldout_loss: float
    state_bytes: int
    eight_bit_tensors: int
    seconds: float


def train(
    model: TinyGPT,
    opt: torch.optim.Optimizer,
    train_data: torch.Tensor,
    heldout: torch.Tensor,
    starts: torch.Tensor,
    cfg: ModelConfig,
) -> Result:
    """Run one optimizer step per row of ``starts`` and measure the result."""
    t0 = time.perf_counter()
    losses = []
    for step_starts in starts:
        x, y = windows(train_data, step_starts, cfg.context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    last = losses[-FINAL_WINDOW:]
    eight_bit = sum(1 for s in opt.state.values() for t in s.values() if getattr(t, "dtype", None) == torch.uint8)
    return Result(
        sum(last) / len(last),
        evaluate(model, heldout, cfg.context, cfg.batch, EVAL_WINDOWS),
        state_bytes(opt),
        eight_bit,
        time.perf_counter() - t0,
    )


def main() -> None:
    """Train the three runs and print the comparisons."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    cfg, device = ModelConfig(), torch.device(args.device)

    data = load_text()
    split = int(len(data) * (1 - HOLDOUT))
    train_data, heldout = data[:split].to(device), data[split:].to(device)
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, split - cfg.context - 1, (args.steps, cfg.batch), generator=g).to(device)
    print(
        f"data: {len(data):,} bytes of {Path(sysconfig.get_paths()['stdlib'])}/*.py, "
        f"{split:,} train / {len(data) - split:,} held out; {args.steps} steps of {cfg.batch}x{cfg.context} bytes"
    )

    runs = {
        "torch.optim.Adam + nn.Embedding": (
            lambda: nn.Embedding(VOCAB, cfg.d_model),
            lambda params: torch.optim.Adam(params, lr=cfg.lr),
        ),
        "torch.optim.Adam + lowbit.nn.StableEmbedding": (
            lambda: lowbit.nn.StableEmbedding(VOCAB, cfg.d_model),
            lambda params: torch.optim.Adam(params, lr=cfg.lr),
        ),
        "lowbit.optim.Adam8bit + lowbit.nn.StableEmbedding": (
            lambda: lowbit.nn.StableEmbedding(VOCAB, cfg.d_model),
            lambda params: lowbit.optim.Adam8bit(params, lr=cfg.lr),
        ),
    }
    results = []
    for name, (embedding, optimizer) in runs.items():
        model = build_model(cfg, args.seed, embedding, device)
        if not results:
            n_params = sum(p.numel() for p in model.parameters())
            big = sum(1 for p in model.parameters() if p.numel() >= 4096)
            print(
                f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, context {cfg.context}, "
                f"{n_params:,} parameters in {len(list(model.parameters()))} tensors ({big} with >= 4096 elements)"
            )
        r = train(model, optimizer(model.parameters()), train_data, heldout, starts, cfg)
        results.append(r)
        print(
            f"{name:<50} final train loss {r.train_loss:.4f}  held-out loss {r.heldout_loss:.4f}  "
            f"state {r.state_bytes:,} bytes ({r.eight_bit_tensors} uint8 tensors)  {r.seconds:.1f} s"
        )
        if not (math.isfinite(r.train_loss) and math.isfinite(r.heldout_loss)):
            raise SystemExit(f"{name}: non-finite loss")

    base, same_model, low = results
    for label, ref in (("torch Adam, same model", same_model), ("torch Adam + nn.Embedding", base)):
        print(
            f"8-bit relative to {label}: train {100 * (low.train_loss / ref.train_loss - 1):+.2f}%, "
            f"held-out {100 * (low.heldout_loss / ref.heldout_loss - 1):+.2f}%, "
            f"optimizer state {low.state_bytes / ref.state_bytes:.3f}x"
        )


if __name__ == "__main__":
    main()
