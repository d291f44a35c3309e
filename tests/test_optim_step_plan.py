"""The reuse of a param group's prepared step (lowbit/optim/step_plan.py).

Each test drives two copies of one optimizer through the same steps and the same edit between two steps:
``planned`` keeps its plans, as every optimizer does, and ``fresh`` drops them before every step, so each
of its steps is prepared from scratch (the path every other optimizer test checks against torch.optim and
the twins). A plan is a cache: after any edit, the two must agree bit for bit in every parameter and state
tensor. The tests also count the preparations from scratch of ``planned`` (``_fused_layout`` calls): none
on an ordinary step (else the plan saves nothing), and some after each edit that changes what the
preparation derives (else the values test could pass by luck of an edit that changed nothing).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import lowbit.optim as O
from lowbit.optim.optimizer import LowbitOptimizer

SHAPES = [[(64, 96), (96,)], [(40, 32)]]  # two param groups; each tensor spans several blocks
STEPS = 6
EDIT_STEP = 3  # the edit comes before this step

FACTORIES: dict[str, Callable[[list[dict[str, Any]]], LowbitOptimizer]] = {
    "adamw8": lambda groups: O.AdamW8bit(groups, lr=1e-2, min_8bit_size=0),
    "adam4_rank1": lambda groups: O.Adam4bit(groups, lr=1e-2, min_4bit_size=0, rank1_normalization=True),
    "adamw4_factored": lambda groups: O.AdamW4bit(groups, lr=1e-2, min_4bit_size=0, factored=True),
    "sgd8_stochastic": lambda groups: O.SGD8bit(groups, lr=1e-2, momentum=0.9, min_8bit_size=0, rounding="stochastic"),
    "lamb8": lambda groups: O.LAMB8bit(groups, lr=1e-2, min_8bit_size=0),
}


class Run:
    """One optimizer over its own copy of the parameters."""

    def __init__(self, name: str, fresh: bool) -> None:
        torch.manual_seed(0)  # the same parameters, and the same rounding_seed, for both runs
        self.groups = [[nn.Parameter(torch.randn(shape)) for shape in shapes] for shapes in SHAPES]
        self.opt = FACTORIES[name]([{"params": list(ps)} for ps in self.groups])
        self.fresh = fresh

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.opt.param_groups for p in g["params"]]

    def set_grads(self, step: int) -> None:
        gen = torch.Generator().manual_seed(100 + step)
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=gen)

    def step(self) -> None:
        if self.fresh:
            self.opt.__dict__.pop("_plans", None)
        self.opt.step()

    def tensors(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.params]
        for p in self.params:
            state = self.opt.state.get(p, {})
            out += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
        return out


def _scale_lr(run: Run) -> None:
    for g in run.opt.param_groups:
        g["lr"] *= 0.5


def _edit_hyperparameter(run: Run) -> None:
    g = run.opt.param_groups[0]
    if "betas" in g:
        g["betas"] = (0.8, 0.99)
    else:
        g["momentum"] = 0.5


def _layout_edit(run: Run) -> dict[str, Any]:
    """An option edit that changes the states' layout (factored=True needs 4-bit states, so that one drops
    the factors instead)."""
    return {"factored": False} if run.opt.defaults["factored"] else {"optim_bits": 32}


def _edit_layout(run: Run) -> None:
    run.opt.param_groups[1].update(_layout_edit(run))


def _override(run: Run) -> None:
    O.override(run.groups[0][0], **_layout_edit(run))


def _drop_grad(run: Run) -> None:
    run.groups[0][1].grad = None


def _new_storage(run: Run) -> None:
    p = run.groups[0][0]
    p.data = p.data.clone()  # same shape, another storage: the step must write the new one


def _new_state_storage(run: Run) -> None:
    state = run.opt.state[run.groups[1][0]]
    state["state1"].data = state["state1"].data.clone()  # the same tensor object on another storage


def _set_step_counter(run: Run) -> None:
    run.opt.state[run.groups[0][1]]["step"] = torch.tensor(40.0)  # a new counter: the bias corrections follow it


def _float64_step_counter(run: Run) -> None:
    # A counter the plan cannot share (not fp32): that parameter's call advances its counters one by one.
    run.opt.state[run.groups[1][0]]["step"] = torch.tensor(3.0, dtype=torch.float64)


def _edit_step_counter(run: Run) -> None:
    run.opt.state[run.groups[1][0]]["step"].fill_(20.0)  # in place: the plan stays, and the step reads 21


def _reshape(run: Run) -> None:
    p = run.groups[1][0]
    p.data = p.data.reshape(32, 40).clone()  # same numel; rank-1 statistics and factors follow the shape
    p.grad = p.grad.reshape(32, 40).clone()


def _replace_state(run: Run) -> None:
    state = run.opt.state[run.groups[0][0]]
    state["state1"] = state["state1"].clone()  # the step must update the tensor the state dict now holds


def _load_state_dict(run: Run) -> None:
    run.opt.load_state_dict(copy.deepcopy(run.opt.state_dict()))


def _grow_first_group(run: Run) -> None:
    # A later group's parameters move in the optimizer: the positions that key stochastic rounding change.
    extra = nn.Parameter(torch.ones(48, 20))
    extra.grad = torch.full((48, 20), 0.25)
    run.opt.param_groups[0]["params"].insert(0, extra)


# name -> (edit, whether it changes what a preparation derives)
EDITS: dict[str, tuple[Callable[[Run], None], bool]] = {
    "lr": (_scale_lr, False),
    "hyperparameter": (_edit_hyperparameter, True),
    "layout": (_edit_layout, True),
    "override": (_override, True),
    "no_grad": (_drop_grad, True),
    "new_storage": (_new_storage, False),
    "new_state_storage": (_new_state_storage, False),
    "set_step_counter": (_set_step_counter, True),
    "edit_step_counter": (_edit_step_counter, False),
    "float64_step_counter": (_float64_step_counter, True),
    "reshape": (_reshape, True),
    "replace_state": (_replace_state, True),
    "load_state_dict": (_load_state_dict, True),
    "grow_first_group": (_grow_first_group, True),
}


@pytest.fixture
def count_preparations(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """id(optimizer) -> its calls of ``_fused_layout`` so far."""
    counts: dict[int, int] = {}
    original = LowbitOptimizer._fused_layout

    def counted(self: LowbitOptimizer, *args: Any, **kwargs: Any) -> Any:
        counts[id(self)] = counts.get(id(self), 0) + 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LowbitOptimizer, "_fused_layout", counted)
    return counts


# A factored second moment cannot be carried to a reshaped parameter (its relayout refuses, planned or not).
CASES = [(name, edit) for name in FACTORIES for edit in EDITS if (name, edit) != ("adamw4_factored", "reshape")]


@pytest.mark.parametrize(("name", "edit"), CASES)
def test_planned_steps_equal_fresh_ones_after_each_edit(name, edit, count_preparations):
    planned, fresh = Run(name, fresh=False), Run(name, fresh=True)
    apply, changes_layout = EDITS[edit]
    try:
        for step in range(STEPS):
            for run in (planned, fresh):
                run.set_grads(step)
                if step == EDIT_STEP or (edit == "lr" and step > 0):
                    apply(run)
            before = count_preparations.get(id(planned.opt), 0)
            planned.step()
            fresh.step()
            made = count_preparations.get(id(planned.opt), 0) - before
            for a, b in zip(planned.tensors(), fresh.tensors(), strict=True):
                assert torch.equal(a, b), f"step {step}: the planned step differs from the fresh one"
            if step == 0:
                assert made == len(SHAPES), "the first step prepares each group's call"
            elif step == EDIT_STEP and changes_layout:
                assert made > 0, f"the {edit} edit must make the step prepare anew"
            elif step == EDIT_STEP + 1 and edit == "no_grad":
                assert made > 0, "the gradient is back: the step prepares anew"
            elif step != EDIT_STEP:
                assert made == 0, f"step {step}: an unchanged group must reuse its plan"
    finally:
        for run in (planned, fresh):
            O.clear_override(run.params)
    initial = [p for g in Run(name, fresh=True).groups for p in g]
    for p, q in zip([p for g in planned.groups for p in g], initial, strict=True):
        assert not torch.equal(p, q), "every parameter must have moved"


def test_a_refused_step_leaves_no_plan_behind(count_preparations):
    """A step refused by the second group's checks (a sparse gradient), at the first step (the first group's
    states were just created, then removed) and at a later one, changes nothing, and the steps after the
    gradient is fixed equal a fresh optimizer's."""
    planned, fresh = Run("adamw8", fresh=False), Run("adamw8", fresh=True)
    for step in range(4):
        for run in (planned, fresh):
            run.set_grads(step)
        if step in (0, 2):
            for run in (planned, fresh):
                good = run.groups[1][0].grad
                run.groups[1][0].grad = good.to_sparse()
                before = [t.clone() for t in run.tensors()]
                with pytest.raises(RuntimeError, match="sparse gradients"):
                    run.step()
                after = run.tensors()
                assert len(after) == len(before), "a refused step creates no state"
                for a, b in zip(after, before, strict=True):
                    assert torch.equal(a, b), "a refused step changes no parameter or state"
                run.groups[1][0].grad = good
        planned.step()
        fresh.step()
        for a, b in zip(planned.tensors(), fresh.tensors(), strict=True):
            assert torch.equal(a, b)


