"""CUDA against CPU: identical codes (stochastic rounding included) and values for the same seed.

Every device-parametrised test in the suite also runs on CUDA when a GPU is present; this file adds
the cross-device identity checks.
"""

from __future__ import annotations

import pytest
import torch

from lowbit import _C, _ops, _reference
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


@pytest.mark.parametrize("bits", [8, 12])
@pytest.mark.parametrize("blocksize", [256, 0])
def test_linear_twin_identical_on_cpu_and_cuda(bits, blocksize):
    # `python -m lowbit` checks CUDA results against the twin run on CUDA; torch's CUDA division by a Python
    # number multiplies by the reciprocal, which once put 9% of the twin's dequantized values one ulp off.
    x = sample("normal", 5003, seed=bits)
    cpu = _reference.quantize_linear(x, bits, blocksize, False, 99, 0)
    gpu = _reference.quantize_linear(x.cuda(), bits, blocksize, False, 99, 0)
    _exact(cpu[0], gpu[0])
    _exact(
        _reference.dequantize_linear(*cpu, bits, blocksize, x.numel(), torch.float32),
        _reference.dequantize_linear(*gpu, bits, blocksize, x.numel(), torch.float32),
    )
    _exact(
        _ops.dequantize_linear(*gpu, bits, blocksize, x.numel(), torch.float32),
        _reference.dequantize_linear(*gpu, bits, blocksize, x.numel(), torch.float32),
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


@pytest.mark.parametrize(
    "name",
    [
        "Adam8bit",
        "AdamW8bit",
        "SGD8bit",
        "Lion8bit",
        "RMSprop8bit",
        "Adagrad8bit",
        "AdamW4bit",
        "SGD4bit",
        "AdEMAMix8bit",
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_steps_identical_on_cpu_and_cuda(name, dtype):
    import lowbit.optim as O

    kw = {"SGD8bit": {"lr": 1e-2, "momentum": 0.9}, "SGD4bit": {"lr": 1e-2, "momentum": 0.9}}.get(name, {})
    kw = {"RMSprop8bit": {"momentum": 0.9}, "AdEMAMix8bit": {"t_alpha": 3, "t_beta3": 3}}.get(name, kw)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8, 12, 16])
@pytest.mark.parametrize("group", [64, 128, 2048, 4096])
@pytest.mark.parametrize("stochastic", [False, True])
def test_lpmm_accumulate_identical_on_cpu_and_cuda(dtype, bits, group, stochastic):
    n = 70_001
    codes, absmax = _ops.quantize_linear(sample("heavy", n, seed=bits), bits, group, False, 0, 0)
    grad = sample("normal", n, seed=group, dtype=dtype)
    gc, ga = codes.cuda(), absmax.cuda()
    _ops.lpmm_accumulate_(grad, codes, absmax, bits, group, stochastic, 99)
    _ops.lpmm_accumulate_(grad.cuda(), gc, ga, bits, group, stochastic, 99)
    _exact(codes, gc)
    _exact(absmax, ga)


def _lpmm_step_identical(sizes: list[int], **kw: int) -> None:
    """One lowbit::lpmm_step_ on tensors of ``sizes`` (tests/test_lpmm_ops.py's ``_step_args(sizes, **kw)``)
    on the CPU and on CUDA: afterwards its eight lists of codes and absmax (parameters, gradients, states)
    must agree bit for bit."""
    from tests.test_lpmm_ops import _step_args

    cpu = _step_args(sizes, **kw)
    gpu = _step_args(sizes, device="cuda", **kw)
    _ops.lpmm_step_(*cpu)
    _ops.lpmm_step_(*gpu)
    for a, b in zip(cpu[:8], gpu[:8], strict=True):
        for x, y in zip(a, b, strict=True):
            _exact(x, y)


@pytest.mark.parametrize("rule,n_states", [(1, 1), (1, 0), (0, 2)])
@pytest.mark.parametrize("bits", [(12, 8, 8), (16, 4, 4), (5, 13, 6)])
@pytest.mark.parametrize("group", [64, 256, 2048, 4096])
def test_lpmm_step_identical_on_cpu_and_cuda(rule, n_states, bits, group):
    pb, gb, sb = bits
    kw = dict(rule=rule, param_bits=pb, grad_bits=gb, state_bits=sb, group=group, n_states=n_states, seed=5)
    _lpmm_step_identical([1, 4095, 4097, 300_000], **kw)


def test_lpmm_training_identical_on_cpu_and_cuda():
    import torch.nn.functional as nnf

    import lowbit.lpmm as lpmm
    from lowbit.optim import LPMMSGD

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(30, 500), torch.nn.ReLU(), torch.nn.Linear(500, 7))  # noqa: E731
    models, opts = [], []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(3)
        model = lpmm.convert(make().to(device), group_size=256, generator=gen)
        models.append(model)
        opts.append(LPMMSGD(model.parameters(), lr=0.05, generator=gen))
    x, y = torch.randn(16, 30), torch.randint(0, 7, (16,))
    for _ in range(3):
        for model, opt in zip(models, opts, strict=True):
            dev = next(iter(lpmm.low_precision_parameters(model).values())).device
            nnf.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
    a, b = (lpmm.low_precision_parameters(m) for m in models)
    for name in a:
        # Matmuls differ between devices in the last bits, so codes may differ by one step.
        diff = (a[name].dequantize() - b[name].dequantize().cpu()).abs().max()
        assert float(diff) <= 2 * float(a[name].absmax.max()) / 2047, name


