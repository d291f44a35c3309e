"""Generator of ``lowbit/nn/fewbit_tables.json``, the shipped few-bit backward tables.

``python -m lowbit.nn._fewbit_gen`` solves :func:`lowbit.nn.fewbit.optimal_levels` for every activation in
``ACTIVATIONS``, both weights and the bit widths of ``table_bits`` on [-10, 10], and rewrites the file;
``--check`` only compares and exits with status 1 when the file differs. The output depends only on the
code: there is no randomness, and the torch thread count does not matter (one thread is used to leave
the other cores alone). Floats are written with ``repr``, so they read back exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

import torch

from lowbit.nn._registry import ACTIVATIONS
from lowbit.nn.fewbit.solver import _builtin_tables
from lowbit.nn.fewbit.tables import TABLE_FILE, TABLE_GRID_CELLS, TABLE_INTERVAL, WEIGHTS, table_bits

FORMAT = 1


def generate(names: Sequence[str] = ACTIVATIONS, log: bool = False) -> dict[str, Any]:
    """All shipped tables of ``names`` as the JSON-ready dictionary that :func:`render` writes.

    Args:
        names: activation names, a subset of :data:`lowbit.nn.fewbit.ACTIVATIONS`.
        log: print the time each activation takes to stderr.
    """
    tables: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        tables[name] = {}
        for weight in WEIGHTS:
            solved = _builtin_tables(name, weight, table_bits(name))
            tables[name][weight] = {
                str(bits): {
                    "error": t.error,
                    "boundaries": t.boundaries.tolist(),
                    "levels": t.levels.tolist(),
                }
                for bits, t in solved.items()
            }
        if log:
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return {
        "format": FORMAT,
        "generator": "python -m lowbit.nn._fewbit_gen",
        "interval": list(TABLE_INTERVAL),
        "grid_cells": TABLE_GRID_CELLS,
        "tables": tables,
    }


def render(data: dict[str, Any]) -> str:
    """JSON text with one table per line, so that diffs stay readable.

    Args:
        data: the dictionary from :func:`generate`.
    """
    lines = ["{"]
    for key in ("format", "generator", "interval", "grid_cells"):
        lines.append(f"  {json.dumps(key)}: {json.dumps(data[key])},")
    lines.append('  "tables": {')
    names = list(data["tables"])
    for n, name in enumerate(names):
        lines.append(f"    {json.dumps(name)}: {{")
        weights = list(data["tables"][name])
        for m, weight in enumerate(weights):
            lines.append(f"      {json.dumps(weight)}: {{")
            entries = data["tables"][name][weight]
            for k, (bits, entry) in enumerate(entries.items()):
                comma = "," if k + 1 < len(entries) else ""
                lines.append(f"        {json.dumps(bits)}: {json.dumps(entry)}{comma}")
            lines.append("      }" + ("," if m + 1 < len(weights) else ""))
        lines.append("    }" + ("," if n + 1 < len(names) else ""))
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.
    """
    parser = argparse.ArgumentParser(prog="python -m lowbit.nn._fewbit_gen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    text = render(generate(log=True))
    print(f"all tables: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return write_or_check(TABLE_FILE, text, args.check)


def write_or_check(name: str, text: str, check: bool) -> int:
    """Writes ``text`` to the package file ``name`` of lowbit.nn, or with ``check`` only compares them;
    returns the exit status (1 when checking finds a difference).

    Args:
        name: file name inside the ``lowbit.nn`` package.
        text: the generated contents.
        check: compare instead of writing.
    """
    path = resources.files("lowbit.nn").joinpath(name)
    if check:
        same = path.is_file() and path.read_text(encoding="utf-8") == text
        print(f"{path}: {'up to date' if same else 'differs'}", file=sys.stderr)
        return 0 if same else 1
    with open(str(path), "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
