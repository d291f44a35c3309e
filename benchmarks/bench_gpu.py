"""GPU benchmarks for a lent device: the optimizer step per 1B parameters against its memory floor (LAMB8bit
for the norm pre-pass, AdEMAMix8bit and AdEMAMix32bit for three states), the 4-bit step against the 8-bit
one and fused AdamW, Muon8bit against torch.optim.Muon, LPMM's gradient accumulation and step per group size,
quantize/dequantize throughput, the activation layers and a BLPA conv stack against torch's. Prints Markdown
for benchmarks/RESULTS.md.

Run from the repository root (benchmarks/gpu_session.sh runs it)::

    python benchmarks/bench_gpu.py                      # on cuda:0, full sizes
    python benchmarks/bench_gpu.py --cpu-dry-run        # the same code paths on CPU tensors, tiny sizes

Options: ``--numel`` (parameters per optimizer workload and elements per quantize/activation input, default
2**28), ``--warmup`` (untimed calls first, 3), ``--repeats`` (timed calls, median taken, 20), ``--device``
(cuda or cpu), ``--tiny`` (tiny sizes, for a dry run), ``--cpu-dry-run`` (``--device cpu --tiny``),
``--threads``, ``--json PATH``.

Every time is the median of ``--repeats`` calls after ``--warmup`` untimed ones, each call bracketed by
CUDA events with the device idle before it. The memory floor of an optimizer step is the bytes it must
move (parameters and states read and written, gradients read: each storage once) over the device-to-device
copy bandwidth measured in the same process (bytes read plus bytes written); a step can not be faster.
bitsandbytes and torchao rows appear when those packages are importable. The 4-bit section repeats the
4-bit rows of the step table (lowbit AdamW4bit, blocks of 128; torchao AdamW4bit) with their ratio to
lowbit AdamW8bit's step from the same run and their state bytes per parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from bench_activations import fwd_bwd, preact_stack
from bench_optim import import_optional, state_bytes
from common import environment, parse, time_median, write_json
from torch import Tensor, nn

import lowbit.lpmm
import lowbit.optim
from lowbit import functional
from lowbit.nn.activations import FewBitGELU, FewBitSiLU, InvGELU, InvSiLU

LR = 1e-3
BASELINE = "torch AdamW fused"
EIGHT_BIT = "lowbit AdamW8bit"
FOUR_BIT = ("lowbit AdamW4bit", "torchao AdamW4bit")
# One step's tensors: square matrices of a transformer's width, so per-tensor launch costs are realistic.
MATRIX_SIDE = 4096
TINY_SIDE = 64
TINY_NUMEL = 4 * TINY_SIDE * TINY_SIDE
PER_BILLION = 1e9
# LPMM group sizes: 64 shares a thread block among 8 groups (csrc/cuda/lpmm.cu), 2048 is lowbit's default.
LPMM_GROUPS = (64, 256, 2048)
# The BLPA stack's images: 64 channels of 32 x 32 (bench_activations.preact_stack).
BLPA_IMAGE = (64, 32, 32)

Factory = Callable[[list[Tensor]], torch.optim.Optimizer]


@dataclasses.dataclass
class StepRow:
    """One optimizer's step on one parameter dtype."""

    optimizer: str
    dtype: str
    median_s: float
    floor_bytes: int
    state_bytes: int

    def per_billion_ms(self, numel: int) -> float:
        """Step time scaled to 1B parameters, in milliseconds."""
        return self.median_s * 1e3 * PER_BILLION / numel


@dataclasses.dataclass
class LpmmRow:
    """LPMM at one group size: accumulating a gradient, and that plus the optimizer step."""

    group: int
    accumulate_s: float
    train_step_s: float


@dataclasses.dataclass
class ThroughputRow:
    """One quantize/dequantize or activation call: its median time and the bytes it moves at the least."""

    name: str
    dtype: str
    median_s: float
    bytes_moved: int
    baseline: Optional[str] = None


