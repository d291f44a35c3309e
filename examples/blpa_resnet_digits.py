"""A pre-activation ResNet with approximate activations (BLPA) on scikit-learn's digits.

    python examples/blpa_resnet_digits.py [--epochs 15] [--bits 4]

Every BatchNorm -> ReLU -> Conv unit of the network is torch's layers, or
:class:`lowbit.nn.ApproxBNReLUConv2d`, which runs the same forward pass but saves a ``--bits``-bit code
of each activation for backward instead of two full tensors (approx-activations-blpa.txt, section 3), or
torch's layers converted by ``lowbit.nn.compress_activations(model, method="blpa")``, which finds the units
in an existing model and does the same. The three networks start from the same weights and see the same
batches; the script prints the bytes saved for backward by one batch
(:func:`lowbit.memory.saved_tensor_bytes`), the test accuracy and the final training loss of each, and
the conversion's expected bytes.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from lowbit.memory import saved_tensor_bytes
from lowbit.nn import ApproxBNReLUConv2d, compress_activations

WIDTH = 32


class TorchUnit(nn.Module):
    """BatchNorm2d -> ReLU -> Conv2d with torch's layers (the parameter names of ApproxBNReLUConv2d)."""

    def __init__(self, c_in: int, c_out: int, **conv: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.act = nn.ReLU()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, **conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.act(self.bn(x)))


class PreActResNet(nn.Module):
    """Stem conv, three residual blocks of two pre-activation units, a downsampling unit, a linear head."""

    def __init__(self, unit) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, WIDTH, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(unit(WIDTH, WIDTH), unit(WIDTH, WIDTH)) for _ in range(3))
        self.down = unit(WIDTH, 2 * WIDTH, stride=2)
        self.norm = nn.BatchNorm2d(2 * WIDTH)
        self.head = nn.Linear(2 * WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        h = F.relu(self.norm(self.down(h)))
        return self.head(h.mean(dim=(2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args()
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xtr, ytr, xte, yte = x[perm[:1437]], y[perm[:1437]], x[perm[1437:]], y[perm[1437:]]

    torch.manual_seed(0)
    approx = PreActResNet(lambda c_in, c_out, **kw: ApproxBNReLUConv2d(c_in, c_out, 3, padding=1, bits=args.bits, **kw))
    exact = PreActResNet(TorchUnit)
    exact.load_state_dict(approx.state_dict())
    converted = copy.deepcopy(exact)
    report = compress_activations(converted, method="blpa", bits=args.bits, sample_args=(xtr[:64],))
    print(
        f"compress_activations(method='blpa'): {len(report.replaced)} units converted; saved for backward "
        f"{report.bytes_before:,} -> {report.expected_bytes:,} bytes expected"
    )
    runs = (
        ("torch BN-ReLU-Conv", exact),
        (f"ApproxBNReLUConv2d {args.bits}-bit", approx),
        (f"converted {args.bits}-bit", converted),
    )
    for name, model in runs:
        saved = saved_tensor_bytes(model, xtr[:64]).total
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        order = torch.Generator().manual_seed(1)
        for _ in range(args.epochs):
            model.train()
            for idx in torch.randperm(len(xtr), generator=order).split(64):
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(xte).argmax(1) == yte).float().mean().item()
            train_loss = F.cross_entropy(model(xtr), ytr).item()
        print(
            f"{name:<28} saved for backward {saved:>10,} bytes per batch of 64   "
            f"test accuracy {100 * accuracy:.1f}%   train loss {train_loss:.4f}"
        )


if __name__ == "__main__":
    main()
