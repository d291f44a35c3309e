"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

import lowbit


def cpu_model() -> str:
    """The first ``model name`` in /proc/cpuinfo with its ``cpu family`` and ``model`` numbers (a virtual machine
    may name only the vendor's line, "AMD EPYC": family 25 model 17 is Zen 4), or "unknown"."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    if "model name" not in fields:
        return "unknown"
    numbers = f" (family {fields['cpu family']}, model {fields['model']})" if "cpu family" in fields else ""
    return fields["model name"] + numbers


def environment(device: str, **settings: object) -> dict[str, object]:
    """What a benchmark's numbers depend on, for its header and JSON file: versions, threads, CPU, the CPU code
    paths in use (``build_info()``'s ``cpu_*`` entries: the kernels and the coders that timing chose), the
    device, then ``settings`` in their order, then the GPU's name on CUDA."""
    info = lowbit._C.build_info()
    env: dict[str, object] = {
        "torch": torch.__version__,
        "lowbit": lowbit.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        **{key: value for key, value in info.items() if key.startswith("cpu_")},
        "device": device,
        **settings,
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def parse(p: argparse.ArgumentParser, argv: Optional[list[str]]) -> argparse.Namespace:
    """``p.parse_args(argv)`` plus the options the benchmarks share: ``--device cuda`` is refused without a
    GPU and a CUDA build of lowbit, and ``--threads`` (when given) is applied with ``torch.set_num_threads``."""
    args = p.parse_args(argv)
    if getattr(args, "device", "cpu") == "cuda" and not (torch.cuda.is_available() and lowbit._C.cuda_built()):
        p.error("--device cuda needs a CUDA GPU and a CUDA build of lowbit")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return args


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds taken by one call of ``fn``. On CUDA the call is bracketed by events (the device's time, not
    the launch's), with the device idle before it starts."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_median(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (:func:`time_once`) after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_once(fn, device) for _ in range(repeats))


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Writes ``result`` as indented JSON to ``path`` (its folder made first) and says so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
