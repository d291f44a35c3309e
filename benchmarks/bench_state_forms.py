"""How should 4-bit Adam second moments be stored? A measurement of four stored forms of v.

    python benchmarks/bench_state_forms.py [--seeds 0 1 2] [--per-seed] [--m-fp32] [--m-map paper|dynamic]

Pure PyTorch (fp32, CPU, one thread, fixed seeds); lowbit itself is not imported. Every variant runs
torch.optim.AdamW's update (decoupled decay ``p *= 1 - lr*wd``, ``m.lerp_(g, 1-b1)``,
``v.mul_(b2).addcmul_(g, g, value=1-b2)``, ``denom = sqrt(v)/sqrt(bc2) + eps``,
``p -= lr/bc1 * m/denom``) and after each step replaces m and v by their 4-bit quantize -> dequantize
round trip: block-wise absmax over blocks of 128 contiguous elements of the flattened tensor (last
block zero-padded), nearest code (argmin over the map, ties to the lower index). Every tensor is
quantized, whatever its size. m uses the signed 4-bit dynamic-exponent (DE) map of Li, Chen,
Zhu 2023, or with ``--m-map dynamic`` lowbit's symmetric one. The variants differ in v:

    V1  v       on the linear map (i+1)/16            (the 4-bit paper / torchao AdamW4bit)
    V2  sqrt(v) on the linear map (i+1)/16
    V3  sqrt(v) on the unsigned 4-bit DE map, code[0] = code[1] ("DE-0"; lowbit's 8-bit form)
    V4  v       on the same DE-0 map

Controls: torch.optim.AdamW (fp32 states, foreach=False) is the reference trajectory of every
scenario, and "fp32 loop" is this script's own update loop without quantization (it must reproduce the
reference exactly, which checks the harness; it also gives the reference's largest |u|/lr). The
diagnostic row "m4 only" quantizes m alone and keeps v in fp32: the part of each deviation that no
form of v can remove. ``--m-fp32`` instead runs V1-V4 with m kept in fp32, to isolate the effect of
the v form alone.

Scenarios (lr 1e-3, wd 1e-2, betas (0.9, 0.999), eps 1e-8; same init and same batches for all):
  1 mlp    Linear(64,256)-ReLU-Linear(256,256)-ReLU-Linear(256,10), 30 steps of cross-entropy on
           batches of 4 standard normal inputs with random labels.
  2 embed  Embedding(1000,32) -> Linear(32,1000), 60 steps of cross-entropy on 16 tokens drawn with
           probability proportional to 1/k^1.5 (k = 1..1000), target = the token (rare rows).
  3 dense  one parameter randn(8192) * logspace(-4,0,8192)[randperm], loss (p*p).sum(), 60 steps.
  4 regr   Linear(16,64)-GELU-Linear(64,64)-GELU-Linear(64,1), 300 full-batch steps of MSE on a fixed
           synthetic regression set of 512 samples.

Reported: for 1-3, max|p - p_ref| and mean|p - p_ref| over all parameter elements after the last step,
and "max/moved" = max|p - p_ref| / max|p_ref - p_init| (the largest distance the reference moved any
element), and "L2/moved" = ||p - p_ref|| / ||p_ref - p_init||; for 4, final loss / the reference's
final loss (closer to 1 = closer to fp32 AdamW; below 1 = more progress than fp32 in the same steps) and
L2/moved. For every variant: "zero-pt" = the number of (step, element) pairs where an element of a v
block with non-zero absmax decodes to exactly 0 (the zero-point problem; 0 is expected for these
zero-free maps), "floored %" = the share of (step, element) pairs of v whose true stored form lies below
the map's smallest code times the block scale (so decoded v is raised to that floor), and "max|u|/lr" =
the largest Adam step |m_hat/denom| of any element at any step (blow-ups show here; the "fp32 loop" row
gives fp32 AdamW's own value, 1 to 3 in these scenarios).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

LR, WD, BETAS, EPS = 1e-3, 1e-2, (0.9, 0.999), 1e-8
BLOCK = 128

# Signed 4-bit maps of the first moment (--m-map): "paper", Li et al.'s dynamic-exponent map
# (notes/low-bit-states.md section 1), which stops at -0.8875; "dynamic", lowbit's (create_dynamic_map at 4
# bits, as lowbit.optim.state_storage.optimizer_state_map), symmetric with both +-1 and 0 twice.
M_MAPS = {
    "paper": torch.tensor(
        [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0]
        + [0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]
    ),
    "dynamic": torch.tensor(
        [-1.0, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0]
        + [0.0, 0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 1.0]
    ),
}
M_MAP = M_MAPS["paper"].clone()
# Linear map without zero, (i+1)/16.
LINEAR_MAP = torch.arange(1, 17, dtype=torch.float32) / 16
# Unsigned 4-bit dynamic map; DE-0 sets code[0] = code[1] so that nothing decodes to 0.
_DE_UNSIGNED = [0.0, 5.5e-4, 3.25e-3, 7.75e-3, 2.125e-2, 4.375e-2, 6.625e-2, 8.875e-2]
_DE_UNSIGNED += [0.15625, 0.26875, 0.38125, 0.49375, 0.60625, 0.71875, 0.83125, 1.0]
DE0_MAP = torch.tensor(_DE_UNSIGNED)
DE0_MAP[0] = DE0_MAP[1]


@dataclass(frozen=True)
class Variant:
    """How v is stored: on ``v_map`` as v itself (root False) or as sqrt(v) (root True); None = fp32.

    m is quantized on the signed DE map when ``quant_m`` is True.
    """

    name: str
    v_map: torch.Tensor | None
    root: bool
    quant_m: bool = True


VARIANTS = [
    Variant("fp32 loop", None, False, quant_m=False),
    Variant("m4 only", None, False),
    Variant("V1 v/lin", LINEAR_MAP, False),
    Variant("V2 sqrt/lin", LINEAR_MAP, True),
    Variant("V3 sqrt/DE-0", DE0_MAP, True),
    Variant("V4 v/DE-0", DE0_MAP, False),
]


@dataclass
class Stats:
    """Counters gathered over a run."""

    zero_points: int = 0
    floored: int = 0
    v_elems: int = 0
    max_u: float = 0.0
    extra: dict = field(default_factory=dict)


def round_trip(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` block-wise (absmax, 128, nearest on ``qmap``) and decode it.

    Returns:
        The decoded tensor (shape of x), the per-element block scale, and the normalized values.
    """
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % BLOCK
    blocks = F.pad(flat, (0, pad)).view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True)
    normed = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1.0), 0.0)
    idx = (normed.unsqueeze(-1) - qmap).abs().argmin(dim=-1)  # first minimum: ties to the lower index
    decoded = qmap[idx] * scale
    per_elem_scale = scale.expand_as(blocks)
    return (
        decoded.reshape(-1)[:n].view_as(x),
        per_elem_scale.reshape(-1)[:n].view_as(x),
        normed.reshape(-1)[:n].view_as(x),
    )


