"""Training-quality check: 8-bit Adam + StableEmbedding against torch Adam.

    python examples/train_lm_8bit.py [--steps 300] [--device cpu] [--seed 0]

Trains a small byte-level GPT-style language model three times on the same text, from the same
initial weights (apart from the token embedding), with the same batches: with ``torch.optim.Adam``
and ``nn.Embedding``; with ``torch.optim.Adam`` and ``lowbit.nn.StableEmbedding``; and with
``lowbit.optim.Adam8bit`` and ``lowbit.nn.StableEmbedding`` (8bit-optimizers.txt sections 2 and
2.3). The second run has the third's model, so comparing those two isolates the 8-bit optimizer
states; comparing the first and third gives the paper's recipe against the usual setup. The text is
the CPython standard library's top-level ``.py`` files in sorted order, the first 1.5 MB; the last
10 % is held out. Prints each run's final training loss (mean of the last 20 steps), held-out loss,
optimizer state bytes and time, and the relative differences.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import lowbit.nn
import lowbit.optim

VOCAB = 256
DATA_BYTES = 1_500_000
HOLDOUT = 0.1
FINAL_WINDOW = 20
EVAL_WINDOWS = 1024


@dataclass(frozen=True)
class Config:
    """Model and training sizes."""

    layers: int = 2
    d_model: int = 128
    heads: int = 4
    context: int = 64
    batch: int = 32
    lr: float = 2e-3


def load_text() -> torch.Tensor:
    """The first DATA_BYTES bytes of the stdlib's top-level .py files, sorted by name, as uint8."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= DATA_BYTES:
            break
    data = b"".join(chunks)[:DATA_BYTES]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The block applied to ``h`` of shape (batch, time, d_model)."""
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return h + self.out(F.gelu(self.fc(self.norm2(h))))


class TinyGPT(nn.Module):
    """Token embedding + learned positions, pre-norm causal transformer blocks, linear head."""

    def __init__(self, cfg: Config, embedding: nn.Module) -> None:
        super().__init__()
        self.tok = embedding
        self.pos = nn.Parameter(0.02 * torch.randn(cfg.context, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-byte logits of shape (batch, time, VOCAB) for byte ids ``x`` of shape (batch, time)."""
        h = self.tok(x) + self.pos[: x.shape[1]]  # position embeddings are added after StableEmbedding's norm
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(cfg: Config, seed: int, embedding: Callable[[], nn.Module], device: torch.device) -> TinyGPT:
    """The model with shared weights drawn from ``seed`` and the token embedding from ``seed + 1``."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg, nn.Identity())
    torch.manual_seed(seed + 1)
    model.tok = embedding()
    return model.to(device)


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows of ``context + 1`` bytes at ``starts``."""
    idx = starts[:, None] + torch.arange(context + 1, device=starts.device)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def evaluate(model: TinyGPT, data: torch.Tensor, context: int, batch: int) -> float:
    """Mean next-byte cross-entropy over EVAL_WINDOWS evenly spaced windows of ``data``."""
    n = min(EVAL_WINDOWS, (len(data) - 1) // context)
    starts = torch.arange(n, device=data.device) * ((len(data) - context - 1) // n)
    total = 0.0
    for chunk in starts.split(batch * 4):
        x, y = windows(data, chunk, context)
        total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    return total / (n * context)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state (moments, absmax, step counters)."""
    return sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))


@dataclass
class Result:
    """What one run measured."""

    train_loss: float
    heldout_loss: float
    state_bytes: int
    eight_bit_tensors: int
    seconds: float


def train(
    model: TinyGPT,
    opt: torch.optim.Optimizer,
    train_data: torch.Tensor,
    heldout: torch.Tensor,
    starts: torch.Tensor,
    cfg: Config,
) -> Result:
    """Run one optimizer step per row of ``starts`` and measure the result."""
    t0 = time.perf_counter()
    losses = []
    for step_starts in starts:
        x, y = windows(train_data, step_starts, cfg.context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    last = losses[-FINAL_WINDOW:]
    eight_bit = sum(1 for s in opt.state.values() for t in s.values() if getattr(t, "dtype", None) == torch.uint8)
    return Result(
        sum(last) / len(last),
        evaluate(model, heldout, cfg.context, cfg.batch),
        state_bytes(opt),
        eight_bit,
        time.perf_counter() - t0,
    )


def main() -> None:
    """Train the three runs and print the comparisons."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    cfg, device = Config(), torch.device(args.device)

    data = load_text()
    split = int(len(data) * (1 - HOLDOUT))
    train_data, heldout = data[:split].to(device), data[split:].to(device)
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, split - cfg.context - 1, (args.steps, cfg.batch), generator=g).to(device)
    print(
        f"data: {len(data):,} bytes of {Path(sysconfig.get_paths()['stdlib'])}/*.py, "
        f"{split:,} train / {len(data) - split:,} held out; {args.steps} steps of {cfg.batch}x{cfg.context} bytes"
    )

    runs = {
        "torch.optim.Adam + nn.Embedding": (
            lambda: nn.Embedding(VOCAB, cfg.d_model),
            lambda params: torch.optim.Adam(params, lr=cfg.lr),
        ),
        "torch.optim.Adam + lowbit.nn.StableEmbedding": (
            lambda: lowbit.nn.StableEmbedding(VOCAB, cfg.d_model),
            lambda params: torch.optim.Adam(params, lr=cfg.lr),
        ),
        "lowbit.optim.Adam8bit + lowbit.nn.StableEmbedding": (
            lambda: lowbit.nn.StableEmbedding(VOCAB, cfg.d_model),
            lambda params: lowbit.optim.Adam8bit(params, lr=cfg.lr),
        ),
    }
    results = []
    for name, (embedding, optimizer) in runs.items():
        model = build(cfg, args.seed, embedding, device)
        if not results:
            n_params = sum(p.numel() for p in model.parameters())
            big = sum(1 for p in model.parameters() if p.numel() >= 4096)
            print(
                f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, context {cfg.context}, "
                f"{n_params:,} parameters in {len(list(model.parameters()))} tensors ({big} with >= 4096 elements)"
            )
        r = train(model, optimizer(model.parameters()), train_data, heldout, starts, cfg)
        results.append(r)
        print(
            f"{name:<50} final train loss {r.train_loss:.4f}  held-out loss {r.heldout_loss:.4f}  "
            f"state {r.state_bytes:,} bytes ({r.eight_bit_tensors} uint8 tensors)  {r.seconds:.1f} s"
        )
        if not (math.isfinite(r.train_loss) and math.isfinite(r.heldout_loss)):
            raise SystemExit(f"{name}: non-finite loss")

    base, same_model, low = results
    for label, ref in (("torch Adam, same model", same_model), ("torch Adam + nn.Embedding", base)):
        print(
            f"8-bit relative to {label}: train {100 * (low.train_loss / ref.train_loss - 1):+.2f}%, "
            f"held-out {100 * (low.heldout_loss / ref.heldout_loss - 1):+.2f}%, "
            f"optimizer state {low.state_bytes / ref.state_bytes:.3f}x"
        )


if __name__ == "__main__":
    main()
