"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations


def cpu_model() -> str:
    """The first ``model name`` in /proc/cpuinfo, or "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
