"""The CUDA kernels of csrc/cuda, run on the host, against the CPU kernels: the same bits.

lowbit._C_cuda_emu holds the CUDA sources compiled by the host compiler against an emulation of the CUDA
execution model (include/lowbit/cuda_host.h; CMake option LOWBIT_CUDA_EMULATION): each block's threads
run as fibers, so barriers, warp shuffles, partial blocks and grid-stride loops behave as on a GPU. Every
test runs lowbit's ops on CPU tensors twice: with lowbit._C's CPU loops, and with the emulated CUDA
launchers called exactly as lowbit/_ops calls them for a GPU (its argument lists, then device 0 and
stream 0). Emulated threads are slow, so sizes stay small; they still end in partial blocks and warps.

Launchers (csrc/cuda) and the tests that run them:
- quantize.cu: quantize, dequantize: test_map_quantization, test_linear_quantization,
  test_unaligned_input; pack_bits, unpack_bits: test_packing
- fewbit.cu: fewbit_encode, fewbit_grad: test_fewbit
- invact.cu: invact_grad: test_invact_grad
- blpa.cu: blpa_encode, blpa_decode, blpa_backward: test_blpa, test_blpa_backward_sum_order (inputs
  over several chunks of the backward sums, with cancelling gradients of mixed magnitudes)
- optim.cu: optimizer_step: test_optimizer_step (every rule, 8-bit and 32-bit states, fp32/fp16/bf16
  parameters, uneven tensors in one call; LAMB, LARS and max_unorm run the norm pre-pass kernels),
  test_optimizer_norms_then_step_with_update_scales (its norm_sums and update_scales entries),
  test_norm_sums_in_the_shared_order (include/lowbit/norm_order.h: passes of a thread block, lanes of a
  tensor's block sums); its rank-1 statistics pass (stats_only, include/lowbit/rank1.h) and the step that
  encodes against it: test_optimizer_step's 4-bit cases with min_4bit_size=0 and rank1_normalization=True (the (64, 7)
  matrix and the (2, 3, 50) tensor, whose second moments are normalised rank-1; Adam, RMSprop's slot 0, LAMB,
  AdEMAMix); its factorized second moments (include/lowbit/factored.h: the row, column and mean passes and the
  factored blocks of the step): test_optimizer_step's cases with factored=True (AdamW, and Adam with coupled
  decay and maximize: the (64, 7) matrix and the (2, 3, 50) tensor, in one call with block-wise tensors) and
  test_factored_step_over_several_row_blocks (columns over several blocks of 64 rows); stochastic rounding of the
  states (rounding="stochastic"): test_optimizer_step's cases with that option (4-bit block-wise and rank-1, 8-bit
  with AMSGrad's third state, SGD's one state)
- lpmm.cu: lpmm_accumulate: test_lpmm_accumulate; lpmm_step: test_lpmm_step,
  test_lpmm_step_blocks_of_several_groups (small groups sharing a thread block)
- muon.cu: muon_momentum: test_muon_momentum (8-bit buffers at block sizes 64..4096 and fp32 buffers,
  fp32/fp16/bf16 gradients, Nesterov on and off, a non-finite gradient), test_muon8bit_steps (Muon8bit's
  step through the launcher)
- every launcher with no elements: test_empty_launches
Not covered yet: nothing of csrc/cuda; what the emulation cannot show (races between blocks, stream order,
occupancy) needs a GPU. Build the module as .ci/run does; LOWBIT_CUDA_EMULATION_SANITIZE=ON adds
AddressSanitizer and UBSan (run with LD_PRELOAD=$(gcc -print-file-name=libasan.so)), and .ci/run runs
this file a second time so.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from lowbit import _C, _ops
from lowbit import functional as F
from tests.conftest import DTYPES, sample

emu = pytest.importorskip("lowbit._C_cuda_emu", reason="built only with the CMake option LOWBIT_CUDA_EMULATION=ON")

SIZES = [1, 255, 257, 4095, 4097]
_OP_MODULES = [
    importlib.import_module(f"lowbit._ops.{name}")
    for name in ("quantize", "fewbit", "invact", "blpa", "optim", "lpmm", "muon")
]


def _emulated_launch(kernel: _ops._common.Kernel, device: torch.device) -> Callable[..., None]:
    """lowbit/_ops/_common.launch for a GPU, with the emulated CUDA launcher of ``kernel`` and CPU tensors."""
    assert device.type == "cpu"
    launcher = getattr(emu, kernel.cpu.__name__.removesuffix("_cpu") + "_cuda")
    return lambda *args: launcher(*args, 0, 0)


def _flat(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for item in out:
            yield from _flat(item)
    elif isinstance(out, dict):
        for key in sorted(out):
            yield from _flat(out[key])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _on_both(run: Callable[[], Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors ``run()`` returns with the CPU kernels, and with the emulated CUDA kernels."""
    cpu = list(_flat(run()))
    with pytest.MonkeyPatch.context() as patch:
        for module in _OP_MODULES:
            patch.setattr(module, "launch", _emulated_launch)
        cuda = list(_flat(run()))
    assert len(cpu) == len(cuda)
    return cpu, cuda


