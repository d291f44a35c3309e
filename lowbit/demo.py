"""``python -m lowbit demo``: the same language model trained five ways, with the memory measured.

A byte-level GPT-style model learns the CPython standard library sources (found through
``sysconfig``, nothing is downloaded; ``--data`` takes any text file or folder) from the same initial
weights, batches and schedule in each configuration:

- ``fp32``: ``torch.optim.AdamW`` and ``nn.Embedding``, everything in fp32 (the baseline);
- ``adamw8bit``: :class:`lowbit.optim.AdamW8bit` and :class:`lowbit.nn.StableEmbedding`
  (8bit-optimizers.txt);
- ``act``: the same plus :func:`lowbit.nn.compress_activations` (inverted GELU: the output, which the
  next Linear saves anyway, plus one bit; inverted-activations.txt);
- ``lpmm``: the same plus :func:`lowbit.lpmm.convert` (12-bit parameters, 8-bit gradient
  accumulators, groups of 256) and :class:`lowbit.optim.LPMMAdamW` with 8-bit moments (lpmm.txt);
- ``adamw4bit``: ``adamw8bit`` with :class:`lowbit.optim.AdamW4bit` (4-bit states, blocks of 128) in place
  of AdamW8bit;
- ``release``: ``adamw8bit`` with gradient release (:func:`lowbit.optim.step_in_backward`: each parameter
  steps inside backward and its gradient is freed);
- ``muon8bit``: :func:`lowbit.optim.muon_with_adamw`: Muon8bit for the hidden matrices, AdamW8bit for the
  embedding, head, biases and norms;
- ``minimal``: ``act`` with LPMM 12-bit parameters, 4-bit gradient accumulators (groups of
  ``MINIMAL_GROUP``), :class:`lowbit.optim.LPMMAdamW` with 4-bit moments, and gradient release, which
  frees each accumulator after its parameter's step.

For each it measures the bytes of parameters, gradients and optimizer state from their storage
(:func:`lowbit.lpmm.memory_report`) after the last step, and their peak sum during that step: at every
parameter's post-accumulate-grad hook of its backward (before release steps the parameter), after the
backward and after ``step()``; the bytes saved for backward by one training batch
(:func:`lowbit.memory.saved_tensor_bytes`), peak memory (CUDA: ``torch.cuda.max_memory_allocated``;
CPU: the largest rise of the resident set of a fresh process that trains only that configuration), the
median step time and the final training and held-out losses. It prints a table and writes
``report.json`` and ``report.png`` (loss curves and stacked memory bars) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

import lowbit.lpmm
import lowbit.nn
import lowbit.optim
from lowbit.memory import saved_tensor_bytes

VOCAB = 256
DATA_BYTES = 1_500_000
HOLDOUT = 0.1
FINAL_WINDOW = 20
EVAL_WINDOWS = 512

CONFIGS: dict[str, str] = {
    "fp32": "torch AdamW + nn.Embedding (fp32)",
    "adamw8bit": "lowbit AdamW8bit + StableEmbedding",
    "act": "+ compressed activations (InvGELU)",
    "lpmm": "+ LPMM 12-bit params / 8-bit grads (groups of 256), LPMMAdamW 8-bit moments",
    "adamw4bit": "lowbit AdamW4bit + StableEmbedding",
    "release": "lowbit AdamW8bit + StableEmbedding, gradient release (step_in_backward)",
    "muon8bit": "lowbit Muon8bit (hidden matrices) + AdamW8bit (the rest) + StableEmbedding",
    "minimal": "+ compressed activations, LPMM 12-bit params / 4-bit grads, LPMMAdamW 4-bit moments, gradient release",
}
#: Configurations that step inside backward (lowbit.optim.step_in_backward).
RELEASED = ("release", "minimal")
#: The minimal configuration's quantization group (parameters, accumulators and moments).
MINIMAL_GROUP = 512
#: Its accumulators' width (see make_config).
MINIMAL_GRAD_BITS = 4
#: Muon's learning rate in ``muon8bit`` (its AdamW part takes ModelConfig.lr). The minimum of a sweep on
#: seed 0 (benchmarks/sweep_demo_muon_lr.py, README): 0.014 and 0.028 end 1.1-1.2% higher in train loss,
#: 0.01 and 0.04 2.5-8%.
MUON_LR = 0.02


@dataclass(frozen=True)
class ModelConfig:
    """Model and training sizes."""

    layers: int = 2
    d_model: int = 128
    heads: int = 4
    context: int = 64
    batch: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.01


# -- data ---------------------------------------------------------------------------------------------


def stdlib_sources() -> Path:
    """The CPython standard library folder of this interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_text(path: Optional[Path] = None, max_bytes: int = DATA_BYTES) -> torch.Tensor:
    """Up to ``max_bytes`` bytes as uint8: of a file, of the files below a folder (sorted by path), or
    by default of the standard library's top-level ``.py`` files."""
    if path is None:
        files = sorted(stdlib_sources().glob("*.py"))
    elif path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        raise FileNotFoundError(f"lowbit demo: --data {path} is neither a file nor a folder")
    chunks, total = [], 0
    for f in files:
        chunks.append(f.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def split_and_sample(
    data: torch.Tensor, cfg: ModelConfig, steps: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training and held-out parts of ``data`` (the last ``HOLDOUT`` of it) on ``device``, and the
    window starts of ``steps`` training batches drawn from ``seed``: every configuration sees the same."""
    split = int(len(data) * (1 - HOLDOUT))
    if split < 2 * (cfg.context + 1) or len(data) - split < cfg.context + 1:
        raise SystemExit(f"lowbit demo: {len(data)} bytes of data is too little; give at least 2 KB")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, split - cfg.context - 1, (steps, cfg.batch), generator=g).to(device)
    return data[:split].to(device), data[split:].to(device), starts


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows of ``context + 1`` bytes at ``starts``."""
    idx = starts[:, None] + torch.arange(context + 1, device=starts.device)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


# -- model ----------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The block applied to ``h`` of shape (batch, time, d_model)."""
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return h + self.out(self.act(self.fc(self.norm2(h))))


class TinyGPT(nn.Module):
    """Token embedding + learned positions, pre-norm causal transformer blocks, linear head."""

    def __init__(self, cfg: ModelConfig, embedding: nn.Module) -> None:
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


def build_model(cfg: ModelConfig, seed: int, embedding: Callable[[], nn.Module], device: torch.device) -> TinyGPT:
    """The model with shared weights drawn from ``seed`` and the token embedding from ``seed + 1``."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg, nn.Identity())
    torch.manual_seed(seed + 1)
    model.tok = embedding()
    return model.to(device)


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, context: int, batch: int, n_windows: int = EVAL_WINDOWS) -> float:
    """Mean next-byte cross-entropy over up to ``n_windows`` evenly spaced windows of ``data``."""
    n = max(1, min(n_windows, (len(data) - 1) // context))
    starts = torch.arange(n, device=data.device) * ((len(data) - context - 1) // n)
    total = 0.0
    for chunk in starts.split(batch * 4):
        x, y = windows(data, chunk, context)
        total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    return total / (n * context)


class _Both(torch.optim.Optimizer):
    """Two optimizers stepped together (Muon and AdamW of ``muon_with_adamw``), seen as one by the loop
    and by :func:`lowbit.lpmm.memory_report` (``state`` is the union of theirs)."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.parts = (first, second)

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {**self.parts[0].state, **self.parts[1].state}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none)


def make_config(
    name: str, cfg: ModelConfig, seed: int, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of configuration ``name`` (a key of CONFIGS); gradient release, for the
    ``RELEASED`` ones, is switched on by the caller."""
    if name == "fp32":
        model = build_model(cfg, seed, lambda: nn.Embedding(VOCAB, cfg.d_model), device)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model = build_model(cfg, seed, lambda: lowbit.nn.StableEmbedding(VOCAB, cfg.d_model), device)
    if name in ("act", "lpmm", "minimal"):
        lowbit.nn.compress_activations(model, method="invact")
    if name == "minimal":
        # 12 + 4 + 4 bits a parameter, and 4-bit accumulators, of which release keeps one or two alive at a
        # time: the largest (fc, out: 65,536 elements) is 0.07 bytes a parameter of this model at 4 bits,
        # 0.14 at 8. The absmaxes of the three stored tensors cost 12 / group bytes a parameter. Measured
        # (README): groups of 512 peak at 2.595 bytes a parameter and train within 1.3% of fp32 on seeds
        # 0-2; groups of 1024 with 4-bit accumulators missed by one seed (train +2.32%), with 5-bit ones
        # (peak 2.600) by another (held-out +3.58%).
        lowbit.lpmm.convert(model, param_bits=12, grad_bits=MINIMAL_GRAD_BITS, group_size=MINIMAL_GROUP)
        return model, lowbit.optim.LPMMAdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, momentum_bits=4
        )
    if name == "muon8bit":
        muon, adamw = lowbit.optim.muon_with_adamw(
            model,
            muon=dict(lr=MUON_LR, weight_decay=cfg.weight_decay),
            adamw=dict(lr=cfg.lr, weight_decay=cfg.weight_decay),
        )
        return model, _Both(muon, adamw)
    if name == "lpmm":
        # Groups of 256 rather than the paper's 2048: this model's tensors are small and AdamW amplifies
        # the gradient-quantization noise of small elements in a group (0.05 bytes/param more).
        lowbit.lpmm.convert(model, param_bits=12, grad_bits=8, group_size=256)
        opt: torch.optim.Optimizer = lowbit.optim.LPMMAdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, momentum_bits=8
        )
        return model, opt
    cls = lowbit.optim.AdamW4bit if name == "adamw4bit" else lowbit.optim.AdamW8bit
    return model, cls(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


# -- measurement ------------------------------------------------------------------------------------------


def _rss_bytes() -> Optional[int]:
    """The resident set size of this process (Linux), or None where /proc is not available."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _PeakMemory:
    """Peak CUDA allocation, or the largest rise of the CPU resident set over its level at the start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rise = 0
        self.start: Optional[int]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_allocated(device)
        else:
            self.start = _rss_bytes()

    def sample(self) -> None:
        if self.device.type != "cuda" and self.start is not None:
            self.rise = max(self.rise, (_rss_bytes() or 0) - self.start)

    def result(self) -> Optional[int]:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.rise if self.start is not None else None


def _warm_up(cfg: ModelConfig, device: torch.device) -> None:
    """One forward/backward pass of a tiny model, so that the libraries' one-time set-up (thread pools,
    kernel caches) is not counted as the configuration's memory."""
    tiny = ModelConfig(layers=1, d_model=cfg.heads * 4, heads=cfg.heads, context=8, batch=2)
    model = build_model(tiny, 0, lambda: nn.Embedding(VOCAB, tiny.d_model), device)
    x = torch.zeros(tiny.batch, tiny.context, dtype=torch.long, device=device)
    model(x).sum().backward()


class _Progress:
    """A one-line progress bar on stderr (a line per quarter where stderr is not a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        done = step == self.total
        if not self.tty and not done and step % max(1, self.total // 4):
            return
        width = 30
        fill = int(width * step / self.total)
        rate = (time.perf_counter() - self.t0) / step * 1e3
        line = f"{self.label:<10} [{'#' * fill}{'.' * (width - fill)}] {step}/{self.total}  loss {loss:.3f}  "
        line += f"{rate:.0f} ms/step"
        sys.stderr.write(("\r" if self.tty else "") + line + ("\n" if done or not self.tty else ""))
        sys.stderr.flush()


class _ModelBytesPeak:
    """The peak of parameter + gradient + optimizer-state bytes (from storage, :func:`lowbit.lpmm.memory_report`)
    over the samples taken while armed: one at each parameter's post-accumulate-grad hook (registered
    before gradient release's, so it sees the gradient before release steps the parameter and frees it),
    and those the training loop takes after backward and after the step."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self.armed = False
        self.peak = 0
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _: self.sample())

    def sample(self) -> None:
        if self.armed:
            r = lowbit.lpmm.memory_report(self.model, self.opt)
            self.peak = max(self.peak, r.params + r.grads + r.optimizer_state)


