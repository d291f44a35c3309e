"""How far each 8- and 4-bit optimizer's trajectory ends from its fp32 reference, on the patterns of an audit.

Run from the repository root::

    python benchmarks/bench_numerics.py
    python benchmarks/bench_numerics.py --seeds 5 --min-8bit-size 0 --block-size 256 --json out/numerics.json

Options: ``--seeds`` (seeds 0..N-1 per scenario, default 3), ``--block-size`` (lowbit's 8-bit state
block size, default 256; bitsandbytes always uses 256), ``--min-8bit-size`` (tensors with fewer elements
keep fp32 states, default 4096 as in lowbit and bitsandbytes; 0 forces 8-bit states everywhere),
``--block-size-4bit`` and ``--min-4bit-size`` (the same for lowbit's 4-bit columns, defaults 128 and 4096;
torchao always uses blocks of 128 and quantizes only tensors of at least 4096 elements whose size its
block divides), ``--threads`` (``torch.set_num_threads``), ``--json PATH`` (also write the numbers as
JSON). At the defaults it takes about 6 s on two idle CPU cores without torchao (progress goes to
stderr); torchao compiles its step for every parameter shape, which adds minutes on a first run (torch's
compile cache shortens later ones). The results are deterministic.

Every column is an 8- or 4-bit optimizer and its reference, both started from the same fp32 parameters
(one model per seed, built after ``torch.manual_seed(seed)`` or from a generator seeded with it,
deep-copied for each run) and fed the same batches:

- lowbit Adam8bit, AdamW8bit, SGD8bit, RMSprop8bit, Adagrad8bit against ``torch.optim``'s optimizer of
  the same name with the same arguments (``foreach=False``);
- lowbit Lion8bit, LAMB8bit, LARS8bit against lowbit's Lion32bit, LAMB32bit, LARS32bit (fp32 states;
  torch has no such optimizers);
- lowbit Muon8bit against ``torch.optim.Muon``, both stepping the scenario's 2-D parameters only (the
  others keep their initial values on both sides; not run where a scenario has no matrix);
- lowbit AdEMAMix8bit (and bitsandbytes' AdEMAMix8bit) against the pure-PyTorch AdEMAMix formula
  (``lowbit/_reference/ademamix.py``, fp32 states; torch has no AdEMAMix);
- bitsandbytes' Adam8bit, AdamW8bit, SGD8bit, RMSprop8bit, Adagrad8bit and Lion8bit against the same
  references, when ``import bitsandbytes`` works (the columns are skipped with a note otherwise);
- lowbit Adam4bit, AdamW4bit (block-wise, the default, and with its matrices' second moments normalised
  rank-1: ``AdamW4bit r1``), SGD4bit, and torchao's ``torchao.optim.Adam4bit`` and ``AdamW4bit`` when
  ``import torchao.optim`` works, against the same ``torch.optim`` references (a table of their own).

Hyperparameters: Adam/AdamW lr 1e-3 (AdamW weight_decay 1e-2), SGD lr 1e-2 momentum 0.9, RMSprop lr
1e-3, Adagrad lr 1e-2, Lion lr 1e-4, LAMB lr 1e-3, LARS lr 1e-2 momentum 0.9, Muon lr 2e-2, AdEMAMix lr
1e-3 (its defaults: betas (0.9, 0.999, 0.9999), alpha 5, weight_decay 1e-2); everything else default.

Scenarios (fp32 parameters):

1. ``two-gradient block``: one zero parameter of 4096 elements; step 1's gradient is 10.0 at [0], 1e-4
   at [1] and 0 elsewhere, step 2's gradient is all zero; lr 1e-3 for every optimizer. The small
   element shares a quantization block with the large one (the audit found Adam8bit's p[1] at -4.205
   where torch's is -0.00167). The same for every seed.
2. ``ReLU MLP``: Linear(64, 256), ReLU, Linear(256, 256), ReLU, Linear(256, 10); 30 steps of cross-entropy
   on a fresh batch of 4 standard-normal inputs with random labels (a generator seeded per seed).
3. ``rare embedding rows``: Embedding(1000, 32) then Linear(32, 1000); 60 steps of cross-entropy on 16
   tokens drawn with probability proportional to 1/k^1.5 (k = 1..1000), the target being the token
   itself, so most rows get a gradient only now and then.
4. ``dense``: one parameter ``randn(8192) * logspace(-4, 0, 8192)[randperm]`` (magnitudes over four
   decades, shuffled), loss ``(p * p).sum()``, 60 steps. The Adam family runs as AdamW only here (the
   Adam columns read "-").
5. ``LPMMAdamW`` (a table of its own): scenario 4's and scenario 3's models converted with
   :func:`lowbit.lpmm.convert` and trained by :class:`lowbit.optim.LPMMAdamW` (lr 1e-3, weight_decay
   1e-2), against ``torch.optim.AdamW`` with the same arguments on the fp32 model loaded from
   :func:`lowbit.lpmm.export_float` of the converted one (so both start from the same values); the
   difference is taken between the exported float parameters and the reference's. Configurations:
   the defaults (12-bit parameters, 8-bit gradient accumulators and moments, groups of 2048, stochastic
   rounding) and 16-bit parameters and accumulators (``param_bits=16, grad_bits=16``, the rest default);
   rounding draws come from generators seeded per seed.

A cell is ``max / mean``: the largest |tested - reference| over every element of every parameter
(the max over seeds), then the mean |tested - reference| over all elements (the mean over seeds). As
optimizers move parameters by different amounts, a second table gives the max difference divided by
the largest distance the reference moved any element from its initial value (also in the JSON file).
Which tensors hold quantized (8- or 4-bit) states is read from the optimizers' states after the run (uint8
tensors, also inside torchao's state subclasses) and listed under the tables; a column that differs from
the rest is flagged. An optimizer that raises gets "error" in its
cell and the message below the tables.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F
from common import cpu_model, parse, write_json
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import lowbit
import lowbit.lpmm as lpmm
import lowbit.optim as O
from lowbit._reference.ademamix import ReferenceAdEMAMix

Batch = Any
OptFactory = Callable[..., torch.optim.Optimizer]


# -- columns: an optimizer under test and its reference ---------------------------------------------


@dataclasses.dataclass
class Column:
    """One 8- or 4-bit optimizer under test, its fp32 reference and their shared arguments."""

    name: str
    tested: OptFactory
    reference: OptFactory
    reference_name: str
    hyper: dict[str, float]
    library: str  # "lowbit", "bitsandbytes" or "torchao": which options the tested optimizer takes
    adam: bool = False  # Adam without decoupled decay: not run on the dense scenario
    bits: int = 8
    matrices: bool = False  # Muon: steps the 2-D parameters only (the others keep their values on both sides)

    def make_tested(self, params: list[Tensor], hyper: dict[str, float], args: argparse.Namespace) -> Any:
        options: dict[str, Any] = {}
        if self.library == "lowbit" and self.bits == 4:
            options = {"min_4bit_size": args.min_4bit_size, "block_size": args.block_size_4bit}
        elif self.library == "lowbit":
            options = {"min_8bit_size": args.min_8bit_size, "block_size": args.block_size}
        elif self.library == "bitsandbytes":
            options = {"min_8bit_size": args.min_8bit_size}
        return self.tested(self.stepped(params), **hyper, **options)

    def stepped(self, params: list[Tensor]) -> list[Tensor]:
        """The parameters this column's optimizers step."""
        return [p for p in params if p.dim() == 2] if self.matrices else params

    def make_reference(self, params: list[Tensor], hyper: dict[str, float]) -> torch.optim.Optimizer:
        if self.matrices:  # torch.optim.Muon has no foreach option
            return self.reference(self.stepped(params), **hyper)
        if self.reference.__module__.startswith("torch."):
            return self.reference(params, **hyper, foreach=False)
        return self.reference(params, **hyper)


