"""Inverted activations: the lowbit::invact_grad op, the shipped tables, the layers and their savings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import lowbit
import lowbit.nn.activations as A
from lowbit import _ops
from lowbit import _reference as R
from lowbit.memory import saved_tensor_bytes
from lowbit.nn import _invact_gen, fewbit, invact
from tests.conftest import DTYPES

ops = torch.ops.lowbit
SIZES = [0, 1, 7, 8, 15, 16, 17, 4095, 4096, 4097, 3 * 4096 + 5]
# Measured by gradient_error (fp32 forward and evaluation, x in [-10, 10]); the floor is fp32 itself:
# near the minimum T a rounded y pins x down only to ~sqrt(ulp(f(T))). With y correctly rounded the
# worst is 1.4e-4 (gelu_tanh) and 2.9e-6 in L2-normal.
LINF_BOUND = 2e-4
L2_NORMAL_BOUND = 5e-6
# With torch's own fp32 forward, whose error dy near T the inversion amplifies to sqrt(2 f''(T) dy) in
# the slope: allowing dy up to 8 ulp of f(T) at GELU's f''(T) = 0.43 adds 3.2e-4. Measured: 1.1e-4 on an
# AVX-512 CPU, 2.5e-4 on an AVX2 AMD EPYC, whose torch GELU is 6 ulp off at T.
LAYER_LINF_BOUND = LINF_BOUND + 3.2e-4
LAYERS = {
    "gelu": (A.InvGELU, nn.GELU, {}),
    "gelu_tanh": (A.InvGELU, nn.GELU, {"approximate": "tanh"}),
    "silu": (A.InvSiLU, nn.SiLU, {}),
    "mish": (A.InvMish, nn.Mish, {}),
}


def _outputs(name: str, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of the activation on a wide input, with the special values, and the branch bits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 4
    tab = invact.table(name)
    y = fewbit.activation_fn(name)(x)
    special = torch.tensor(
        [tab.params[0].item(), tab.params[0].item() - 1e-3, 0.0, -0.0, 1e-30, float("nan"), float("inf"), 7.0]
    )
    k = min(n, special.numel())
    y[:k] = special[:k]
    bits = _ops.fewbit_encode(x, tab.threshold_tensor, 1)
    return y.to(dtype), bits


@pytest.mark.parametrize("name", invact.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_matches_reference(device, name, dtype, cpu_kernels):
    tab = invact.table(name)
    for n in SIZES:
        y, bits = _outputs(name, n, dtype, seed=n)
        grad = torch.randn(n, generator=torch.Generator().manual_seed(n + 1)).to(dtype)
        got = ops.invact_grad(
            grad.to(device), y.to(device), bits.to(device), tab.coeffs.to(device), tab.params.to(device)
        )
        assert got.dtype == dtype and got.shape == grad.shape
        want = R.invact_grad(grad, y, bits, tab.coeffs, tab.params)
        assert torch.equal(got.cpu().isnan(), want.isnan())
        assert torch.equal(got.cpu().nan_to_num(), want.nan_to_num())


def _every_16bit_output(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every bit pattern of a 16-bit y (NaNs, infinities, subnormals, both zeros) on the left branch, then
    all of them again on the right, with gradients of both signs over many binades."""
    y = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(dtype).repeat(2)
    bits = _ops.pack_bits(torch.cat([torch.zeros(2**16), torch.ones(2**16)]).to(torch.uint8), 1)
    g = torch.Generator().manual_seed(5)
    grad = (torch.randn(2**17, generator=g) * torch.exp2(torch.randint(-20, 20, (2**17,), generator=g))).to(dtype)
    return grad, y, bits