class LoopAdamW:
    """AdamW in torch.optim.AdamW's single-tensor order, with 4-bit round trips of m and v per ``variant``."""

    def __init__(self, params, variant: Variant) -> None:
        self.params = [p for p in params]
        self.variant = variant
        self.step_count = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.stats = Stats()

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step, then the round trip of the states."""
        self.step_count += 1
        b1, b2 = BETAS
        step = float(self.step_count)
        bc1 = 1 - b1**step
        bc2 = 1 - b2**step
        step_size = LR / bc1
        bc2_sqrt = bc2**0.5
        st = self.stats
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad
            p.mul_(1 - LR * WD)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(EPS)
            st.max_u = max(st.max_u, float((m / denom).abs().max()) / bc1)
            p.addcdiv_(m, denom, value=-step_size)
            vm = self.variant.v_map
            if self.variant.quant_m:
                m.copy_(round_trip(m, M_MAP)[0])
            if vm is None:
                continue
            stored = v.sqrt() if self.variant.root else v
            dec, scale, normed = round_trip(stored, vm)
            new_v = dec * dec if self.variant.root else dec
            st.zero_points += int(((new_v == 0) & (scale > 0)).sum())
            st.floored += int(((normed < vm[0]) & (scale > 0)).sum())
            st.v_elems += v.numel()
            v.copy_(new_v)


# ---------------------------------------------------------------- scenarios


def build_mlp(seed: int):
    """Scenario 1: model and 30 batches of 4 inputs with random labels."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    gen = torch.Generator().manual_seed(10_000 + seed)
    batches = [(torch.randn(4, 64, generator=gen), torch.randint(0, 10, (4,), generator=gen)) for _ in range(30)]

    def loss_fn(mod, batch):
        return F.cross_entropy(mod(batch[0]), batch[1])

    return model, batches, loss_fn