def make_columns(bnb: Optional[ModuleType], torchao_optim: Optional[ModuleType] = None) -> list[Column]:
    """The columns: lowbit's 8-bit, bitsandbytes' when it is importable, lowbit's 4-bit, torchao's 4-bit when
    ``torchao_optim`` is given."""
    adam = {"lr": 1e-3}
    adamw = {"lr": 1e-3, "weight_decay": 1e-2}
    sgdm = {"lr": 1e-2, "momentum": 0.9}
    rms, ada, lion = {"lr": 1e-3}, {"lr": 1e-2}, {"lr": 1e-4}
    muon = {"lr": 2e-2}
    cols = [
        Column("Adam8bit", O.Adam8bit, torch.optim.Adam, "torch Adam", adam, "lowbit", adam=True),
        Column("AdamW8bit", O.AdamW8bit, torch.optim.AdamW, "torch AdamW", adamw, "lowbit"),
        Column("SGD8bit", O.SGD8bit, torch.optim.SGD, "torch SGD", sgdm, "lowbit"),
        Column("RMSprop8bit", O.RMSprop8bit, torch.optim.RMSprop, "torch RMSprop", rms, "lowbit"),
        Column("Adagrad8bit", O.Adagrad8bit, torch.optim.Adagrad, "torch Adagrad", ada, "lowbit"),
        Column("Lion8bit", O.Lion8bit, O.Lion32bit, "lowbit Lion32bit", lion, "lowbit"),
        Column("LAMB8bit", O.LAMB8bit, O.LAMB32bit, "lowbit LAMB32bit", {"lr": 1e-3}, "lowbit"),
        Column("LARS8bit", O.LARS8bit, O.LARS32bit, "lowbit LARS32bit", sgdm, "lowbit"),
        Column("Muon8bit", O.Muon8bit, torch.optim.Muon, "torch Muon", muon, "lowbit", matrices=True),
        Column("AdEMAMix8bit", O.AdEMAMix8bit, ReferenceAdEMAMix, "PyTorch AdEMAMix", {"lr": 1e-3}, "lowbit"),
    ]
    if bnb is not None:
        cols += [
            Column("bnb Adam8bit", bnb.optim.Adam8bit, torch.optim.Adam, "torch Adam", adam, "bitsandbytes", adam=True),
            Column("bnb AdamW8bit", bnb.optim.AdamW8bit, torch.optim.AdamW, "torch AdamW", adamw, "bitsandbytes"),
            Column("bnb SGD8bit", bnb.optim.SGD8bit, torch.optim.SGD, "torch SGD", sgdm, "bitsandbytes"),
            Column("bnb RMSprop8bit", bnb.optim.RMSprop8bit, torch.optim.RMSprop, "torch RMSprop", rms, "bitsandbytes"),
            Column("bnb Adagrad8bit", bnb.optim.Adagrad8bit, torch.optim.Adagrad, "torch Adagrad", ada, "bitsandbytes"),
            Column("bnb Lion8bit", bnb.optim.Lion8bit, O.Lion32bit, "lowbit Lion32bit", lion, "bitsandbytes"),
            Column(
                "bnb AdEMAMix8bit",
                bnb.optim.AdEMAMix8bit,
                ReferenceAdEMAMix,
                "PyTorch AdEMAMix",
                {"lr": 1e-3},
                "bitsandbytes",
            ),
        ]
    cols += [
        Column("Adam4bit", O.Adam4bit, torch.optim.Adam, "torch Adam", adam, "lowbit", adam=True, bits=4),
        Column("AdamW4bit", O.AdamW4bit, torch.optim.AdamW, "torch AdamW", adamw, "lowbit", bits=4),
        Column("AdamW4bit r1", _rank1_v(O.AdamW4bit), torch.optim.AdamW, "torch AdamW", adamw, "lowbit", bits=4),
        Column("SGD4bit", O.SGD4bit, torch.optim.SGD, "torch SGD", sgdm, "lowbit", bits=4),
    ]
    if torchao_optim is not None:
        ao_adam, ao_adamw = torchao_optim.Adam4bit, torchao_optim.AdamW4bit
        cols += [
            Column("ao Adam4bit", ao_adam, torch.optim.Adam, "torch Adam", adam, "torchao", adam=True, bits=4),
            Column("ao AdamW4bit", ao_adamw, torch.optim.AdamW, "torch AdamW", adamw, "torchao", bits=4),
        ]
    return cols


