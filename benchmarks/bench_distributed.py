"""Agreement of distributed training with one process: the figures behind tests/test_distributed.py.

Run from the repository root::

    python benchmarks/bench_distributed.py                 # every group below
    python benchmarks/bench_distributed.py --groups lpmm dcp

Each line trains the jobs of ``tests/dist_jobs.py`` (a small byte-level GPT, 8 steps, gloo on the CPU,
spawned ranks) and prints the largest relative difference of the per-step global mean loss:

- ``fsdp``: 2-rank FSDP2 against one process on the full batch, per optimizer (and StableEmbedding);
- ``ddp``: 2-rank DDP against one process;
- ``lpmm``: LPMM at 12-bit parameters and 8-bit accumulators under FSDP2, DDP and plain data parallelism,
  with the model bytes (parameters, gradients, optimizer state) that rank 0 holds;
- ``dcp``: a checkpoint saved after 4 steps and resumed at another world size, against the
  uninterrupted run, and the same resume with the weights only (a fresh optimizer); for LPMM, whether the
  saved and loaded storage digests agree;
- ``act``: inverted activations with activation checkpointing under FSDP2 and DDP.

The tests bound these numbers; their comments quote this script's output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.dist_jobs import launch  # noqa: E402

STEPS = 8
LPMM = {"lpmm": [12, 8]}
GROUPS = ("fsdp", "ddp", "lpmm", "dcp", "act")


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(y / x - 1) for x, y in zip(a, b, strict=True))


def _against_one_process(tmp: Path, job: dict[str, Any], **run: Any) -> tuple[dict[str, Any], dict[str, Any], float]:
    ref = launch(1, {**job, "parallel": "none"}, tmp)
    out = launch(2, {**job, **run}, tmp)
    return ref, out, _relative(ref["losses"], out["losses"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lowbit-dist-"))
    if "fsdp" in args.groups:
        names = ["Adam8bit", "AdamW8bit", "SGD8bit", "AdamW32bit", "LARS8bit", "Adam8bit-clip", "LAMB8bit"]
        for name in names:
            *_, rel = _against_one_process(tmp, {"optimizer": name, "steps": STEPS}, parallel="fsdp")
            print(f"fsdp  {name:<24} {rel:.2e}", flush=True)
        job = {"optimizer": "Adam8bit", "steps": STEPS, "stable": True}
        *_, rel = _against_one_process(tmp, job, parallel="fsdp")
        print(f"fsdp  {'Adam8bit+StableEmbedding':<24} {rel:.2e}", flush=True)
    if "ddp" in args.groups:
        for name in ["Adam8bit", "AdamW8bit", "SGD8bit"]:
            *_, rel = _against_one_process(tmp, {"optimizer": name, "steps": STEPS}, parallel="ddp")
            print(f"ddp   {name:<24} {rel:.2e}", flush=True)
    if "lpmm" in args.groups:
        for name, parallel in [("LPMMSGD", "fsdp"), ("LPMMAdamW", "fsdp"), ("LPMMSGD", "ddp"), ("LPMMSGD", "none")]:
            job = {"optimizer": name, "steps": STEPS, **LPMM}
            ref, out, rel = _against_one_process(tmp, job, parallel=parallel)
            held = f"{out['model_bytes']:,} of {ref['model_bytes']:,} bytes on rank 0"
            print(f"lpmm  {name:<10} {parallel:<13} {rel:.2e}   {held}", flush=True)
    if "dcp" in args.groups:
        for name in ["Adam8bit", "AdamW8bit", "SGD8bit", "LPMMSGD"]:
            job = {"parallel": "fsdp", "optimizer": name, **(LPMM if name.startswith("LPMM") else {})}
            for save, load in [(2, 1), (1, 2)]:
                checkpoint = str(tmp / f"checkpoint-{name}-{save}-{load}")
                full = launch(save, {**job, "steps": STEPS, "save": checkpoint, "save_after": STEPS // 2}, tmp)
                resume = {**job, "steps": STEPS // 2, "start": STEPS // 2, "load": checkpoint}
                resumed = launch(load, resume, tmp)
                fresh = launch(load, {**resume, "load_optimizer": False}, tmp)
                tail = full["losses"][STEPS // 2 :]
                digests = full["digests"].get("saved") == resumed["digests"].get("loaded")
                same = f"   digests equal: {digests}" if name.startswith("LPMM") else ""
                print(
                    f"dcp   {name:<10} {save} -> {load}  resumed {_relative(tail, resumed['losses']):.2e}"
                    f"   weights only {_relative(tail, fresh['losses']):.2e}{same}",
                    flush=True,
                )
    if "act" in args.groups:
        for parallel in ["fsdp", "ddp"]:
            job = {"optimizer": "Adam8bit", "steps": STEPS, "compress": True}
            *_, rel = _against_one_process(tmp, job, parallel=parallel, checkpoint=True)
            print(f"act   InvGELU+checkpoint {parallel:<5} {rel:.2e}", flush=True)


if __name__ == "__main__":
    main()
