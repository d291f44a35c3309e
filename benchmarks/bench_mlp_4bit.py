"""Final loss of issue 28's small MLP regression (16 -> 64 -> 64 -> 1, ReLU, full batch) after ``--steps``
steps, per optimizer, against torch.optim.AdamW on the same data and initialisation.

Run from the repository root::

    python benchmarks/bench_mlp_4bit.py
    python benchmarks/bench_mlp_4bit.py --n 512 --noise 0 --seeds 0 1 2

Rows: torch AdamW (the baseline), lowbit AdamW8bit, AdamW4bit (block-wise second moments, the default), with
``rank1_normalization=True``, with ``factored=True`` (Adafactor row/column second moments,
lowbit/optim/factored.py, a PyTorch step) and with ``rounding="stochastic"`` (block-wise, its states rounded
stochastically), the block-wise, rank-1 and stochastic ones stepped by lowbit's pure-PyTorch
twins (lowbit/_reference) instead of the native step, torchao's AdamW4bit when ``import torchao.optim`` works,
and a decomposition of the 4-bit error: torch AdamW's formula in plain torch with m (the signed 4-bit map)
and/or sqrt(v) (the unsigned zero-free 4-bit map) round-tripped block-wise through ``lowbit.functional`` after
each step, and with a zero code added below the unsigned map (the paper's zero-point failure), and with v
factored (Adafactor's v_hat from fp32 row and column means), m in fp32 or round-tripped. Every optimizer
keeps fp32 states below ``--min-size`` elements (lowbit's min_8bit_size/min_4bit_size; torchao's own rule is
4096 and a size the block divides), so by default only the 64 x 64 weight is quantized.

Data: ``--n`` inputs x ~ N(0, I_16), targets sin(x . w) + 0.1 x_0 x_1 + ``--noise`` N(0, 1), seeded per
run. Options: ``--lr`` (1e-3), ``--eps`` (1e-8), ``--weight-decay`` (1e-2), ``--steps`` (300), ``--seeds``
(0 1 2), ``--n`` (16384), ``--noise`` (0.3), ``--min-size`` (4096), ``--threads`` (1), ``--rows`` (only the
rows whose names contain one of the words given; torch AdamW always runs). The output gives each
seed's final loss and its ratio to torch's, and the ratio of the means over the seeds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

import lowbit._ops as ops
import lowbit.optim as O
from lowbit import _reference as R
from lowbit.functional import dequantize_blockwise, quantize_blockwise
from lowbit.optim.state_storage import optimizer_state_map

BLOCK = 128  # lowbit's 4-bit default block, and torchao's

Factory = Callable[[list[nn.Parameter]], Any]


def data(seed: int, n: int, noise: float) -> tuple[Tensor, Tensor]:
    """The regression set of one seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return x, torch.sin(x @ w) + 0.1 * (x[:, :1] * x[:, 1:2]) + noise * torch.randn(n, 1, generator=g)


def model(seed: int) -> nn.Module:
    """The MLP of one seed (torch's default initialisation)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def final_loss(seed: int, make: Factory, args: argparse.Namespace) -> float:
    """Train ``args.steps`` full-batch steps and return the training loss after the last."""
    x, y = data(seed, args.n, args.noise)
    net = model(seed)
    opt = make(list(net.parameters()))
    for _ in range(args.steps):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(net(x), y))


def round_trip(t: Tensor, signed: bool, zero_code: bool = False) -> Tensor:
    """``t`` encoded block-wise on lowbit's 4-bit state map and decoded; with ``zero_code``, values nearer to
    0 than to the unsigned map's lowest code (half of it, times the block's absmax) decode to 0."""
    code = optimizer_state_map(signed, t.device, 4)
    codes, qs = quantize_blockwise(t.reshape(-1), code=code, blocksize=BLOCK)
    out = dequantize_blockwise(codes, qs).view_as(t)
    if zero_code:
        absmax = qs.absmax.repeat_interleave(BLOCK)[: t.numel()].view_as(t)
        out = torch.where(t < 0.5 * float(code[0]) * absmax, torch.zeros_like(t), out)
    return out


class QuantizedStatesAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update, with m and/or sqrt(v) of tensors of at least ``min_size`` elements
    round-tripped through the 4-bit maps after each step (the next step reads the decoded values, as the
    quantized optimizers do); with ``factored``, v of such matrices replaced by Adafactor's v_hat from fp32
    EMAs of the row and column means of g^2 (lowbit._reference.factored_v_hat)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        hyper: dict[str, float],
        m: bool,
        v: bool,
        min_size: int,
        zero_code: bool,
        factored: bool = False,
    ) -> None:
        super().__init__(params, dict(hyper))
        self.m, self.v, self.min_size, self.zero_code, self.factored = m, v, min_size, zero_code, factored

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                t = state["t"]
                p.mul_(1 - lr * wd)
                m = state["m"].lerp_(p.grad, 0.1)
                if self.factored and p.dim() >= 2 and p.numel() >= self.min_size:
                    square = p.grad.square()
                    state["row"] = state.get("row", torch.zeros(p.shape[:-1])).mul_(0.999).add_(0.001 * square.mean(-1))
                    state["col"] = state.get("col", torch.zeros(p.shape[-1:])).mul_(0.999).add_(0.001 * square.mean(-2))
                    v = R.factored_v_hat(state["row"], state["col"])
                else:
                    v = state["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                denom = (v / (1 - 0.999**t)).sqrt_().add_(eps)
                p.addcdiv_(m / (1 - 0.9**t), denom, value=-lr)
                if p.numel() >= self.min_size:
                    if self.m:
                        state["m"] = round_trip(m, True)
                    if self.v:
                        state["v"] = round_trip(v.sqrt(), False, self.zero_code).square()


class Twin:
    """``opt`` stepped by lowbit's pure-PyTorch twins of the native step (lowbit/_reference)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.calls = opt, 0

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def _step(self, args: Any, widths: Optional[list[int]] = None, cache: Any = None) -> None:
        self.calls += 1
        R.optimizer_step_(*args)

    def step(self) -> None:
        saved = ops.optimizer_step_eager, ops.rank1_statistics_eager
        ops.optimizer_step_eager = self._step
        ops.rank1_statistics_eager = lambda args, widths=None: R.rank1_statistics_(*args)
        try:
            self.opt.step()
        finally:
            ops.optimizer_step_eager, ops.rank1_statistics_eager = saved
        assert self.calls > 0, "the optimizer did not call lowbit._ops.optimizer_step_eager"


