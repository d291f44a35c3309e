"""Time, saved bytes and gradient error of lowbit's few-bit and inverted activations vs torch's.

Run from the repository root::

    python benchmarks/bench_activations.py
    python benchmarks/bench_activations.py --numel 1000000 --repeats 3 --threads 2

Options: ``--numel`` (elements per layer call, default 16 * 2**20), ``--repeats`` (timed runs,
alternated between the layers, default 10), ``--threads`` (``torch.set_num_threads``), ``--bits`` (3),
``--dtype`` (of the timed layers' input, float32 or bfloat16; the byte counts and errors are fp32).

Time: one forward and one backward pass of each layer on the same randn input and output gradient,
median of the alternated runs; the ratio to torch's layer from the same run is the number to read on
this noisy machine. Bytes: what a GPT-2-small-shaped MLP stack (12 blocks of Linear 768 -> 3072,
activation, Linear 3072 -> 768, batch 8 x 1024 tokens) saves for backward, counted by
:func:`lowbit.memory.saved_tensor_bytes`, with torch's GELU, FewBitGELU and InvGELU. Error: the
backward slope against the exact f' over x in [-10, 10] as each layer computes it
(:func:`lowbit.nn.invact.gradient_error`; the same grid for the few-bit layers), for lowbit's InvAct
tables, the InvAct paper's approximations and few-bit tables of 1, 3 and 8 bits. BLPA: bytes saved by a
pre-activation conv stack (8 units BatchNorm2d -> ReLU -> Conv2d 64 -> 64, 3x3, batch 32 x 32 x 32) with
torch's layers and with ApproxBNReLUConv2d at 8 and 4 bits, and the forward+backward time of the stack:
training (the gradients of the input and of every parameter) and frozen (parameters with
``requires_grad=False``, the input's gradient alone, as when fine-tuning the layers above), each against torch's
layers in the same mode.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Optional

import torch
from common import cpu_model, parse
from torch import nn

import lowbit
from lowbit import _ops
from lowbit.memory import saved_tensor_bytes
from lowbit.nn import ApproxBNReLUConv2d, fewbit, invact
from lowbit.nn.activations import FewBitGELU, FewBitSiLU, InvGELU, InvSiLU

GPT2_BLOCKS, GPT2_D, GPT2_TOKENS = 12, 768, 8 * 1024


def fwd_bwd(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, params: bool = False) -> Callable[[], None]:
    """One forward and backward pass of ``layer`` at ``x`` with output gradient ``g``: the gradient of
    ``x``, and with ``params`` those of the layer's parameters too (a training step's backward)."""
    inputs = [x, *layer.parameters()] if params else [x]

    def run() -> None:
        torch.autograd.grad(layer(x), inputs, g)

    return run


def time_alternated(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls taking turns so machine noise hits all alike."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def mlp_stack(activation: Callable[[], nn.Module]) -> nn.Sequential:
    """GPT2_BLOCKS blocks of Linear(d, 4d) -> activation -> Linear(4d, d)."""
    layers: list[nn.Module] = []
    for _ in range(GPT2_BLOCKS):
        layers += [nn.Linear(GPT2_D, 4 * GPT2_D), activation(), nn.Linear(4 * GPT2_D, GPT2_D)]
    return nn.Sequential(*layers)


def fewbit_error(name: str, bits: int, points: int = 2_000_001) -> dict[str, float]:
    """gradient_error's measures for the shipped few-bit table of ``name`` (normal weight)."""
    t = fewbit.table(name, bits)
    x = torch.linspace(-10.0, 10.0, points)
    got = _ops.fewbit_grad(torch.ones_like(x), _ops.fewbit_encode(x, t.boundaries, bits), t.levels, bits).double()
    xd = x.double()
    err = got - fewbit.derivative(name)(xd)
    dx = 20.0 / (points - 1)
    density = torch.exp(-0.5 * xd * xd) / (2 * torch.pi) ** 0.5
    return {
        "linf": err.abs().max().item(),
        "l2_uniform": ((err * err).sum().item() * dx) ** 0.5,
        "l2_normal": ((err * err * density).sum().item() * dx) ** 0.5,
    }


