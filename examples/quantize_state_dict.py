"""Store a model's weights in 8 or 4 bits with block-wise quantization and load them back.

    python examples/quantize_state_dict.py [--bits 8|4] [--blocksize 256]

Every floating-point tensor of the state dict becomes uint8 codes plus a QuantState; the file loads
with ``torch.load(weights_only=True)``. Prints bytes before/after and how much the outputs move.
"""

from __future__ import annotations

import argparse
import io

import torch
from torch import nn

from lowbit import functional as F


def compress(state: dict[str, torch.Tensor], bits: int, blocksize: int) -> dict[str, object]:
    """Quantize every floating-point tensor of ``state``; other entries are kept as they are."""
    code = F.create_dynamic_map(signed=True, total_bits=bits)
    return {
        name: F.quantize_blockwise(t, code=code, blocksize=blocksize) if t.is_floating_point() else t
        for name, t in state.items()
    }


def decompress(packed: dict[str, object]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`compress`."""
    return {name: F.dequantize_blockwise(*v) if isinstance(v, tuple) else v for name, v in packed.items()}


def main() -> None:
    """Build a small MLP, compress its weights, reload them and compare outputs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=8, choices=range(2, 9))
    parser.add_argument("--blocksize", type=int, default=256)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256))
    x = torch.randn(64, 256)
    before = model(x)

    raw, packed = io.BytesIO(), io.BytesIO()
    torch.save(model.state_dict(), raw)
    torch.save(compress(model.state_dict(), args.bits, args.blocksize), packed)
    packed.seek(0)
    model.load_state_dict(decompress(torch.load(packed, weights_only=True)))
    after = model(x)

    rel = ((after - before).norm() / before.norm()).item()
    print(f"state dict: {raw.tell():,} bytes fp32 -> {packed.tell():,} bytes at {args.bits} bits")
    print(f"relative output change: {rel:.2e}")


if __name__ == "__main__":
    main()
