"""benchmarks/bench_optim.py's turn order: each timed repeat steps every optimizer once, and no optimizer
always follows the same one (a step's time depends on what ran before it)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_optim as bench  # noqa: E402

NAMES = [f"optimizer {i}" for i in range(15)]


def test_every_repeat_steps_each_optimizer_once():
    orders = list(bench.turn_orders(NAMES, 10))
    assert len(orders) == 10
    for order in orders:
        assert sorted(order) == sorted(NAMES)


def test_no_optimizer_always_follows_the_same_one():
    # The predecessor of each optimizer in each repeat, the previous repeat's last one for the first.
    orders = list(bench.turn_orders(NAMES, 10))
    sequence = [name for order in orders for name in order]
    before: dict[str, set[str]] = {name: set() for name in NAMES}
    for prev, name in zip(sequence[:-1], sequence[1:], strict=True):
        before[name].add(prev)
    # 9 or 10 turns each: a rotation gives every optimizer one predecessor; a shuffle many.
    assert all(len(preds) >= 3 for preds in before.values()), before


def test_the_order_is_reproducible():
    assert list(bench.turn_orders(NAMES, 4)) == list(bench.turn_orders(NAMES, 4))
    assert list(bench.turn_orders(NAMES, 4, seed=1)) != list(bench.turn_orders(NAMES, 4))
