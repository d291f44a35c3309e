"""Model memory and speed of LPMM (lpmm.txt) against fp32 SGD with momentum and lowbit's Adam8bit.

Run from the repository root::

    python benchmarks/bench_lpmm.py
    python benchmarks/bench_lpmm.py --width 2048 --layers 4 --repeats 10 --threads 2 --json out/lpmm.json

The model is an MLP of ``--layers`` square Linear layers of ``--width`` (with biases and GELU) fed a
batch of ``--batch`` random inputs. Configurations, all trained from the same initial weights:

- ``torch SGDM``: fp32 parameters and gradients, ``torch.optim.SGD(momentum=0.9)`` (the baseline);
- ``lowbit Adam8bit``: fp32 parameters and gradients, 8-bit block-wise Adam states;
- ``LPMM-SGDM p/g/m``: :func:`lowbit.lpmm.convert` at p-bit parameters and g-bit gradient accumulators,
  :class:`lowbit.optim.LPMMSGD` with m-bit momentum;
- ``LPMM-AdamW 12/8/8``: the same storage with :class:`lowbit.optim.LPMMAdamW`;
- with ``--ablation``, LPMM-SGDM 12/8/8 also with nearest rounding of the momentum (``p SR, m near``),
  of parameters and momentum (``p near, m near``) and without momentum (``no m, p SR`` and
  ``no m, p near``), so that the step's cost splits into its stochastic roundings and its momentum.

Model memory is measured with :func:`lowbit.lpmm.memory_report` after a training step: the storage
bytes of parameters (codes and absmaxes, or fp32 tensors), gradients (accumulators, or ``.grad``) and
optimizer state, per parameter. Two times are taken: ``step`` (``optimizer.step()`` alone; for LPMM the
gradient accumulated by one backward pass, which the step consumes, is restored before each timed step)
and ``iteration`` (forward, backward, step and ``zero_grad``). Configurations take turns in every
repeat, and ratios are to the baseline's median in the same run: this machine is noisy, so the ratios
are the numbers to read.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import cpu_model
from torch import nn

import lowbit
import lowbit.lpmm as lpmm
from lowbit.optim import LPMMSGD, Adam8bit, LPMMAdamW


def make_model(width: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods[:-1])


class Config:
    """One model + optimizer under test, with its timed closures."""

    def __init__(self, name: str, model: nn.Module, make_opt: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
        self.name = name
        self.model = model
        self.opt = make_opt(model)
        self.lpmm = bool(lpmm.low_precision_parameters(model))
        self.step_times: list[float] = []
        self.iter_times: list[float] = []

    def iteration(self, x: torch.Tensor) -> float:
        loss = self.model(x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def accumulate(self, x: torch.Tensor) -> None:
        self.model(x).square().mean().backward()

    def save_grads(self) -> None:
        """Keeps the gradients of one backward pass, for timed_step to restore."""
        if self.lpmm:
            lps = lpmm.low_precision_parameters(self.model).values()
            self.saved = [(lp.grad_absmax.clone(), lp.grad_codes.clone()) for lp in lps]
        else:
            self.saved = [p.grad.clone() for p in self.model.parameters()]

    def timed_step(self) -> float:
        if self.lpmm:
            for lp, (absmax, codes) in zip(lpmm.low_precision_parameters(self.model).values(), self.saved, strict=True):
                lp.grad_absmax.copy_(absmax)
                lp.grad_codes.copy_(codes)
                lp.has_grad = True
        else:
            for p, g in zip(self.model.parameters(), self.saved, strict=True):
                p.grad = g.clone()
        t0 = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--ablation", action="store_true", help="add the rounding and momentum ablations of LPMM-SGDM")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = make_model(args.width, args.layers)
    x = torch.randn(args.batch, args.width)

    def converted(bits: tuple[int, int], rounding: str = "stochastic") -> nn.Module:
        return lpmm.convert(
            copy.deepcopy(base), param_bits=bits[0], grad_bits=bits[1], group_size=2048, rounding=rounding
        )

    configs = [
        Config("torch SGDM", copy.deepcopy(base), lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)),
        Config("lowbit Adam8bit", copy.deepcopy(base), lambda m: Adam8bit(m.parameters(), lr=1e-4)),
        Config("LPMM-SGDM 12/8/8", converted((12, 8)), lambda m: LPMMSGD(m.parameters(), lr=1e-3, momentum=0.9)),
        Config("LPMM-SGDM 8/8/8", converted((8, 8)), lambda m: LPMMSGD(m.parameters(), lr=1e-3, momentum=0.9)),
        Config("LPMM-AdamW 12/8/8", converted((12, 8)), lambda m: LPMMAdamW(m.parameters(), lr=1e-4)),
    ]
    if args.ablation:
        for name, rounding, momentum, state_rounding in (
            ("p SR, m near", "stochastic", 0.9, "nearest"),
            ("p near, m near", "nearest", 0.9, "nearest"),
            ("no m, p SR", "stochastic", 0.0, "stochastic"),
            ("no m, p near", "nearest", 0.0, "stochastic"),
        ):
            configs.append(
                Config(
                    name,
                    converted((12, 8), rounding),
                    lambda m, mom=momentum, r=state_rounding: LPMMSGD(
                        m.parameters(), lr=1e-3, momentum=mom, rounding=r
                    ),
                )
            )
    for c in configs:
        for _ in range(max(args.warmup, 1)):
            c.iteration(x)
    reports = {}
    for c in configs:
        c.accumulate(x)
        reports[c.name] = lpmm.memory_report(c.model, c.opt)
        c.save_grads()
    for _ in range(args.repeats):
        for c in configs:
            c.step_times.append(c.timed_step())
        for c in configs:
            c.opt.zero_grad()
            t0 = time.perf_counter()
            c.iteration(x)
            c.iter_times.append(time.perf_counter() - t0)

    base_step = statistics.median(configs[0].step_times)
    base_iter = statistics.median(configs[0].iter_times)
    n = reports[configs[0].name].num_params
    print(
        f"lowbit {lowbit.__version__}, torch {torch.__version__}, {cpu_model()}, {torch.get_num_threads()} threads; "
        f"MLP {args.layers} x Linear({args.width}, {args.width}) = {n:,} parameters, batch {args.batch}, "
        f"{args.repeats} repeats"
    )
    head = f"{'configuration':<20}{'params':>8}{'grads':>8}{'state':>8}{'total B/param':>15}"
    head += f"{'step ms':>10}{'x SGDM':>8}{'iter ms':>10}{'x SGDM':>8}"
    print(head)
    results = []
    for c in configs:
        r = reports[c.name]
        step, it = statistics.median(c.step_times), statistics.median(c.iter_times)
        row = {
            "name": c.name,
            "params_bytes_per_param": r.params / r.num_params,
            "grads_bytes_per_param": r.grads / r.num_params,
            "state_bytes_per_param": r.optimizer_state / r.num_params,
            "total_bytes_per_param": r.bytes_per_param,
            "step_ms": step * 1e3,
            "step_ratio": step / base_step,
            "iteration_ms": it * 1e3,
            "iteration_ratio": it / base_iter,
        }
        results.append(row)
        print(
            f"{c.name:<20}{row['params_bytes_per_param']:>8.3f}{row['grads_bytes_per_param']:>8.3f}"
            f"{row['state_bytes_per_param']:>8.3f}{row['total_bytes_per_param']:>15.3f}"
            f"{row['step_ms']:>10.2f}{row['step_ratio']:>8.2f}{row['iteration_ms']:>10.2f}{row['iteration_ratio']:>8.2f}"
        )
    out = {"argv": sys.argv[1:], "num_params": n, "threads": torch.get_num_threads(), "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
