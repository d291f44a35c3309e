"""Generator of ``lowbit/nn/invact_tables.json``, the shipped inverted-activation tables.

``python -m lowbit.nn._invact_gen`` fits :func:`lowbit.nn.invact.fit` for every activation in
``invact.ACTIVATIONS`` and rewrites the file; ``--check`` only compares and exits with status 1 when the
file differs. Floats are written with ``repr``, so they read back exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Optional

import torch

from lowbit.nn import invact
from lowbit.nn._fewbit_gen import write_or_check


def render(tables: Sequence[invact.InvActTable]) -> str:
    """The JSON text of ``tables`` (one activation per line; floats read back exactly).

    Args:
        tables: fitted tables, e.g. ``[invact.fit(n) for n in invact.ACTIVATIONS]``.
    """
    head = {
        "format": 1,
        "generator": "python -m lowbit.nn._invact_gen",
        "pieces": invact.PIECES,
        "degree": invact.DEGREE,
    }
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "tables": {']
    for i, t in enumerate(tables):
        comma = "," if i + 1 < len(tables) else ""
        lines.append(f"    {json.dumps(t.name)}: {json.dumps(invact._to_json(t))}{comma}")
    return "\n".join(lines + ["  }", "}"]) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lowbit.nn._invact_gen [--check]``: rewrite (or compare) the shipped tables; exit status.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.
    """
    parser = argparse.ArgumentParser(prog="python -m lowbit.nn._invact_gen", description="Fit the InvAct tables.")
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    text = render([invact.fit(n) for n in invact.ACTIVATIONS])
    return write_or_check(invact.TABLE_FILE, text, args.check)


if __name__ == "__main__":
    sys.exit(main())