class _WithLoss(nn.Module):
    """The model and its loss as one module, so that saved_tensor_bytes leaves its parameters out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())


@dataclass
class RunResult:
    """What one configuration measured (bytes are exact storage bytes)."""

    name: str
    description: str
    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    saved_activation_bytes: int
    peak_bytes: Optional[int]
    peak_model_bytes: int
    step_ms: float
    train_loss: float
    heldout_loss: float
    seconds: float
    losses: list[float] = field(default_factory=list)

    @property
    def model_bytes(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes


def train_config(
    name: str,
    cfg: ModelConfig,
    seed: int,
    device: torch.device,
    train_data: torch.Tensor,
    heldout: torch.Tensor,
    starts: torch.Tensor,
    eval_windows: int = EVAL_WINDOWS,
) -> RunResult:
    """Train configuration ``name`` for ``len(starts)`` steps and measure it; the held-out loss is the
    mean over ``eval_windows`` windows (:func:`evaluate`)."""
    _warm_up(cfg, device)
    peak = _PeakMemory(device)
    model, opt = make_config(name, cfg, seed, device)
    model_peak = _ModelBytesPeak(model, opt)
    if name in RELEASED:
        # The released configurations make lowbit optimizers (make_config), which step_in_backward checks.
        lowbit.optim.step_in_backward(cast(Union[lowbit.optim.LowbitOptimizer, lowbit.optim.LPMMOptimizer], opt), model)
    x0, y0 = windows(train_data, starts[0], cfg.context)
    saved = saved_tensor_bytes(_WithLoss(model), x0, y0).total
    progress = _Progress(name, len(starts))
    losses, times, report = [], [], None
    t_start = time.perf_counter()
    for i, step_starts in enumerate(starts):
        x, y = windows(train_data, step_starts, cfg.context)
        t0 = time.perf_counter()
        model_peak.armed = i == len(starts) - 1  # the last step, whose states all exist
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        model_peak.sample()
        opt.step()
        model_peak.sample()
        if i == len(starts) - 1:  # measured while this step's gradients still exist (none under release)
            report = lowbit.lpmm.memory_report(model, opt)
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # synchronises, so the time below is the step's on any device
        times.append(time.perf_counter() - t0)
        losses.append(value)
        peak.sample()
        progress.update(i + 1, value)
        if not math.isfinite(value):
            raise RuntimeError(f"lowbit demo: configuration {name} diverged (loss {value}) at step {i + 1}")
    seconds = time.perf_counter() - t_start
    last = losses[-FINAL_WINDOW:]
    assert report is not None
    return RunResult(
        name=name,
        description=CONFIGS[name],
        num_params=report.num_params,
        param_bytes=report.params,
        grad_bytes=report.grads,
        optimizer_state_bytes=report.optimizer_state,
        saved_activation_bytes=saved,
        peak_bytes=peak.result(),
        peak_model_bytes=model_peak.peak,
        step_ms=statistics.median(times) * 1e3,
        train_loss=sum(last) / len(last),
        heldout_loss=evaluate(model, heldout, cfg.context, cfg.batch, eval_windows),
        seconds=seconds,
        losses=losses,
    )


def _train_in_subprocess(*args: Any) -> RunResult:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(train_config, *args).result()


def train_configs(
    names: list[str],
    cfg: ModelConfig,
    seed: int,
    device: torch.device,
    train_data: torch.Tensor,
    heldout: torch.Tensor,
    starts: torch.Tensor,
    eval_windows: int = EVAL_WINDOWS,
) -> list[RunResult]:
    """:func:`train_config` for each of ``names`` in turn. On the CPU each configuration trains in a fresh
    process, so that its resident-set rise is its own and not shaped by what earlier configurations left in
    the allocator."""
    train = train_config if device.type == "cuda" else _train_in_subprocess
    return [train(n, cfg, seed, device, train_data, heldout, starts, eval_windows) for n in names]


# -- report -----------------------------------------------------------------------------------------------


def _mib(b: Optional[int]) -> str:
    return "n/a" if b is None else f"{b / 2**20:.2f}"


def format_table(results: list[RunResult], device: torch.device) -> str:
    """The comparison table; ratios are to the first configuration."""
    base = results[0]
    peak_label = "peak MiB" if device.type == "cuda" else "RSS+ MiB"
    head = (
        f"{'config':<10}{'params MiB':>11}{'grads MiB':>10}{'optim MiB':>10}{'activ MiB':>10}"
        f"{'model B/param':>14}{'peak B/param':>13}{peak_label:>10}{'ms/step':>9}{'train loss':>11}{'held-out':>10}"
        f"{'vs ' + base.name:>11}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        rel = 100 * (r.train_loss / base.train_loss - 1)
        lines.append(
            f"{r.name:<10}{_mib(r.param_bytes):>11}{_mib(r.grad_bytes):>10}{_mib(r.optimizer_state_bytes):>10}"
            f"{_mib(r.saved_activation_bytes):>10}{r.model_bytes / r.num_params:>14.3f}"
            f"{r.peak_model_bytes / r.num_params:>13.3f}{_mib(r.peak_bytes):>10}"
            f"{r.step_ms:>9.1f}{r.train_loss:>11.4f}{r.heldout_loss:>10.4f}{rel:>+10.2f}%"
        )
    lines.append("")
    lines += [f"{r.name:<10}{r.description}" for r in results]
    return "\n".join(lines)


def write_figure(results: list[RunResult], path: Path) -> bool:
    """Loss curves and stacked memory bars as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        k = max(1, len(r.losses) // 50)
        smooth = [
            sum(r.losses[max(0, i - k + 1) : i + 1]) / len(r.losses[max(0, i - k + 1) : i + 1])
            for i in range(len(r.losses))
        ]
        ax_loss.plot(range(1, len(smooth) + 1), smooth, label=r.name)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"training loss (running mean of {max(1, len(results[0].losses) // 50)})")
    ax_loss.set_title("training loss")
    ax_loss.legend()
    names = [r.name for r in results]
    bottom = [0.0] * len(results)
    parts = [
        ("parameters", [r.param_bytes for r in results]),
        ("gradients", [r.grad_bytes for r in results]),
        ("optimizer state", [r.optimizer_state_bytes for r in results]),
        ("saved activations", [r.saved_activation_bytes for r in results]),
    ]
    for label, values in parts:
        mib = [v / 2**20 for v in values]
        ax_mem.bar(names, mib, bottom=bottom, label=label)
        bottom = [b + m for b, m in zip(bottom, mib, strict=True)]
    ax_mem.set_ylabel("MiB (measured storage)")
    ax_mem.set_title("memory per training step")
    ax_mem.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_configs(text: str) -> list[str]:
    """The configuration names of a comma-separated ``--configs`` value, each a key of CONFIGS."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per configuration (300)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--out", type=Path, default=Path("lowbit-demo"), help="folder for report.json, report.png")
    parser.add_argument(
        "--configs", type=parse_configs, default=list(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}"
    )
    parser.add_argument("--data", type=Path, default=None, help="a text file or folder (default: the stdlib sources)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed ``args``; returns the exit status."""
    if args.steps < 1:
        raise SystemExit("lowbit demo: --steps must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("lowbit demo: --device cuda, but torch sees no CUDA device")
    cfg = ModelConfig()
    data = load_text(args.data)
    train_data, heldout, starts = split_and_sample(data, cfg, args.steps, args.seed, device)
    split = len(train_data)
    source = args.data if args.data is not None else f"{stdlib_sources()}/*.py"
    print(
        f"lowbit demo: {len(data):,} bytes of {source} ({split:,} train / {len(data) - split:,} held out); "
        f"{args.steps} steps of {cfg.batch} x {cfg.context} bytes on {device}; "
        f"{cfg.layers}-layer GPT, d_model {cfg.d_model}; seed {args.seed}"
    )
    results = train_configs(args.configs, cfg, args.seed, device, train_data, heldout, starts)
    print()
    print(format_table(results, device))
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "argv": sys.argv[1:],
        "device": str(device),
        "torch": torch.__version__,
        "lowbit": lowbit.__version__,
        "model": asdict(cfg),
        "steps": args.steps,
        "seed": args.seed,
        "data": str(source),
        "results": [asdict(r) | {"model_bytes": r.model_bytes} for r in results],
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    written = [str(args.out / "report.json")]
    if write_figure(results, args.out / "report.png"):
        written.append(str(args.out / "report.png"))
    else:
        print("figure skipped: matplotlib is not installed (pip install matplotlib)")
    print(f"wrote {', '.join(written)}")
    return 0