def _rank1_v(cls: Any) -> OptFactory:
    """``cls`` with ``rank1_normalization=True``: the second moments of matrices normalised rank-1."""
    return lambda params, **kw: cls(params, rank1_normalization=True, **kw)


# -- scenarios ----------------------------------------------------------------------------------------


class Dense(nn.Module):
    """One flat parameter ``p`` with loss ``(p * p).sum()``."""

    def __init__(self, value: Tensor) -> None:
        super().__init__()
        self.p = nn.Parameter(value)

    def forward(self) -> Tensor:
        return (self.p * self.p).sum()


@dataclasses.dataclass
class Scenario:
    """A model builder, the batches of one seed and how a batch sets the gradients."""

    name: str
    build: Callable[[int], tuple[nn.Module, list[Batch]]]
    backward: Callable[[nn.Module, Batch], None]
    lr: Optional[float] = None  # overrides every column's learning rate
    dense: bool = False  # the Adam family runs as AdamW only


def two_gradient_block(seed: int) -> tuple[nn.Module, list[Batch]]:
    g1 = torch.zeros(4096)
    g1[0], g1[1] = 10.0, 1e-4
    return Dense(torch.zeros(4096)), [g1, torch.zeros(4096)]


def set_grad(model: nn.Module, grad: Tensor) -> None:
    model.p.grad = grad.clone()