def factories(args: argparse.Namespace) -> dict[str, Factory]:
    """The optimizer factory of each row that ``args.rows`` selects (torch AdamW's always)."""

    def wanted(name: str) -> bool:
        return not args.rows or name == "torch AdamW" or any(r in name for r in args.rows)

    kw = dict(lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)
    four = dict(kw, min_4bit_size=args.min_size)
    rank1 = dict(four, rank1_normalization=True)
    stochastic = dict(four, rounding="stochastic")  # its rounding_seed: drawn after model(seed) seeds torch
    rows: dict[str, Factory] = {
        "torch AdamW": lambda ps: torch.optim.AdamW(ps, **kw),
        "lowbit AdamW8bit": lambda ps: O.AdamW8bit(ps, **kw, min_8bit_size=args.min_size),
        "lowbit AdamW4bit (block-wise)": lambda ps: O.AdamW4bit(ps, **four),
        "lowbit AdamW4bit (rank-1)": lambda ps: O.AdamW4bit(ps, **rank1),
        "lowbit AdamW4bit (factored)": lambda ps: O.AdamW4bit(ps, **four, factored=True),
        "lowbit AdamW4bit (stochastic)": lambda ps: O.AdamW4bit(ps, **stochastic),
        "twin AdamW4bit (block-wise)": lambda ps: Twin(O.AdamW4bit(ps, **four)),
        "twin AdamW4bit (rank-1)": lambda ps: Twin(O.AdamW4bit(ps, **rank1)),
        "twin AdamW4bit (stochastic)": lambda ps: Twin(O.AdamW4bit(ps, **stochastic)),
    }
    # Imported only for its row: importing torchao takes seconds.
    if wanted("torchao AdamW4bit"):
        try:
            import torchao.optim as tao

            rows["torchao AdamW4bit"] = lambda ps: tao.AdamW4bit(ps, **kw, block_size=BLOCK)
        except ImportError:
            print("torchao.optim is not importable: its row is skipped")
    for label, m, v, zero in [
        ("m 4-bit", True, False, False),
        ("sqrt(v) 4-bit", False, True, False),
        ("m and sqrt(v) 4-bit", True, True, False),
        ("sqrt(v) 4-bit with a zero code", False, True, True),
    ]:
        rows[f"AdamW, {label}"] = lambda ps, m=m, v=v, zero=zero: QuantizedStatesAdamW(
            ps, kw, m, v, args.min_size, zero
        )
    for label, m in [("v factored", False), ("v factored, m 4-bit", True)]:
        rows[f"AdamW, {label}"] = lambda ps, m=m: QuantizedStatesAdamW(ps, kw, m, False, args.min_size, False, True)
    return {name: make for name, make in rows.items() if wanted(name)}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n", type=int, default=16384, help="training examples (default 16384)")
    p.add_argument("--noise", type=float, default=0.3, help="target noise std (default 0.3)")
    p.add_argument("--min-size", type=int, default=4096, help="fp32 states below this many elements")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads(THREADS)")
    p.add_argument("--rows", nargs="+", default=None, help="run only the rows whose names contain one of these")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"n {args.n}, noise {args.noise}, lr {args.lr}, eps {args.eps}, weight_decay {args.weight_decay}, "
        f"steps {args.steps}, min_size {args.min_size}, seeds {args.seeds}"
    )
    print("| optimizer | final losses | / torch AdamW | mean / torch's mean |")
    print("|---|---|---|---|")
    base: list[float] = []
    for name, make in factories(args).items():
        losses = [final_loss(seed, make, args) for seed in args.seeds]
        base = base or losses
        ratios = " ".join(f"{got / want:.3f}" for got, want in zip(losses, base, strict=True))
        mean = sum(losses) / sum(base)
        print(f"| {name} | {' '.join(f'{x:.5g}' for x in losses)} | {ratios} | {mean:.3f} |", flush=True)


if __name__ == "__main__":
    main()