def _launch_args() -> tuple[int, int]:
    device = torch.cuda.current_device()
    return device, torch.cuda.current_stream(device).cuda_stream


# Every CUDA launcher with no elements: each must return before launching (a grid of 0 blocks is a
# CUDA error). The ops skip empty tensors before reaching _C, so these call _C directly with null pointers.
EMPTY_LAUNCHES = {
    "quantize": lambda d, s: _C.quantize_cuda(0, 0, 0, 0, 0, 8, 256, False, 0, 0, 0, 0, d, s),
    "quantize tensor-wise": lambda d, s: _C.quantize_cuda(0, 0, 0, 0, 0, 8, 0, True, 0, 0, 0, 0, d, s),
    "dequantize": lambda d, s: _C.dequantize_cuda(0, 0, 0, 0, 0, 8, 256, 0, 0, d, s),
    "pack_bits": lambda d, s: _C.pack_bits_cuda(0, 0, 0, 3, d, s),
    "unpack_bits": lambda d, s: _C.unpack_bits_cuda(0, 0, 0, 3, d, s),
    "fewbit_encode": lambda d, s: _C.fewbit_encode_cuda(0, 0, 0, 0, 3, 0, d, s),
    "fewbit_grad": lambda d, s: _C.fewbit_grad_cuda(0, 0, 0, 0, 0, 3, 0, d, s),
    "invact_grad": lambda d, s: _C.invact_grad_cuda(0, 0, 0, 0, 0, 0, 0, 0, d, s),
    "blpa_encode": lambda d, s: _C.blpa_encode_cuda([0] * 13, 0, 4, 1, 0, 4, 1, d, s),
    "blpa_decode": lambda d, s: _C.blpa_decode_cuda([0] * 13, 0, 4, 1, 0, 4, 1, d, s),
    "blpa_backward": lambda d, s: _C.blpa_backward_cuda([0] * 13, 0, 4, 1, 0, 4, 1, d, s),
    "lpmm_accumulate": lambda d, s: _C.lpmm_accumulate_cuda(0, 0, 0, 0, 0, 8, 256, False, 0, d, s),
}


@pytest.mark.parametrize("name", sorted(EMPTY_LAUNCHES))
def test_empty_launch_returns_without_launching(name):
    device, stream = _launch_args()
    EMPTY_LAUNCHES[name](device, stream)
    torch.cuda.synchronize(device)


@pytest.mark.parametrize("name", ["Adam8bit", "AdamW8bit", "LAMB8bit", "AdamW32bit"])
def test_empty_parameters_step_on_cuda(name):
    # An empty parameter contributes no blocks: the optimizer launcher gets total_blocks == 0 when it is
    # the only one, and a block count without it when it sits beside a non-empty one.
    import lowbit.optim as O

    for shapes in ([(0,)], [(0,), (4096,), (0, 7)]):
        cpu = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
        o_cpu, o_gpu = getattr(O, name)(cpu), getattr(O, name)(gpu)
        for p, q in zip(cpu, gpu, strict=True):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.cuda()
        o_cpu.step()
        o_gpu.step()
        for p, q in zip(cpu, gpu, strict=True):
            _exact(p.detach(), q.detach())


def test_empty_lpmm_step_on_cuda():
    _lpmm_step_identical([0, 300], rule=1, param_bits=12, grad_bits=8, state_bits=8, group=256, n_states=1, seed=5)


def test_empty_tensors_through_the_ops_on_cuda():
    x = torch.empty(0, device="cuda")
    codes, state = F.quantize_blockwise(x, blocksize=256)
    assert codes.numel() == 0 and F.dequantize_blockwise(codes, state).numel() == 0
    assert F.unpack_bits(F.pack_bits(torch.empty(0, dtype=torch.uint8, device="cuda"), 3), 3, 0).numel() == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("current,other", [(0, 1), (1, 0)])
def test_launchers_restore_the_current_device(current, other):
    x = sample("normal", 10_000).to(f"cuda:{other}")
    with torch.cuda.device(current):
        codes, state = F.quantize_blockwise(x, blocksize=256)
        assert torch.cuda.current_device() == current
        y = F.dequantize_blockwise(codes, state)
        assert torch.cuda.current_device() == current
        p = torch.nn.Parameter(x.clone())
        p.grad = torch.ones_like(p)
        import lowbit.optim as O

        O.AdamW8bit([p]).step()
        assert torch.cuda.current_device() == current
    assert y.device == x.device
    _exact(codes, F.quantize_blockwise(x.cpu(), blocksize=256)[0])
