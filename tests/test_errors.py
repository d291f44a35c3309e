"""Bad input gets a clear TypeError/ValueError naming the argument; nothing is silently ignored."""

from __future__ import annotations

import pytest
import torch

from lowbit import _C, _ops
from lowbit import functional as F
from lowbit._ops import _common, quantize


def x() -> torch.Tensor:
    return torch.randn(1000)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: F.quantize_blockwise([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda: F.quantize_blockwise(torch.arange(10)), TypeError, "x has dtype torch.int64"),
        (lambda: F.quantize_blockwise(torch.randn(4, dtype=torch.float64)), TypeError, "x has dtype torch.float64"),
        (lambda: F.quantize_blockwise(torch.randn(4, device="meta")), ValueError, "only cpu and cuda"),
        (lambda: F.quantize_blockwise(x(), blocksize=100), ValueError, "blocksize must be a power of two"),
        (lambda: F.quantize_blockwise(x(), blocksize=8192), ValueError, "blocksize"),
        (lambda: F.quantize_blockwise(x(), blocksize=32), ValueError, "blocksize"),
        (lambda: F.quantize_blockwise(x(), blocksize=256.0), TypeError, "blocksize must be an int"),
        (lambda: F.quantize_blockwise(x(), blocksize=True), TypeError, "blocksize must be an int"),
        (lambda: F.quantize_blockwise(x(), rounding="up"), ValueError, "rounding must be"),
        (lambda: F.quantize_blockwise(x(), generator=torch.Generator()), ValueError, "generator is only used"),
        (lambda: F.quantize_blockwise(x(), rounding="stochastic", generator=1), TypeError, "generator must be"),
        (lambda: F.quantize_blockwise(x(), code=torch.linspace(-1, 1, 100)), ValueError, "code must have 2"),
        (lambda: F.quantize_blockwise(x(), code=torch.linspace(-1, 1, 16).flip(0)), ValueError, "sorted"),
        (lambda: F.quantize_blockwise(x(), code=torch.linspace(-2, 2, 16)), ValueError, r"within \[-1, 1\]"),
        (lambda: F.quantize_blockwise(x(), code=torch.linspace(-1, 1, 16).double()), TypeError, "float32"),
        (
            lambda: F.quantize_blockwise(x(), code=torch.linspace(-1, 1, 16, device="meta")),
            ValueError,
            "code is on meta but x is on cpu",
        ),
        (lambda: F.quantize_linear(x(), bits=1), ValueError, "bits must be in 2..16"),
        (lambda: F.quantize_linear(x(), bits=17), ValueError, "bits must be in 2..16"),
        (lambda: F.quantize_linear(x(), bits=8.0), TypeError, "bits must be an int"),
    ],
)
def test_bad_quantize_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_codes_state_mismatch():
    codes, state = F.quantize_blockwise(x(), blocksize=256)
    with pytest.raises(ValueError, match="codes has 999 bytes but 1000 elements|codes has 999 bytes"):
        F.dequantize_blockwise(codes[:999], state)
    with pytest.raises(TypeError, match="codes must have dtype uint8"):
        F.dequantize_blockwise(codes.int(), state)
    with pytest.raises(TypeError, match="state must be a QuantState"):
        F.dequantize_blockwise(codes, None)
    lcodes, lstate = F.quantize_linear(x(), bits=8)
    with pytest.raises(TypeError, match="state must be a LinearQuantState"):
        F.dequantize_linear(lcodes, state)
    with pytest.raises(TypeError, match="state must be a QuantState"):
        F.dequantize_blockwise(lcodes, lstate)
    bad = F.QuantState(state.absmax[:2], state.code, 256, state.shape, state.dtype, 8)
    with pytest.raises(ValueError, match="absmax has 2 entries but 1000 elements need 4"):
        F.dequantize_blockwise(codes, bad)
    meta = F.QuantState(state.absmax.to("meta"), state.code, 256, state.shape, state.dtype, 8)
    with pytest.raises(ValueError, match="absmax is on meta but codes is on cpu"):
        F.dequantize_blockwise(codes, meta)


def test_ops_validate_their_own_inputs():
    code = F.create_dynamic_map()
    with pytest.raises(ValueError, match="x must be contiguous"):
        torch.ops.lowbit.quantize_blockwise(torch.randn(8, 8).t(), code, 8, 64, False, 0, 0)
    with pytest.raises(ValueError, match="code must be 1-D with 2\\*\\*bits = 16 entries"):
        torch.ops.lowbit.quantize_blockwise(torch.randn(8), code, 4, 64, False, 0, 0)
    with pytest.raises(ValueError, match="seed must be in"):
        torch.ops.lowbit.quantize_linear(torch.randn(8), 8, 64, True, -1, 0)
    with pytest.raises(ValueError, match="dtype must be"):
        torch.ops.lowbit.dequantize_linear(torch.zeros(8, dtype=torch.uint8), torch.ones(1), 8, 64, 8, torch.int32)


def test_cuda_tensor_on_a_cpu_only_build_says_how_to_rebuild(monkeypatch):
    monkeypatch.setattr(_C, "cuda_built", lambda: False)
    with pytest.raises(RuntimeError, match="built without CUDA.*LOWBIT_CUDA=ON pip install"):
        _common.launch(quantize._QUANTIZE, torch.device("cuda", 0))


def test_dtensor_misuse_raises_instead_of_crashing(tmp_path):
    # A DTensor has no storage of its own (data_ptr() is 0): passing it to a native loop would crash.
    # The optimizers step its local shard (tests/test_distributed.py); what cannot take one raises.
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import lowbit.lpmm
    import lowbit.optim

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(64, 80), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(64, 80), mesh, [Shard(0)])
        layer = torch.nn.Linear(80, 64)
        layer.weight = p
        # LPMM shards its own storage: convert before fully_shard (tests/test_lpmm_fsdp.py).
        with pytest.raises(TypeError, match="'weight' of .* is a DTensor: convert the model before fully_shard"):
            lowbit.lpmm.convert(layer)
        with pytest.raises(TypeError, match="is an ordinary tensor"):
            lowbit.optim.LPMMSGD([p])
        # The eager step bypasses the dispatcher (and DTensor's own refusal of unknown ops).
        code = F.create_dynamic_map()
        hyper = [1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.0, 1.0, 0.0, 0.0, 0.0]
        with pytest.raises(TypeError, match=r"params\[0\] is a DTensor"):
            _ops.optimizer_step_eager(
                _ops.StepArgs(
                    [p.detach()],
                    [p.grad],
                    [],
                    [],
                    [],
                    [],
                    [],
                    [],
                    [1e-3, 1.0, 1.0],
                    None,
                    code,
                    code,
                    code,
                    1,
                    hyper,
                    0,
                    0,
                    0,
                    256,
                )
            )
    finally:
        dist.destroy_process_group()
