"""torch.library integration: opcheck for every op, fake kernels, torch.compile tracing."""

from __future__ import annotations

import pytest
import torch

from lowbit import functional as F
from tests.conftest import sample

ops = torch.ops.lowbit


def _cases(device: str) -> list[tuple[object, tuple]]:
    x = sample("normal", 1000, seed=1, device=device)
    xb = sample("heavy", 777, seed=2, dtype=torch.bfloat16, device=device)
    code8 = F.create_dynamic_map().to(device)
    code3 = F.create_dynamic_map(total_bits=3).to(device)
    p8, a8 = ops.quantize_blockwise(x, code8, 8, 256, False, 0, 0)
    p3, a3 = ops.quantize_blockwise(xb, code3, 3, 0, True, 5, 9)
    pl, al = ops.quantize_linear(x, 12, 64, True, 3, 0)
    codes = torch.randint(0, 8, (1001,), dtype=torch.uint8, device=device)
    return [
        (ops.quantize_blockwise.default, (x, code8, 8, 256, False, 0, 0)),
        (ops.quantize_blockwise.default, (xb, code3, 3, 0, True, 5, 9)),
        (ops.dequantize_blockwise.default, (p8, a8, code8, 8, 256, 1000, torch.float32)),
        (ops.dequantize_blockwise.default, (p3, a3, code3, 3, 0, 777, torch.bfloat16)),
        (ops.quantize_linear.default, (x, 12, 64, True, 3, 0)),
        (ops.quantize_linear.default, (xb, 8, 4096, False, 0, 0)),
        (ops.dequantize_linear.default, (pl, al, 12, 64, 1000, torch.float16)),
        (ops.pack_bits.default, (codes, 3)),
        (ops.unpack_bits.default, (ops.pack_bits(codes, 3), 3, 1001)),
    ]


@pytest.mark.parametrize("case", range(9))
def test_opcheck(device, case):
    op, args = _cases(device)[case]
    torch.library.opcheck(op, args)


def test_fake_kernels_report_output_sizes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(10007)
        code = torch.empty(16)
        packed, absmax = ops.quantize_blockwise(x, code, 4, 512, False, 0, 0)
        assert packed.shape == (5004,) and absmax.shape == (20,)
        packed, absmax = ops.quantize_linear(x, 12, 0, True, 0, 0)
        assert packed.shape == (15011,) and absmax.shape == (1,)
        out = ops.dequantize_linear(packed, absmax, 12, 0, 10007, torch.bfloat16)
        assert out.shape == (10007,) and out.dtype == torch.bfloat16


def test_torch_compile_traces_through_ops_with_dynamic_shapes():
    code = F.create_dynamic_map()

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        packed, absmax = ops.quantize_blockwise(x, code, 8, 256, True, 7, 0)
        y = ops.dequantize_blockwise(packed, absmax, code, 8, 256, x.numel(), x.dtype)
        lp, la = ops.quantize_linear(y, 10, 256, False, 0, 0)
        return ops.dequantize_linear(lp, la, 10, 256, x.numel(), x.dtype) * 2

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (1000, 3001):
        x = sample("normal", n, seed=n)
        assert torch.equal(compiled(x), roundtrip(x))
