"""Every configuration of ``python -m lowbit demo`` at a realistic size: model memory per parameter and its
peak during a training step, for a GPT-style model of ``--params`` parameters (default 85M, GPT-2 small's
body).

    python benchmarks/bench_demo_memory.py [--params 85e6] [--device cpu] [--steps 3] [--configs ...]
    python benchmarks/bench_demo_memory.py --params 1e9 --device cuda     # a GPU session's rerun at 1B

The demo's own code does everything but choose the size (:func:`lowbit.demo.train_configs`): the same
model class and configurations (:func:`lowbit.demo.make_config`), batches and measurements. Per
configuration: parameter + gradient + optimizer-state bytes per parameter counted from storage after the
last step (:func:`lowbit.lpmm.memory_report`; release has freed every gradient by then), their peak
during the last step (sampled at every parameter's post-accumulate-grad hook, before release steps it,
after backward and after ``step()``), and the process's peak memory: on the CPU the largest rise of the
resident set of a fresh process that builds and trains only that configuration (model construction,
LPMM conversion and activations included), on CUDA ``torch.cuda.max_memory_allocated``. The model has
``d_model = 64 * layers`` (GPT-2 small's aspect: 12 layers of 768) and heads of 64; :func:`gpt_size`
picks the layer count whose parameter count is nearest ``--params``, and the table states the count.
Losses after a few steps say nothing about quality (the demo measures that); the step time is the
median over the steps, on a shared machine only a ratio within one run means anything.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch
from common import environment, parse, write_json

from lowbit import demo

# GPT-2 small's aspect ratio: d_model = 64 * layers, heads of 64 channels.
HEAD_DIM = 64


def gpt_params(layers: int, context: int) -> int:
    """Parameters of the demo's GPT with ``layers`` blocks of width ``64 * layers`` and learned positions
    for ``context`` tokens (StableEmbedding's norm counted), as :class:`lowbit.demo.TinyGPT` builds it."""
    d = HEAD_DIM * layers
    block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    embed = demo.VOCAB * d + 2 * d
    return layers * block + embed + context * d + 2 * d + (d * demo.VOCAB + demo.VOCAB)


def gpt_size(params: float, context: int, batch: int) -> demo.ModelConfig:
    """The demo's model configuration whose parameter count (:func:`gpt_params`) is nearest ``params``."""
    layers = min(range(1, 257), key=lambda n: abs(gpt_params(n, context) - params))
    return demo.ModelConfig(layers=layers, d_model=HEAD_DIM * layers, heads=layers, context=context, batch=batch)


def markdown(results: list[demo.RunResult], device: torch.device) -> str:
    """The README's table: bytes per parameter after the step and at its peak, the process's peak memory."""
    peak = "RSS rise MiB" if device.type == "cpu" else "max allocated MiB"
    lines = [
        f"| config | params | grads after step | state | model B/param | peak B/param during the step | {peak} "
        "| x fp32 peak | ms/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fp32 = next((r for r in results if r.name == "fp32"), None)
    for r in results:
        n = r.num_params
        ratio = "" if fp32 is None else f"{r.peak_model_bytes / fp32.peak_model_bytes:.3f}"
        mem = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.0f}"
        lines.append(
            f"| `{r.name}` | {r.param_bytes / n:.3f} | {r.grad_bytes / n:.3f} | {r.optimizer_state_bytes / n:.3f} "
            f"| {r.model_bytes / n:.3f} | {r.peak_model_bytes / n:.3f} | {mem} | {ratio} | {r.step_ms:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=85e6, help="target parameter count (85e6)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=3, help="training steps per configuration (3)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--eval-windows", type=int, default=8, help="held-out windows evaluated after training (8)")
    p.add_argument("--configs", type=demo.parse_configs, default=list(demo.CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = parse(p, argv)
    if args.steps < 2:
        p.error("--steps must be at least 2: the peak is measured on the last step, once every state exists")
    device = torch.device(args.device)
    cfg = gpt_size(args.params, args.context, args.batch)
    train_data, heldout, starts = demo.split_and_sample(demo.load_text(), cfg, args.steps, args.seed, device)
    n = gpt_params(cfg.layers, cfg.context)
    env = environment(args.device, model=f"{cfg.layers} layers, d_model {cfg.d_model}, {n:,} parameters")
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{args.steps} steps of {cfg.batch} x {cfg.context} tokens, seed {args.seed}", flush=True)
    results = demo.train_configs(args.configs, cfg, args.seed, device, train_data, heldout, starts, args.eval_windows)
    print()
    print(demo.format_table(results, device))
    print()
    print(markdown(results, device))
    if args.json is not None:
        write_json(args.json, {"environment": env, "results": [vars(r) | {"losses": r.losses} for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