@pytest.mark.parametrize("name", invact.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_output_matches_reference(name, dtype, cpu_kernels):
    """bf16 and fp16 read their slopes from a table of every y (invact.cpp): each entry, on both branches, is
    the twin's slope, and the product with grad is rounded as the twin rounds it."""
    tab = invact.table(name)
    grad, y, bits = _every_16bit_output(dtype)
    got = ops.invact_grad(grad, y, bits, tab.coeffs, tab.params)
    want = R.invact_grad(grad, y, bits, tab.coeffs, tab.params)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    # NaN is stored as from_float stores it (the twin's torch conversion may keep a payload): bf16 0x7FC0,
    # fp16 0x7E00 with the sign.
    nan_bits = got[got.isnan()].view(torch.int16).int() & 0xFFFF
    assert nan_bits.numel() > 0
    if dtype == torch.bfloat16:
        assert torch.all(nan_bits == 0x7FC0)
    else:
        assert torch.all((nan_bits & 0x7FFF) == 0x7E00)


def test_slope_tables_follow_the_coefficients():
    """The cached tables are keyed by every coefficient and parameter and by dtype: ten coefficient sets
    (more than the cache keeps; every other one differs in params only), each used twice and interleaved with
    the other dtype, each matching the twin on its own coefficients and differing from its neighbour."""
    tab = invact.table("silu")
    sets = []
    for k in range(10):
        coeffs, params = tab.coeffs.clone(), tab.params.clone()
        if k % 2:
            params[2] *= 1 + 0.01 * k  # the right branch's pieces per unit t
        else:
            coeffs *= 1 + 0.01 * k
        sets.append((coeffs, params))
    inputs = {dtype: _every_16bit_output(dtype) for dtype in (torch.bfloat16, torch.float16)}
    last: dict[torch.dtype, torch.Tensor] = {}
    for _ in range(2):
        for coeffs, params in sets:
            for dtype, (grad, y, bits) in inputs.items():
                got = ops.invact_grad(grad, y, bits, coeffs, params).nan_to_num()
                assert torch.equal(got, R.invact_grad(grad, y, bits, coeffs, params).nan_to_num())
                assert dtype not in last or not torch.equal(got, last[dtype])
                last[dtype] = got


def test_special_outputs():
    """NaN gives NaN; y = +inf on the right branch and y = 0 on the left take the limits 1 and 0."""
    tab = invact.table("gelu")
    y = torch.tensor([float("nan"), float("inf"), 0.0, -1e-30] + [0.0] * 12)
    bits = _ops.pack_bits(torch.tensor([1, 1, 0, 0] + [0] * 12, dtype=torch.uint8), 1)
    for avx512 in (True, False):
        lowbit._C._set_cpu_avx512(avx512)
        try:
            got = ops.invact_grad(torch.ones(16), y, bits, tab.coeffs, tab.params)
        finally:
            lowbit._C._set_cpu_avx512(True)
        # y = -1e-30 is far below half an ulp of -f(T) (~0.17), so y - f(T) rounds as for y = 0 and takes the
        # same limit exactly (measured 0.0 on both paths; was |got| < 1e-6).
        assert torch.isnan(got[0]) and got[1].item() == 1.0 and got[2].item() == 0.0 and got[3].item() == 0.0


@given(n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1), name=st.sampled_from(invact.ACTIVATIONS))
def test_grad_is_close_to_the_exact_derivative(n, seed, name):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 5
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    tab = invact.table(name)
    y = fewbit.activation_fn(name)(x)
    bits = _ops.fewbit_encode(x, tab.threshold_tensor, 1)
    got = ops.invact_grad(g, y, bits, tab.coeffs, tab.params).double()
    want = g.double() * fewbit.derivative(name)(x.double())
    # The slope is within LAYER_LINF_BOUND of f'(x), and the fp32 product g * slope adds 2**-24 relative, far
    # inside that, so no absolute term is needed. Measured over seeds 0-199 x 4 activations, n = 3000: worst
    # |got - want| / |g| 1.4e-4 (bound 5.2e-4), never above the bound (was + 1e-6 absolute).
    assert torch.all((got - want).abs() <= LAYER_LINF_BOUND * g.abs().double())


@pytest.mark.parametrize("name", invact.ACTIVATIONS)
def test_gradient_error_is_within_the_stated_bounds(name):
    table = invact.gradient_error(name, forward="exact")
    assert table["linf"] < LINF_BOUND and table["l2_normal"] < L2_NORMAL_BOUND
    layer = invact.gradient_error(name)
    assert layer["linf"] < LAYER_LINF_BOUND and layer["l2_normal"] < L2_NORMAL_BOUND