def test_a_copied_optimizer_prepares_its_own_step(count_preparations):
    """``copy.deepcopy`` of an optimizer with plans: the copy steps its own parameters (a plan holding the
    original's tensors would write those), as a fresh copy does."""
    planned = Run("adamw8", fresh=False)
    for step in range(2):
        planned.set_grads(step)
        planned.step()
    model_and_opt = copy.deepcopy((planned.groups, planned.opt))
    groups, opt = model_and_opt
    originals = [t.clone() for t in planned.tensors()]
    for p in [p for g in opt.param_groups for p in g["params"]]:
        p.grad = torch.ones_like(p)
    opt.step()
    for a, b in zip(planned.tensors(), originals, strict=True):
        assert torch.equal(a, b), "stepping the copy must not touch the original"
    assert count_preparations.get(id(opt), 0) == len(SHAPES), "the copy prepares its steps anew"


def test_step_counters_advance_as_torch_optims_do():
    """The planned step's shared counters (FusedLayout.share_counters) against torch.optim.AdamW's: the same
    values each step, for a parameter that skips steps (no gradient) too; 0-d fp32 CPU tensors, each an
    object of its own, updated in place as autograd's version counters see. A new plan (here when the
    skipping parameter's gradient comes back at step 3) gives the counters new objects, with the same values;
    while a plan is kept they keep their identity."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt, ref = O.AdamW8bit(ours, lr=1e-2, min_8bit_size=0), torch.optim.AdamW(theirs, lr=1e-2)
    held: dict[int, torch.Tensor] = {}
    for step in range(5):
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            skip = i == 2 and step in (1, 2)
            p.grad = None if skip else torch.full_like(p, 0.1)
            q.grad = None if skip else torch.full_like(q, 0.1)
        before = {i: opt.state[p]["step"] for i, p in enumerate(ours) if p in opt.state}
        versions = {i: t._version for i, t in before.items()}
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            counter = opt.state[p]["step"]
            assert counter.dtype == torch.float32 and counter.dim() == 0 and counter.device.type == "cpu"
            assert counter.item() == ref.state[q]["step"].item()
            if i in before and before[i] is counter and p.grad is not None:
                assert counter._version > versions[i], "the step's update must bump the counter's version"
            if step == 4:
                assert counter is held[i], "a plan kept from step to step keeps the counter objects"
            held[i] = counter
    assert len({id(opt.state[p]["step"]) for p in ours}) == len(ours)
