"""Saved-for-backward bytes of Hugging Face models before and after ``compress_activations``.

Run from the repository root (transformers needed; models are built from their default local configs with
random weights, nothing is downloaded)::

    python benchmarks/bench_model_memory.py
    python benchmarks/bench_model_memory.py --models resnet50,clip --batch 2 --threads 2

Options: ``--models`` (comma-separated, default all of :data:`MODELS`), ``--batch`` (default 2),
``--bits`` (few-bit width, default 3), ``--threads`` (``torch.set_num_threads``).

For each model and method (``fewbit``, ``invact``) the model is built afresh in training mode, its
saved-for-backward bytes measured by :func:`lowbit.memory.saved_tensor_bytes` on one batch, compressed with
that batch as the sample (``when="smaller"``), and measured again. The table gives both measurements, the
bytes the report expected, the activations replaced and left alone, and the paper's figure where one
reports it. Not yet here (issue 32): step times, and the conv-net (BLPA) conversion.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch
import transformers
from common import parse
from torch import nn

import lowbit.nn as lnn
from lowbit.memory import saved_tensor_bytes

Sample = dict[str, Any]

# The papers' saved-activation reductions (fewbit-backward.txt Table 4, inverted-activations.txt's memory
# table), by model and method, where they report one.
PAPER = {
    ("resnet50", "fewbit"): "-28%",
    ("clip", "invact"): "-23.4%",
}


def _images(batch: int) -> Sample:
    return {"pixel_values": torch.randn(batch, 3, 224, 224)}


def _clip(batch: int) -> tuple[nn.Module, Sample]:
    ids = torch.randint(0, 1000, (batch, 77))
    return transformers.CLIPModel(transformers.CLIPConfig()), {**_images(batch), "input_ids": ids}


# Each model from its default config, and a batch of its inputs.
MODELS: dict[str, Callable[[int], tuple[nn.Module, Sample]]] = {
    "resnet50": lambda batch: (transformers.ResNetModel(transformers.ResNetConfig()), _images(batch)),
    "mobilenetv2": lambda batch: (transformers.MobileNetV2Model(transformers.MobileNetV2Config()), _images(batch)),
    "clip": _clip,
}


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def measure(name: str, method: str, batch: int, bits: int) -> dict[str, Any]:
    """Bytes before, expected and after compressing model ``name`` with ``method``, and the report's counts."""
    torch.manual_seed(0)
    model, sample = MODELS[name](batch)
    model.train()
    before = saved_tensor_bytes(model, **sample).total
    report = lnn.compress_activations(model, method=method, bits=bits, sample_kwargs=sample)
    after = saved_tensor_bytes(model, **sample).total
    return {
        "before": before,
        "expected": report.expected_bytes,
        "after": after,
        "replaced": len(report.replaced),
        "skipped": len(report.skipped),
    }


def main(argv: Optional[list[str]] = None) -> None:
    """Print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = parse(p, argv)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {','.join(MODELS)}")
    print("| model | method | before MiB | after MiB | change | expected MiB | replaced / left | paper |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for method in ("fewbit", "invact"):
            r = measure(name, method, args.batch, args.bits)
            change = 100 * (r["after"] - r["before"]) / r["before"]
            print(
                f"| {name} | {method} | {_mib(r['before'])} | {_mib(r['after'])} | {change:+.1f}% | "
                f"{_mib(r['expected'])} | {r['replaced']} / {r['skipped']} | {PAPER.get((name, method), '-')} |",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