@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_tables_beat_the_papers_approximations_tenfold(name):
    ours, paper = invact.gradient_error(name), invact.gradient_error(name, "paper")
    for key in ("linf", "l2_uniform", "l2_normal"):
        assert ours[key] * 10 < paper[key], (key, ours[key], paper[key])


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many fp32 values lie between a and b (0 when equal), elementwise."""

    def order(t: torch.Tensor) -> torch.Tensor:
        bits = t.to(torch.float32).contiguous().view(torch.int32).long()
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (order(a) - order(b)).abs()


def test_shipped_file_is_in_generator_format():
    from importlib import resources

    shipped = resources.files("lowbit.nn").joinpath(invact.TABLE_FILE).read_text(encoding="utf-8")
    assert _invact_gen.render([invact.table(n) for n in invact.ACTIVATIONS]) == shipped


@pytest.mark.parametrize("name", invact.ACTIVATIONS)
def test_regenerated_tables_match_shipped(name):
    # The fit is float64 (numpy lstsq, torch's float64 activations) rounded to fp32 coefficients; the last
    # float64 bits differ between CPUs, so a coefficient may round to the neighbouring fp32 value. Measured:
    # identical on the AVX-512 machine that wrote the file; 4 of 768 coefficients one ulp apart on an AVX2
    # AMD EPYC. The full comparison is `python -m lowbit.nn._invact_gen --check`.
    new, old = invact.fit(name), invact.table(name)
    assert _ulps(torch.tensor(new.threshold), torch.tensor(old.threshold)) <= 1
    assert int(_ulps(new.params, old.params).max()) <= 1
    assert new.coeffs.shape == old.coeffs.shape and int(_ulps(new.coeffs, old.coeffs).max()) <= 1


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_is_torchs_and_backward_is_close(name, dtype):
    ours_cls, torch_cls, kw = LAYERS[name]
    x = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 4).to(dtype).requires_grad_()
    g = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = ours_cls(**kw)(x)
    assert torch.equal(y, torch_cls(**kw)(x))
    (dx,) = torch.autograd.grad(y, x, g)
    assert dx.dtype == dtype
    want = g.double() * fewbit.derivative(name)(x.detach().double())
    if dtype == torch.float32:  # the layer's bound (torch's fp32 forward)
        bound = LAYER_LINF_BOUND * g.abs().double() + 1e-6
    else:  # bf16/fp16: the rounding of y (and of dx) dominates
        bound = 0.05 * g.abs().double() + 1e-6 + 1e-2 * want.abs()
    assert torch.all((dx.double() - want).abs() <= bound)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4096 + 3])
def test_saved_bytes_are_the_shared_output_and_one_bit(n):
    model = nn.Sequential(A.InvGELU(), nn.Linear(n, 3))
    x = torch.randn(2, n, requires_grad=True)
    saved = saved_tensor_bytes(model, x)
    assert saved.total == 4 * 2 * n + (2 * n + 7) // 8
    plain = saved_tensor_bytes(nn.Sequential(nn.GELU(), nn.Linear(n, 3)), x)
    assert plain.total == 2 * 4 * 2 * n


def test_under_torch_compile_and_checkpointing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), A.InvSiLU(), nn.Linear(64, 4))
    x = torch.randn(8, 16, requires_grad=True)
    (eager,) = torch.autograd.grad(model(x).sum(), x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    (comp,) = torch.autograd.grad(compiled(x).sum(), x)
    assert torch.equal(eager, comp)
    (ckpt,) = torch.autograd.grad(checkpoint(model, x, use_reentrant=False).sum(), x)
    assert torch.equal(eager, ckpt)


def test_functional_form_matches_the_module():
    x = torch.randn(513, requires_grad=True)
    g = torch.randn(513)
    (a,) = torch.autograd.grad(A.inv_act(x, "mish"), x, g)
    (b,) = torch.autograd.grad(A.InvMish()(x), x, g)
    assert torch.equal(a, b)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="one minimum"):
        A.InvActivation("tanh")
    with pytest.raises(ValueError, match="approximate must be"):
        A.InvGELU(approximate="fast")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        A.InvSiLU()([1.0])
    tab = invact.table("gelu")
    y, g = torch.randn(16), torch.randn(16)
    bits = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits has 3 bytes"):
        ops.invact_grad(g, y, torch.zeros(3, dtype=torch.uint8), tab.coeffs, tab.params)
    with pytest.raises(TypeError, match="y has dtype"):
        ops.invact_grad(g, y.double(), bits, tab.coeffs, tab.params)
    with pytest.raises(ValueError, match="coeffs must hold 192"):
        ops.invact_grad(g, y, bits, tab.coeffs[:1], tab.params)
    with pytest.raises(ValueError, match="y has shape"):
        ops.invact_grad(g, y.reshape(4, 4), bits, tab.coeffs, tab.params)


def test_opcheck():
    tab = invact.table("silu")
    x = torch.randn(100) * 4  # no NaN: opcheck compares outputs with NaN != NaN
    bits = _ops.fewbit_encode(x, tab.threshold_tensor, 1)
    torch.library.opcheck(
        ops.invact_grad.default, (torch.randn(100), torch.nn.functional.silu(x), bits, tab.coeffs, tab.params)
    )


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    # transformers' ReLUSquaredActivation.forward, its two torch ops: an independent reference for relu2.
    return torch.square(nn.functional.relu(x))


# Exactly inverted layers: (lowbit layer, torch's module or function, c = the largest slope on the branch
# y <= 0, where the backward reads y; None: a slope that does not depend on y, so the gradient is exact).
EXACT = {
    "elu": (A.InvELU(), nn.ELU(), 1.0),
    "elu-0.5": (A.InvELU(0.5), nn.ELU(0.5), 0.5),
    "elu-0": (A.InvELU(0.0), nn.ELU(0.0), 0.0),
    "celu-0.7": (A.InvCELU(0.7), nn.CELU(0.7), 1.0),
    "celu-3": (A.InvCELU(3.0), nn.CELU(3.0), 1.0),
    "selu": (A.InvSELU(), nn.SELU(), A._SELU_SCALE * A._SELU_ALPHA),
    "leaky_relu": (A.InvLeakyReLU(), nn.LeakyReLU(), None),
    "leaky_relu-0.2": (A.InvLeakyReLU(0.2), nn.LeakyReLU(0.2), None),
    "leaky_relu-0": (A.InvLeakyReLU(0.0), nn.LeakyReLU(0.0), None),
    "relu2": (A.InvReLUSquared(), _relu_squared, None),
}


def _exact_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Both branches, exactly 0 (both signs), tiny and large negatives, near-saturation; |x| <= 100, so that
    relu2's square stays finite in fp16 too."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 4
    special = [0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, -5.0, -17.0, -20.0, -88.0, -100.0, 20.0, 100.0]
    return torch.cat([x, torch.tensor(special)]).to(dtype)


def _input_grad(act, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg = x.clone().requires_grad_(True)
    y = act(xg * 1.0)  # a non-leaf input, as inside a model (and as torch's in-place forms need)
    (dx,) = torch.autograd.grad(y, xg, g)
    return y.detach(), dx


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_inverse_forward_is_torchs_and_backward_matches_autograd(device, name, dtype):
    ours, theirs, c = EXACT[name]
    x = _exact_inputs(dtype).to(device)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    got_y, got = _input_grad(ours, x, g)
    want_y, want = _input_grad(theirs, x, g)
    assert torch.equal(got_y, want_y)  # torch's forward, bit for bit
    assert got.dtype == dtype
    fi = torch.finfo(dtype)
    if name.startswith("leaky_relu"):
        # y > 0 exactly where x > 0 for a slope >= 0 (x = 0 and underflowing slope * x give y <= 0 and the
        # slope, as torch's x > 0 test does): the same product grad * slope, bit for bit.
        assert torch.equal(got, want)
        return
    if name == "relu2":
        # sqrt of a correctly rounded square is the root itself in binary floating point, so where y is a
        # normal number grad * 2 sqrt(y) is torch's grad * 2 relu(x), bit for bit. Below, y is subnormal (or 0):
        # |sqrt(y) - r| <= sqrt(|y - r**2|) <= sqrt(smallest_normal), twice that in the slope, plus the rounding
        # of both products (eps / 2 of |want| each).
        normal = got_y >= fi.smallest_normal
        assert torch.equal(got[normal], want[normal])
        bound = 2 * g.double().abs() * fi.smallest_normal**0.5 + fi.eps * want.double().abs()
    else:
        # On y > 0 both read a constant. On y <= 0 the slope input_scale * (y + alpha * scale) reads y, whose
        # error is at most 1 ulp of |y| <= alpha * scale (rounding to the dtype, torch's expm1 within 1 ulp
        # in fp32): eps * c in the slope, times |g|. Both gradients are then rounded (eps / 2 of |want|
        # each) and torch's exp(x) carries up to 1 ulp: 2 eps |want|. Subnormal results round absolutely:
        # eps * smallest_normal.
        bound = fi.eps * (c * g.double().abs() + 2 * want.double().abs()) + fi.eps * fi.smallest_normal
    err = (got.double() - want.double()).abs()
    assert torch.all(err <= bound), float((err / bound).max())
    # Direction as well as size: wherever torch's gradient is larger than the bound, the signs agree.
    clear = want.double().abs() > bound
    assert torch.equal(torch.sign(got[clear]), torch.sign(want[clear]))


@pytest.mark.parametrize("name", [n for n in EXACT if not n.startswith("relu2")])
def test_exact_inverse_is_torchs_inplace_backward(name):
    """torch's in-place ELU, CELU, SELU and LeakyReLU compute their backward from the output too: equal, bit
    for bit, and inplace=True runs them, writing into the input."""
    ours, theirs, _ = EXACT[name]
    inplace_cls = {nn.ELU: A.InvELU, nn.CELU: A.InvCELU, nn.SELU: A.InvSELU, nn.LeakyReLU: A.InvLeakyReLU}
    args = () if isinstance(theirs, nn.SELU) else (ours.p,)
    torch_inplace = type(theirs)(*args, inplace=True)
    ours_inplace = inplace_cls[type(theirs)](*args, inplace=True)
    x = _exact_inputs(torch.float32)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    want_y, want = _input_grad(torch_inplace, x, g)
    for layer in (ours, ours_inplace):
        got_y, got = _input_grad(layer, x, g)
        assert torch.equal(got_y, want_y) and torch.equal(got, want), layer
    h = x * 1.0
    assert ours_inplace(h) is h


@pytest.mark.parametrize("name", EXACT)
def test_exact_inverse_saves_only_the_shared_output(name):
    ours, theirs, _ = EXACT[name]
    n = 1000
    x = torch.randn(2, n, requires_grad=True)
    # Only y, which the Linear saves as its input: one fp32 tensor of 2 n elements, no bits.
    assert saved_tensor_bytes(nn.Sequential(ours, nn.Linear(n, 3)), x).total == 4 * 2 * n
    # torch's out-of-place forms save their input (relu2: relu's output), beside the Linear's.
    want = nn.Sequential(theirs, nn.Linear(n, 3)) if isinstance(theirs, nn.Module) else None
    if want is not None:
        assert saved_tensor_bytes(want, x).total == 2 * 4 * 2 * n


def test_exact_inverses_compile():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), A.InvCELU(0.7), nn.Linear(64, 64), A.InvReLUSquared(), nn.Linear(64, 4))
    x = torch.randn(8, 16, requires_grad=True)
    (eager,) = torch.autograd.grad(model(x).sum(), x)
    (comp,) = torch.autograd.grad(torch.compile(model, backend="aot_eager", fullgraph=True)(x).sum(), x)
    # aot_eager may decompose the Linear backwards: the fp32 rounding of a few sums, torch's fp32 tolerance.
    torch.testing.assert_close(comp, eager)


def test_exact_inverses_reject_what_the_output_cannot_invert():
    with pytest.raises(ValueError, match="negative_slope must be a number >= 0"):
        A.InvLeakyReLU(-0.5)
    with pytest.raises(ValueError, match="alpha must be a number >= 0"):
        A.InvELU(-1.0)
    with pytest.raises(ValueError, match="alpha must be a number > 0"):
        A.InvCELU(0.0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        A.InvSELU()([1.0])
