"""The CI smoke of benchmarks/bench_demo_memory.py: its model sizing counts what the demo builds, and its
table reports what the demo's measurement gives, at a tiny size (in this process, not a fresh one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import lowbit.nn
from lowbit import demo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_demo_memory as bench  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_gpt_params_is_the_built_models_count(layers):
    cfg = demo.ModelConfig(layers=layers, d_model=bench.HEAD_DIM * layers, heads=layers, context=128)
    model = demo.build_model(cfg, 0, lambda: lowbit.nn.StableEmbedding(demo.VOCAB, cfg.d_model), CPU)
    assert bench.gpt_params(layers, 128) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("target", [1e5, 85e6, 1e9])
def test_gpt_size_takes_the_nearest_count(target):
    cfg = bench.gpt_size(target, context=128, batch=4)
    assert (cfg.d_model, cfg.heads, cfg.context, cfg.batch) == (64 * cfg.layers, cfg.layers, 128, 4)
    err = abs(bench.gpt_params(cfg.layers, 128) - target)
    assert all(err <= abs(bench.gpt_params(n, 128) - target) for n in (cfg.layers - 1, cfg.layers + 1) if n >= 1)


def test_table_reports_the_demo_measurement():
    cfg = bench.gpt_size(1e5, context=16, batch=2)
    train, heldout, starts = demo.split_and_sample(demo.load_text(max_bytes=20_000), cfg, 2, 0, CPU)
    results = [demo.train_config(n, cfg, 0, CPU, train, heldout, starts, 1) for n in ("fp32", "release")]
    rows = bench.markdown(results, CPU).splitlines()[2:]
    fp32, release = (row.split(" | ") for row in rows)
    n = results[0].num_params
    # fp32 AdamW: 4 bytes of parameter, 4 of gradient, 8 of state per parameter, plus a 4-byte step per tensor.
    k = sum(1 for _ in demo.build_model(cfg, 0, lambda: torch.nn.Embedding(demo.VOCAB, cfg.d_model), CPU).parameters())
    assert float(fp32[4]) == pytest.approx((16 * n + 4 * k) / n, abs=5e-4)  # printed to 3 decimals
    assert fp32[7] == "1.000"  # the peak ratio to itself
    # Release frees every gradient: none after the step, and a peak below the ordinary loop's 10+ bytes.
    assert float(release[2]) == 0.0 and float(release[4]) < float(release[5]) < 10