def build_embed(seed: int):
    """Scenario 2: Embedding(1000,32) -> Linear(32,1000); 60 batches of 16 Zipf(1.5) tokens."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(1000, 32), nn.Linear(32, 1000))
    gen = torch.Generator().manual_seed(20_000 + seed)
    probs = 1.0 / torch.arange(1, 1001, dtype=torch.float64) ** 1.5
    probs = probs / probs.sum()
    batches = [torch.multinomial(probs, 16, replacement=True, generator=gen) for _ in range(60)]

    def loss_fn(mod, tokens):
        return F.cross_entropy(mod(tokens), tokens)

    return model, batches, loss_fn


class Dense(nn.Module):
    """Scenario 3: one parameter with magnitudes spread over four decades."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(30_000 + seed)
        mags = torch.logspace(-4, 0, 8192)[torch.randperm(8192, generator=gen)]
        self.p = nn.Parameter(torch.randn(8192, generator=gen) * mags)


def build_dense(seed: int):
    """Scenario 3: loss (p*p).sum(), 60 steps."""
    model = Dense(seed)

    def loss_fn(mod, _batch):
        return (mod.p * mod.p).sum()

    return model, [None] * 60, loss_fn


REGR_DATA: tuple[torch.Tensor, torch.Tensor] | None = None


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed synthetic regression set (512 x 16 inputs, smooth non-linear target plus noise)."""
    global REGR_DATA
    if REGR_DATA is None:
        gen = torch.Generator().manual_seed(4242)
        x = torch.randn(512, 16, generator=gen)
        a = torch.randn(16, generator=gen) / 4
        b = torch.randn(16, generator=gen) / 4
        y = torch.sin(2 * x @ a) + 0.5 * torch.tanh(x @ b) * (x[:, 0] ** 2) + 0.05 * torch.randn(512, generator=gen)
        REGR_DATA = (x, y.unsqueeze(1))
    return REGR_DATA


def build_regr(seed: int):
    """Scenario 4: small GELU MLP, 300 full-batch MSE steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    data = regression_data()

    def loss_fn(mod, batch):
        return F.mse_loss(mod(batch[0]), batch[1])

    return model, [data] * 300, loss_fn


SCENARIOS = {"1 mlp": build_mlp, "2 embed": build_embed, "3 dense": build_dense, "4 regr": build_regr}


def train(model: nn.Module, batches, loss_fn, opt) -> float:
    """Run the steps; return the loss on the last batch after training."""
    for batch in batches:
        for p in model.parameters():
            p.grad = None
        loss_fn(model, batch).backward()
        opt.step()
    with torch.no_grad():
        return float(loss_fn(model, batches[-1]))


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters of ``model`` as one detached vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_scenario(name: str, seeds: list[int]) -> dict:
    """Per variant and seed: trajectory metrics against torch.optim.AdamW, and the run statistics."""
    results: dict = {v.name: [] for v in VARIANTS}
    for seed in seeds:
        model, batches, loss_fn = SCENARIOS[name](seed)
        init = copy.deepcopy(model)
        ref = copy.deepcopy(init)
        torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
        ref_loss = train(ref, batches, loss_fn, torch_opt)
        p0, pref = flat_params(init), flat_params(ref)
        moved = float((pref - p0).abs().max())
        for variant in VARIANTS:
            mod = copy.deepcopy(init)
            opt = LoopAdamW(mod.parameters(), variant)
            loss = train(mod, batches, loss_fn, opt)
            diff = (flat_params(mod) - pref).abs()
            results[variant.name].append(
                {
                    "max": float(diff.max()),
                    "mean": float(diff.mean()),
                    "rel": float(diff.max()) / moved,
                    "l2rel": float(diff.norm() / (pref - p0).norm()),
                    "loss_ratio": loss / ref_loss,
                    "loss": loss,
                    "ref_loss": ref_loss,
                    "stats": opt.stats,
                }
            )
    return results


