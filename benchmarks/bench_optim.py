"""Step time and state memory of lowbit's optimizers against torch.optim, bitsandbytes and torchao.

Run from the repository root::

    python benchmarks/bench_optim.py
    python benchmarks/bench_optim.py --numel 1000000 --repeats 3 --threads 2 --json out/optim.json

Options: ``--numel`` (parameters per workload, default 16 * 2**20), ``--workload`` (``single``: one tensor of
``--numel`` parameters; ``many``: transformer-like tensors totalling about ``--numel``; ``both``, the default;
``gpt``: issue 28's GPT-like matrices, 4 x 1024x1024, 2 x 4096x1024, 2 x 1024x4096 and four biases of 1024, whatever
``--numel``; ``muon``: the 1024x1024, 4096x1024 and 1024x4096 matrices of issue 29, stepped by Muon8bit, Muon32bit and
torch.optim.Muon, the baseline of that table, also with ``ns_steps=0``, which times the momentum step and the update
alone; ``ademamix``: one tensor of ``--numel`` parameters stepped by AdEMAMix8bit (without and with the alpha and
beta3 warm-ups), AdEMAMix32bit, the baseline of that table, and AdamW8bit and AdamW32bit, which keep one state fewer),
``--repeats`` (timed steps per optimizer, 10),
``--warmup`` (untimed steps per optimizer before timing, 3, at least 1), ``--threads``
(``torch.set_num_threads``), ``--dtype`` (parameter and gradient dtype, float32 or bfloat16), ``--device``
(cpu or cuda), ``--json PATH`` (also write the results as JSON). ``LOWBIT_CPU_AVX512=0`` in the environment
times lowbit's AVX2 kernels on an AVX-512 CPU, and with ``LOWBIT_CPU_AVX2=0`` too its portable loops (the
environment line shows ``cpu_avx512`` and ``cpu_avx2``).

The ``many`` workload is a GPT-style stack of 24 layers of hidden size d (the largest multiple of 16
that fits ``--numel``), each with four d x d attention matrices, a d x 4d and a 4d x d MLP matrix, their
biases and two layer norms, plus a final layer norm and a token embedding that takes up the rest. Biases
and layer-norm weights have fewer than 4096 elements, so lowbit keeps fp32 states for them.

Every optimizer steps its own copy of the parameters; the gradients are fixed random tensors assigned
once, so only ``step()`` is timed. The optimizers take turns: each warm-up round and each timed repeat
steps every optimizer once, so a noisy neighbour or a clock change slows them all alike; the turn order is
shuffled each repeat (a fixed seed), so that no optimizer always follows the same one. The table shows
the median and fastest step, the median per parameter, and the ratio of each median to the median of
``torch.optim.AdamW(fused=True)`` from the same run: this machine is noisy, so that ratio is the number
to read, and absolute times mean something only on a GPU. State bytes per parameter are counted after
the first step: the storage bytes of every tensor in ``optimizer.state`` except the ``step`` counters,
shared storages counted once, divided by the number of parameters. The 4-bit rows (blocks of 128,
``min_4bit_size`` 4096) also give their median over that of their 8-bit twin from the same run (``x 8-bit``);
``AdamW4bit (rank-1 v)`` is AdamW4bit with ``rank1_normalization=True``: the second moments of matrices
normalised rank-1 instead of in blocks of 128; ``AdamW4bit (stochastic)`` is AdamW4bit with
``rounding="stochastic"`` (its cost over nearest rounding: its median over ``lowbit AdamW4bit``'s).
LAMB8bit and LARS8bit (momentum 0.9) are timed on the same workloads: both add a per-tensor norm pass
(the trust ratio) to the step. The last lines compare the headline and trust-ratio ratios with issue 31's
goals.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import random
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Optional

import common
import torch
from common import parse, time_once, write_json
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import lowbit
import lowbit.optim

LR = 1e-3
MOMENTUM = 0.9
BASELINE = "torch AdamW fused"
MUON_BASELINE = "torch Muon"
MUON_LR = 0.02
MUON_SHAPES = [(1024, 1024), (4096, 1024), (1024, 4096)]
# Issue 28's GPT-like set, whose AdamW4bit state is to take <= 1.04 bytes per parameter.
GPT_SHAPES = [(1024, 1024)] * 4 + [(4096, 1024)] * 2 + [(1024, 4096)] * 2 + [(1024,)] * 4
ADEMAMIX_BASELINE = "lowbit AdEMAMix32bit"
HEADLINE = "lowbit Adam8bit"
# Each 4-bit row and the 8-bit row it is compared with.
FOUR_BIT_TWINS = {
    "lowbit Adam4bit": HEADLINE,
    "lowbit AdamW4bit": "lowbit AdamW8bit",
    "lowbit SGD4bit (momentum 0.9)": "lowbit SGD8bit (momentum 0.9)",
    "lowbit AdamW4bit (rank-1 v)": "lowbit AdamW8bit",
    "lowbit AdamW4bit (stochastic)": "lowbit AdamW8bit",
}
FOUR_BIT_HEADLINE = "lowbit AdamW4bit"
# Issue 31's goals for the headline ratio on each workload, and for the trust-ratio optimizers'.
HEADLINE_GOALS = {"single": 0.9, "many": 1.0}
TRUST_RATIO_ROWS = ("lowbit LAMB8bit", "lowbit LARS8bit (momentum 0.9)")
TRUST_RATIO_GOAL = 1.3
LAYERS = 24
# Hidden sizes are multiples of 16, as in real models, so the shapes stay realistic at any --numel.
HIDDEN_STEP = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Factory = Callable[[list[Tensor]], torch.optim.Optimizer]


@dataclasses.dataclass
class Workload:
    """Named parameter shapes; ``hidden`` is the model width of the ``many`` workload."""

    name: str
    shapes: list[tuple[int, ...]]
    hidden: Optional[int] = None
    baseline: str = BASELINE

    @property
    def numel(self) -> int:
        """Total number of parameters."""
        return sum(torch.Size(s).numel() for s in self.shapes)


@dataclasses.dataclass
class Row:
    """The measurements of one optimizer on one workload."""

    optimizer: str
    median_s: float
    min_s: float
    state_bytes: int


def layer_shapes(d: int) -> list[tuple[int, ...]]:
    """One pre-norm transformer layer of width ``d``: attention, MLP, their biases and layer norms."""
    attention = [(d, d), (d,)] * 4
    mlp = [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    layer_norms = [(d,), (d,)] * 2
    return attention + mlp + layer_norms


def many_workload(numel: int) -> Workload:
    """``LAYERS`` layers of the widest multiple of 16 that fits, a final norm and an embedding with the rest."""

    def stack(d: int) -> list[tuple[int, ...]]:
        return layer_shapes(d) * LAYERS + [(d,), (d,)]

    d = HIDDEN_STEP
    while Workload("many", stack(d + HIDDEN_STEP)).numel <= numel:
        d += HIDDEN_STEP
    shapes = stack(d)
    vocab = (numel - Workload("many", shapes).numel) // d
    if vocab > 0:
        shapes.insert(0, (vocab, d))
    return Workload("many", shapes, hidden=d)


def make_workloads(kind: str, numel: int) -> list[Workload]:
    """The workloads selected by ``--workload``."""
    workloads = []
    if kind in ("single", "both"):
        workloads.append(Workload("single", [(numel,)]))
    if kind in ("many", "both"):
        workloads.append(many_workload(numel))
    if kind == "gpt":
        workloads.append(Workload("gpt", list(GPT_SHAPES)))
    if kind == "muon":
        workloads.append(Workload("muon", list(MUON_SHAPES), baseline=MUON_BASELINE))
    if kind == "ademamix":
        workloads.append(Workload("ademamix", [(numel,)], baseline=ADEMAMIX_BASELINE))
    return workloads


def muon_factories() -> dict[str, Factory]:
    """Muon's rows: lowbit's 8- and 32-bit buffers against torch.optim.Muon, with and without Newton-Schulz."""
    return {
        "lowbit Muon8bit": lambda ps: lowbit.optim.Muon8bit(ps, lr=MUON_LR),
        "lowbit Muon32bit": lambda ps: lowbit.optim.Muon32bit(ps, lr=MUON_LR),
        MUON_BASELINE: lambda ps: torch.optim.Muon(ps, lr=MUON_LR),
        "lowbit Muon8bit, ns_steps=0": lambda ps: lowbit.optim.Muon8bit(ps, lr=MUON_LR, ns_steps=0),
        "torch Muon, ns_steps=0": lambda ps: torch.optim.Muon(ps, lr=MUON_LR, ns_steps=0),
    }


def ademamix_factories() -> dict[str, Factory]:
    """AdEMAMix's rows: 8-bit states against fp32 ones, and AdamW's two states for the cost of the third."""
    return {
        "lowbit AdEMAMix8bit": lambda ps: lowbit.optim.AdEMAMix8bit(ps, lr=LR),
        "lowbit AdEMAMix8bit, warm-ups": lambda ps: lowbit.optim.AdEMAMix8bit(ps, lr=LR, t_alpha=1000, t_beta3=1000),
        ADEMAMIX_BASELINE: lambda ps: lowbit.optim.AdEMAMix32bit(ps, lr=LR),
        "lowbit AdamW8bit": lambda ps: lowbit.optim.AdamW8bit(ps, lr=LR),
        "lowbit AdamW32bit": lambda ps: lowbit.optim.AdamW32bit(ps, lr=LR),
    }


def import_optional(name: str) -> Optional[ModuleType]:
    """The module ``name``, or None when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def make_params(workload: Workload, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """Parameters of ``workload`` with fixed random gradients; the same values on every call."""
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in workload.shapes:
        p = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
        p.grad = torch.randn(shape, generator=gen).to(device, dtype)
        params.append(p)
    return params


def make_factories(
    bnb: Optional[ModuleType], torchao_optim: Optional[ModuleType]
) -> tuple[dict[str, Factory], list[str]]:
    """The optimizers to time by row name, and the names of those skipped because not installed."""
    factories: dict[str, Factory] = {
        HEADLINE: lambda ps: lowbit.optim.Adam8bit(ps, lr=LR),
        "lowbit AdamW8bit": lambda ps: lowbit.optim.AdamW8bit(ps, lr=LR),
        "lowbit SGD8bit (momentum 0.9)": lambda ps: lowbit.optim.SGD8bit(ps, lr=LR, momentum=MOMENTUM),
        "lowbit Adam4bit": lambda ps: lowbit.optim.Adam4bit(ps, lr=LR),
        FOUR_BIT_HEADLINE: lambda ps: lowbit.optim.AdamW4bit(ps, lr=LR),
        "lowbit AdamW4bit (rank-1 v)": lambda ps: lowbit.optim.AdamW4bit(ps, lr=LR, rank1_normalization=True),
        "lowbit AdamW4bit (stochastic)": lambda ps: lowbit.optim.AdamW4bit(ps, lr=LR, rounding="stochastic"),
        "lowbit SGD4bit (momentum 0.9)": lambda ps: lowbit.optim.SGD4bit(ps, lr=LR, momentum=MOMENTUM),
        "lowbit AdamW32bit": lambda ps: lowbit.optim.AdamW32bit(ps, lr=LR),
        "lowbit LAMB8bit": lambda ps: lowbit.optim.LAMB8bit(ps, lr=LR),
        "lowbit LARS8bit (momentum 0.9)": lambda ps: lowbit.optim.LARS8bit(ps, lr=LR, momentum=MOMENTUM),
        BASELINE: lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=True),
        "torch AdamW for-loop": lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=False),
        "torch SGD foreach (momentum 0.9)": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, foreach=True),
    }
    skipped = []
    if bnb is not None:
        factories["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=LR)
    else:
        skipped.append("bitsandbytes AdamW8bit")
    if torchao_optim is not None:
        factories["torchao AdamW8bit"] = lambda ps: torchao_optim.AdamW8bit(ps, lr=LR)
        factories["torchao AdamW4bit"] = lambda ps: torchao_optim.AdamW4bit(ps, lr=LR)
    else:
        skipped += ["torchao AdamW8bit", "torchao AdamW4bit"]
    return factories, skipped


def plain_tensors(t: Tensor) -> Iterator[Tensor]:
    """``t``, or the plain tensors inside it when it is a wrapper subclass (torchao's 8- and 4-bit states)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from plain_tensors(getattr(t, name))
    else:
        yield t


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Storage bytes of the tensors in ``opt.state`` except ``step``, each storage counted once.

    Storages are de-duplicated because bitsandbytes puts one shared quantization map in every
    parameter's state.
    """
    storages: dict[tuple[torch.device, int], int] = {}
    for state in opt.state.values():
        for key, value in state.items():
            if key == "step" or not isinstance(value, Tensor):
                continue
            for t in plain_tensors(value):
                storage = t.untyped_storage()
                storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def time_step(opt: torch.optim.Optimizer, device: torch.device) -> float:
    """Seconds taken by one ``opt.step()``; CUDA steps are timed with events."""
    return time_once(opt.step, device)


def turn_orders(names: list[str], repeats: int, seed: int = 0) -> Iterator[list[str]]:
    """The optimizers' turn order in each of ``repeats`` timed repeats: a new shuffle each repeat (fixed
    ``seed``), so that no optimizer always follows the same one. On the CPU a step right after one that wrote
    or allocated much memory (torch's for-loop and foreach steps, whose temporaries are freed again) ran
    10-25% slower than after another optimizer's step. Rotating the order, as this benchmark once did, keeps
    each optimizer's predecessor: Adam8bit always followed torch's foreach SGD (1.02-1.17x fused AdamW's
    median in three runs; 0.96-1.02x with the order shuffled)."""
    rng = random.Random(seed)
    order = list(names)
    for _ in range(repeats):
        rng.shuffle(order)
        yield list(order)


def run_workload(
    workload: Workload,
    factories: dict[str, Factory],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> list[Row]:
    """Give each factory its own copy of the parameters, then time the optimizers' steps in turns."""
    optimizers = {name: factory(make_params(workload, dtype, device)) for name, factory in factories.items()}

    memory = {}
    for round_ in range(warmup):
        for name, opt in optimizers.items():
            print(f"{workload.name}: warm-up {round_ + 1}/{warmup} {name} ...", file=sys.stderr, flush=True)
            opt.step()
            if round_ == 0:
                memory[name] = state_bytes(opt)
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for repeat, order in enumerate(turn_orders(list(optimizers), repeats)):
        print(f"{workload.name}: repeat {repeat + 1}/{repeats} ...", file=sys.stderr, flush=True)
        for name in order:
            times[name].append(time_step(optimizers[name], device))
    return [Row(name, statistics.median(ts), min(ts), memory[name]) for name, ts in times.items()]


def ratio_to_baseline(rows: list[Row], optimizer: str, baseline: str = BASELINE) -> float:
    """Median step time of ``optimizer`` over that of ``baseline``, both from ``rows``."""
    medians = {r.optimizer: r.median_s for r in rows}
    return medians[optimizer] / medians[baseline]


def ratio_to_8bit(rows: list[Row], optimizer: str) -> Optional[float]:
    """Median step time of a 4-bit ``optimizer`` over that of its 8-bit twin, both from ``rows``; None for
    the other rows."""
    if optimizer not in FOUR_BIT_TWINS:
        return None
    medians = {r.optimizer: r.median_s for r in rows}
    return medians[optimizer] / medians[FOUR_BIT_TWINS[optimizer]]


def format_table(rows: list[Row], numel: int, baseline: str = BASELINE) -> str:
    """Plain-text table; ms and ns/param from the median step, "best" the fastest, ratio of medians."""
    ratio = "x fused AdamW" if baseline == BASELINE else f"x {baseline}"
    header = ["optimizer", "median ms", "best ms", "ns/param", ratio, "x 8-bit", "state bytes/param"]
    lines = [header]
    for r in rows:
        vs_8bit = ratio_to_8bit(rows, r.optimizer)
        lines.append(
            [
                r.optimizer,
                f"{r.median_s * 1e3:.2f}",
                f"{r.min_s * 1e3:.2f}",
                f"{r.median_s * 1e9 / numel:.3f}",
                f"{ratio_to_baseline(rows, r.optimizer, baseline):.2f}x",
                "" if vs_8bit is None else f"{vs_8bit:.2f}x",
                f"{r.state_bytes / numel:.3f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def describe(workload: Workload) -> str:
    """One-line size of a workload for the header."""
    n = len(workload.shapes)
    text = f"{workload.numel} params in {n} tensor{'s' if n > 1 else ''}"
    if workload.hidden is not None:
        small = sum(1 for s in workload.shapes if torch.Size(s).numel() < 4096)
        text += f" ({LAYERS} layers, hidden {workload.hidden}, {small} tensors < 4096 elements)"
    return text


def environment(
    args: argparse.Namespace,
    workloads: list[Workload],
    bnb: Optional[ModuleType],
    torchao: Optional[ModuleType],
) -> dict[str, object]:
    """What the numbers depend on, for the header and the JSON file."""
    return common.environment(
        args.device,
        dtype=args.dtype,
        **{w.name: describe(w) for w in workloads},
        warmup=args.warmup,
        repeats=args.repeats,
        bitsandbytes=None if bnb is None else bnb.__version__,
        torchao=None if torchao is None else torchao.__version__,
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--numel", type=int, default=16 * 2**20, help="parameters per workload (default 16M)")
    p.add_argument("--workload", choices=("single", "many", "both", "gpt", "muon", "ademamix"), default="both")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per optimizer (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer first (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(THREADS)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="parameter and gradient dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results as JSON")
    args = parse(p, argv)
    if args.numel < 1 or args.repeats < 1:
        p.error("--numel and --repeats must be positive")
    # The first step allocates the state, so it is never timed and the state is measured after it.
    if args.warmup < 1:
        p.error("--warmup must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Time every optimizer on every workload, print the environment, the tables and the headline."""
    args = parse_args(argv)
    device = torch.device(args.device)
    bnb = import_optional("bitsandbytes")
    torchao = import_optional("torchao")
    factories, skipped = make_factories(bnb, None if torchao is None else import_optional("torchao.optim"))
    workloads = make_workloads(args.workload, args.numel)

    results = {
        w.name: run_workload(
            w,
            {BASELINE: factories, MUON_BASELINE: muon_factories(), ADEMAMIX_BASELINE: ademamix_factories()}[w.baseline],
            DTYPES[args.dtype],
            device,
            args.warmup,
            args.repeats,
        )
        for w in workloads
    }

    env = environment(args, workloads, bnb, torchao)
    print("lowbit optimizer step, " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(
        f"median and best of {args.repeats} steps per optimizer after {args.warmup} warm-up steps, optimizers "
        f"taking turns; ns/param from the median; x fused AdamW = median / median of {BASELINE} in this run; "
        "state bytes/param = storage bytes of optimizer.state after the first step, step counters excluded."
    )
    for name in skipped:
        print(f"{name}: skipped: not installed")
    for w in workloads:
        print()
        print(f"workload {w.name}: {describe(w)}")
        print(format_table(results[w.name], w.numel, w.baseline))
    print()
    headline = {w.name: ratio_to_baseline(results[w.name], HEADLINE) for w in workloads if w.baseline == BASELINE}
    headline_4bit: dict[str, Optional[float]] = {}  # the muon and ademamix workloads have no headline
    if headline:
        print(
            f"{HEADLINE} median / {BASELINE} median (issue 31's goal on CPU, 2 threads, 16M fp32 params: "
            f"single <= {HEADLINE_GOALS['single']}x, many <= {HEADLINE_GOALS['many']}x): "
            + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in headline.items())
        )
        trust = {name: [ratio_to_baseline(results[name], row) for row in TRUST_RATIO_ROWS] for name in headline}
        print(
            f"{' / '.join(TRUST_RATIO_ROWS)} median / {BASELINE} median (goal <= {TRUST_RATIO_GOAL}x): "
            + ", ".join(f"{name} " + " / ".join(f"{r:.2f}x" for r in ratios) for name, ratios in trust.items())
        )
        headline_4bit = {name: ratio_to_8bit(results[name], FOUR_BIT_HEADLINE) for name in headline}
        print(
            f"{FOUR_BIT_HEADLINE} median / {FOUR_BIT_TWINS[FOUR_BIT_HEADLINE]} median (target <= 1.1x on CPU): "
            + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in headline_4bit.items())
        )

    if args.json is not None:
        result = {
            "environment": env,
            "baseline": BASELINE,
            "skipped": skipped,
            "workloads": {
                w.name: {
                    "numel": w.numel,
                    "tensors": len(w.shapes),
                    "hidden": w.hidden,
                    "baseline": w.baseline,
                    "rows": [
                        {
                            **dataclasses.asdict(r),
                            "ns_per_param": r.median_s * 1e9 / w.numel,
                            "x_baseline": ratio_to_baseline(results[w.name], r.optimizer, w.baseline),
                            "x_8bit": ratio_to_8bit(results[w.name], r.optimizer),
                            "state_bytes_per_param": r.state_bytes / w.numel,
                        }
                        for r in results[w.name]
                    ],
                }
                for w in workloads
            },
            "headline": headline,
            "headline_4bit": headline_4bit,
        }
        write_json(args.json, result)


if __name__ == "__main__":
    main()
