"""Gradient release (lowbit.optim.step_in_backward): the peak of model bytes during an iteration and
the time per iteration, against the ordinary ``backward(); step(); zero_grad()`` loop.

    python benchmarks/bench_gradient_release.py [--layers 4] [--d-model 256] [--steps 6] [--micro 4]

The demo's byte-level GPT (lowbit.demo) trains with AdamW8bit on the same batches four ways: the
ordinary loop and release, each on whole batches and with ``--micro`` micro-batches per step (release
then accumulates inside ``release.accumulate()`` until the last one). Model bytes (parameters + live
``.grad`` tensors + optimizer state, lowbit.memory.memory_report, counted from storage) are sampled
whenever a gradient becomes final (before release's hook, so the gradient being stepped counts), after
backward and after ``opt.step()``; the peak over the run is reported per parameter. Times come from
separate runs without the sampling hooks (the faster of two runs' median per iteration, the two ways
alternating, as a ratio to the ordinary loop). Each way's final parameters are compared with the
ordinary loop's bit for bit. Last, the optimizer step alone: one fused call over all tensors against
one call per tensor, as release steps them (``--step-only`` prints this line alone).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import lowbit.optim
from lowbit.demo import ModelConfig, build_model, load_text, windows
from lowbit.memory import memory_report


def train(cfg: ModelConfig, batches: list, release: bool, micro: int, sample: bool) -> tuple[float, int, list]:
    """Median seconds per iteration, peak model bytes (0 unless ``sample``) and the final parameters."""
    model = build_model(cfg, 0, lambda: nn.Embedding(256, cfg.d_model), torch.device("cpu"))
    opt = lowbit.optim.AdamW8bit(model.parameters(), lr=cfg.lr)
    peak = 0

    def measure(*_: object) -> None:
        nonlocal peak
        peak = max(peak, memory_report(model, opt).total)

    if sample:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(measure)
    handle = lowbit.optim.step_in_backward(opt, model) if release else None
    times = []
    for x, y in batches:
        start = time.perf_counter()
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            # Sum of the micro-batch means / micro: the whole batch's mean loss when they are equal in size.
            loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / micro
            if handle is not None and i < micro - 1:
                with handle.accumulate():
                    loss.backward()
            else:
                loss.backward()
        if sample:
            measure()
        opt.step()
        if sample:
            measure()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak, [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--step-only", action="store_true", help="only the optimizer-step line")
    args = parser.parse_args()
    cfg = ModelConfig(layers=args.layers, d_model=args.d_model, heads=4, context=64, batch=32)
    data = load_text(max_bytes=400_000)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - cfg.context - 1, (args.steps, cfg.batch), generator=g)
    batches = [windows(data, s, cfg.context) for s in starts]
    n = sum(p.numel() for p in build_model(cfg, 0, lambda: nn.Embedding(256, cfg.d_model), "cpu").parameters())
    print(
        f"{n:,} parameters, AdamW8bit, {args.steps} iterations of batch {cfg.batch}, {torch.get_num_threads()} threads"
    )
    if not args.step_only:
        print(f"{'way':<26}{'peak MiB':>10}{'peak B/param':>14}{'time/ordinary':>15}{'bit-identical':>15}")
    for micro in () if args.step_only else (1, args.micro):
        # Alternating rounds, the fastest median of each way: the machine is shared and noisy.
        runs: dict[bool, list] = {False: [], True: []}
        for _ in range(2):
            for release in (False, True):
                runs[release].append(train(cfg, batches, release, micro, sample=False))
        best = {release: min(seconds for seconds, _, _ in r) for release, r in runs.items()}
        reference = runs[False][0][2]
        for release in (False, True):
            _, peak, params = train(cfg, batches, release, micro, sample=True)
            same = all(torch.equal(a, b) for a, b in zip(reference, params, strict=True))
            way = f"{'release' if release else 'ordinary'}, {micro} micro-batch{'es' if micro > 1 else ''}"
            ratio = best[release] / best[False]
            print(f"{way:<26}{peak / 2**20:>10.2f}{peak / n:>14.3f}{ratio:>15.2f}{str(same):>15}")
    fused, single = step_cost(cfg)
    ratio = single / fused
    print(
        f"optimizer step alone: fused {fused * 1e3:.1f} ms, one tensor at a time {single * 1e3:.1f} ms ({ratio:.1f}x)"
    )


def step_cost(cfg: ModelConfig, repeats: int = 15) -> tuple[float, float]:
    """Fastest seconds of one ``opt.step()`` over all tensors, and of stepping them one at a time as
    release does (``_step_params``, one fused call per tensor), on fixed gradients."""
    model = build_model(cfg, 0, lambda: nn.Embedding(256, cfg.d_model), torch.device("cpu"))
    opt = lowbit.optim.AdamW8bit(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # creates the states
    where = [(gi, j) for gi, g in enumerate(opt.param_groups) for j in range(len(g["params"]))]
    fused, single = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        fused.append(time.perf_counter() - start)
        start = time.perf_counter()
        for gi, j in where:
            opt._step_params({gi: [j]})
        single.append(time.perf_counter() - start)
    return min(fused), min(single)


if __name__ == "__main__":
    main()
