"""The CI subset of benchmarks/bench_model_memory.py: small configs of the conv nets, the chosen method."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_model_memory as bench  # noqa: E402


@pytest.mark.parametrize("name", sorted(bench.SMALL))
def test_chosen_compression_lowers_the_bytes_and_the_report_is_the_measurement(name):
    r = bench.measure(name, bench.CHOSEN[name], batch=2, bits=4, repeats=1, small=True)
    assert r["after"] < r["before"] and r["replaced"] > 0, r
    # The report's expected bytes are what saved_tensor_bytes measures after the call, within 1% (the
    # issue's bound; the accounting is exact here).
    assert abs(r["expected"] - r["after"]) <= 0.01 * r["after"], r
    assert r["step"] is not None and r["step"] > 0, r