def relu_mlp(seed: int) -> tuple[nn.Module, list[Batch]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(4, 64, generator=gen), torch.randint(0, 10, (4,), generator=gen)) for _ in range(30)]
    return model, batches


def cross_entropy(model: nn.Module, batch: Batch) -> None:
    x, y = batch
    F.cross_entropy(model(x), y).backward()


def rare_embedding(seed: int) -> tuple[nn.Module, list[Batch]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(1000, 32), nn.Linear(32, 1000))
    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, 1001, dtype=torch.float64).pow(-1.5)
    batches = []
    for _ in range(60):
        idx = torch.multinomial(probs, 16, replacement=True, generator=gen)
        batches.append((idx, idx))
    return model, batches


def dense(seed: int) -> tuple[nn.Module, list[Batch]]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 0, 8192)[torch.randperm(8192, generator=gen)]
    return Dense(torch.randn(8192, generator=gen) * scale), [None] * 60


def square_loss(model: nn.Module, batch: Batch) -> None:
    model().backward()


SCENARIOS = [
    Scenario("two-gradient block", two_gradient_block, set_grad, lr=1e-3),
    Scenario("ReLU MLP", relu_mlp, cross_entropy),
    Scenario("rare embedding rows", rare_embedding, cross_entropy),
    Scenario("dense", dense, square_loss, dense=True),
]


# -- running and comparing ----------------------------------------------------------------------------


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Batch], backward: Callable) -> None:
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        backward(model, batch)
        opt.step()


