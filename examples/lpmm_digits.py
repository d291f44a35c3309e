"""LPMM on scikit-learn's digits: low-precision parameters, gradients and momentum against fp32 SGDM.

    python examples/lpmm_digits.py [--seeds 3] [--epochs 20]

Converting a model is one call, and LPMMSGD replaces torch.optim.SGD::

    lowbit.lpmm.convert(model, param_bits=12, grad_bits=8)       # lpmm.txt: 12/8/8 bits
    opt = lowbit.optim.LPMMSGD(model.parameters(), lr=0.05, momentum=0.9)

Two experiments, each on the same data split, initial weights and batch order for every
configuration (SGD with momentum 0.9 and a cosine learning-rate schedule):

1. An MLP (64-128-10) for 20 epochs: fp32 ``torch.optim.SGD`` against LPMM at 12/8/8 bits, and the
   ablation at 8-bit parameters (lpmm.txt Table 2): round-to-nearest everywhere, stochastic rounding,
   stochastic rounding with N = 8 micro-batches per step.
2. Logistic regression (the convex case of section 4) with a small learning rate, where 8-bit
   round-to-nearest stalls (section 3.2): fp32 and 8/8/8 LPMM, N = 1 and N = 8.

Prints test accuracy per seed, final training loss and the model memory measured by
``lowbit.lpmm.memory_report`` (bytes per parameter: parameters + gradients + momentum).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import lowbit.lpmm
import lowbit.optim

Bits = Optional[tuple[int, int, str]]  # (param_bits, grad_bits, rounding); None: fp32


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """1437 training and 360 test images (pixels scaled to [0, 1]), split by a fixed permutation."""
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm[:1437]], y[perm[:1437]], x[perm[1437:]], y[perm[1437:]]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def logistic() -> nn.Module:
    return nn.Linear(64, 10)


def fit(
    make: Callable[[], nn.Module],
    bits: Bits,
    *,
    lr: float,
    epochs: int,
    seed: int,
    micro: int = 1,
    batch: int = 32,
) -> tuple[float, float, float]:
    """Train with SGDM; returns (test accuracy, training loss, model bytes per parameter).

    Each step accumulates ``micro`` mini-batches of ``batch`` examples (lpmm.txt Algorithm 1, lines
    3-6), so one epoch has ``1437 // (batch * micro)`` steps.
    """
    xtr, ytr, xte, yte = digits_split()
    torch.manual_seed(seed)
    model = make()
    if bits is None:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        param_bits, grad_bits, rounding = bits
        lowbit.lpmm.convert(model, param_bits=param_bits, grad_bits=grad_bits, rounding=rounding)
        opt = lowbit.optim.LPMMSGD(model.parameters(), lr=lr, momentum=0.9, momentum_bits=8, rounding=rounding)
    order = torch.Generator().manual_seed(seed + 1)
    per_epoch = len(xtr) // (batch * micro)
    total, t = epochs * per_epoch, 0
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), generator=order)
        for s in range(per_epoch):
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * t / total))
            for m in range(micro):
                idx = perm[(s * micro + m) * batch : (s * micro + m + 1) * batch]
                F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            t += 1
            if t == total:  # measured while the gradients of the last step still exist
                report = lowbit.lpmm.memory_report(model, opt)
            opt.zero_grad()
    with torch.no_grad():
        accuracy = float((model(xte).argmax(1) == yte).float().mean())
        loss = float(F.cross_entropy(model(xtr), ytr))
    return accuracy, loss, report.bytes_per_param


def table(title: str, rows: list[tuple[str, Callable[[int], tuple[float, float, float]]]], seeds: int) -> None:
    print(f"\n{title}")
    print(f"{'configuration':<34}{'test accuracy % per seed':>28}{'mean':>8}{'train loss':>12}{'bytes/param':>13}")
    for name, run in rows:
        results = [run(seed) for seed in range(seeds)]
        accs = " ".join(f"{100 * a:5.1f}" for a, _, _ in results)
        mean_acc = 100 * sum(a for a, _, _ in results) / seeds
        mean_loss = sum(v for _, v, _ in results) / seeds
        print(f"{name:<34}{accs:>28}{mean_acc:>8.2f}{mean_loss:>12.4f}{results[0][2]:>13.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description="LPMM against fp32 SGDM on scikit-learn's digits")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args()
    e = args.epochs

    def mlp_run(bits: Bits, micro: int = 1) -> Callable[[int], tuple[float, float, float]]:
        return lambda seed: fit(mlp, bits, lr=0.05, epochs=e, seed=seed, micro=micro)

    table(
        f"MLP 64-128-10, SGDM lr 0.05, {e} epochs, batch 32",
        [
            ("fp32 SGDM", mlp_run(None)),
            ("LPMM 12/8/8 stochastic", mlp_run((12, 8, "stochastic"))),
            ("LPMM 8/8/8 nearest", mlp_run((8, 8, "nearest"))),
            ("LPMM 8/8/8 stochastic", mlp_run((8, 8, "stochastic"))),
            ("LPMM 8/8/8 stochastic, N=8", mlp_run((8, 8, "stochastic"), 8)),
        ],
        args.seeds,
    )

    def logistic_run(bits: Bits, micro: int = 1) -> Callable[[int], tuple[float, float, float]]:
        return lambda seed: fit(logistic, bits, lr=0.002, epochs=max(e // 2, 1), seed=seed, micro=micro, batch=16)

    table(
        f"logistic regression, SGDM lr 0.002, {max(e // 2, 1)} epochs, batch 16",
        [
            ("fp32 SGDM", logistic_run(None)),
            ("fp32 SGDM, N=8", logistic_run(None, 8)),
            ("LPMM 8/8/8 nearest", logistic_run((8, 8, "nearest"))),
            ("LPMM 8/8/8 nearest, N=8", logistic_run((8, 8, "nearest"), 8)),
            ("LPMM 8/8/8 stochastic", logistic_run((8, 8, "stochastic"))),
            ("LPMM 8/8/8 stochastic, N=8", logistic_run((8, 8, "stochastic"), 8)),
        ],
        args.seeds,
    )


if __name__ == "__main__":
    main()