def preact_stack(bits: Optional[int]) -> nn.Sequential:
    """8 pre-activation units of 64 channels: torch's layers (bits None) or ApproxBNReLUConv2d."""
    torch.manual_seed(0)
    if bits is None:
        units = [nn.Sequential(nn.BatchNorm2d(64), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)) for _ in range(8)]
    else:
        units = [ApproxBNReLUConv2d(64, 64, 3, padding=1, bits=bits) for _ in range(8)]
    return nn.Sequential(*units)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--numel", type=int, default=16 * 2**20)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parse(p, argv)
    if args.numel < 1 or args.repeats < 1:
        p.error("--numel and --repeats must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Print the timing table and the saved-bytes comparison."""
    args = parse_args(argv)
    print(
        f"lowbit {lowbit.__version__}, torch {torch.__version__}, {cpu_model()}, "
        f"{torch.get_num_threads()} threads, python {sys.version.split()[0]}"
    )
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.numel, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(args.numel, generator=gen).to(dtype)
    layers = {
        "torch GELU": nn.GELU(),
        f"FewBitGELU({args.bits})": FewBitGELU(args.bits),
        "InvGELU": InvGELU(),
        "torch SiLU": nn.SiLU(),
        f"FewBitSiLU({args.bits})": FewBitSiLU(args.bits),
        "InvSiLU": InvSiLU(),
    }
    times = time_alternated({k: fwd_bwd(m, x, g) for k, m in layers.items()}, args.repeats)
    print(f"\nforward+backward, {args.numel} {args.dtype} elements, median of {args.repeats} alternated runs")
    print(f"{'layer':<16} {'ms':>8} {'x torch':>8}")
    for k, t in times.items():
        base = times["torch GELU"] if "GELU" in k else times["torch SiLU"]
        print(f"{k:<16} {t * 1e3:8.2f} {t / base:7.2f}x")

    tokens = torch.randn(GPT2_TOKENS, GPT2_D)
    print(f"\nsaved for backward, GPT-2-small MLP stack ({GPT2_BLOCKS} blocks, {GPT2_TOKENS} tokens, fp32)")
    base = None
    variants = (
        ("torch GELU", nn.GELU),
        (f"FewBitGELU({args.bits})", lambda: FewBitGELU(args.bits)),
        ("InvGELU", InvGELU),
    )
    for label, act in variants:
        with torch.no_grad():
            model = mlp_stack(act)
        saved = saved_tensor_bytes(model, tokens).total
        base = base or saved
        print(f"{label:<16} {saved / 2**20:10.1f} MiB  {saved / base:6.3f}x")

    images = torch.randn(32, 64, 32, 32, requires_grad=True)
    stacks = {"torch BN-ReLU-Conv": preact_stack(None), "BLPA 8-bit": preact_stack(8), "BLPA 4-bit": preact_stack(4)}
    out_grad = torch.randn(32, 64, 32, 32)
    calls = {}
    for k, m in stacks.items():
        calls[f"{k} train"] = fwd_bwd(m, images, out_grad, params=True)
        calls[f"{k} frozen"] = fwd_bwd(copy.deepcopy(m).requires_grad_(False), images, out_grad)
    stack_times = time_alternated(calls, args.repeats)
    print(
        "\npre-activation conv stack (8 units, 64 channels, 32 x 32 x 32, fp32): saved bytes; fwd+bwd time with the"
        " gradients of the input and all parameters (train), and with the parameters frozen (frozen)"
    )
    print(f"{'stack':<20} {'saved':>12} {'x torch':>7} {'train ms':>9} {'x torch':>7} {'frozen ms':>9} {'x torch':>7}")
    base_bytes = None
    for label, model in stacks.items():
        saved = saved_tensor_bytes(model, images).total
        base_bytes = base_bytes or saved
        row = f"{label:<20} {saved / 2**20:8.1f} MiB {saved / base_bytes:6.3f}x"
        for mode in ("train", "frozen"):
            t = stack_times[f"{label} {mode}"]
            row += f" {t * 1e3:9.1f} {t / stack_times[f'torch BN-ReLU-Conv {mode}']:6.2f}x"
        print(row)

    print("\nbackward slope error vs exact f', x in [-10, 10] (fp32 forward and evaluation)")
    print(f"{'method':<24} {'Linf':>9} {'L2 unif':>9} {'L2 normal':>9}")
    for name in ("gelu", "silu"):
        rows = {
            f"{name} InvAct (lowbit)": invact.gradient_error(name),
            f"{name} InvAct (paper)": invact.gradient_error(name, "paper"),
        }
        rows.update({f"{name} FewBit {b}-bit": fewbit_error(name, b) for b in (1, 3, 8)})
        for label, e in rows.items():
            print(f"{label:<24} {e['linf']:9.2e} {e['l2_uniform']:9.2e} {e['l2_normal']:9.2e}")


if __name__ == "__main__":
    main()
