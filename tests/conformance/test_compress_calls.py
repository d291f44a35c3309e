"""compress_activations on activation functions stored as attributes keeps every call working.

A model may call its ``self.act = F.leaky_relu`` as ``self.act(x, 0.2)``, ``self.act(x, negative_slope=0.2)``
or ``self.act(x, inplace=True)``. A call whose arguments select a function lowbit has a layer for runs that
layer (forward identical to torch's, backward identical to the lowbit layer's, in-place calls still write
into their input); any other call runs the original function unchanged, with one warning per attribute
and an entry in the report's ``fallbacks``; a call the original rejects raises the original's error.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lowbit.nn as lnn
from lowbit.memory import saved_tensor_bytes

BITS = 3


class Net(nn.Module):
    """Linear -> ``self.act(h, *args, **kwargs)`` -> Linear; ``by_keyword`` passes ``h`` as ``input=``."""

    def __init__(self, act: Any, args: tuple = (), kwargs: Optional[dict] = None, by_keyword: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 40)
        self.out = nn.Linear(40, 8)
        self.act = act
        self.call_args, self.call_kwargs, self.by_keyword = args, dict(kwargs or {}), by_keyword

    def forward(self, x: Tensor) -> Tensor:
        # Scaled so the activation sees [-10, 10] and beyond: every table interval is used.
        h = self.lin(x) * 6
        if self.by_keyword:
            y = self.act(input=h, **self.call_kwargs)
        else:
            y = self.act(h, *self.call_args, **self.call_kwargs)
        if _inplace(self.call_args, self.call_kwargs):
            # What in-place callers rely on: the input itself now holds the output.
            assert y is h
        return self.out(y)


def _inplace(args: tuple, kwargs: dict) -> bool:
    return bool(kwargs.get("inplace", False)) or any(a is True for a in args)


def _x() -> Tensor:
    return torch.randn(12, 16, generator=torch.Generator().manual_seed(1))


def _run(model: nn.Module) -> tuple[Tensor, list[Tensor]]:
    x = _x().requires_grad_(True)
    out = model(x)
    grads = torch.autograd.grad(out, [x, *model.parameters()], torch.ones_like(out))
    return out.detach(), list(grads)


def _assert_same(got: tuple[Tensor, list[Tensor]], want: tuple[Tensor, list[Tensor]]) -> None:
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


_EXACT_INVERSES = {"elu": lnn.InvELU, "selu": lnn.InvSELU, "leaky_relu": lnn.InvLeakyReLU}


def _layer(method: str, name: str) -> nn.Module:
    if method == "invact":
        return _EXACT_INVERSES[name]() if name in _EXACT_INVERSES else lnn.InvActivation(name)
    return lnn.FewBitActivation(name, 1 if name in ("relu", "leaky_relu") else BITS)


# (function, positional extras, keyword extras, method, the lowbit activation the call maps to).
SUPPORTED = [
    (F.leaky_relu, (), {"negative_slope": 0.01, "inplace": False}, "fewbit", "leaky_relu"),
    (F.leaky_relu, (0.01, True), {}, "fewbit", "leaky_relu"),
    (F.gelu, (), {"approximate": "tanh"}, "fewbit", "gelu_tanh"),
    (F.gelu, (), {"approximate": "tanh"}, "invact", "gelu_tanh"),
    (F.gelu, (), {"approximate": "none"}, "invact", "gelu"),
    (functools.partial(F.gelu, approximate="tanh"), (), {"approximate": "none"}, "fewbit", "gelu"),
    (F.elu, (), {"alpha": 1.0, "inplace": True}, "fewbit", "elu"),
    (F.softplus, (1, 20), {}, "fewbit", "softplus"),
    (F.relu, (), {"inplace": True}, "fewbit", "relu"),
    (F.relu, (True,), {}, "fewbit", "relu"),
    (F.silu, (), {"inplace": True}, "invact", "silu"),
    (F.silu, (), {"inplace": True}, "fewbit", "silu"),
    (F.mish, (True,), {}, "invact", "mish"),
    (F.hardswish, (), {"inplace": True}, "fewbit", "hardswish"),
    (F.selu, (True,), {}, "fewbit", "selu"),
    (torch.sigmoid, (), {"out": None}, "fewbit", "sigmoid"),
    (F.elu, (), {"alpha": 1.0}, "invact", "elu"),
    (F.elu, (1.0, True), {}, "invact", "elu"),
    (F.selu, (), {}, "invact", "selu"),
    (torch.selu, (), {}, "invact", "selu"),
    (F.leaky_relu, (0.01,), {"inplace": True}, "invact", "leaky_relu"),
]


def _id(case: tuple) -> str:
    fn, args, kwargs, method, _ = case
    name = getattr(fn, "__name__", None) or fn.func.__name__ + "_partial"
    return f"{name}-{args}-{kwargs}-{method}"


@pytest.mark.parametrize(("fn", "args", "kwargs", "method", "name"), SUPPORTED, ids=[_id(c) for c in SUPPORTED])
def test_calls_with_supported_arguments_use_the_lowbit_layer(fn, args, kwargs, method, name):
    original = Net(fn, args, kwargs)
    want_out = _run(original)[0]
    twin = Net(_layer(method, name))  # the lowbit layer, called plainly
    model = Net(fn, args, kwargs)
    # when="always": the call conventions are under test, not whether the swap pays (ReLU's output is saved anyway).
    report = lnn.compress_activations(model, method=method, bits=BITS, when="always")
    assert [r.path for r in report.replaced] == ["act"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _run(model)
    assert torch.equal(got[0], want_out)  # torch's forward, bit for bit
    _assert_same(got, _run(twin))  # the lowbit layer's backward, bit for bit
    assert saved_tensor_bytes(model, _x().requires_grad_(True)).total == (
        saved_tensor_bytes(twin, _x().requires_grad_(True)).total
    )
    assert report.fallbacks == []


def test_input_passed_by_keyword():
    model = Net(F.silu, kwargs={"inplace": False}, by_keyword=True)
    lnn.compress_activations(model, bits=BITS)
    _assert_same(_run(model), _run(Net(_layer("fewbit", "silu"))))


# Arguments no lowbit layer implements: the original function runs.
FALLBACK = [
    (F.leaky_relu, (0.2,), {}, "fewbit"),
    (F.leaky_relu, (), {"negative_slope": 0.2}, "fewbit"),
    (F.leaky_relu, (0.2, True), {}, "fewbit"),
    (F.elu, (0.5,), {}, "fewbit"),
    (F.elu, (0.5,), {}, "invact"),
    (F.leaky_relu, (), {"negative_slope": 0.2}, "invact"),
    (F.softplus, (), {"beta": 2.0}, "fewbit"),
    (F.softplus, (1.0, 5.0), {}, "fewbit"),
]


@pytest.mark.parametrize(("fn", "args", "kwargs", "method"), FALLBACK, ids=[_id((*c, None)) for c in FALLBACK])
def test_calls_with_other_arguments_run_the_original_and_warn_once(fn, args, kwargs, method):
    want = _run(Net(fn, args, kwargs))
    model = Net(fn, args, kwargs)
    # when="always": the call conventions are under test, not whether the swap pays (ReLU's output is saved anyway).
    report = lnn.compress_activations(model, method=method, bits=BITS, when="always")
    assert [r.path for r in report.replaced] == ["act"]
    with pytest.warns(UserWarning, match=r"act.*original") as caught:
        first = _run(model)
    assert len([w for w in caught if "lowbit" in str(w.message)]) == 1
    _assert_same(first, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per attribute, not per call
        _assert_same(_run(model), want)
    assert [path for path, _ in report.fallbacks] == ["act"]
    assert "act" in str(report)


@pytest.mark.parametrize(
    ("fn", "args", "kwargs"),
    [
        (F.gelu, (), {"approximate": "bad"}),
        (F.gelu, ("tanh",), {}),
        (F.leaky_relu, (0.2, False, 3), {}),
        (F.relu, (), {"inplace": False, "slope": 1}),
    ],
)
def test_calls_the_original_rejects_raise_the_original_error(fn, args, kwargs):
    h = torch.randn(4, 40)
    with pytest.raises(Exception) as original:
        fn(h, *args, **kwargs)
    model = Net(fn, args, kwargs)
    lnn.compress_activations(model, bits=BITS)
    with pytest.raises(original.type) as got:
        model(torch.randn(4, 16))
    assert str(got.value) == str(original.value)


def test_in_place_on_a_leaf_that_requires_grad_raises_like_torch():
    h = torch.randn(4, 40, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        F.relu(h, inplace=True)
    model = Net(F.relu, kwargs={"inplace": True})
    lnn.compress_activations(model, bits=BITS)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        model.act(h, inplace=True)


def test_compressing_twice_keeps_one_layer():
    model = Net(F.leaky_relu, (0.2,))
    lnn.compress_activations(model, bits=BITS)
    again = lnn.compress_activations(model, bits=BITS)
    assert again.replaced == []
    with pytest.warns(UserWarning, match="original"):
        _assert_same(_run(model), _run(Net(F.leaky_relu, (0.2,))))
