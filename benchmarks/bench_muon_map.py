"""Which 8-bit map for Muon's momentum buffer: the signed dynamic map or the linear one (issue 29).

    python benchmarks/bench_muon_map.py [--steps 50] [--seeds 3]

Muon8bit with each map and Muon32bit (which is torch.optim.Muon bit for bit) take the same steps on the
same gradients of a 512x384 matrix. Gradients do not depend on the parameters, so the fp32 buffer is the
exact reference at every step. Columns: the buffer's relative L2 error after ``--steps`` steps, and the
parameters' relative L2 drift from Muon32bit as a fraction of how far Muon32bit moved them (mean over
seeds), for gradient kinds that stress a block's scale differently; then the final loss of a small MLP
(Muon on the hidden matrices, AdamW32bit on the rest) after 200 steps, against Muon32bit's.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

import lowbit.optim as O
from lowbit.functional import create_linear_map

KINDS = ("gaussian", "heavy_tailed", "row_scales", "sparse_rows")


class LinearMuon8bit(O.Muon8bit):
    """Muon8bit with its buffer on the symmetric linear map (create_linear_map), for this comparison."""

    def _momentum_map(self, device: torch.device) -> Tensor:
        return create_linear_map(signed=True).to(device)


def gradient(kind: str, shape: tuple[int, int], gen: torch.Generator) -> Tensor:
    g = torch.randn(shape, generator=gen)
    if kind == "heavy_tailed":  # Student-t with 2 degrees of freedom: outliers inside most blocks
        chi = torch.randn((2, *shape), generator=gen).square().sum(0)
        return g / (chi / 2).sqrt()
    if kind == "row_scales":  # rows spanning six decades, one row per 384 elements: blocks within a row
        return g * torch.logspace(-3, 3, shape[0])[:, None]
    if kind == "sparse_rows":  # 5% of rows get a gradient at a step (embedding-like)
        return g * (torch.rand(shape[0], 1, generator=gen) < 0.05)
    return g


def trajectory(cls: type, kind: str, steps: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(512, 384, generator=gen) * 0.02)
    opt = cls([p], lr=0.02)
    for _ in range(steps):
        p.grad = gradient(kind, (512, 384), gen)
        opt.step()
    return p.detach(), opt.dequantized_state(p)["momentum_buffer"]


def mlp_loss(cls: type, seed: int, steps: int = 200) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 32, generator=gen)
    y = torch.sin(x @ torch.randn(32, 8, generator=gen))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    hidden = [model[2].weight]
    rest = [p for p in model.parameters() if p is not model[2].weight]
    opts = [cls(hidden, lr=0.02, weight_decay=0.0), O.AdamW32bit(rest, lr=3e-3)]
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    maps = {"dynamic": O.Muon8bit, "linear": LinearMuon8bit}
    print(f"{'gradients':14} {'map':8} {'buffer error':>13} {'param drift':>12}")
    for kind in KINDS:
        for name, cls in maps.items():
            buf_err = drift = 0.0
            for seed in range(args.seeds):
                p32, m32 = trajectory(O.Muon32bit, kind, args.steps, seed)
                p8, m8 = trajectory(cls, kind, args.steps, seed)
                p0 = torch.randn(512, 384, generator=torch.Generator().manual_seed(seed)) * 0.02
                buf_err += float((m8 - m32).norm() / m32.norm()) / args.seeds
                drift += float((p8 - p32).norm() / (p32 - p0).norm()) / args.seeds
            print(f"{kind:14} {name:8} {buf_err:13.2e} {drift:12.2e}")
    for name, cls in {"fp32": O.Muon32bit, **maps}.items():
        losses = [mlp_loss(cls, seed) for seed in range(args.seeds)]
        print(f"MLP final loss, {name:8}: {sum(losses) / len(losses):.5f}")


if __name__ == "__main__":
    main()
