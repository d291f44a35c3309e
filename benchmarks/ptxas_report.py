"""Summarizes ``nvcc -Xptxas -v`` output as a Markdown table: registers, stack frame and spills per kernel.

Usage: ``python benchmarks/ptxas_report.py LOG``, where LOG holds the compiler output of each ``.cu`` file
preceded by a line ``== FILE``. A kernel's instantiations (dtypes, rules, coders) are folded into one row
with ranges. The stack frame is where runtime-indexed per-thread arrays live (local memory, off-chip).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ENTRY = re.compile(r"Compiling entry function '(\S+)'")
STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def kernel_name(mangled: str) -> str:
    """The kernel's unqualified name without template arguments."""
    demangled = subprocess.run(["c++filt", mangled], capture_output=True, text=True, check=True).stdout.strip()
    unqualified = demangled.removeprefix("void ").replace("(anonymous namespace)::", "")
    return unqualified.split("(")[0].split("<")[0].rsplit("::", 1)[-1]


def parse(text: str) -> dict[tuple[str, str], list[tuple[int, int, int, int]]]:
    """(file, kernel) -> one (registers, stack, spill stores, spill loads) tuple per instantiation."""
    kernels: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {}
    lines = text.splitlines()
    source = "?"
    for i, line in enumerate(lines):
        if line.startswith("== "):
            source = line[3:].strip()
        entry = ENTRY.search(line)
        if entry is None:
            continue
        stack = registers = None
        for following in lines[i + 1 : i + 6]:
            if ENTRY.search(following):
                break
            stack = stack or STACK.search(following)
            registers = registers or REGISTERS.search(following)
        if stack is None or registers is None:
            raise ValueError(f"no resource lines after {entry.group(1)}")
        row = (int(registers.group(1)), *(int(stack.group(k)) for k in (1, 2, 3)))
        kernels.setdefault((source, kernel_name(entry.group(1))), []).append(row)
    return kernels


def span(values: list[int]) -> str:
    """``a`` or ``a-b``."""
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def table(kernels: dict[tuple[str, str], list[tuple[int, int, int, int]]]) -> str:
    """The Markdown table, one row per kernel."""
    lines = [
        "| file | kernel | instantiations | registers | stack frame (B) | spill stores / loads (B) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (source, name), rows in kernels.items():
        regs, stack, stores, loads = (list(column) for column in zip(*rows, strict=True))
        lines.append(
            f"| {source} | `{name}` | {len(rows)} | {span(regs)} | {span(stack)} | {span(stores)} / {span(loads)} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Prints the table for the log named in ``argv``."""
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(parse(Path(argv[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
