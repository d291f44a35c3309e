"""CUDA against CPU: identical codes (stochastic rounding included) and values for the same seed.

Every device-parametrised test in the suite also runs on CUDA when a GPU is present; this file adds
the cross-device identity checks.
"""

from __future__ import annotations

import pytest
import torch

from lowbit import _ops
from lowbit import functional as F
from tests.conftest import DTYPES, HAS_CUDA, sample

if not HAS_CUDA:
    pytest.skip("needs a CUDA GPU and a CUDA build of lowbit", allow_module_level=True)


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("blocksize", [64, 256, 2048, 4096, 0])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("n", [1, 4097, 1 << 20])
def test_map_codes_identical_on_cpu_and_cuda(dtype, bits, blocksize, stochastic, n):
    x = sample("heavy", n, seed=n + bits, dtype=dtype)
    x[n // 2] = float("nan") if n > 1 else x[0]
    code = F.create_dynamic_map(total_bits=bits)
    cpu = _ops.quantize_blockwise(x, code, bits, blocksize, stochastic, 1234, 77)
    gpu = _ops.quantize_blockwise(x.cuda(), code.cuda(), bits, blocksize, stochastic, 1234, 77)
    _exact(cpu[0], gpu[0])
    _exact(cpu[1], gpu[1])
    y_cpu = _ops.dequantize_blockwise(*cpu, code, bits, blocksize, n, dtype)
    y_gpu = _ops.dequantize_blockwise(*gpu, code.cuda(), bits, blocksize, n, dtype)
    _exact(y_cpu, y_gpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 8, 10, 12, 16])
@pytest.mark.parametrize("blocksize", [64, 2048, 0])
@pytest.mark.parametrize("stochastic", [False, True])
def test_linear_codes_identical_on_cpu_and_cuda(dtype, bits, blocksize, stochastic):
    x = sample("normal", 100_003, seed=bits, dtype=dtype)
    cpu = _ops.quantize_linear(x, bits, blocksize, stochastic, 99, 0)
    gpu = _ops.quantize_linear(x.cuda(), bits, blocksize, stochastic, 99, 0)
    _exact(cpu[0], gpu[0])
    _exact(cpu[1], gpu[1])
    _exact(
        _ops.dequantize_linear(*cpu, bits, blocksize, x.numel(), dtype),
        _ops.dequantize_linear(*gpu, bits, blocksize, x.numel(), dtype),
    )


def test_unaligned_inputs_take_the_scalar_path():
    base = sample("normal", 10_001).cuda()
    x = base[1:]  # 4-byte offset: not 16-byte aligned
    code = F.create_dynamic_map().cuda()
    gpu = _ops.quantize_blockwise(x, code, 8, 256, True, 5, 0)
    cpu = _ops.quantize_blockwise(x.cpu(), code.cpu(), 8, 256, True, 5, 0)
    _exact(cpu[0], gpu[0])


def test_runs_on_the_current_stream_and_device():
    x = sample("normal", 1 << 16).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        codes, state = F.quantize_blockwise(x, blocksize=256)
        y = F.dequantize_blockwise(codes, state)
    s.synchronize()
    ref_codes, _ = F.quantize_blockwise(x.cpu(), blocksize=256)
    assert torch.equal(codes.cpu(), ref_codes) and y.device == x.device


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_identical_on_cpu_and_cuda(bits):
    codes = torch.randint(0, 2**bits, (100_001,), dtype=torch.uint8)
    packed = F.pack_bits(codes.cuda(), bits)
    _exact(packed, F.pack_bits(codes, bits))
    _exact(F.unpack_bits(packed, bits, codes.numel()), codes)


@pytest.mark.parametrize("name", ["Adam8bit", "AdamW8bit", "SGD8bit", "Lion8bit", "RMSprop8bit", "Adagrad8bit"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_steps_identical_on_cpu_and_cuda(name, dtype):
    import lowbit.optim as O

    kw = {"SGD8bit": {"lr": 1e-2, "momentum": 0.9}, "RMSprop8bit": {"momentum": 0.9}}.get(name, {})
    gen = torch.Generator().manual_seed(0)
    shapes = [(5000,), (100,), (64, 300), (4097,)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    o_cpu, o_gpu = getattr(O, name)(cpu, **kw), getattr(O, name)(gpu, **kw)
    for _ in range(5):
        for p, q in zip(cpu, gpu, strict=True):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            q.grad = p.grad.cuda()
        o_cpu.step()
        o_gpu.step()
    for p, q in zip(cpu, gpu, strict=True):
        _exact(p.detach(), q.detach())
        for key, value in o_cpu.state[p].items():
            _exact(value, o_gpu.state[q][key])


def test_optimizer_state_dict_moves_between_devices():
    import lowbit.optim as O

    p = torch.nn.Parameter(torch.randn(10_000))
    opt = O.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    q = torch.nn.Parameter(p.detach().cuda())
    opt_gpu = O.AdamW8bit([q])
    opt_gpu.load_state_dict(opt.state_dict())
    assert opt_gpu.state[q]["state1"].device == q.device and opt_gpu.state[q]["state1"].dtype == torch.uint8
    g = torch.randn_like(p)
    p.grad, q.grad = g, g.cuda()
    opt.step()
    opt_gpu.step()
    _exact(p.detach(), q.detach())
