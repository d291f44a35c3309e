"""Saved-for-backward bytes of Hugging Face models before and after ``compress_activations``.

Run from the repository root (transformers needed; models are built from their default local configs with
random weights, nothing is downloaded)::

    python benchmarks/bench_model_memory.py
    python benchmarks/bench_model_memory.py --models resnet50,clip --batch 2 --threads 2

Options: ``--models`` (comma-separated, default all of :data:`MODELS`), ``--batch`` (default 2),
``--bits`` (few-bit width, default 3), ``--blpa-bits`` (approximate-activation code width, default 4, the
paper's), ``--repeats`` (timed training steps per model and method, default 3; 0: no step times),
``--methods`` (comma-separated subset), ``--chosen`` (only each model's method in :data:`CHOSEN`),
``--small`` (small configs of the conv nets and BERT: the CI subset), ``--threads`` (``torch.set_num_threads``).

For each model and method (``fewbit``, ``invact``, and for the conv nets ``blpa``: BatchNorm -> ReLU(6) ->
Conv units through approximate activations) the model is built afresh in training mode, its
saved-for-backward bytes measured by :func:`lowbit.memory.saved_tensor_bytes` on one batch, compressed with
that batch as the sample (``when="smaller"``), and measured again. The table gives both measurements, the
bytes the report expected, the activations replaced and left alone, the paper's figure where one
reports it, and the median time of a training step (forward, a mean-square loss on the first output,
backward) with the compressed model over the uncompressed copy's, the two timed alternately in one
process (a ratio, so that a shared machine's load cancels).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch
import transformers
from common import parse, time_once
from torch import nn
from torch.utils._pytree import tree_leaves

import lowbit.nn as lnn
from lowbit.memory import saved_tensor_bytes

Sample = dict[str, Any]

# The papers' saved-activation reductions, by model and method, quoted with the table they come from and the
# model it measured where that differs from the row's: fewbit-backward.txt Table 4 at 3 bits (it reports
# ResNet-101 and EfficientNet-B7 at 256x256 images, RoBERTa-base and GPT-2 at 256 tokens), the
# inverted-activations paper's memory table (inverted-activations.txt, Listing 1's table; setups in its A.1),
# and approx-activations-blpa.txt Sec. 3.4 (its ResNets at 4 bits).
PAPER = {
    ("resnet50", "fewbit"): "-28% (ResNet-101, FewBit T4)",
    ("resnet50", "blpa"): "up to 8x less (BLPA 3.4)",
    ("mobilenetv2", "blpa"): "up to 8x less (BLPA 3.4)",
    ("efficientnet_b0", "fewbit"): "-24% (B7, FewBit T4)",
    ("roberta", "fewbit"): "-15% (FewBit T4)",
    ("gpt2", "fewbit"): "-39% (FewBit T4)",
    ("bert", "invact"): "-22.9% (InvAct table)",
    ("vit", "invact"): "-23.8% (InvAct table)",
    ("ast", "invact"): "-24.0% (InvAct table)",
    ("clip", "invact"): "-23.4% (InvAct table)",
}


def _images(batch: int) -> Sample:
    return {"pixel_values": torch.randn(batch, 3, 224, 224)}


def _clip(batch: int) -> tuple[nn.Module, Sample]:
    ids = torch.randint(0, 1000, (batch, 77))
    return transformers.CLIPModel(transformers.CLIPConfig()), {**_images(batch), "input_ids": ids}


def _tokens(batch: int, length: int) -> Sample:
    return {"input_ids": torch.randint(0, 1000, (batch, length))}


# Each model from its default config (Llama's is 7B parameters, too large for a CPU run: a 12-layer,
# 768-wide Llama with its default SwiGLU ratio instead), and a batch of its inputs: 224-pixel images
# (the configs' size; EfficientNet-B0's own 224), 256 tokens as FewBit Table 4 uses for RoBERTa and GPT-2
# (and here for BERT and Llama too; CLIP's text side its 77), AST's default 1024 frames of 128 mel bins.
MODELS: dict[str, Callable[[int], tuple[nn.Module, Sample]]] = {
    "resnet50": lambda batch: (transformers.ResNetModel(transformers.ResNetConfig()), _images(batch)),
    "mobilenetv2": lambda batch: (transformers.MobileNetV2Model(transformers.MobileNetV2Config()), _images(batch)),
    "efficientnet_b0": lambda batch: (
        transformers.EfficientNetModel(
            transformers.EfficientNetConfig(
                width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280, dropout_rate=0.2
            )
        ),
        _images(batch),
    ),
    "convnext": lambda batch: (transformers.ConvNextModel(transformers.ConvNextConfig()), _images(batch)),
    "bert": lambda batch: (transformers.BertModel(transformers.BertConfig()), _tokens(batch, 256)),
    "roberta": lambda batch: (transformers.RobertaModel(transformers.RobertaConfig()), _tokens(batch, 256)),
    "gpt2": lambda batch: (transformers.GPT2Model(transformers.GPT2Config()), _tokens(batch, 256)),
    "llama": lambda batch: (
        transformers.LlamaModel(
            transformers.LlamaConfig(
                hidden_size=768,
                intermediate_size=2048,
                num_hidden_layers=12,
                num_attention_heads=12,
                num_key_value_heads=12,
            )
        ),
        _tokens(batch, 256),
    ),
    "vit": lambda batch: (transformers.ViTModel(transformers.ViTConfig()), _images(batch)),
    "ast": lambda batch: (
        transformers.ASTModel(transformers.ASTConfig()),
        {"input_values": torch.randn(batch, 1024, 128)},
    ),
    "clip": _clip,
}

# ``--small``: the same architectures, a few layers wide and deep, on 32-pixel images or 16 tokens (the CI
# subset).
SMALL: dict[str, Callable[[int], tuple[nn.Module, Sample]]] = {
    "resnet50": lambda batch: (
        transformers.ResNetModel(transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])),
        {"pixel_values": torch.randn(batch, 3, 32, 32)},
    ),
    "mobilenetv2": lambda batch: (
        transformers.MobileNetV2Model(transformers.MobileNetV2Config(depth_multiplier=0.35, image_size=32)),
        {"pixel_values": torch.randn(batch, 3, 32, 32)},
    ),
    # A two-layer transformer on 16 tokens: its GELUs through inverted layers.
    "bert": lambda batch: (
        transformers.BertModel(
            transformers.BertConfig(
                vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
            )
        ),
        _tokens(batch, 16),
    ),
}

# The method the table's readers would choose for each model: the one that saves most in the table.
# GPT-2's NewGELUActivation is a Python formula that an inverted layer replaces only with strict=False, so
# few-bit keeps its forward bit for bit.
CHOSEN = {
    "resnet50": "blpa",
    "mobilenetv2": "blpa",
    "efficientnet_b0": "invact",
    "convnext": "invact",
    "bert": "invact",
    "roberta": "invact",
    "gpt2": "fewbit",
    "llama": "invact",
    "vit": "invact",
    "ast": "invact",
    "clip": "invact",
}


# The methods tried on each model: the approximate-activation units exist only in the conv nets.
CONV_NETS = ("resnet50", "mobilenetv2")


def _methods(name: str) -> tuple[str, ...]:
    return ("fewbit", "invact", "blpa") if name in CONV_NETS else ("fewbit", "invact")


# Where torch and transformers define their activation classes: each such module of a model must appear in
# the report, replaced or left alone with a reason.
ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def _listed(report: lnn.CompressionReport) -> set[str]:
    """The module paths the report names; a BLPA unit is named ``bn -> act -> conv``."""
    paths = [r.path for r in report.replaced] + [path for path, _ in report.skipped]
    return {part for path in paths for part in path.split(" -> ")}


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def _step(model: nn.Module, sample: Sample) -> None:
    """One training step's forward and backward: a mean-square loss on the first floating output."""
    out = next(t for t in tree_leaves(model(**sample)) if isinstance(t, torch.Tensor) and t.requires_grad)
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def measure(name: str, method: str, batch: int, bits: int, repeats: int, small: bool = False) -> dict[str, Any]:
    """Bytes before, expected and after compressing model ``name`` (its ``--small`` form with ``small``) with
    ``method``, the report's counts, and the compressed model's step time over the uncompressed one's (None
    without ``repeats``)."""
    torch.manual_seed(0)
    model, sample = (SMALL if small else MODELS)[name](batch)
    model.train()
    plain = copy.deepcopy(model)
    activations = {path for path, m in model.named_modules() if type(m).__module__ in ACTIVATION_MODULES}
    before = saved_tensor_bytes(model, **sample).total
    report = lnn.compress_activations(model, method=method, bits=bits, sample_kwargs=sample)
    after = saved_tensor_bytes(model, **sample).total
    ratio = None
    if repeats:
        cpu = torch.device("cpu")
        _step(plain, sample)  # warm-up of both
        _step(model, sample)
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(repeats):
            times[0].append(time_once(lambda: _step(plain, sample), cpu))
            times[1].append(time_once(lambda: _step(model, sample), cpu))
        ratio = statistics.median(times[1]) / statistics.median(times[0])
    return {
        "before": before,
        "expected": report.expected_bytes,
        "after": after,
        "replaced": len(report.replaced),
        "skipped": len(report.skipped),
        "unlisted": sorted(activations - _listed(report)),
        "step": ratio,
    }


