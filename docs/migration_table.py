"""The migration table of docs/migration.md, as data: ``python docs/migration_table.py`` writes the table into
the page, and tests/test_migration.py runs every row (constructs the lowbit equivalent, checks the row's
claims about defaults and arguments against it, and steps it).

Sources: the signatures of bitsandbytes 0.4x (``bnb.optim``) and torchao's ``torchao.optim`` (0.1x).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

PAGE = Path(__file__).with_name("migration.md")
BEGIN, END = "<!-- migration table: begin -->", "<!-- migration table: end -->"


@dataclass(frozen=True)
class Row:
    """One source class and its lowbit equivalent.

    ``same``: the source's defaults that lowbit shares (the test checks lowbit's defaults equal them).
    ``differ``: the source's defaults that lowbit's differ from; pass them to get the source's behaviour (the
    test checks lowbit's default differs and that passing the value sets it). ``accepted``: source arguments
    lowbit takes with the same meaning, with a non-default value to pass (the test checks it lands in the
    param group). ``dropped``: source arguments lowbit does not take (the test checks they raise TypeError).
    ``required``: arguments to pass whatever the row (the source has no default for them).
    """

    source: str
    lowbit: Optional[str]
    same: dict[str, Any] = field(default_factory=dict)
    differ: dict[str, Any] = field(default_factory=dict)
    accepted: dict[str, Any] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    required: dict[str, Any] = field(default_factory=dict)
    bits: int = 32
    notes: str = ""


ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
BNB_COMMON = ("args", "block_wise")
PAGED = (
    "No paged optimizers: states stay on the parameter's device; the 8- or 4-bit states, gradient release or "
    "LPMM cut the memory paging would move."
)
BLOCK_WISE = "lowbit is always block-wise (`block_size`, 256 at 8 bits)."


def _bnb_family(
    name: str,
    target: str,
    same: dict[str, Any],
    differ: dict[str, Any],
    dropped: tuple[str, ...],
    notes: str,
    paged: bool,
    required: Optional[dict[str, Any]] = None,
    accepted8: Optional[dict[str, Any]] = None,
) -> list[Row]:
    """The generic class (``optim_bits=32`` by default), its 8bit and 32bit twins, and their Paged variants."""
    accepted = {"min_8bit_size": 1024, "percentile_clipping": 95, **(accepted8 or {})}
    rows = []
    variants = [("", target, 32), ("8bit", f"{target}8bit", 8), ("32bit", f"{target}32bit", 32)]
    for prefix in ("", "Paged") if paged else ("",):
        for suffix, lowbit, bits in variants:
            extra = {"optim_bits": 8} if suffix == "" else {}
            drop = dropped + (("is_paged",) if paged and prefix == "" else ())
            first = not prefix and not suffix
            note = (notes if first else f"As `bnb.optim.{name}`.") + (" " + PAGED if prefix else "")
            rows.append(
                Row(
                    f"bnb.optim.{prefix}{name}{suffix}",
                    lowbit,
                    same=same,
                    differ=differ,
                    accepted={**accepted, **extra},
                    dropped=drop,
                    required=required or {},
                    bits=bits,
                    notes=note.strip(),
                )
            )
    return rows


ROWS: list[Row] = [
    *_bnb_family(
        "Adam",
        "AdamW",
        {**ADAM, "amsgrad": False},
        {"weight_decay": 0.0},
        BNB_COMMON,
        "bnb's Adam decays the weights decoupled, as AdamW does; lowbit's `Adam` adds L2 decay to the gradient "
        "as torch.optim.Adam does, so bnb's Adam is lowbit's `AdamW` with bnb's `weight_decay=0` passed. bnb "
        "ignores `amsgrad=True`; lowbit honours it. " + BLOCK_WISE,
        paged=True,
    ),
    *_bnb_family(
        "AdamW",
        "AdamW",
        {**ADAM, "weight_decay": 1e-2, "amsgrad": False},
        {},
        BNB_COMMON,
        "bnb ignores `amsgrad=True`; lowbit honours it. " + BLOCK_WISE,
        paged=True,
    ),
    *_bnb_family(
        "SGD",
        "SGD",
        {"dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
        {},
        BNB_COMMON,
        "bnb has no default `lr` and refuses `momentum=0`; lowbit's defaults are torch's (`lr=1e-3`, "
        "`momentum=0`). " + BLOCK_WISE,
        paged=False,
        required={"lr": 0.1, "momentum": 0.9},
    ),
    *_bnb_family(
        "Lion",
        "Lion",
        {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
        {},
        BNB_COMMON,
        BLOCK_WISE,
        paged=True,
    ),
    *_bnb_family(
        "LAMB",
        "LAMB",
        {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
        {"eps": 1e-8},
        ("args", "block_wise", "bias_correction", "adam_w_mode", "amsgrad"),
        "lowbit's LAMB applies the trust ratio `||p|| / ||r||` (bnb's 8-bit LAMB applies none and clips the "
        "update with `max_unorm=1.0`), so it refuses `max_unorm`; it always corrects the bias and decays "
        "decoupled (bnb's `bias_correction=True`, `adam_w_mode=True`). bnb's LAMB is tensor-wise "
        "(`block_wise=False`); lowbit's is block-wise.",
        paged=False,
    ),
    *_bnb_family(
        "LARS",
        "LARS",
        {"dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
        {},
        ("args",),
        "bnb has no default `lr` and refuses its default `momentum=0` (lowbit's default is 0.9). "
        "lowbit's LARS scales by the trust ratio with "
        "`trust_coefficient` (1e-3) and `eps`; bnb's 8-bit LARS applies no trust ratio and clips with "
        "`max_unorm=0.02`, which lowbit takes with the same meaning (default 0, off).",
        paged=False,
        required={"lr": 0.1, "momentum": 0.9},
        accepted8={"max_unorm": 0.02},
    ),
    *_bnb_family(
        "RMSprop",
        "RMSprop",
        {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False},
        {},
        BNB_COMMON,
        "bnb refuses `centered=True`; lowbit supports it (a second state, 8-bit in the 8-bit optimizer). " + BLOCK_WISE,
        paged=False,
    ),
    *_bnb_family(
        "Adagrad",
        "Adagrad",
        {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10},
        {},
        BNB_COMMON,
        "bnb refuses `lr_decay` and `initial_accumulator_value` other than 0; lowbit takes them as torch does. "
        + BLOCK_WISE,
        paged=False,
    ),
    *_bnb_family(
        "AdEMAMix",
        "AdEMAMix",
        {"lr": 1e-3, "betas": (0.9, 0.999, 0.9999), "alpha": 5.0, "eps": 1e-8, "weight_decay": 1e-2},
        {},
        (),
        "Same arguments and defaults (`t_alpha`, `t_beta3` included); a resumed run continues the warm-ups.",
        paged=True,
    ),
    Row(
        "torchao.optim.AdamW8bit",
        "AdamW8bit",
        same={**ADAM, "weight_decay": 1e-2, "amsgrad": False},
        accepted={"block_size": 256},
        dropped=("bf16_stochastic_round",),
        bits=8,
        notes="`bf16_stochastic_round` (bf16 weights updated with stochastic rounding) has no equivalent in the "
        "block-wise optimizers: keep fp32 weights, or store them low with LPMM (`lowbit.lpmm.convert`, "
        "stochastic rounding). `rounding='stochastic'` rounds the states, not the weights.",
    ),
    Row(
        "torchao.optim.Adam8bit",
        "Adam8bit",
        same={**ADAM, "weight_decay": 0.0, "amsgrad": False},
        accepted={"block_size": 256},
        dropped=("bf16_stochastic_round",),
        bits=8,
        notes="As torchao.optim.AdamW8bit.",
    ),
    Row(
        "torchao.optim.AdamW4bit",
        "AdamW4bit",
        same={**ADAM, "weight_decay": 1e-2, "amsgrad": False},
        accepted={"block_size": 128},
        dropped=("bf16_stochastic_round",),
        bits=4,
        notes="Blocks of 128 in both. As torchao.optim.AdamW8bit for `bf16_stochastic_round`.",
    ),
    Row(
        "torchao.optim.Adam4bit",
        "Adam4bit",
        same={**ADAM, "weight_decay": 0.0, "amsgrad": False},
        accepted={"block_size": 128},
        dropped=("bf16_stochastic_round",),
        bits=4,
        notes="As torchao.optim.AdamW4bit.",
    ),
    Row(
        "torchao.optim.AdamWFp8",
        "AdamW8bit",
        same={**ADAM, "weight_decay": 1e-2, "amsgrad": False},
        accepted={"block_size": 256},
        dropped=("bf16_stochastic_round",),
        bits=8,
        notes="No fp8 states: AdamW8bit keeps the same 1 byte an element plus one fp32 scale per block of 256, "
        "on 8-bit dynamic maps.",
    ),
    Row(
        "torchao.optim.AdamFp8",
        "Adam8bit",
        same={**ADAM, "weight_decay": 0.0, "amsgrad": False},
        accepted={"block_size": 256},
        dropped=("bf16_stochastic_round",),
        bits=8,
        notes="As torchao.optim.AdamWFp8.",
    ),
    Row(
        "torchao.optim._AdamW",
        "AdamW32bit",
        same={**ADAM, "weight_decay": 1e-2, "amsgrad": False},
        dropped=("bf16_stochastic_round",),
        bits=32,
        notes="fp32 states, torch.optim.AdamW's values. As torchao.optim.AdamW8bit for `bf16_stochastic_round`.",
    ),
    Row(
        "torchao.optim.CPUOffloadOptimizer",
        None,
        notes="No CPU offload. To shrink the states, use AdamW8bit or AdamW4bit in place of the offloaded "
        "optimizer; for `offload_gradients=True`, `lowbit.optim.step_in_backward` (gradient release) never keeps "
        "all gradients at once.",
    ),
]


def _args(d: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v!r}`" for k, v in d.items()) or "-"


def render() -> str:
    """The Markdown table, one line a row, between the page's markers."""
    lines = [
        "| source | lowbit | pass to match the source (defaults differ) | same meaning | not taken (drop) | notes |",
        "|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        target = f"`lowbit.optim.{r.lowbit}`" if r.lowbit else "none"
        accepted = ", ".join(f"`{k}`" for k in r.accepted) or "-"
        dropped = ", ".join(f"`{k}`" for k in r.dropped) or "-"
        differ = _args({**r.required, **r.differ})
        lines.append(f"| `{r.source}` | {target} | {differ} | {accepted} | {dropped} | {r.notes} |")
    return "\n".join(lines) + "\n"


def page_table(text: str) -> str:
    """The table as the page holds it."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    if match is None:
        raise ValueError(f"{PAGE} has no {BEGIN} ... {END} section")
    return match.group(1)


def main() -> None:
    """Write the table into docs/migration.md."""
    text = PAGE.read_text()
    new = text.replace(BEGIN + "\n" + page_table(text) + END, BEGIN + "\n" + render() + END)
    PAGE.write_text(new)
    sys.stdout.write(f"wrote {len(ROWS)} rows into {PAGE}\n")


if __name__ == "__main__":
    main()
