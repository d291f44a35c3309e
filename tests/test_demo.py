"""``python -m lowbit demo``: it trains every configuration, measures memory honestly and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit import demo


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", "demo", *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _table_run(tmp_path: Path) -> tuple[dict, Path, str, str]:
    """A run of ``python -m lowbit demo`` with every configuration: its report, output folder, stdout and stderr.
    In CI, the quickstart's own run (the folder of $LOWBIT_DEMO_REPORT, where .ci/run keeps its stdout.txt and
    stderr.txt), which trains every configuration anyway; else a fresh 4-step run."""
    given = os.environ.get("LOWBIT_DEMO_REPORT")
    if given:
        out = Path(given).parent
        stdout, stderr = (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()
        return json.loads(Path(given).read_text()), out, stdout, stderr
    proc = _run("--steps", "4", "--out", str(tmp_path))
    return json.loads((tmp_path / "report.json").read_text()), tmp_path, proc.stdout, proc.stderr


def test_demo_writes_table_json_and_figure(tmp_path):
    report, out, stdout, stderr = _table_run(tmp_path)
    steps = report["steps"]
    for name in demo.CONFIGS:
        assert any(line.startswith(name + " ") for line in stdout.splitlines()), stdout
    assert f"{steps}/{steps}" in stderr  # the progress bars
    assert (out / "report.png").stat().st_size > 10_000
    r = {row["name"]: row for row in report["results"]}
    assert list(r) == list(demo.CONFIGS)
    base = r["fp32"]
    # Measured storage: the 8-bit optimizer shrinks the optimizer state, inverted activations the
    # saved activations, LPMM the parameters and gradients as well. Storage does not depend on the steps; the
    # README's demo table gives the ratios: AdamW8bit's states 1.12 / 3.59 MiB = 0.31 (2.03 / 8 bytes a
    # parameter for the 8-bit tensors, 8 for those under min_8bit_size); InvGELU's saved activations
    # 29.44 / 36.17 = 0.81; LPMM's 12-bit parameters 0.68 / 1.80 = 0.38 (12 / 32 plus absmaxes), its 8-bit
    # accumulators 0.46 / 1.80 = 0.26 (8 / 32 plus absmaxes), its model 4.563 / 16 = 0.29. Each bound sits
    # just above its ratio and below the next wider format's (16-bit parameters: 0.5; fp32 states: 1).
    assert r["adamw8bit"]["optimizer_state_bytes"] < 0.35 * base["optimizer_state_bytes"]
    # AdamW4bit: 1.0625 bytes a parameter for the 4-bit tensors (two codes per byte, an fp32 absmax per 128),
    # 8 for those under min_4bit_size and StableEmbedding's fp32 states: 0.72 / 3.59 MiB = 0.20 in the
    # README's demo table; bound between that and the 8-bit ratio.
    assert r["adamw4bit"]["optimizer_state_bytes"] < 0.25 * base["optimizer_state_bytes"]
    assert r["act"]["saved_activation_bytes"] < 0.85 * base["saved_activation_bytes"]
    assert r["lpmm"]["param_bytes"] < 0.4 * base["param_bytes"]
    assert r["lpmm"]["grad_bytes"] < 0.3 * base["grad_bytes"]
    assert r["lpmm"]["model_bytes"] < 0.3 * base["model_bytes"]
    assert r["lpmm"]["saved_activation_bytes"] == r["act"]["saved_activation_bytes"]
    assert base["grad_bytes"] == base["param_bytes"]  # fp32 .grad tensors, measured after the step
    # The ordinary loop's peak during a step holds every gradient: params + grads + states after backward.
    assert base["peak_model_bytes"] == base["model_bytes"]
    assert r["adamw8bit"]["peak_model_bytes"] == r["adamw8bit"]["model_bytes"]
    # Gradient release: no gradient is left after the step, and its peak holds the gradients of one or
    # two tensors at a time instead of all (the largest, fc and out, are 65,536 of the 471,552 elements, 14%
    # of the fp32 gradient bytes each), so it saves more than half of the fp32 gradient bytes.
    assert r["release"]["grad_bytes"] == 0 and r["minimal"]["grad_bytes"] == 0
    saved = r["adamw8bit"]["peak_model_bytes"] - r["release"]["peak_model_bytes"]
    assert 0.5 * base["grad_bytes"] < saved < base["grad_bytes"]
    # minimal: 12-bit parameters, two 4-bit moments and 4-bit accumulators, one or two alive at a time, groups
    # of 512: 1.5 + 1.0 + 3 * 4 / 512 + 0.07 per live accumulator bytes a parameter (measured 2.595; the
    # issue's bound: 2.6; 8-bit moments alone would be 3.5 without the gradients).
    n = r["minimal"]["num_params"]
    assert 2.5 < r["minimal"]["peak_model_bytes"] / n <= 2.6
    assert r["minimal"]["optimizer_state_bytes"] < 0.15 * base["optimizer_state_bytes"]  # 1.0 / 8 plus absmaxes
    # Muon8bit keeps one 8-bit state (momentum) for the hidden matrices where AdamW8bit keeps two.
    assert r["muon8bit"]["optimizer_state_bytes"] < 0.75 * r["adamw8bit"]["optimizer_state_bytes"]
    assert all(len(row["losses"]) == steps and row["peak_bytes"] is not None for row in r.values())


def _default_run(tmp_path: Path, configs: list[str]) -> dict:
    """The report of ``python -m lowbit demo`` at its defaults (300 steps, seed 0, the stdlib sources) for at
    least ``configs``: the report that $LOWBIT_DEMO_REPORT names (CI sets it to the quickstart's own demo run,
    so that the same 300-step trainings are not run twice), else a fresh run of ``configs``."""
    given = os.environ.get("LOWBIT_DEMO_REPORT")
    if given:
        report = json.loads(Path(given).read_text())
        names = [row["name"] for row in report["results"]]
        # A report of other arguments would test something else: refuse it rather than fall back.
        assert report["steps"] == 300 and report["seed"] == 0, given
        assert report["data"] == f"{demo.stdlib_sources()}/*.py" and set(configs) <= set(names), (given, names)
        return report
    _run("--configs", ",".join(configs), "--out", str(tmp_path))
    return json.loads((tmp_path / "report.json").read_text())


def test_demo_losses_stay_within_two_percent_of_fp32(tmp_path):
    # Issue 30's bound at the default 300 steps over seeds 0, 1 and 2, on the mean of the three seeds' relative
    # differences. One seed's loss moves by about 2% with the machine's arithmetic (torch's kernels round
    # differently on other CPUs, and the trajectories part): measured (train / held-out vs fp32, seeds 0/1/2) on
    # an Intel Xeon, lpmm -1.55% / -0.21% / +0.73% and -1.61% / -0.08% / -0.99%, minimal (one thread) +1.12% /
    # -0.00% / +1.26% and +1.26% / +0.81% / +0.20%; on an AMD EPYC (Zen 4), lpmm +0.05% / -0.02% / +0.59% and
    # -0.08% / +2.15% / -0.40%, minimal +2.05% / +0.20% / +0.95% and +1.69% / +0.21% / -0.13% (means 0.21%,
    # 0.56%, 1.07%, 0.59%). A seed's 2% tests that noise; the mean of three has sqrt(3) less of it.
    configs = ["fp32", "lpmm", "minimal"]
    runs = [_default_run(tmp_path / "seed0", configs)]
    for seed in (1, 2):
        out = tmp_path / f"seed{seed}"
        _run("--configs", ",".join(configs), "--seed", str(seed), "--out", str(out))
        runs.append(json.loads((out / "report.json").read_text()))
    rows = [{row["name"]: row for row in run["results"]} for run in runs]
    for name in ("lpmm", "minimal"):
        for key in ("train_loss", "heldout_loss"):
            gaps = [r[name][key] / r["fp32"][key] - 1 for r in rows]
            assert abs(sum(gaps) / len(gaps)) < 0.02, (name, key, gaps)


def test_demo_reads_a_data_file_and_refuses_bad_arguments(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(Path(demo.__file__).read_bytes() * 2)
    _run("--steps", "2", "--configs", "fp32", "--data", str(text), "--out", str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "report.json").read_text())["data"] == str(text)
    bad = subprocess.run(
        [sys.executable, "-m", "lowbit", "demo", "--configs", "fp32,nope"], capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0 and "nope" in bad.stderr
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x" * 100)
    small = subprocess.run(
        [sys.executable, "-m", "lowbit", "demo", "--data", str(tiny), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert small.returncode != 0 and "too little" in small.stderr


def test_load_text_defaults_to_the_standard_library():
    data = demo.load_text(max_bytes=10_000)
    assert data.dtype == torch.uint8 and data.numel() == 10_000
    with pytest.raises(FileNotFoundError, match="--data"):
        demo.load_text(Path("/nonexistent/lowbit"))