def copy_bandwidth(numel: int, device: torch.device, warmup: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes per second, counting bytes read plus bytes written."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = time_median(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.nbytes / seconds


def optimizer_factories() -> tuple[dict[str, Factory], list[str]]:
    """The optimizers to time by row name (fused torch AdamW first), and those skipped as not installed."""
    factories: dict[str, Factory] = {
        BASELINE: lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
        EIGHT_BIT: lambda ps: lowbit.optim.AdamW8bit(ps, lr=LR),
        "lowbit Adam8bit": lambda ps: lowbit.optim.Adam8bit(ps, lr=LR),
        "lowbit LAMB8bit": lambda ps: lowbit.optim.LAMB8bit(ps, lr=LR),  # the norm pre-pass kernels too
        FOUR_BIT[0]: lambda ps: lowbit.optim.AdamW4bit(ps, lr=LR),
        # AdEMAMix's three states: against its fp32 twin and bitsandbytes' (whose m2 absmax index is off
        # for sizes not a multiple of 256: the matrices here are, so its timing is fair).
        "lowbit AdEMAMix8bit": lambda ps: lowbit.optim.AdEMAMix8bit(ps, lr=LR),
        "lowbit AdEMAMix32bit": lambda ps: lowbit.optim.AdEMAMix32bit(ps, lr=LR),
    }
    skipped = []
    bnb = import_optional("bitsandbytes")
    if bnb is not None:
        factories["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=LR)
        factories["bitsandbytes AdEMAMix8bit"] = lambda ps: bnb.optim.AdEMAMix8bit(ps, lr=LR)
    else:
        skipped.append("bitsandbytes")
    torchao_optim = import_optional("torchao.optim")
    if torchao_optim is not None:
        factories["torchao AdamW8bit"] = lambda ps: torchao_optim.AdamW8bit(ps, lr=LR)
        factories[FOUR_BIT[1]] = lambda ps: torchao_optim.AdamW4bit(ps, lr=LR)
    else:
        skipped.append("torchao")
    return factories, skipped


MUON_LR = 0.02
MUON_MATRICES = 4  # Newton-Schulz's matmuls dominate Muon's step: four matrices time it within the budget


def muon_factories() -> dict[str, Factory]:
    """Muon's rows: lowbit's 8- and 32-bit buffers against torch.optim.Muon, also with ``ns_steps=0`` (the
    momentum step and the update alone, without Newton-Schulz's matmuls)."""
    return {
        "torch Muon": lambda ps: torch.optim.Muon(ps, lr=MUON_LR),
        "lowbit Muon8bit": lambda ps: lowbit.optim.Muon8bit(ps, lr=MUON_LR),
        "lowbit Muon32bit": lambda ps: lowbit.optim.Muon32bit(ps, lr=MUON_LR),
        "torch Muon, ns_steps=0": lambda ps: torch.optim.Muon(ps, lr=MUON_LR, ns_steps=0),
        "lowbit Muon8bit, ns_steps=0": lambda ps: lowbit.optim.Muon8bit(ps, lr=MUON_LR, ns_steps=0),
    }


def muon_table(rows: list[StepRow], numel: int) -> str:
    """Markdown: Muon's rows in ms per 1B parameters, x torch.optim.Muon with the same ``ns_steps``, and state
    bytes per parameter."""
    medians = {(r.optimizer, r.dtype): r.median_s for r in rows}
    lines = ["| optimizer | params | ms / 1B params | x torch Muon (same ns_steps) | state bytes / param |"]
    lines.append("|---|---|---:|---:|---:|")
    for r in rows:
        base = "torch Muon, ns_steps=0" if r.optimizer.endswith("ns_steps=0") else "torch Muon"
        lines.append(
            f"| {r.optimizer} | {r.dtype} | {r.per_billion_ms(numel):.2f} | "
            f"{r.median_s / medians[(base, r.dtype)]:.2f} | {r.state_bytes / numel:.3f} |"
        )
    return "\n".join(lines)


def step_tensors(numel: int, side: int) -> int:
    """How many side x side parameters a step of about ``numel`` parameters takes (at least one)."""
    return max(1, numel // (side * side))


def make_params(numel: int, side: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """:func:`step_tensors` side x side parameters with random gradients."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(step_tensors(numel, side)):
        p = torch.randn(side, side, generator=gen, device=device).to(dtype).requires_grad_()
        p.grad = torch.randn(side, side, generator=gen, device=device).to(dtype)
        params.append(p)
    return params


def step_floor_bytes(params: list[Tensor], opt: torch.optim.Optimizer) -> int:
    """Bytes one step must move: parameters and states read and written once, gradients read once."""
    param_bytes = sum(p.nbytes for p in params)
    grad_bytes = sum(p.grad.nbytes for p in params if p.grad is not None)
    return 2 * param_bytes + grad_bytes + 2 * state_bytes(opt)


def time_steps(
    factories: dict[str, Factory], dtype: torch.dtype, args: argparse.Namespace, device: torch.device
) -> list[StepRow]:
    """Each optimizer's median step time on fresh parameters; the first step (state allocation) is untimed."""
    rows = []
    for name, factory in factories.items():
        params = make_params(args.numel, args.side, dtype, device)
        opt = factory(params)
        opt.step()
        seconds = time_median(opt.step, device, args.warmup, args.repeats)
        dtype_name = str(dtype).removeprefix("torch.")
        rows.append(StepRow(name, dtype_name, seconds, step_floor_bytes(params, opt), state_bytes(opt)))
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_quantize(dtype: torch.dtype, args: argparse.Namespace, device: torch.device) -> list[ThroughputRow]:
    """Block-wise 8-bit quantize and dequantize (block 256, nearest and stochastic rounding)."""
    x = torch.randn(args.numel, device=device).to(dtype)
    name = str(dtype).removeprefix("torch.")
    codes, state = functional.quantize_blockwise(x, blocksize=256)
    coded_bytes = codes.nbytes + state.absmax.nbytes
    rows = []
    for rounding in ("nearest", "stochastic"):
        seconds = time_median(
            lambda r=rounding: functional.quantize_blockwise(x, blocksize=256, rounding=r),
            device,
            args.warmup,
            args.repeats,
        )
        rows.append(ThroughputRow(f"quantize_blockwise ({rounding})", name, seconds, x.nbytes + coded_bytes))
    seconds = time_median(lambda: functional.dequantize_blockwise(codes, state), device, args.warmup, args.repeats)
    rows.append(ThroughputRow("dequantize_blockwise", name, seconds, coded_bytes + x.nbytes))
    return rows


def time_lpmm(args: argparse.Namespace, device: torch.device) -> list[LpmmRow]:
    """LPMM (lpmm.txt) with 12-bit parameters, 8-bit gradients and LPMMAdamW's 8-bit states, per group size:
    accumulating one fp32 gradient, and that plus the step (a step empties the accumulator, so each step
    needs a gradient). The first step (state allocation) is untimed."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for group in LPMM_GROUPS:
        layers = [nn.Linear(args.side, args.side, bias=False) for _ in range(step_tensors(args.numel, args.side))]
        model = lowbit.lpmm.convert(nn.Sequential(*layers).to(device), param_bits=12, grad_bits=8, group_size=group)
        lps = list(lowbit.lpmm.low_precision_parameters(model).values())
        grads = [torch.randn(lp.shape, generator=gen, device=device) for lp in lps]
        opt = lowbit.optim.LPMMAdamW(model.parameters(), lr=LR)

        def accumulate(lps: list = lps, grads: list[Tensor] = grads) -> None:
            for lp, grad in zip(lps, grads, strict=True):
                lp.accumulate_(grad)

        def train_step(opt: torch.optim.Optimizer = opt, accumulate: Callable[[], None] = accumulate) -> None:
            accumulate()
            opt.step()

        train_step()
        accumulate_s = time_median(accumulate, device, args.warmup, args.repeats)
        rows.append(LpmmRow(group, accumulate_s, time_median(train_step, device, args.warmup, args.repeats)))
        del opt, model, lps, grads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_blpa(args: argparse.Namespace, device: torch.device) -> list[ThroughputRow]:
    """Forward plus backward of 8 pre-activation units (BN-ReLU-conv): torch's layers and BLPA's at 4 and 8
    bits, fp32, as many 64 x 32 x 32 images as make about ``numel / 8`` elements. The bytes are torch's
    activation traffic (each unit's input read and output written, forward and backward)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (max(1, args.numel // 8 // math.prod(BLPA_IMAGE)), *BLPA_IMAGE)
    x = torch.randn(shape, generator=gen, device=device).requires_grad_()
    g = torch.randn(shape, generator=gen, device=device)
    stacks = {"torch BN-ReLU-Conv": None, "BLPA 8-bit": 8, "BLPA 4-bit": 4}
    rows = []
    for label, bits in stacks.items():
        seconds = time_median(fwd_bwd(preact_stack(bits).to(device), x, g), device, args.warmup, args.repeats)
        rows.append(ThroughputRow(label, "float32", seconds, 8 * 4 * x.nbytes, "torch BN-ReLU-Conv"))
    return rows


def time_activations(dtype: torch.dtype, args: argparse.Namespace, device: torch.device) -> list[ThroughputRow]:
    """Forward plus backward of each activation layer; the bytes are torch's (x read, y written, then x and
    the output gradient read, the input gradient written), so lowbit's rows show against the same yardstick."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.numel, generator=gen, device=device).to(dtype).requires_grad_()
    g = torch.randn(args.numel, generator=gen, device=device).to(dtype)
    layers: dict[str, tuple[nn.Module, str]] = {
        "torch GELU": (nn.GELU(), "torch GELU"),
        "FewBitGELU(3)": (FewBitGELU(3), "torch GELU"),
        "InvGELU": (InvGELU(), "torch GELU"),
        "torch SiLU": (nn.SiLU(), "torch SiLU"),
        "FewBitSiLU(3)": (FewBitSiLU(3), "torch SiLU"),
        "InvSiLU": (InvSiLU(), "torch SiLU"),
    }
    name = str(dtype).removeprefix("torch.")
    rows = []
    for label, (layer, baseline) in layers.items():
        seconds = time_median(fwd_bwd(layer.to(device), x, g), device, args.warmup, args.repeats)
        rows.append(ThroughputRow(label, name, seconds, 5 * x.nbytes, baseline))
    return rows


def step_table(rows: list[StepRow], numel: int, bandwidth: float) -> str:
    """Markdown: ms per 1B parameters, x fused AdamW, the floor and how far above it each step is."""
    base = {r.dtype: r.median_s for r in rows if r.optimizer == BASELINE}
    lines = [
        "| optimizer | params | ms / 1B params | x torch AdamW fused | floor bytes / param | floor ms / 1B | x floor |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        floor_s = r.floor_bytes / bandwidth
        lines.append(
            f"| {r.optimizer} | {r.dtype} | {r.per_billion_ms(numel):.2f} | {r.median_s / base[r.dtype]:.2f} | "
            f"{r.floor_bytes / numel:.2f} | {floor_s * 1e3 * PER_BILLION / numel:.2f} | {r.median_s / floor_s:.2f} |"
        )
    return "\n".join(lines)


def four_bit_table(rows: list[StepRow], numel: int) -> str:
    """Markdown: the 4-bit rows' ms per 1B parameters, x fused AdamW and x lowbit AdamW8bit (same run), and
    their state bytes per parameter next to AdamW8bit's."""
    medians = {(r.optimizer, r.dtype): r.median_s for r in rows}
    lines = [
        f"| optimizer | params | ms / 1B params | x {BASELINE} | x {EIGHT_BIT} | state bytes / param |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.optimizer not in (EIGHT_BIT, *FOUR_BIT):
            continue
        lines.append(
            f"| {r.optimizer} | {r.dtype} | {r.per_billion_ms(numel):.2f} | "
            f"{r.median_s / medians[(BASELINE, r.dtype)]:.2f} | {r.median_s / medians[(EIGHT_BIT, r.dtype)]:.2f} | "
            f"{r.state_bytes / numel:.3f} |"
        )
    return "\n".join(lines)


def lpmm_table(rows: list[LpmmRow], numel: int) -> str:
    """Markdown: ms per 1B parameters of accumulating, of accumulating plus the step, and their difference."""
    lines = [
        "| group | accumulate ms / 1B | accumulate + step ms / 1B | step alone (difference) ms / 1B |",
        "|---:|---:|---:|---:|",
    ]
    scale = 1e3 * PER_BILLION / numel
    for r in rows:
        step_s = r.train_step_s - r.accumulate_s
        lines.append(
            f"| {r.group} | {r.accumulate_s * scale:.2f} | {r.train_step_s * scale:.2f} | {step_s * scale:.2f} |"
        )
    return "\n".join(lines)


def throughput_table(rows: list[ThroughputRow], bandwidth: float) -> str:
    """Markdown: median time, GB/s of the bytes moved, the fraction of copy bandwidth, x the torch baseline."""
    times = {(r.name, r.dtype): r.median_s for r in rows}
    lines = ["| op | dtype | ms | GB/s | x copy bandwidth | x torch |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        rate = r.bytes_moved / r.median_s
        vs_torch = "" if r.baseline is None else f"{r.median_s / times[(r.baseline, r.dtype)]:.2f}"
        ms = r.median_s * 1e3
        lines.append(f"| {r.name} | {r.dtype} | {ms:.3f} | {rate / 1e9:.1f} | {rate / bandwidth:.2f} | {vs_torch} |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--numel", type=int, default=1 << 28, help="parameters / elements per workload (default 2**28)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls, median taken (default 20)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: exercises the code paths only")
    p.add_argument("--cpu-dry-run", action="store_true", help="--device cpu --tiny")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(THREADS)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results as JSON")
    argv = sys.argv[1:] if argv is None else argv
    if "--cpu-dry-run" in argv:
        argv = [*argv, "--device", "cpu", "--tiny"]
    args = parse(p, argv)
    if args.tiny:
        args.numel, args.warmup, args.repeats = TINY_NUMEL, 1, 2
    if args.numel < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--numel and --repeats must be positive and --warmup non-negative")
    args.side = TINY_SIDE if args.tiny else MATRIX_SIDE
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Run the benchmarks, printing each Markdown section as soon as it is measured (a run stopped by a time
    limit keeps the sections it finished), then write the JSON."""
    args = parse_args(argv)
    device = torch.device(args.device)
    env = environment(args.device, numel=args.numel, warmup=args.warmup, repeats=args.repeats)
    bandwidth = copy_bandwidth(args.numel, device, args.warmup, args.repeats)
    section("### Environment\n", ", ".join(f"{k}={v}" for k, v in env.items()))
    print(f"device-to-device copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s\n", flush=True)

    factories, skipped = optimizer_factories()
    dtypes = (torch.float32, torch.bfloat16)
    numel_step = step_tensors(args.numel, args.side) * args.side * args.side
    steps = [row for dtype in dtypes for row in time_steps(factories, dtype, args, device)]
    missing = f"not importable, so no rows: {', '.join(skipped)}\n\n" if skipped else ""
    title = f"### Optimizer step ({numel_step} parameters, scaled to 1B)\n"
    section(title, missing + step_table(steps, numel_step, bandwidth))
    section(
        f"### 4-bit optimizer states: AdamW4bit (blocks of 128) against AdamW8bit ({numel_step} parameters)\n",
        four_bit_table(steps, numel_step),
    )
    muon_args = argparse.Namespace(**{**vars(args), "numel": min(args.numel, MUON_MATRICES * args.side**2)})
    muon_numel = step_tensors(muon_args.numel, args.side) * args.side * args.side
    muon = [row for dtype in dtypes for row in time_steps(muon_factories(), dtype, muon_args, device)]
    title = f"### Muon: 8-bit momentum against torch.optim.Muon ({muon_numel} parameters)\n"
    section(title, muon_table(muon, muon_numel))
    lpmm_rows = time_lpmm(args, device)
    section(
        f"### LPMM: 12-bit parameters, 8-bit gradients, LPMMAdamW 8-bit states ({numel_step} parameters)\n",
        lpmm_table(lpmm_rows, numel_step),
    )
    quantize = [row for dtype in dtypes for row in time_quantize(dtype, args, device)]
    section(
        f"### Quantize / dequantize (8-bit dynamic map, block 256, {args.numel} elements)\n",
        throughput_table(quantize, bandwidth),
    )
    activations = [row for dtype in dtypes for row in time_activations(dtype, args, device)]
    section(
        f"### Activation layers, forward + backward ({args.numel} elements)\n", throughput_table(activations, bandwidth)
    )
    blpa = time_blpa(args, device)
    title = "### BLPA: 8 pre-activation units of 64 channels, forward + backward, fp32\n"
    section(title, throughput_table(blpa, bandwidth))

    if args.json is not None:
        write_json(
            args.json,
            {
                "environment": env,
                "copy_bandwidth_bytes_per_s": bandwidth,
                "step_numel": numel_step,
                "steps": [dataclasses.asdict(r) for r in steps],
                "muon": [dataclasses.asdict(r) for r in muon],
                "quantize": [dataclasses.asdict(r) for r in quantize],
                "lpmm": [dataclasses.asdict(r) for r in lpmm_rows],
                "activations": [dataclasses.asdict(r) for r in activations],
                "blpa": [dataclasses.asdict(r) for r in blpa],
            },
        )


def section(title: str, body: str) -> None:
    """Print one Markdown section and flush it, so a log cut short still holds it."""
    print(f"{title}\n{body}\n", flush=True)


if __name__ == "__main__":
    main()
