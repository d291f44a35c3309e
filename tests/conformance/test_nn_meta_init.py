"""Every ``lowbit.nn`` layer follows torch's meta-device habits: it builds under ``torch.device("meta")``
without touching memory, and ``to_empty`` (plus ``reset_parameters`` where it has parameters, as torch's
own layers need) gives the module a CPU-built twin would be, bit for bit, forward and backward. Dtype
casts and deepcopy keep the constant lookup tables intact.

The layers are discovered from ``lowbit.nn.__all__``, so a new layer is covered without editing this file;
one whose constructor needs arguments or whose input is not a float tensor must be added to ``_SPECIAL``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import lowbit.lpmm
import lowbit.nn as lnn
import lowbit.optim
from lowbit.memory import saved_tensor_bytes
from lowbit.nn import fewbit, invact


def _float_input(gen: torch.Generator, args: tuple) -> Tensor:
    # Spans the tables' interval [-10, 10] and beyond, so every interval of a table is hit.
    return torch.randn(6, 37, generator=gen) * 4


def _ids(gen: torch.Generator, args: tuple) -> Tensor:
    return torch.randint(0, 11, (5, 7), generator=gen)


# Registered activations: an exact two-valued form (1 bit, the code of f'(x)) and a derived few-bit table.
_REGISTERED = (
    lnn.register_activation(
        "conformance_relu6",
        torch.nn.functional.relu6,
        lambda x: torch.ops.aten.hardtanh_backward(torch.ones_like(x), x, 0.0, 6.0),
        two_values=(0.0, 1.0),
    ),
    lnn.register_activation("conformance_logsigmoid", torch.nn.functional.logsigmoid),
)


# class -> (constructor variants as (args, kwargs), input factory of (generator, args)). Anything else in
# __all__ that is an nn.Module is built with no arguments and fed ``_float_input``.
Factory = Callable[[torch.Generator, tuple], Tensor]
_SPECIAL: dict[type, tuple[list[tuple[tuple, dict]], Factory]] = {
    lnn.FewBitActivation: (
        [((name,), {"bits": fewbit.table_bits(name)[-1]}) for name in (*fewbit.ACTIVATIONS, *_REGISTERED)],
        _float_input,
    ),
    lnn.InvActivation: ([((name,), {}) for name in invact.INVERTIBLE], _float_input),
    # The exactly inverted layers hold no tensors; non-default parameters too (the in-place forms, like
    # torch's, refuse the leaf inputs used here: test_invact runs them on non-leaf ones).
    lnn.InvELU: ([((), {}), ((0.5,), {})], _float_input),
    lnn.InvCELU: ([((), {}), ((0.7,), {})], _float_input),
    lnn.InvLeakyReLU: ([((), {}), ((0.2,), {}), ((0.0,), {})], _float_input),
    lnn.ApproxBNReLULinear: (
        [((9, 5), {}), ((9, 5), {"bias": False, "bits": 4})],
        lambda g, a: torch.randn(8, a[0], generator=g),
    ),
    lnn.ApproxBNReLUConv2d: (
        [((3, 4, 3), {"padding": 1}), ((4, 4, 3), {"groups": 2, "bias": False, "bits": 4})],
        lambda g, a: torch.randn(2, a[0], 6, 5, generator=g),
    ),
    lnn.Embedding: ([((11, 6), {}), ((11, 6), {"padding_idx": 2})], _ids),
    lnn.StableEmbedding: ([((11, 6), {}), ((11, 6), {"padding_idx": 2})], _ids),
}


def _layer_classes() -> list[type]:
    return [obj for name in lnn.__all__ if isinstance(obj := getattr(lnn, name), type) and issubclass(obj, nn.Module)]


def _cases() -> list[Any]:
    out = []
    for cls in _layer_classes():
        variants, make_input = _SPECIAL.get(cls, ([((), {})], _float_input))
        for i, (args, kwargs) in enumerate(variants):
            out.append(pytest.param(cls, args, kwargs, make_input, id=f"{cls.__name__}-{i}"))
    return out


CASES = _cases()


def _input_for(make_input: Factory, args: tuple) -> Tensor:
    return make_input(torch.Generator().manual_seed(1), args)


def _materialize(module: nn.Module) -> None:
    """What FSDP and torch's meta-init recipes do: ``to_empty``, then ``reset_parameters`` on every
    submodule that owns parameters itself (torch's layers re-initialise their buffers there too)."""
    module.to_empty(device="cpu")
    for m in module.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.reset_parameters()


def _run(module: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Output, then the gradients of the input (if floating) and of every parameter, in training mode."""
    module.train()
    x = x.clone().requires_grad_(x.is_floating_point())
    out = module(x)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    leaves = ([x] if x.requires_grad else []) + list(module.parameters())
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), [g.detach() for g in grads]


def _assert_same_tensors(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].device == want[k].device, k
        assert torch.equal(got[k], want[k]), k


def _assert_same_run(got: nn.Module, want: nn.Module, x: Tensor) -> None:
    out_got, grads_got = _run(got, x)
    out_want, grads_want = _run(want, x)
    assert torch.equal(out_got, out_want)
    assert len(grads_got) == len(grads_want)
    for a, b in zip(grads_got, grads_want, strict=True):
        assert torch.equal(a, b)


def test_every_layer_is_covered():
    """A layer that cannot be built without arguments must say how in _SPECIAL."""
    assert len(_layer_classes()) >= 20
    for cls in _layer_classes():
        if cls not in _SPECIAL:
            cls()


@pytest.mark.parametrize(("cls", "args", "kwargs", "make_input"), CASES)
def test_meta_construction_allocates_nothing(cls, args, kwargs, make_input):
    with torch.device("meta"):
        module = cls(*args, **kwargs)
    tensors = list(module.parameters()) + list(module.buffers())
    assert all(t.is_meta for t in tensors), [t.device for t in tensors]


@pytest.mark.parametrize(("cls", "args", "kwargs", "make_input"), CASES)
def test_to_empty_then_reset_matches_a_cpu_built_twin(cls, args, kwargs, make_input):
    torch.manual_seed(0)
    want = cls(*args, **kwargs)
    with torch.device("meta"):
        got = cls(*args, **kwargs)
    torch.manual_seed(0)
    _materialize(got)
    # Non-persistent buffers (the activation tables) are compared too: to_empty must not leave garbage.
    _assert_same_tensors(dict(got.named_buffers()), dict(want.named_buffers()))
    _assert_same_tensors(dict(got.named_parameters()), dict(want.named_parameters()))
    _assert_same_tensors(got.state_dict(), want.state_dict())
    x = _input_for(make_input, args)
    _assert_same_run(got, want, x)
    # And the twin survives a copy the way torch modules do.
    _assert_same_run(copy.deepcopy(got), want, x)


@pytest.mark.parametrize(("cls", "args", "kwargs", "make_input"), CASES)
def test_to_empty_on_a_cpu_module_then_reset_matches(cls, args, kwargs, make_input):
    """to_empty on an already materialised module (FSDP's re-materialisation path) drops the data too."""
    torch.manual_seed(0)
    want = cls(*args, **kwargs)
    torch.manual_seed(0)
    got = cls(*args, **kwargs)
    with torch.no_grad():
        for t in list(got.parameters()) + list(got.buffers()):
            t.fill_(7) if t.is_floating_point() else t.fill_(3)
    torch.manual_seed(0)
    _materialize(got)
    _assert_same_tensors(dict(got.named_buffers()), dict(want.named_buffers()))
    _assert_same_run(got, want, _input_for(make_input, args))


def _parameterless_cases() -> list[Any]:
    return [c for c in CASES if not any(True for _ in c.values[0](*c.values[1], **c.values[2]).parameters())]


@pytest.mark.parametrize(("cls", "args", "kwargs", "make_input"), _parameterless_cases())
@pytest.mark.parametrize("cast", ["half", "double", "bfloat16", "float64"])
def test_dtype_casts_keep_the_tables(cls, args, kwargs, make_input, cast):
    """``model.half()`` and friends cast parameters; an activation's fp32 lookup tables are constants
    and must stay as they are, so the layer keeps working on the inputs it accepts."""
    want = cls(*args, **kwargs)
    got = cls(*args, **kwargs)
    got = got.to(torch.float64) if cast == "float64" else getattr(got, cast)()
    _assert_same_tensors(dict(got.named_buffers()), dict(want.named_buffers()))
    x = _input_for(make_input, args)
    _assert_same_run(got, want, x)
    _assert_same_run(got, want, x.half())
    _assert_same_run(copy.deepcopy(got), want, x.bfloat16())


def test_lpmm_model_converted_on_meta_loads_after_to_empty():
    # Used to fail in to_empty ("Cannot copy out of meta tensor"): the storage and its handle were moved
    # with .to(), which a meta tensor cannot do.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    weights = ref.state_dict()
    lowbit.lpmm.convert(ref, rounding="nearest")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    lowbit.lpmm.convert(model, rounding="nearest")
    model.to_empty(device="cpu")
    model.load_state_dict(weights)
    x = torch.randn(4, 8)
    assert torch.equal(model(x), ref(x))
    for m in (model, ref):
        opt = lowbit.optim.LPMMAdamW(m.parameters(), lr=0.1, rounding="nearest")
        m(x).square().sum().backward()
        assert all(not lp.grad_absmax.isnan().any() for lp in lowbit.lpmm.low_precision_parameters(m).values())
        opt.step()
    assert torch.equal(model(x), ref(x))


def _blpa_pair() -> tuple[nn.Module, nn.Module, Tensor]:
    """A BatchNorm2d -> ReLU -> Conv2d unit and its compress_activations(method="blpa") conversion."""
    torch.manual_seed(0)
    exact = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1))
    x = torch.randn(3, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    converted = copy.deepcopy(exact)
    assert len(lnn.compress_activations(converted, method="blpa", bits=4, sample_args=(x,)).replaced) == 1
    return exact, converted, x


def test_blpa_converted_unit_to_empty_then_reset_matches_torchs():
    """The stand-ins are torch's layer classes underneath: FSDP's re-materialisation recipe gives the
    parameters and buffers torch's layers get, and the unit still runs through the codes."""
    exact, converted, x = _blpa_pair()
    for m in (exact, converted):
        torch.manual_seed(0)
        _materialize(m)
    _assert_same_tensors(converted.state_dict(), exact.state_dict())
    assert torch.equal(converted(x), exact(x))
    assert saved_tensor_bytes(converted, x).total < saved_tensor_bytes(exact, x).total


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_blpa_converted_unit_dtype_casts(cast):
    """Cast like torch's layers; fp16 and bf16 keep the codes (forward equal to torch's), float64, which the
    kernels lack, runs torch's layers: forward and gradients equal to torch's."""
    exact, converted, x = _blpa_pair()
    exact, converted = getattr(exact, cast)(), getattr(converted, cast)()
    x = x.to(converted[0].weight.dtype)
    assert torch.equal(converted(x), exact(x))
    saved, torch_saved = saved_tensor_bytes(converted, x).total, saved_tensor_bytes(exact, x).total
    if cast == "double":
        assert saved == torch_saved
        _assert_same_run(converted, exact, x)
    else:
        assert saved < torch_saved
