"""Throughput of lowbit's block-wise and linear quantizers against their pure-PyTorch reference twins.

Run from the repository root::

    python benchmarks/bench_quantize.py
    python benchmarks/bench_quantize.py --numel 100000 --repeats 3 --threads 2 --json out/quantize.json

Options: ``--numel`` (default 16 * 2**20 elements of randn data), ``--blocksize`` (2048), ``--repeats``
(timed runs of each lowbit op, 7), ``--reference-repeats`` (timed runs of each reference twin, 2),
``--threads`` (``torch.set_num_threads``), ``--device`` (cpu or cuda), ``--json PATH`` (also write the
results as JSON).

Every op runs once as warm-up and is then timed ``--repeats`` times; the table shows the median and the
fastest run. Throughput counts fp32-equivalent bytes of the full-precision tensor, ``numel * 4 /
seconds``, for every op and input dtype, so rows compare directly. The baseline is the pure-PyTorch
twin from ``lowbit._reference``, called with the same arguments as the op in ``lowbit._ops`` on the
same data in the same process: this machine is noisy, so the speed-up ratios are the numbers to read,
and absolute GB/s mean something only on a GPU. If bitsandbytes is importable, its fp32
quantize/dequantize_blockwise are timed on the same data as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Optional

import common
import torch
from common import parse, time_once, write_json
from torch import Tensor

from lowbit import _reference, functional

DTYPES = (torch.float32, torch.bfloat16)
# Any valid seed: the reference's random draws cost the same for every seed.
REFERENCE_SEED = 1234


@dataclasses.dataclass
class Timing:
    """Median and fastest wall time of the timed runs, in seconds."""

    median_s: float
    min_s: float


@dataclasses.dataclass
class Case:
    """One table row: a lowbit call, its reference twin and, where one exists, the bitsandbytes call."""

    op: str
    dtype: torch.dtype
    setting: str
    lowbit: Callable[[], object]
    reference: Callable[[], object]
    bnb: Optional[Callable[[], object]] = None


@dataclasses.dataclass
class Row:
    """The timings of one :class:`Case`."""

    op: str
    dtype: str
    setting: str
    lowbit: Timing
    reference: Timing
    bnb: Optional[Timing]


def time_call(fn: Callable[[], object], repeats: int, device: torch.device) -> Timing:
    """Run ``fn`` once as warm-up, then ``repeats`` times; CUDA runs are timed with events."""
    fn()
    times = [time_once(fn, device) for _ in range(repeats)]
    return Timing(median_s=statistics.median(times), min_s=min(times))


def gbps(numel: int, seconds: float) -> float:
    """fp32-equivalent throughput: ``numel * 4`` bytes per ``seconds``, in GB/s (1e9 bytes)."""
    return numel * 4 / seconds / 1e9


def import_bnb() -> Optional[ModuleType]:
    """The ``bitsandbytes`` package, or None when it is not installed."""
    try:
        import bitsandbytes
    except ImportError:
        return None
    return bitsandbytes


def make_cases(x: Tensor, blocksize: int, bnb: Optional[ModuleType]) -> list[Case]:
    """The rows for one input tensor; bitsandbytes is timed on fp32 input only.

    The lowbit calls go through the public functional API, as users call it, so what is timed is the
    op in ``lowbit._ops`` plus the argument checks of ``lowbit.functional``.
    """
    numel, dtype = x.numel(), x.dtype
    code = functional.create_dynamic_map(signed=True).to(x.device)
    codes, state = functional.quantize_blockwise(x, blocksize=blocksize)
    cases = [
        Case(
            "quantize_blockwise",
            dtype,
            rounding,
            lambda r=rounding: functional.quantize_blockwise(x, blocksize=blocksize, rounding=r),
            lambda s=rounding == "stochastic": _reference.quantize_blockwise(
                x, code, 8, blocksize, s, REFERENCE_SEED, 0
            ),
        )
        for rounding in functional.ROUNDING_MODES
    ]
    cases.append(
        Case(
            "dequantize_blockwise",
            dtype,
            "8-bit map",
            lambda: functional.dequantize_blockwise(codes, state),
            lambda: _reference.dequantize_blockwise(codes.reshape(-1), state.absmax, code, 8, blocksize, numel, dtype),
        )
    )
    if bnb is not None and dtype == torch.float32:
        bnb_codes, bnb_state = bnb.functional.quantize_blockwise(x, blocksize=blocksize)
        cases[0].bnb = lambda: bnb.functional.quantize_blockwise(x, blocksize=blocksize)
        cases[-1].bnb = lambda: bnb.functional.dequantize_blockwise(bnb_codes, bnb_state)
    for bits in (8, 12):
        lin_codes, lin_state = functional.quantize_linear(x, bits=bits, blocksize=blocksize)
        cases += [
            Case(
                "quantize_linear",
                dtype,
                f"nearest {bits}-bit",
                lambda b=bits: functional.quantize_linear(x, bits=b, blocksize=blocksize),
                lambda b=bits: _reference.quantize_linear(x, b, blocksize, False, REFERENCE_SEED, 0),
            ),
            Case(
                "dequantize_linear",
                dtype,
                f"{bits}-bit",
                lambda c=lin_codes, s=lin_state: functional.dequantize_linear(c, s),
                lambda c=lin_codes, s=lin_state: _reference.dequantize_linear(
                    c.reshape(-1), s.absmax, s.bits, blocksize, numel, dtype
                ),
            ),
        ]
    return cases


def environment(args: argparse.Namespace, bnb: Optional[ModuleType]) -> dict[str, object]:
    """What the numbers depend on, for the header and the JSON file."""
    return common.environment(
        args.device,
        numel=args.numel,
        blocksize=args.blocksize,
        repeats=args.repeats,
        reference_repeats=args.reference_repeats,
        bitsandbytes=None if bnb is None else bnb.__version__,
    )


def format_table(rows: list[Row], numel: int, with_bnb: bool) -> str:
    """Plain-text table; GB/s from the median run, "best" from the fastest, speed-up = ratio of medians."""
    header = ["op", "dtype", "rounding/bits", "lowbit GB/s", "lowbit best", "reference GB/s", "speed-up"]
    if with_bnb:
        header += ["bnb GB/s", "lowbit/bnb"]
    lines = [header]
    for r in rows:
        line = [
            r.op,
            r.dtype,
            r.setting,
            f"{gbps(numel, r.lowbit.median_s):.2f}",
            f"{gbps(numel, r.lowbit.min_s):.2f}",
            f"{gbps(numel, r.reference.median_s):.3f}",
            f"{r.reference.median_s / r.lowbit.median_s:.1f}x",
        ]
        if with_bnb:
            line += (
                [f"{gbps(numel, r.bnb.median_s):.2f}", f"{r.bnb.median_s / r.lowbit.median_s:.2f}x"]
                if r.bnb is not None
                else ["-", "-"]
            )
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def stochastic_ratio(x: Tensor, blocksize: int, repeats: int, device: torch.device) -> float:
    """Median time of stochastic over nearest quantize_blockwise, the two timed alternately.

    Alternating the calls exposes both to the same machine state, so a noisy neighbour or a clock
    change during one block of runs cannot bias the ratio.
    """
    calls = {
        r: (lambda r=r: functional.quantize_blockwise(x, blocksize=blocksize, rounding=r))
        for r in functional.ROUNDING_MODES
    }
    times: dict[str, list[float]] = {r: [] for r in calls}
    for _ in range(repeats):
        for r, fn in calls.items():
            times[r].append(time_call(fn, 1, device).median_s)
    return statistics.median(times["stochastic"]) / statistics.median(times["nearest"])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--numel", type=int, default=16 * 2**20, help="elements of randn input (default 16M)")
    p.add_argument("--blocksize", type=int, default=2048, help="elements per block (default 2048)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per lowbit/bitsandbytes op (default 7)")
    p.add_argument(
        "--reference-repeats",
        type=int,
        default=2,
        help="timed runs per reference op (default 2; it takes seconds and GBs at 16M elements)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(THREADS)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results as JSON")
    args = parse(p, argv)
    if args.numel < 1 or args.repeats < 1 or args.reference_repeats < 1:
        p.error("--numel, --repeats and --reference-repeats must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Time every case, print the environment, the table and the stochastic/nearest ratios."""
    args = parse_args(argv)
    device = torch.device(args.device)
    bnb = import_bnb()
    base = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(device)

    rows = []
    ratios = {}
    for dtype in DTYPES:
        x = base.to(dtype)
        ratios[str(dtype).removeprefix("torch.")] = stochastic_ratio(x, args.blocksize, 2 * args.repeats, device)
        for case in make_cases(x, args.blocksize, bnb):
            print(f"timing {case.op} {case.dtype} {case.setting} ...", file=sys.stderr, flush=True)
            rows.append(
                Row(
                    op=case.op,
                    dtype=str(case.dtype).removeprefix("torch."),
                    setting=case.setting,
                    lowbit=time_call(case.lowbit, args.repeats, device),
                    reference=time_call(case.reference, args.reference_repeats, device),
                    bnb=None if case.bnb is None else time_call(case.bnb, args.repeats, device),
                )
            )

    env = environment(args, bnb)
    print("lowbit quantization throughput, " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(
        "GB/s = numel * 4 / seconds (fp32-equivalent input bytes for every op and dtype, so rows compare); "
        f"median of {args.repeats} runs (reference: {args.reference_repeats}) after one warm-up, "
        "'best' = fastest run; speed-up = reference median / lowbit median, measured in this process."
    )
    if bnb is None:
        print("bitsandbytes: not importable, skipped.")
    print()
    print(format_table(rows, args.numel, with_bnb=bnb is not None))
    print()
    print(
        "quantize_blockwise stochastic/nearest time ratio, runs alternated (target <= 1.5x): "
        + ", ".join(f"{d} {v:.2f}x" for d, v in ratios.items())
    )

    if args.json is not None:
        result = {
            "environment": env,
            "unit": "GB/s = numel * 4 / median_s / 1e9 (fp32-equivalent input bytes)",
            "rows": [
                {
                    **dataclasses.asdict(r),
                    "lowbit_gbps": gbps(args.numel, r.lowbit.median_s),
                    "reference_gbps": gbps(args.numel, r.reference.median_s),
                    "speedup": r.reference.median_s / r.lowbit.median_s,
                }
                for r in rows
            ],
            "stochastic_over_nearest": ratios,
        }
        write_json(args.json, result)


if __name__ == "__main__":
    main()
