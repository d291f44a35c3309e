"""Short training runs: 3-bit few-bit and inverted activations reach the exact activation's loss."""

from __future__ import annotations

import pathlib
import sysconfig

import pytest
import torch
from torch import nn

import lowbit.nn as lnn

CONTEXT, STEPS, BATCH = 8, 200, 256


def _corpus() -> torch.Tensor:
    """Bytes of a few CPython standard-library sources (always present, no download)."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / f).read_bytes() for f in ("argparse.py", "textwrap.py", "string.py"))
    return torch.tensor(list(text), dtype=torch.long)


def _train(method: str, act: str, seed: int = 0) -> float:
    """Loss of a byte-level MLP language model (8 bytes of context -> next byte) after training,
    on 8192 fixed windows of the corpus (one batch's loss is too noisy to compare runs by)."""
    data = _corpus()
    layer = {"gelu": nn.GELU, "silu": nn.SiLU}[act]
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(256, 32),
        nn.Flatten(),
        nn.Linear(CONTEXT * 32, 512),
        layer(),
        nn.Linear(512, 512),
        layer(),
        nn.Linear(512, 256),
    )
    if method != "exact":
        lnn.compress_activations(model, method=method, bits=3)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(CONTEXT + 1)
    for _ in range(STEPS):
        starts = torch.randint(0, data.numel() - CONTEXT - 1, (BATCH,), generator=gen)
        window = data[starts[:, None] + offsets]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(window[:, :CONTEXT]), window[:, CONTEXT])
        loss.backward()
        opt.step()
    starts = torch.randint(0, data.numel() - CONTEXT - 1, (8192,), generator=torch.Generator().manual_seed(99))
    window = data[starts[:, None] + offsets]
    with torch.no_grad():
        return nn.functional.cross_entropy(model(window[:, :CONTEXT]), window[:, CONTEXT]).item()


@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("method", ["fewbit", "invact"])
def test_final_loss_within_one_percent_of_exact(method, act):
    # Measured, seeds 0/1/2 (exact loss ~1.38-1.47): 3-bit few-bit GELU +0.14/+0.19/+0.12%, SiLU
    # +0.38/+0.47/+0.38%; InvAct within 1e-6 relative. 1% is the bound for few-bit, about twice its
    # worst. InvAct's backward differs from the exact derivative only by its slope error, about 1e-4 of the
    # gradient at worst and only near the activation's minimum (README, Numerics), so its loss is held to
    # 1e-4 relative: 100x the measured difference, 100x below few-bit's bound.
    # (On a regression task driven to a loss near zero, 3-bit few-bit ended 1.0-2.6% above exact: relative
    # differences of a vanishing loss are large.)
    exact = _train("exact", act)
    got = _train(method, act)
    bound = 1e-4 if method == "invact" else 0.01
    assert abs(got - exact) <= bound * exact, (got, exact)