def _identical(run: Callable[[], Any]) -> None:
    """``run()`` gives the same bits with the CPU kernels and with the emulated CUDA kernels."""
    cpu, cuda = _on_both(run)
    for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(_bits(a), _bits(b)), f"output {i} differs in {int((_bits(a) != _bits(b)).sum())} bytes"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 3])
@pytest.mark.parametrize("blocksize", [64, 256, 4096, 0])
@pytest.mark.parametrize("stochastic", [False, True])
def test_map_quantization(dtype, bits, blocksize, stochastic):
    code = F.create_dynamic_map(total_bits=bits)

    def run() -> list:
        out = []
        for n in SIZES:
            x = sample("heavy", n, seed=n + bits, dtype=dtype)
            x[n // 2] = float("nan") if n > 1 else x[0]
            q = _ops.quantize_blockwise(x, code, bits, blocksize, stochastic, 1234, 77)
            out += [q, _ops.dequantize_blockwise(*q, code, bits, blocksize, n, dtype)]
        return out

    _identical(run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 8, 16])
@pytest.mark.parametrize("blocksize", [64, 2048, 0])
@pytest.mark.parametrize("stochastic", [False, True])
def test_linear_quantization(dtype, bits, blocksize, stochastic):
    def run() -> list:
        out = []
        for n in SIZES:
            x = sample("normal", n, seed=bits, dtype=dtype)
            q = _ops.quantize_linear(x, bits, blocksize, stochastic, 99, 5)
            out += [q, _ops.dequantize_linear(*q, bits, blocksize, n, dtype)]
        return out

    _identical(run)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_input(dtype):
    # One element past a 16-byte boundary: the kernels' scalar path instead of their vector loads.
    code = F.create_dynamic_map()

    def run() -> list:
        x = sample("normal", 4097, seed=3, dtype=dtype)[1:]
        q = _ops.quantize_blockwise(x, code, 8, 256, True, 5, 0)
        codes = torch.empty(q[0].numel() + 1, dtype=torch.uint8)[1:]
        codes.copy_(q[0])
        return [q, _ops.dequantize_blockwise(codes, q[1], code, 8, 256, x.numel(), dtype)]

    _identical(run)


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing(bits):
    def run() -> list:
        out = []
        for n in SIZES:
            codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
            packed = _ops.pack_bits(codes, bits)
            out += [packed, _ops.unpack_bits(packed, bits, n)]
        return out

    _identical(run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_fewbit(dtype, bits):
    def run() -> list:
        out = []
        for n in SIZES:
            g = torch.Generator().manual_seed(n + bits)
            bounds = torch.sort(torch.randn(2**bits - 1, generator=g) * 2).values
            x = (sample("heavy", n, seed=n) * 0.3).to(dtype)
            x[: min(n, 3)] = float("nan")
            packed = _ops.fewbit_encode(x, bounds, bits)
            levels = torch.randn(2**bits, generator=g)
            grad = torch.randn(n, generator=g).to(dtype)
            out += [packed, _ops.fewbit_grad(grad, packed, levels, bits)]
        return out

    _identical(run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_invact_grad(dtype, name):
    from lowbit.nn import fewbit, invact

    tab = invact.table(name)

    def run() -> list:
        out = []
        for n in SIZES:
            g = torch.Generator().manual_seed(n)
            x = torch.randn(n, generator=g) * 4
            y = fewbit.activation_fn(name)(x).to(dtype)
            bits = _ops.fewbit_encode(x, tab.threshold_tensor, 1)
            grad = torch.randn(n, generator=g).to(dtype)
            out.append(_ops.invact_grad(grad, y, bits, tab.coeffs, tab.params))
        return out

    _identical(run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("shape", [(5, 3), (64, 12), (3, 5, 7, 9)])
def test_blpa(dtype, bits, shape):
    _blpa_identical(dtype, bits, shape, lambda a2, g: torch.randn(a2.shape, generator=g))


def _blpa_identical(
    dtype: torch.dtype, bits: int, shape: tuple[int, ...], draw: Callable[[torch.Tensor, torch.Generator], torch.Tensor]
) -> None:
    """Encode, decode and both backward modes of one BatchNorm -> ReLU block give the same bits on CPU and
    emulated CUDA; ``draw(a2, generator)`` gives the upstream gradient in fp32 (clamped to fp16's range
    for fp16)."""
    from lowbit.nn import blpa

    c = shape[1]
    g = torch.Generator().manual_seed(bits + len(shape))
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype)
    gamma, beta = torch.randn(c, generator=g), torch.randn(c, generator=g)
    dims = [0] + list(range(2, len(shape)))
    view = (1, -1) + (1,) * (len(shape) - 2)
    a2 = (x.float() * gamma.reshape(view) + beta.reshape(view)).to(dtype)
    var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
    invstd = torch.rsqrt(var + 1e-5)
    grid = blpa._grid(gamma, beta, bits, None)
    grad = draw(a2, g)
    if dtype == torch.float16:
        grad = grad.clamp(-6e4, 6e4)
    grad = grad.to(dtype)
    ops = torch.ops.lowbit

    def codes() -> list:
        packed = ops.blpa_encode(x, a2, mean, invstd, grid, bits)
        return [packed, ops.blpa_decode(packed, grid, gamma, beta, list(shape), bits, dtype)]

    _identical(codes)

    def backward() -> list:
        packed = ops.blpa_encode(x, a2, mean, invstd, grid, bits)
        return [ops.blpa_backward(packed, grad, grid, gamma, beta, invstd, bits, stats) for stats in (True, False)]

    _identical(backward)


def _cancelling(a2: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """N(0, 1) gradients, and opposite pairs +X, -X of magnitudes up to about 1e12 at rows 2k and 2k + 1 (the
    same channel and position) where both ReLU masks are set: a channel's masked sum is small next to its
    partial sums, so its rounding shows the order of the additions (the pairs stay exact in every dtype)."""
    small = torch.randn(a2.shape, generator=generator)
    big = torch.zeros(a2.shape)
    rows = a2.shape[0] // 2 * 2
    magnitude = torch.exp(28 * torch.rand(big[0:rows:2].shape, generator=generator))
    sign = torch.randint(0, 2, magnitude.shape, generator=generator) * 2 - 1
    pair = magnitude * sign * ((a2[0:rows:2] > 0) & (a2[1:rows:2] > 0))
    big[0:rows:2], big[1:rows:2] = pair, -pair
    return torch.where(big != 0, big, small)


# Shapes bigger than one chunk of the backward sums (kBlpaSumChunk = 4096 elements, lowbit/blpa.h): inner = 1
# with many runs of every channel in a chunk and a chunk boundary inside a row, or one run a chunk; runs that
# cross chunk boundaries, two runs of a channel in one chunk, a run over several chunks; and more than 256
# chunks of a channel (the CUDA block's threads), in both ways blpa.cu hands them out.
_BLPA_ORDER_SHAPES = [
    (5000, 1),
    (3000, 3),
    (3, 5000),
    (4, 2, 30, 40),
    (3, 2, 60, 50),
    (2, 1, 100, 100),
    (1050000, 1),
    (130, 2, 3000),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", _BLPA_ORDER_SHAPES)
def test_blpa_backward_sum_order(dtype, shape):
    _blpa_identical(dtype, 8, shape, _cancelling)


_OPTIMIZERS = [
    ("Adam8bit", {}),
    ("Adam8bit", {"max_unorm": 0.02}),
    ("AdamW8bit", {"weight_decay": 0.1}),
    ("SGD8bit", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    ("Lion8bit", {}),
    ("RMSprop8bit", {"momentum": 0.9, "centered": True}),
    ("Adagrad8bit", {}),
    ("LAMB8bit", {}),
    ("LARS8bit", {}),
    ("AdamW4bit", {"weight_decay": 0.1}),
    ("AdamW4bit", {"weight_decay": 0.1, "min_4bit_size": 0, "rank1_normalization": True}),
    ("AdamW4bit", {"weight_decay": 0.1, "min_4bit_size": 0, "factored": True}),
    ("Adam4bit", {"weight_decay": 0.1, "min_4bit_size": 0, "factored": True, "maximize": True}),
    ("RMSprop", {"optim_bits": 4, "min_4bit_size": 0, "momentum": 0.9, "rank1_normalization": True}),
    ("Adam4bit", {"max_unorm": 0.02, "amsgrad": True}),
    ("SGD4bit", {"lr": 1e-2, "momentum": 0.9}),
    ("LAMB", {"optim_bits": 4, "min_4bit_size": 0}),
    ("LAMB", {"optim_bits": 4, "min_4bit_size": 0, "rank1_normalization": True}),
    ("Adam32bit", {"amsgrad": True}),
    ("AdamW32bit", {}),
    ("LAMB32bit", {}),
    ("RMSprop32bit", {}),
    ("AdEMAMix8bit", {"t_alpha": 2, "t_beta3": 2}),
    ("AdEMAMix", {"optim_bits": 4, "min_4bit_size": 0, "max_unorm": 0.02}),
    ("AdEMAMix", {"optim_bits": 4, "min_4bit_size": 0, "max_unorm": 0.02, "rank1_normalization": True}),
    ("AdEMAMix32bit", {}),
    # Stochastic rounding of the states (include/lowbit/state_rounding.h): the same draws and codes.
    ("AdamW4bit", {"weight_decay": 0.1, "rounding": "stochastic"}),
    ("AdamW4bit", {"min_4bit_size": 0, "rank1_normalization": True, "rounding": "stochastic"}),
    ("Adam8bit", {"amsgrad": True, "rounding": "stochastic"}),
    ("SGD4bit", {"lr": 1e-2, "momentum": 0.9, "rounding": "stochastic"}),
]


def _three_steps(
    name: str, options: dict, shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int
) -> Callable[[], list]:
    """A run for _identical: three steps of lowbit.optim's ``name`` over parameters of ``shapes`` in one fused call,
    from fixed seeds (the same rounding_seed in both runs)."""
    import lowbit.optim as O

    def run() -> list:
        gen = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        with torch.random.fork_rng():
            torch.manual_seed(0)
            opt = getattr(O, name)(params, **options)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            opt.step()
        return [params, [opt.state[p] for p in params]]

    return run


@pytest.mark.parametrize("name,options", _OPTIMIZERS, ids=[f"{n}-{sorted(o)}" for n, o in _OPTIMIZERS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_step(name, options, dtype):
    # Uneven tensors in one fused call: partial last blocks, a single element, more than one block.
    _identical(_three_steps(name, options, [(300,), (1,), (64, 7), (4097,), (2, 3, 50)], dtype, 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_factored_step_over_several_row_blocks(dtype):
    """Factorized second moments whose columns span several of factored.h's blocks of 64 rows (130 rows: 64 + 64
    + 2; 70 rows per slice of a 3-axis tensor) and whose rows end in partial lanes (33 and 5 columns), next to a
    block-wise vector in the same call: the emulated row, column and mean passes equal the CPU's."""
    options = {"weight_decay": 0.1, "min_4bit_size": 0, "factored": True}
    _identical(_three_steps("Adam4bit", options, [(130, 33), (2, 70, 5), (300,)], dtype, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_factored_step_with_given_factors(dtype):
    """A call whose factorized tensors have their factors given (kFacGiven: a sharded matrix's, computed in Python,
    lowbit/optim/factored.py) beside one whose factors the step updates and a block-wise vector: the emulated
    kernels skip the given tensor's row, column and mean passes and read its factors and mean, as the CPU loops."""
    from lowbit.optim.factored import row_mean
    from lowbit.optim.state_storage import optimizer_state_map

    def run() -> list:
        gen = torch.Generator().manual_seed(2)
        shapes = [(130, 33), (2, 70, 5), (300,)]
        params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        codes = [torch.zeros((p.numel() + 1) // 2, dtype=torch.uint8) for p in params]
        blocks = [torch.zeros(_ops.num_blocks(p.numel(), 128)) for p in params]
        row, col = torch.rand(130, generator=gen), torch.rand(33, generator=gen)
        factors = torch.cat([row, col, row_mean(row), torch.rand(140 + 10, generator=gen)])
        maps = [optimizer_state_map(s, torch.device("cpu"), 4) for s in (True, False, False)]
        hyper = _ops.StepHyper.with_betas(1e-2, (0.9, 0.999), eps=1e-8, weight_decay=0.1, decay=1 - 1e-3)
        args = _ops.StepArgs(
            params=params,
            grads=grads,
            state1=codes,
            state2=[codes[0][:0], codes[1][:0], codes[2].clone()],
            state3=[],
            absmax1=blocks,
            absmax2=[torch.empty(0), torch.empty(0), blocks[2].clone()],
            absmax3=[],
            scalars=[0.1, 0.0447, 1.0] * 3,
            grad_scales=None,
            map1=maps[0],
            map2=maps[1],
            map3=maps[2],
            rule=_C.RULES["adam"],
            hyper=hyper.values(),
            flags=_C.FLAG_DECOUPLED,
            norm_mode=0,
            n_states=2,
            block_size=128,
            state_bits=4,
            factored=[_ops.FACTORED_GIVEN, 1, 0],
            factors=factors,
        )
        given = factors[: 130 + 33 + 1].clone()
        _ops.optimizer_step_(*args)
        assert torch.equal(factors[: 130 + 33 + 1], given)  # the given factors are read, not updated
        return [params, args.state1, args.absmax1, args.state2[2], args.absmax2[2], factors]

    _identical(run)


def _norms_then_step(rule: int, norm_mode: int, max_unorm: float) -> Callable[[], list]:
    """The sharded-parameter path of the norm modes (tests/test_optim.py's ``_step_args``): the pre-pass
    alone (lowbit::optimizer_norms), then the step with update scales computed from its sums."""
    from lowbit.optim.sharded_norms import update_scales
    from tests.test_optim import _step_args

    def run() -> list:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            args = list(_step_args(2, True))
        args[13], args[16] = rule, norm_mode
        args[14] = [*args[14][:8], max_unorm, *args[14][9:]]
        args[8] = [1e-3, 0.3, 0.0] * len(args[0])
        sums = _ops.optimizer_norms(*args)
        _ops.optimizer_step_(*args, update_scales(sums, _ops.StepHyper(*args[14]), norm_mode))
        return [sums, args[:8]]

    return run


_NORM_MODES = [(5, 1, 0.0), (0, 2, 0.01)]  # LAMB's trust ratio; Adam with max_unorm


@pytest.mark.parametrize(("rule", "norm_mode", "max_unorm"), _NORM_MODES)
def test_optimizer_norms_then_step_with_update_scales(rule, norm_mode, max_unorm):
    _identical(_norms_then_step(rule, norm_mode, max_unorm))


def test_gradient_norms():
    """norm_mode 3 (LARS's ||p|| and ||g||): the pre-pass with the gradient in the update's place, no states."""
    from lowbit import _C
    from tests.test_optim import _step_args

    def run() -> list:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            args = list(_step_args(1, False))
        args[0] = [*args[0], args[0][0].bfloat16()]
        args[1] = [*args[1], args[1][0].bfloat16()]
        args[2:8] = [[] for _ in range(6)]
        args[8] = [1e-3, 1.0, 1.0] * len(args[0])
        args[15], args[16], args[17] = 0, _C.NORM_GRAD, 0
        return [_ops.optimizer_norms(*args)]

    _identical(run)


_ORDERED_NORMS = [
    (64, True),  # 45 blocks in a tensor: more than the 32 lanes of its block sums
    (64, False),
    (4096, True),  # a block added in several passes of a 256-thread block
]


@pytest.mark.parametrize(("block", "eight_bit"), _ORDERED_NORMS)
def test_norm_sums_in_the_shared_order(block, eight_bit):
    """optimizer_norms' double sums where their order shows: values over seven decades, so that any other
    order of additions than include/lowbit/norm_order.h's gives other bits."""
    from tests.test_optim import _step_args

    def run() -> list:
        gen = torch.Generator().manual_seed(1)
        sizes = [64 * 44 + 17, 1, 4096 + 700]
        args = list(_step_args(2, eight_bit))
        args[0], args[1] = (
            [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 4, (n,), generator=gen) for n in sizes]
            for _ in range(2)
        )
        for k in (2, 3):
            args[k] = [torch.zeros(n, dtype=torch.uint8 if eight_bit else torch.float32) for n in sizes]
            args[k + 3] = [torch.zeros(_ops.num_blocks(n, block) if eight_bit else 0) for n in sizes]
        args[8] = [1e-3, 0.3, 0.0] * len(sizes)
        args[13], args[16], args[18] = 0, 2, block  # Adam with max_unorm
        return [_ops.optimizer_norms(*args)]

    _identical(run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("group", [64, 128, 256, 512, 4096])
@pytest.mark.parametrize("stochastic", [False, True])
def test_lpmm_accumulate(dtype, bits, group, stochastic):
    def run() -> list:
        out = []
        for n in SIZES:
            codes, absmax = _ops.quantize_linear(sample("heavy", n, seed=bits), bits, group, False, 0, 0)
            grad = sample("normal", n, seed=group, dtype=dtype)
            _ops.lpmm_accumulate_(grad, codes, absmax, bits, group, stochastic, 99)
            out += [codes, absmax]
        return out

    _identical(run)


@pytest.mark.parametrize("offsets", [None, [5 << 40, 3, 1 << 40, 17]], ids=["contiguous", "offsets"])
@pytest.mark.parametrize("rule,n_states", [(1, 1), (1, 0), (0, 2)])
@pytest.mark.parametrize("bits", [(12, 8, 8), (5, 13, 6)])
@pytest.mark.parametrize("group", [64, 256, 2048])
def test_lpmm_step(rule, n_states, bits, group, offsets):
    # offsets: per-tensor counter ranges, as the LPMM optimizers give their parameters.
    from tests.test_lpmm_ops import _step_args

    pb, gb, sb = bits
    kw = dict(rule=rule, param_bits=pb, grad_bits=gb, state_bits=sb, group=group, n_states=n_states, seed=5)

    def run() -> list:
        args = _step_args([1, 255, 4097, 300], **kw, offsets=offsets)
        _ops.lpmm_step_(*args)
        return list(args[:8])

    _identical(run)


@pytest.mark.parametrize("group", [64, 128, 256, 512])
def test_lpmm_step_blocks_of_several_groups(group):
    # Groups of under 1024 elements share a thread block, 1024 // group of them: here tensors start and end
    # inside blocks, each ends in a partial group, and the last block has threads past the last group.
    from tests.test_lpmm_ops import _step_args

    kw = dict(rule=0, param_bits=5, grad_bits=13, state_bits=6, group=group, n_states=2, seed=7)
    sizes = [3 * group + 5, 1, 2 * group - 8, 7, group + 1, group]  # 4 + 1 + 2 + 1 + 2 + 1 = 11 groups

    def run() -> list:
        args = _step_args(sizes, **kw)
        _ops.lpmm_step_(*args)
        return list(args[:8])

    _identical(run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [64, 256, 4096, 0])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_momentum(dtype, block, nesterov):
    # block 0: an fp32 buffer (the grid-stride kernel); otherwise 8-bit codes on the signed dynamic map.
    code = F.create_dynamic_map(signed=True)

    def run() -> list:
        out = []
        for n in SIZES:
            g = torch.Generator().manual_seed(n)
            grad = (torch.randn(n, generator=g) * torch.logspace(-3, 3, n)).to(dtype)
            grad[n // 2] = float("nan")
            m = torch.randn(n, generator=g)
            if block:
                state, qs = F.quantize_blockwise(m, code, blocksize=block)
                absmax = qs.absmax
            else:
                state, absmax = m, torch.empty(0)
            update = torch.empty(n)
            for _ in range(2):
                _ops.muon_momentum_(grad, state, absmax, code, update, 0.95, nesterov, block or 256)
            out += [state, absmax, update]
        return out

    _identical(run)


def test_muon8bit_steps():
    import lowbit.optim as O

    def run() -> list:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(33, 129), (64, 80)]]
        opt = O.Muon8bit(params, lr=0.02, min_8bit_size=0)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return [*params, opt.state_dict()]

    _identical(run)


# Every launcher with no elements returns before launching: a grid of 0 blocks fails in the emulation as
# on a GPU (the ops skip empty tensors before reaching the launchers, so these call them directly).
EMPTY_LAUNCHES = {
    "quantize": lambda: emu.quantize_cuda(0, 0, 0, 0, 0, 8, 256, False, 0, 0, 0, 0, 0, 0),
    "quantize tensor-wise": lambda: emu.quantize_cuda(0, 0, 0, 0, 0, 8, 0, True, 0, 0, 0, 0, 0, 0),
    "dequantize": lambda: emu.dequantize_cuda(0, 0, 0, 0, 0, 8, 256, 0, 0, 0, 0),
    "pack_bits": lambda: emu.pack_bits_cuda(0, 0, 0, 3, 0, 0),
    "unpack_bits": lambda: emu.unpack_bits_cuda(0, 0, 0, 3, 0, 0),
    "fewbit_encode": lambda: emu.fewbit_encode_cuda(0, 0, 0, 0, 3, 0, 0, 0),
    "fewbit_grad": lambda: emu.fewbit_grad_cuda(0, 0, 0, 0, 0, 3, 0, 0, 0),
    "invact_grad": lambda: emu.invact_grad_cuda(0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    "blpa_encode": lambda: emu.blpa_encode_cuda([0] * 13, 0, 4, 1, 0, 4, 1, 0, 0),
    "blpa_decode": lambda: emu.blpa_decode_cuda([0] * 13, 0, 4, 1, 0, 4, 1, 0, 0),
    "blpa_backward": lambda: emu.blpa_backward_cuda([0] * 13, 0, 4, 1, 0, 4, 1, 0, 0),
    "lpmm_accumulate": lambda: emu.lpmm_accumulate_cuda(0, 0, 0, 0, 0, 8, 256, False, 0, 0, 0),
    "muon_momentum": lambda: emu.muon_momentum_cuda(0, 0, 0, 0, 0, 8, 0, 256, 0, 0.05, 0.95, True, 0, 0),
    "muon_momentum fp32": lambda: emu.muon_momentum_cuda(0, 0, 0, 0, 0, 32, 0, 256, 0, 0.05, 0.95, False, 0, 0),
}


@pytest.mark.parametrize("name", sorted(EMPTY_LAUNCHES))
def test_empty_launches(name):
    EMPTY_LAUNCHES[name]()


def test_empty_optimizer_parameters():
    import lowbit.optim as O

    def run() -> list:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(0,), (4096,), (0, 7)]]
        opt = O.AdamW8bit(params)
        for p in params:
            p.grad = torch.ones(p.shape)
        opt.step()
        return params

    _identical(run)