def summarize(name: str, results: dict, per_seed: bool) -> None:
    """Print one scenario's table (aggregated over seeds)."""
    regression = name.startswith("4")
    print(f"\n### Scenario {name}")
    if regression:
        ref_losses = ", ".join(f"{r['ref_loss']:.4g}" for r in results[VARIANTS[0].name])
        print(f"torch.optim.AdamW final loss per seed: {ref_losses}")
        head = (
            "| variant | loss ratio per seed | mean ratio | L2/moved (mean seeds) | zero-pt | floored % | max|u|/lr |"
        )
        print(head + "\n|---|---|---|---|---|---|---|")
    else:
        head = "| variant | max|dp| (max seeds) | mean|dp| (mean seeds) | max/moved (max seeds) | "
        head += "max/moved per seed | L2/moved (mean seeds) | zero-pt | floored % | max|u|/lr |"
        print(head + "\n|---|---|---|---|---|---|---|---|---|")
    for variant in VARIANTS:
        rows = results[variant.name]
        zp = sum(r["stats"].zero_points for r in rows)
        elems = sum(r["stats"].v_elems for r in rows)
        floored = 100.0 * sum(r["stats"].floored for r in rows) / elems if elems else 0.0
        fl = f"{floored:.2f}" if variant.v_map is not None else "-"
        zps = str(zp) if variant.v_map is not None else "-"
        max_u = max(r["stats"].max_u for r in rows)
        l2 = sum(r["l2rel"] for r in rows) / len(rows)
        if regression:
            ratios = " / ".join(f"{r['loss_ratio']:.4f}" for r in rows)
            mean_ratio = sum(r["loss_ratio"] for r in rows) / len(rows)
            print(f"| {variant.name} | {ratios} | {mean_ratio:.4f} | {l2:.3f} | {zps} | {fl} | {max_u:.3g} |")
        else:
            mx = max(r["max"] for r in rows)
            mean = sum(r["mean"] for r in rows) / len(rows)
            rel = max(r["rel"] for r in rows)
            rels = " / ".join(f"{r['rel']:.3f}" for r in rows)
            cells = [variant.name, f"{mx:.3e}", f"{mean:.3e}", f"{rel:.3f}", rels, f"{l2:.3f}", zps, fl, f"{max_u:.3g}"]
            print("| " + " | ".join(cells) + " |")
    if per_seed and not regression:
        for variant in VARIANTS:
            for i, r in enumerate(results[variant.name]):
                print(f"  {variant.name} seed#{i}: max {r['max']:.3e} mean {r['mean']:.3e} loss {r['loss']:.4g}")


def main() -> None:
    """Run all scenarios and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--per-seed", action="store_true", help="also print per-seed rows for scenarios 1-3")
    parser.add_argument(
        "--m-fp32", action="store_true", help="diagnostic: keep m in fp32 so that only v is quantized (V1-V4)"
    )
    parser.add_argument("--m-map", choices=sorted(M_MAPS), default="paper", help="the first moment's 4-bit map")
    args = parser.parse_args()
    M_MAP.copy_(M_MAPS[args.m_map])
    if args.m_fp32:
        VARIANTS[:] = [VARIANTS[0]] + [
            dataclasses.replace(v, name=v.name + " (m fp32)", quant_m=False) for v in VARIANTS if v.v_map is not None
        ]
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, seeds {args.seeds}, block {BLOCK}, lr {LR}, wd {WD}, betas {BETAS}, eps {EPS}, "
        f"m map {args.m_map}"
    )
    for name in args.scenarios:
        t0 = time.perf_counter()
        results = run_scenario(name, args.seeds)
        summarize(name, results, args.per_seed)
        print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