def params_of(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def distance(got: dict[str, Tensor], want: dict[str, Tensor]) -> tuple[float, float]:
    """(max, mean) of |got - want| over every element of every tensor."""
    diff = torch.cat([(got[k].double() - want[k].double()).abs().reshape(-1) for k in want])
    return float(diff.max()), float(diff.mean())


def movement(final: dict[str, Tensor], initial: dict[str, Tensor]) -> float:
    """The largest distance any element moved."""
    return max(float((final[k].double() - initial[k].double()).abs().max()) for k in initial)


def holds_codes(t: Any) -> bool:
    """Whether ``t`` is a uint8 tensor or a wrapper subclass holding one (torchao's quantized states)."""
    if not isinstance(t, Tensor):
        return False
    if is_traceable_wrapper_subclass(t):
        return any(holds_codes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.dtype == torch.uint8


def eight_bit_tensors(opt: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Names of the parameters whose optimizer state holds quantized (8- or 4-bit) codes."""
    return [name for name, p in model.named_parameters() if any(map(holds_codes, opt.state.get(p, {}).values()))]


@dataclasses.dataclass
class Cell:
    """One optimizer on one scenario, over the seeds."""

    max_abs: list[float] = dataclasses.field(default_factory=list)
    mean_abs: list[float] = dataclasses.field(default_factory=list)
    reference_moved: list[float] = dataclasses.field(default_factory=list)
    eight_bit: Optional[list[str]] = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: Optional[str] = None

    def summary(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        return {
            "max_abs": max(self.max_abs),
            "mean_abs": sum(self.mean_abs) / len(self.mean_abs),
            "max_abs_per_seed": self.max_abs,
            "mean_abs_per_seed": self.mean_abs,
            "reference_max_moved": max(self.reference_moved),
            "eight_bit_tensors": self.eight_bit,
            **self.extra,
        }


def run_scenario(scenario: Scenario, columns: list[Column], args: argparse.Namespace) -> dict[str, Optional[Cell]]:
    """Every column on every seed of ``scenario``; None for a column the scenario does not run."""
    has_matrix = any(p.dim() == 2 for p in scenario.build(0)[0].parameters())
    cells: dict[str, Optional[Cell]] = {
        c.name: (None if (scenario.dense and c.adam) or (c.matrices and not has_matrix) else Cell()) for c in columns
    }
    for seed in range(args.seeds):
        base, batches = scenario.build(seed)
        initial = params_of(base)
        references: dict[tuple[Any, ...], dict[str, Tensor]] = {}
        for col in columns:
            cell = cells[col.name]
            if cell is None or cell.error is not None:
                continue
            hyper = dict(col.hyper) if scenario.lr is None else dict(col.hyper, lr=scenario.lr)
            key = (col.reference, tuple(sorted(hyper.items())))
            print(f"{scenario.name}: seed {seed} {col.name} ...", file=sys.stderr, flush=True)
            try:
                if key not in references:
                    ref_model = copy.deepcopy(base)
                    ref_opt = col.make_reference(list(ref_model.parameters()), hyper)
                    train(ref_model, ref_opt, batches, scenario.backward)
                    references[key] = params_of(ref_model)
                model = copy.deepcopy(base)
                opt = col.make_tested(list(model.parameters()), hyper, args)
                train(model, opt, batches, scenario.backward)
            except Exception as e:  # report and go on with the other optimizers
                cell.error = f"{type(e).__name__}: {e}"
                continue
            got, want = params_of(model), references[key]
            hi, mean = distance(got, want)
            cell.max_abs.append(hi)
            cell.mean_abs.append(mean)
            cell.reference_moved.append(movement(want, initial))
            cell.eight_bit = eight_bit_tensors(opt, model)
            if scenario.build is two_gradient_block and seed == 0:
                cell.extra["p1"] = float(got["p"][1])
                cell.extra["reference_p1"] = float(want["p"][1])
    return cells


LPMM_CONFIGS: dict[str, dict[str, Any]] = {
    "LPMMAdamW defaults (p12/g8/m8, group 2048)": {},
    "LPMMAdamW p16/g16/m8 (group 2048)": {"param_bits": 16, "grad_bits": 16},
}
LPMM_SCENARIOS = [s for s in SCENARIOS if s.name in ("dense", "rare embedding rows")][::-1]
LPMM_HYPER = {"lr": 1e-3, "weight_decay": 1e-2}


def run_lpmm(scenario: Scenario, convert_args: dict[str, Any], seeds: int) -> Cell:
    """LPMMAdamW on the converted model against torch AdamW on the exported fp32 twin."""
    cell = Cell()
    for seed in range(seeds):
        print(f"LPMM {scenario.name}: seed {seed} {convert_args or 'defaults'} ...", file=sys.stderr, flush=True)
        try:
            base, batches = scenario.build(seed)
            gen = torch.Generator().manual_seed(seed)
            model = lpmm.convert(copy.deepcopy(base), **convert_args, generator=gen)
            ref = copy.deepcopy(base)
            ref.load_state_dict(lpmm.export_float(model))
            initial = params_of(ref)
            train(model, O.LPMMAdamW(model.parameters(), **LPMM_HYPER, generator=gen), batches, scenario.backward)
            train(ref, torch.optim.AdamW(ref.parameters(), **LPMM_HYPER, foreach=False), batches, scenario.backward)
        except Exception as e:
            cell.error = f"{type(e).__name__}: {e}"
            return cell
        exported = {k: v.detach().float() for k, v in lpmm.export_float(model).items()}
        want = params_of(ref)
        hi, mean = distance(exported, want)
        cell.max_abs.append(hi)
        cell.mean_abs.append(mean)
        cell.reference_moved.append(movement(want, initial))
    return cell


# -- output -------------------------------------------------------------------------------------------


def fmt(cell: Optional[Cell]) -> str:
    """``max / mean`` of a cell, "-" when not run, "error" when it raised."""
    if cell is None:
        return "-"
    if cell.error is not None:
        return "error"
    s = cell.summary()
    return f"{s['max_abs']:.3g} / {s['mean_abs']:.3g}"


def fmt_relative(cell: Optional[Cell]) -> str:
    """The cell's max difference over the largest distance the reference moved any element."""
    if cell is None or cell.error is not None:
        return fmt(cell)
    s = cell.summary()
    return f"{s['max_abs'] / s['reference_max_moved']:.3g}" if s["reference_max_moved"] > 0 else "inf"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def shapes(model: nn.Module) -> dict[str, str]:
    return {name: "x".join(map(str, p.shape)) for name, p in model.named_parameters()}


def eight_bit_notes(scenario: Scenario, cells: dict[str, Optional[Cell]], label: str = "8-bit") -> list[str]:
    """One line naming the tensors with ``label`` states (the most common answer), and the columns that
    differ."""
    model, _ = scenario.build(0)
    dims = shapes(model)
    answers: dict[tuple[str, ...], list[str]] = {}
    for name, cell in cells.items():
        if cell is not None and cell.error is None and cell.eight_bit is not None:
            answers.setdefault(tuple(cell.eight_bit), []).append(name)
    if not answers:
        return []
    common = max(answers, key=lambda k: len(answers[k]))

    def describe(names: tuple[str, ...]) -> str:
        eight = ", ".join(f"{n} [{dims[n]}]" for n in names) or "none"
        fp32 = ", ".join(f"{n} [{dims[n]}]" for n in dims if n not in names) or "none"
        return f"{label} states: {eight}; fp32 states: {fp32}"

    lines = [f"- {scenario.name}: {describe(common)}"]
    for names, cols in answers.items():
        if names != common:
            lines.append(f"  - but {', '.join(cols)}: {describe(names)}")
    return lines


def import_peer(name: str) -> tuple[Optional[ModuleType], Optional[str]]:
    """The module ``name`` (bitsandbytes, torchao.optim), or None and why not."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # not installed, or a broken install
        return None, f"{type(e).__name__}: {e}"


def import_bnb() -> tuple[Optional[ModuleType], Optional[str]]:
    """bitsandbytes, or None and why not."""
    return import_peer("bitsandbytes")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per scenario (default 3)")
    p.add_argument("--block-size", type=int, default=256, help="lowbit 8-bit state block size (default 256)")
    p.add_argument(
        "--min-8bit-size", type=int, default=4096, help="fewer elements keep fp32 states (default 4096; 0: all 8-bit)"
    )
    p.add_argument("--block-size-4bit", type=int, default=128, help="lowbit 4-bit state block size (default 128)")
    p.add_argument(
        "--min-4bit-size", type=int, default=4096, help="fewer elements keep fp32 states in lowbit's 4-bit columns"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(THREADS)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results as JSON")
    args = parse(p, argv)
    if args.seeds < 1:
        p.error("--seeds must be positive")
    if args.min_8bit_size < 0 or args.min_4bit_size < 0:
        p.error("--min-8bit-size and --min-4bit-size must be non-negative")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Run every scenario, print the environment and the tables, optionally write JSON."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    bnb, bnb_error = import_bnb()
    torchao_optim, torchao_error = import_peer("torchao.optim")
    columns = make_columns(bnb, torchao_optim)

    results: dict[str, dict[str, Optional[Cell]]] = {}
    timings: dict[str, float] = {}
    for scenario in SCENARIOS:
        t0 = time.perf_counter()
        results[scenario.name] = run_scenario(scenario, columns, args)
        timings[scenario.name] = time.perf_counter() - t0
    lpmm_results: dict[str, dict[str, Cell]] = {}
    t0 = time.perf_counter()
    for scenario in LPMM_SCENARIOS:
        lpmm_results[scenario.name] = {name: run_lpmm(scenario, cfg, args.seeds) for name, cfg in LPMM_CONFIGS.items()}
    timings["LPMMAdamW"] = time.perf_counter() - t0
    total = time.perf_counter() - t_start

    env: dict[str, Any] = {
        "command": shlex.join(["python", *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lowbit": lowbit.__version__,
        "bitsandbytes": None if bnb is None else bnb.__version__,
        "torchao": None if torchao_optim is None else importlib.import_module("torchao").__version__,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "seeds": args.seeds,
        "block_size": args.block_size,
        "min_8bit_size": args.min_8bit_size,
        "block_size_4bit": args.block_size_4bit,
        "min_4bit_size": args.min_4bit_size,
    }
    print(f"command: {env['command']}")
    print(
        f"torch {env['torch']}, lowbit {env['lowbit']}, bitsandbytes {env['bitsandbytes'] or 'not available'}, "
        f"torchao {env['torchao'] or 'not available'}, python {env['python']}, cpu: {env['cpu']}, "
        f"threads {env['threads']}"
    )
    print(
        f"seeds 0..{args.seeds - 1}, lowbit block_size {args.block_size} (bitsandbytes: 256, fixed), "
        f"min_8bit_size {args.min_8bit_size}; 4-bit: lowbit block_size {args.block_size_4bit}, min_4bit_size "
        f"{args.min_4bit_size} (torchao: 128, fixed; quantizes tensors of >= 4096 elements that 128 divides)"
    )
    if bnb is None:
        print(f"note: bitsandbytes columns skipped: import bitsandbytes failed ({bnb_error})")
    if torchao_optim is None:
        print(f"note: torchao columns skipped: import torchao.optim failed ({torchao_error})")
    print()
    print(
        "Cell: max |tested - reference| over all parameter elements (max over seeds) / mean |tested - reference| "
        "(mean over seeds), after the scenario's last step. '-': not run in that scenario."
    )
    widths = {bits: [c for c in columns if c.bits == bits] for bits in (8, 4)}
    for bits, cols in widths.items():
        print()
        print(f"{bits}-bit states:")
        print()
        header = ["scenario"] + [c.name for c in cols]
        print(markdown(header, [[s.name] + [fmt(results[s.name][c.name]) for c in cols] for s in SCENARIOS]))
    print()
    print(
        "The same max difference as a fraction of the largest distance the reference moved any element from its "
        "initial value (optimizers move parameters by different amounts, so compare columns here):"
    )
    for bits, cols in widths.items():
        print()
        print(f"{bits}-bit states:")
        print()
        header = ["scenario"] + [c.name for c in cols]
        print(markdown(header, [[s.name] + [fmt_relative(results[s.name][c.name]) for c in cols] for s in SCENARIOS]))
    print()
    print("References: " + ", ".join(f"{c.name} vs {c.reference_name}" for c in columns) + ".")
    print(
        "Arguments (both sides): "
        + ", ".join(f"{c.name} " + " ".join(f"{k}={v:g}" for k, v in c.hyper.items()) for c in columns)
        + "; two-gradient block: lr=1e-3 for all; dense: the Adam family as AdamW only."
    )
    for bits, cols in widths.items():
        print(f"Tensors with {bits}-bit states (read from the optimizer states after the run):")
        for s in SCENARIOS:
            cells = {c.name: results[s.name][c.name] for c in cols}
            for line in eight_bit_notes(s, cells, f"{bits}-bit"):
                print(line)
    first = results[SCENARIOS[0].name]
    p1 = [f"{n} {c.extra['p1']:.4g} (ref {c.extra['reference_p1']:.4g})" for n, c in first.items() if c and c.extra]
    if p1:
        print("two-gradient block, p[1] after step 2: " + ", ".join(p1))

    print()
    print(
        "LPMMAdamW (lr 1e-3, weight_decay 1e-2, stochastic rounding, seeded generators) vs torch AdamW on the fp32 "
        "model loaded from export_float; cell as above, over the exported float parameters."
    )
    print()
    names = list(LPMM_CONFIGS)
    print(markdown(["model"] + names, [[s] + [fmt(lpmm_results[s][n]) for n in names] for s in lpmm_results]))
    print()
    print("As a fraction of the reference's largest movement:")
    print()
    rows = [[s] + [fmt_relative(lpmm_results[s][n]) for n in names] for s in lpmm_results]
    print(markdown(["model"] + names, rows))

    errors = [(s, n, c.error) for s, row in results.items() for n, c in row.items() if c and c.error]
    errors += [(f"LPMM {s}", n, c.error) for s, row in lpmm_results.items() for n, c in row.items() if c.error]
    if errors:
        print()
        for s, n, err in errors:
            print(f"error: {s}, {n}: {err}")
    print()
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()) + f"; total {total:.1f} s")

    if args.json is not None:
        out = {
            "environment": env,
            "columns": {
                c.name: {"reference": c.reference_name, "arguments": c.hyper, "library": c.library, "bits": c.bits}
                for c in columns
            },
            "bitsandbytes_skipped": bnb_error,
            "torchao_skipped": torchao_error,
            "scenarios": {
                s: {n: (None if c is None else c.summary()) for n, c in row.items()} for s, row in results.items()
            },
            "lpmm": {
                s: {n: {**c.summary(), "convert": LPMM_CONFIGS[n]} for n, c in row.items()}
                for s, row in lpmm_results.items()
            },
            "seconds": {**timings, "total": total},
        }
        write_json(args.json, out)


if __name__ == "__main__":
    main()
