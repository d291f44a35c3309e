"""Every hyperparameter is validated wherever it enters (constructor, add_param_group, override, direct
param_groups edits, loaded state dicts); the error names the option and where it came from, and the
failed call changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit.optim as O

# (option, a bad value) pairs that torch.optim refuses in its constructors, and lowbit's layout options.
BAD = [
    ("lr", -1.0),
    ("lr", float("nan")),
    ("eps", -1e-8),
    ("betas", (2.0, 0.5)),
    ("betas", (0.9,)),
    ("weight_decay", -5.0),
    ("optim_bits", 16),
    ("block_size", 100),
    ("min_8bit_size", -1),
    ("max_unorm", -1.0),
    ("percentile_clipping", 0),
]


def _setup() -> tuple[list[nn.Parameter], O.AdamW8bit]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64))]
    opt = O.AdamW8bit([{"params": [params[0]]}, {"params": [params[1]]}], min_8bit_size=0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def _snapshot(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> tuple:
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def _assert_unchanged(before: tuple, params: list[nn.Parameter], opt: torch.optim.Optimizer) -> None:
    values, sd = before
    for p, v in zip(params, values, strict=True):
        assert torch.equal(p.detach(), v)
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"]
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            assert torch.equal(now["state"][pid][key], value), key


@pytest.mark.parametrize(("option", "value"), BAD)
def test_param_group_edits_are_refused_at_step(option, value):
    # Used to be accepted: optim_bits=16 silently ran 32-bit, a negative lr stepped uphill.
    params, opt = _setup()
    opt.param_groups[1][option] = value
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=rf"param_groups\[1\].*{option}"):
        opt.step()
    opt.param_groups[1][option] = before[1]["param_groups"][1][option]
    _assert_unchanged(before, params, opt)


@pytest.mark.parametrize(("option", "value"), BAD)
def test_override_refuses_bad_values_and_records_nothing(option, value):
    # Used to be accepted: override(p, lr=-1, eps=-1, betas=(2, .5), weight_decay=-5).
    params, opt = _setup()
    O.override(params[0], lr=0.5)
    with pytest.raises(ValueError, match=rf"lowbit.optim.override.*{option}"):
        O.override(params[0], **{option: value})
    assert O.get_override(params[0]) == {"lr": 0.5}
    O.clear_override(params[0])


@pytest.mark.parametrize(("option", "value"), BAD)
def test_add_param_group_refuses_bad_values_and_adds_nothing(option, value):
    params, opt = _setup()
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=rf"param_groups\[2\].*{option}"):
        opt.add_param_group({"params": [extra], option: value})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize(("option", "value"), BAD)
def test_constructor_refuses_bad_values(option, value):
    with pytest.raises(ValueError, match=option):
        O.AdamW([nn.Parameter(torch.zeros(3))], **{option: value})


def test_nesterov_edit_without_momentum_is_refused_at_step():
    p = nn.Parameter(torch.zeros(3))
    opt = O.SGD8bit([p], lr=0.1, momentum=0.9, nesterov=True)
    opt.param_groups[0]["momentum"] = 0.0
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"param_groups\[0\].*Nesterov"):
        opt.step()
    assert not opt.state


def test_loaded_param_groups_are_validated():
    params, opt = _setup()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["betas"] = (0.9, 1.5)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=r"state dict param_groups\[0\].*betas"):
        opt.load_state_dict(sd)
    _assert_unchanged(before, params, opt)


def _corrupt(sd: dict, key: str, fn) -> dict:
    sd = copy.deepcopy(sd)
    sd["state"][0][key] = fn(sd["state"][0][key])
    return sd


CORRUPTIONS = {
    "shape": ("state1", lambda v: v.reshape(16, 256), "shape"),
    "dtype": ("state1", lambda v: v.to(torch.int8), "dtype"),
    "negative step": ("step", lambda v: torch.tensor(-1.0), ">= 0"),
    "nan step": ("step", lambda v: torch.tensor(float("nan")), ">= 0"),
    "blocks": ("absmax1", lambda v: v[:-1], "blocks"),
    "negative absmax": ("absmax2", lambda v: -v, "scales"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_loaded_state_entries_are_validated(case):
    # Used to load: a wrong shape or dtype failed at a later step, a negative step gave a bias
    # correction of the wrong sign, a short absmax read out of bounds in the native step.
    key, fn, message = CORRUPTIONS[case]
    params, opt = _setup()
    sd = _corrupt(opt.state_dict(), key, fn)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=rf"param_groups\[0\] params\[0\].*'{key}'.*{message}"):
        opt.load_state_dict(sd)
    _assert_unchanged(before, params, opt)


def test_loaded_state_with_unknown_or_missing_keys_is_refused():
    params, opt = _setup()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1]["grad_avg"] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"param_groups\[1\] params\[0\].*'grad_avg'"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]["absmax1"]
    with pytest.raises(ValueError, match=r"param_groups\[0\] params\[0\].*'state1'.*absmax1"):
        opt.load_state_dict(sd)


def test_state_dict_of_another_model_is_refused():
    params, opt = _setup()
    other = O.AdamW8bit([nn.Parameter(torch.zeros(3, 3))], min_8bit_size=0)
    with pytest.raises(ValueError, match="has 2 param groups, this optimizer has 1"):
        other.load_state_dict(opt.state_dict())
    # Same counts, another shape: torch.optim would load it and fail (or step garbage) later.
    other = O.AdamW8bit([{"params": [nn.Parameter(torch.zeros(64, 64))]}, {"params": [nn.Parameter(torch.zeros(32))]}])
    with pytest.raises(ValueError, match=r"param_groups\[1\] params\[0\].*'state1'.*shape \(32,\)"):
        other.load_state_dict(opt.state_dict())


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("state1", torch.zeros(299), ValueError),
        ("state1", torch.zeros(64, dtype=torch.float64), TypeError),
        ("absmax1", torch.zeros(7), ValueError),
    ],
)
def test_step_errors_name_the_parameter_as_the_user_knows_it(key, value, error):
    # Used to name an index inside the fused call ("state1[1] must have ..."), which is neither the
    # parameter's group nor its place in the group.
    params = [nn.Parameter(torch.randn(64)) for _ in range(3)]
    opt = O.AdamW8bit([{"params": params[:1]}, {"params": params[1:]}], min_8bit_size=0)
    for p in params:
        p.grad = torch.randn(64)
    opt.step()
    opt.state[params[2]][key] = value
    with pytest.raises(error, match=r"param_groups\[1\] params\[1\]"):
        opt.step()
