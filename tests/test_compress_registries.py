"""compress_activations knows every activation class of torch.nn and of transformers' ACT2CLS.

Each one is either replaced, with torch's forward bit for bit and a backward checked against torch's own
gradient of the original module, or listed in the report with a reason. The classes are enumerated from
the libraries themselves, so an activation added by a future release fails here until lowbit knows it.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.modules.activation as torch_activations
from torch import nn

import lowbit.nn as lnn
from lowbit.nn import fewbit

# Required constructor arguments; any other class that needs some fails the test until it is listed.
_ARGS: dict[type, tuple] = {nn.Threshold: (0.5, -1.0), nn.MultiheadAttention: (4, 1)}
# Parameters other than the defaults, which select other tables or other exact forms.
_VARIANTS = [
    nn.LeakyReLU(0.2),
    nn.LeakyReLU(-0.5),
    nn.ELU(alpha=0.5),
    nn.CELU(alpha=0.7),
    nn.Softplus(beta=2.0, threshold=5.0),
    nn.Hardtanh(-2.0, 3.0),
    nn.Hardshrink(0.3),
    nn.Softshrink(0.3),
    nn.GELU(approximate="tanh"),
]
# Inputs on both sides of every jump of the derivatives above, and exactly on them.
_EDGES = [-3.0, -2.0, -0.5, -0.3, 0.0, 0.3, 0.5, 2.5, 3.0, 6.0]


def _torch_classes() -> list[type]:
    return [
        c
        for _, c in sorted(vars(torch_activations).items())
        if inspect.isclass(c) and issubclass(c, nn.Module) and c.__module__ == torch_activations.__name__
    ]


def _torch_instances() -> list[nn.Module]:
    return [c(*_ARGS.get(c, ())) for c in _torch_classes()] + _VARIANTS


def _hf_instances() -> list[tuple[str, nn.Module]]:
    activations = pytest.importorskip("transformers.activations")
    return [(key, activations.ACT2FN[key]) for key in activations.ACT2CLS]


def _inputs() -> torch.Tensor:
    edges = torch.tensor(_EDGES)
    near = torch.cat([edges, torch.nextafter(edges, edges - 1), torch.nextafter(edges, edges + 1)])
    return torch.cat([torch.linspace(-12.0, 12.0, 1 << 16), near])


def _grad(act: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg = x.clone().requires_grad_(True)
    y = act(xg * 1.0)  # a non-leaf input, as inside a model (in-place forms)
    (g,) = torch.autograd.grad(y.sum(), xg)
    return y.detach(), g


def _check(act: nn.Module, label: str) -> str:
    """Compress a model holding ``act``; check the replacement against torch, or that a reason is given."""
    model = nn.Sequential(nn.Identity(), act)
    report = lnn.compress_activations(model, bits=3, when="always")
    skipped = dict(report.skipped)
    if "1" in skipped:
        assert skipped["1"], label
        return "skipped"
    assert [r.path for r in report.replaced] == ["1"], f"{label} was neither replaced nor listed: {report}"
    new = model[1]
    assert isinstance(new, lnn.FewBitActivation), label
    x = _inputs()
    want_y, want_g = _grad(act, x)
    got_y, got_g = _grad(new, x)
    assert torch.equal(got_y, want_y), label  # torch's forward, bit for bit
    table = fewbit.table(new.name, new.bits, new.weight)
    if fewbit.table_bits(new.name) == (1,):
        assert torch.equal(got_g, want_g), label  # a two-valued derivative: exact
        return "exact"
    # The backward multiplies by the table's level of each input (an independent bucketize lookup) ...
    assert torch.equal(got_g, table(x)), label
    # ... and that table is as close to torch's own derivative as its recorded error says: the normal-weighted
    # squared error on [-10, 10] as a Riemann sum over a 2**20-cell grid. The sum misses the integral by at most
    # one cell (dx) per boundary, times the square of the largest difference there (levels and f' alike are
    # within [min, max] of the levels and f'), times the density's maximum 1/sqrt(2 pi) < 0.4. torch's fp32 f'
    # differs from the float64 one the error was computed with by 2**-24 of |f'| <= span at most, which moves
    # each squared difference by at most 2 * 2**-24 * span**2; the density integrates to 1.
    grid = torch.linspace(-10.0, 10.0, (1 << 20) + 1, dtype=torch.float32)
    dx = 20.0 / (1 << 20)
    _, fprime = _grad(act, grid)
    density = torch.exp(-(grid.double() ** 2) / 2) / math.sqrt(2 * math.pi)
    err = float((((table(grid) - fprime).double() ** 2) * density).sum() * dx)
    span = float(torch.cat([table.levels, fprime]).max() - torch.cat([table.levels, fprime]).min())
    slack = table.boundaries.numel() * dx * span**2 * 0.4 + 2 * 2**-24 * span**2
    assert abs(err - table.error) <= slack, (label, err, table.error)
    return "few-bit"


@pytest.mark.parametrize("act", _torch_instances(), ids=repr)
def test_every_torch_activation_is_replaced_or_listed(act):
    _check(act, repr(act))


def test_every_hugging_face_activation_is_replaced_or_listed():
    outcomes = {key: _check(act, key) for key, act in _hf_instances()}
    assert outcomes["relu6"] == "exact" and outcomes["quick_gelu"] == "few-bit"


def _quick_gelu() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.activations.QuickGELUActivation()


def test_quick_gelu_inverted_as_a_scaled_silu():
    act = _quick_gelu()
    model = nn.Sequential(nn.Identity(), act)
    report = lnn.compress_activations(model, method="invact", when="always")
    assert [r.path for r in report.replaced] == ["1"] and model[1].name == "quick_gelu"
    a = lnn.invact.SCALED["quick_gelu"][1]
    # x over [-10/a, 10/a]: a x covers SiLU's table range [-10, 10], where its error is known.
    x = torch.linspace(-10.0 / a, 10.0 / a, 2_000_001)
    want_y, want_g = _grad(act, x)
    got_y, got_g = _grad(model[1], x)
    assert torch.equal(got_y, want_y)  # Hugging Face's expression, bit for bit
    # quick_gelu'(x) = silu'(a x), read from SiLU's table at a y. y is the formula's own rounding of silu(a x) / a
    # and a y one more rounding: at SiLU's minimum, where the inversion amplifies an error in y, that at most
    # doubles the error SiLU's table shows for its own fp32 output (its linf over [-10, 10]).
    bound = 2 * lnn.invact.gradient_error("silu")["linf"]
    assert float((got_g - want_g).abs().max()) <= bound
    # Direction as well as size: the slope is negative left of the minimum and positive right of it.
    minimum = lnn.invact.table("silu").threshold / a
    far = (x - minimum).abs() > 0.1
    assert torch.equal(torch.sign(got_g[far]), torch.sign(want_g[far]))


# What method="invact" replaces, by torch instance repr or ACT2CLS key: the layers of lowbit.nn.invact's tables,
# and those that save only the output (ELU, CELU, SELU, LeakyReLU with a slope >= 0, relu2). Python formulas
# (gelu_new, gelu_python, ...) round differently from torch's kernels and are left alone under strict=True.
_INVERTED = {
    "GELU(approximate='none')": lnn.InvActivation,
    "GELU(approximate='tanh')": lnn.InvActivation,
    "SiLU()": lnn.InvActivation,
    "Mish()": lnn.InvActivation,
    "gelu": lnn.InvActivation,
    "gelu_pytorch_tanh": lnn.InvActivation,
    "silu": lnn.InvActivation,
    "swish": lnn.InvActivation,
    "mish": lnn.InvActivation,
    "quick_gelu": lnn.InvActivation,
    "ELU(alpha=1.0)": lnn.InvELU,
    "ELU(alpha=0.5)": lnn.InvELU,
    "CELU(alpha=1.0)": lnn.InvCELU,
    "CELU(alpha=0.7)": lnn.InvCELU,
    "SELU()": lnn.InvSELU,
    "LeakyReLU(negative_slope=0.01)": lnn.InvLeakyReLU,
    "LeakyReLU(negative_slope=0.2)": lnn.InvLeakyReLU,
    "leaky_relu": lnn.InvLeakyReLU,
    "relu2": lnn.InvReLUSquared,
}


def test_every_activation_is_inverted_or_listed():
    """method="invact" over both registries: the activations above are replaced by their inverted layer, with
    torch's forward bit for bit (their gradients are checked in test_invact.py); every other one is listed
    with a reason: ReLU's torch backward already reads the output, a negative-slope LeakyReLU's output does
    not name its branch."""
    x = _inputs()
    inverted, reasons = {}, {}
    for label, act in [(repr(a), a) for a in _torch_instances()] + _hf_instances():
        model = nn.Sequential(nn.Identity(), act)
        report = lnn.compress_activations(model, method="invact", when="always")
        skipped = dict(report.skipped)
        if "1" in skipped:
            assert skipped["1"], label
            reasons[label] = skipped["1"]
            continue
        assert [r.path for r in report.replaced] == ["1"], f"{label} was neither replaced nor listed: {report}"
        assert torch.equal(_grad(model[1], x)[0], _grad(act, x)[0]), label
        inverted[label] = type(model[1])
    assert inverted == _INVERTED
    assert "its own inverted form" in reasons["ReLU()"] and "its own inverted form" in reasons["relu"]
    assert "both signs of x" in reasons["LeakyReLU(negative_slope=-0.5)"]


def test_exact_one_bit_forms():
    got = {repr(a): _check(a, repr(a)) for a in (nn.ReLU6(), nn.Hardtanh(), nn.Threshold(0.5, -1.0), nn.LeakyReLU(0.2))}
    assert set(got.values()) == {"exact"}


def test_register_activation_checks_its_arguments():
    with pytest.raises(ValueError, match="already an activation"):
        lnn.register_activation("gelu", torch.nn.functional.gelu)
    with pytest.raises(TypeError, match="fn must be callable"):
        lnn.register_activation("test_not_callable", 3)
    with pytest.raises(ValueError, match="two_values must be two different"):
        lnn.register_activation("test_one_value", torch.relu, two_values=(1.0, 1.0))
    with pytest.raises(ValueError, match="breakpoints must hold finite"):
        lnn.register_activation("test_bad_breakpoint", torch.relu, breakpoints=(math.inf,))


_COMPILED = {
    "relu6": (nn.ReLU6, "fewbit"),
    "logsigmoid": (nn.LogSigmoid, "fewbit"),
    "quick_gelu": (_quick_gelu, "invact"),
}


@pytest.mark.parametrize("name", list(_COMPILED))
def test_registered_forms_compile(name):
    make, method = _COMPILED[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), make(), nn.Linear(64, 4))
    lnn.compress_activations(model, method=method, when="always")
    assert isinstance(model[1], lnn.FewBitActivation if method == "fewbit" else lnn.InvActivation)
    x = torch.randn(8, 16) * 4
    eager = model(x).square().sum()
    eager.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(x).square().sum()
    got.backward()
    assert torch.equal(got, eager)
    # As in test_activations' compile test: aot_eager decomposes the Linear backward, so the parameter
    # gradients may differ by fp32 rounding of a few sums: torch's default fp32 tolerance.
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)