def main(argv: Optional[list[str]] = None) -> None:
    """Print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--blpa-bits", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default=None, help="comma-separated; default: every method that applies")
    p.add_argument("--chosen", action="store_true", help="only each model's chosen method (CHOSEN)")
    p.add_argument("--small", action="store_true", help="small configs of resnet50, mobilenetv2 and bert (CI)")
    p.add_argument("--threads", type=int, default=None)
    args = parse(p, argv)
    known = SMALL if args.small else MODELS
    names = (args.models or ",".join(known)).split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {','.join(known)}")
    print(
        "| model | method | before MiB | after MiB | change | expected MiB | replaced / left | unlisted | paper "
        "| step time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        methods = [m for m in _methods(name) if args.methods is None or m in args.methods.split(",")]
        if args.chosen:
            methods = [m for m in methods if m == CHOSEN[name]]
        for method in methods:
            bits = args.blpa_bits if method == "blpa" else args.bits
            r = measure(name, method, args.batch, bits, args.repeats, args.small)
            change = 100 * (r["after"] - r["before"]) / r["before"]
            step = "-" if r["step"] is None else f"{r['step']:.2f}x"
            shown = f"**{method}**" if CHOSEN.get(name) == method else method
            print(
                f"| {name} | {shown} | {_mib(r['before'])} | {_mib(r['after'])} | {change:+.1f}% | "
                f"{_mib(r['expected'])} | {r['replaced']} / {r['skipped']} | {len(r['unlisted'])} | "
                f"{PAPER.get((name, method), '-')} | {step} |",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
