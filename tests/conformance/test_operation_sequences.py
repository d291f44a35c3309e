"""Random sequences of optimizer operations on a lowbit optimizer and on its torch.optim reference: steps
with fresh, partly zero or non-finite gradients, ``zero_grad`` both ways, hyperparameter edits through
``param_groups`` (refused ones included), tensor learning rates, state dict round trips (in memory and
through ``torch.save``) into fresh optimizers, and loading the reference's state dict.

Each run keeps four optimizers on four copies of the parameters: ``main`` takes every operation,
``plain`` the same ones except the round trips of its own state and the refused edits, ``released`` the
same as ``plain`` under gradient release (:func:`lowbit.optim.step_in_backward`: each step's gradients
come from a backward pass, which steps each parameter in its hook and frees its gradient; its round trips
load its own state dict while release is on), and ``ref`` is torch.optim. ``main`` and ``released`` must
stay bit-identical to ``plain`` (a round trip or a refused step changes nothing; release is the ordinary
loop), and all must follow ``ref``: fp32 states to rounding; quantized (8- and 4-bit) parameters within
the measured drift bound of their width, and quantized states, decoded, element by element within the bound
their map's code gaps give (``Run._advance_bounds``), with the same step counters and state names. With
``rounding="stochastic"`` (``STOCHASTIC``) every lowbit optimizer of a run holds the same ``rounding_seed``, so
``main``, ``released`` and ``plain`` still agree bit for bit, and each encode of a step may move a state by a
whole code gap.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import lowbit.optim as O
from lowbit._reference.ademamix import ReferenceAdEMAMix
from lowbit.optim.state_storage import optimizer_state_map
from tests.blocks import half_code_gap
from tests.test_optim import DEFAULT_BOUNDS, FOUR_BIT_BOUNDS, _grad, _relative


@dataclasses.dataclass(frozen=True)
class Case:
    cls: type
    tcls: type
    kw: dict[str, Any]
    edits: tuple[str, ...]
    bits: int = 8  # the width of the quantized states (unused by the fp32 twins)
    matrices: bool = False  # Muon: both parameters are matrices
    # lowbit-only layout options of the quantized optimizer (torch's takes none), part of the case's name.
    layout: dict[str, Any] = dataclasses.field(default_factory=dict)


# Muon's reference, torch.optim.Muon, takes no foreach option and decays the weights decoupled, as AdamW.
MUON = dict(lr=2e-2, weight_decay=0.1)


TWINS = [
    Case(O.Adam32bit, torch.optim.Adam, dict(lr=1e-3), ("lr", "weight_decay", "betas")),
    Case(O.AdamW32bit, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1), ("lr", "weight_decay", "betas")),
    Case(O.SGD32bit, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1), ("lr", "weight_decay")),
    Case(O.RMSprop32bit, torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9), ("lr", "weight_decay")),
    Case(
        O.Adagrad32bit,
        torch.optim.Adagrad,
        dict(lr=1e-2, lr_decay=1e-3, initial_accumulator_value=0.1),
        ("lr", "weight_decay"),
    ),
    Case(O.Muon32bit, torch.optim.Muon, MUON, ("lr", "weight_decay"), matrices=True),
    # AdEMAMix has no torch.optim class: its reference is the pure-PyTorch formula, with the warm-ups on.
    Case(O.AdEMAMix32bit, ReferenceAdEMAMix, dict(lr=1e-3, t_alpha=6, t_beta3=6), ("lr", "weight_decay")),
]
QUANTIZED = [
    Case(O.Adam8bit, torch.optim.Adam, dict(lr=1e-3), ("lr", "weight_decay", "betas")),
    Case(O.AdamW8bit, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1), ("lr", "weight_decay", "betas")),
    Case(O.SGD8bit, torch.optim.SGD, dict(lr=1e-2, momentum=0.9), ("lr", "weight_decay")),
    Case(O.Adam4bit, torch.optim.Adam, dict(lr=1e-3), ("lr", "weight_decay", "betas"), bits=4),
    Case(O.AdamW4bit, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1), ("lr", "weight_decay", "betas"), bits=4),
    # The opt-in rank-1 second moment (include/lowbit/rank1.h) of the first parameter, a matrix.
    Case(
        O.AdamW4bit,
        torch.optim.AdamW,
        dict(lr=1e-3, weight_decay=0.1),
        ("lr", "weight_decay", "betas"),
        bits=4,
        layout={"rank1_normalization": True},
    ),
    Case(O.SGD4bit, torch.optim.SGD, dict(lr=1e-2, momentum=0.9), ("lr", "weight_decay"), bits=4),
    Case(O.Muon8bit, torch.optim.Muon, MUON, ("lr", "weight_decay"), matrices=True),
    Case(O.AdEMAMix8bit, ReferenceAdEMAMix, dict(lr=1e-3, t_alpha=6, t_beta3=6), ("lr", "weight_decay")),
]
# Stochastic rounding of the states (rounding="stochastic"): a 4-bit and an 8-bit rule, one with decoupled
# weight decay and one whose L2 decay feeds the drifted parameter back into the states.
STOCHASTIC = [
    Case(
        O.AdamW4bit,
        torch.optim.AdamW,
        dict(lr=1e-3, weight_decay=0.1),
        ("lr", "weight_decay", "betas"),
        bits=4,
        layout={"rounding": "stochastic"},
    ),
    Case(
        O.Adam8bit, torch.optim.Adam, dict(lr=1e-3), ("lr", "weight_decay", "betas"), layout={"rounding": "stochastic"}
    ),
]

# Quantized parameters' drift from torch, relative to how far torch moved them: tests/test_optim.py's
# 100-step bounds (DEFAULT_BOUNDS[1] at 8 bits, FOUR_BIT_BOUNDS[1] at 4: twice the worst measured drift).
# These sequences are at most 14 steps long, and loading torch's state only re-syncs the states.
DRIFT_BOUNDS = {8: DEFAULT_BOUNDS[1], 4: FOUR_BIT_BOUNDS[1]}
# The same drift under stochastic rounding, measured as those were (a one-off script: tests/test_optim.py's
# CASES with rounding="stochastic", seeds 1000-1019, n = 20000, 100 steps): worst 4.53% (Adam8bit), 4.51%
# (AdamW8bit), 3.45% (SGD8bit); 56.0% (Adam4bit), 55.8% (AdamW4bit), 51.7% (SGD4bit); medians within 2.5% of
# the worst. Over these sequences (the STOCHASTIC cases, 300 hypothesis examples each): worst 2.2% (Adam8bit,
# against 1.1% with nearest rounding) and 27.6% (AdamW4bit). Bound at 8 bits twice the 100-step worst; at 4 bits
# twice would pass 1 (a parameter that does not move), so FOUR_BIT_BOUNDS[1], 1.2 times the 100-step worst and
# 2.4 times the worst over these sequences.
STOCHASTIC_DRIFT_BOUNDS = {8: 0.09, 4: FOUR_BIT_BOUNDS[1]}

# fp32 rounding around one encode: the normalisation x / absmax and the decode code * absmax each round
# by at most 2^-24 relative, and the update that feeds the encoder by a few more ulps; 2^-20 of the block
# absmax covers them with room to spare.
ENCODE_ROUNDING = 2.0**-20
# Both recurrences (lowbit's and torch's) round each state element by a few ulps of its value per step,
# over at most 14 steps: under 1e-5 of the value.
STEP_ROUNDING = 1e-5

LR_FACTORS = (0.1, 0.5, 2.0)
EDIT_VALUES = {
    "weight_decay": (0.0, 0.01, 0.1),
    "betas": ((0.9, 0.999), (0.8, 0.99), (0.95, 0.9999), (0.0, 0.99)),
}
# Values every lowbit optimizer refuses when step() reads them from a param group.
BAD_EDITS = [("lr", -1e-3), ("lr", float("nan")), ("weight_decay", -0.1), ("betas", (1.0, 0.999))]
# Gradient kinds: "keep" leaves the gradient as it is (None after zero_grad(set_to_none=True), zeros
# after zero_grad(set_to_none=False)).
GRAD_KINDS = ("dense", "dense", "rows", "nonfinite", "keep")


def _ops(case: Case, quantized: bool) -> st.SearchStrategy[list[tuple]]:
    # A gradient element of 1e21 overflows its square: torch then freezes the element (v = inf), while an
    # 8-bit state element restarts from zero (optimizer.py's policy), so 1e21 is only fed to fp32 twins.
    nonfinite = (float("nan"), float("inf"), float("-inf")) + (() if quantized else (1e21,))
    kinds = st.sampled_from(GRAD_KINDS)
    edits = [("lr", f) for f in LR_FACTORS] + [(k, v) for k in case.edits if k != "lr" for v in EDIT_VALUES[k]]
    bad = [(k, v) for k, v in BAD_EDITS if k in case.edits]
    return st.lists(
        st.one_of(
            st.tuples(st.just("step"), st.tuples(kinds, kinds), st.integers(0, 2**31 - 1), st.sampled_from(nonfinite)),
            st.tuples(st.just("zero_grad"), st.booleans()),
            st.tuples(st.just("edit"), st.integers(0, 1), st.sampled_from(edits)),
            st.tuples(st.just("bad_edit"), st.integers(0, 1), st.sampled_from(bad)),
            st.tuples(st.just("round_trip"), st.booleans()),
            st.tuples(st.just("load_torch")),
        ),
        min_size=1,
        max_size=14,
    )


@st.composite
def scenarios(draw: st.DrawFn, case: Case, quantized: bool) -> dict[str, Any]:
    return dict(
        shapes=[
            (draw(st.integers(5, 30)), draw(st.sampled_from([61, 128]))),
            (draw(st.sampled_from([61, 128])), draw(st.integers(5, 30)))
            if case.matrices
            else (draw(st.sampled_from([300, 1000, 4097])),),
        ],
        seed=draw(st.integers(0, 2**31 - 1)),
        tensor_lr=draw(st.booleans()),
        block_size=draw(st.sampled_from([64, 256, 2048])),
        ops=draw(_ops(case, quantized)),
    )


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of tensors (NaNs included), else ``==``."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _reloaded(state_dict: dict[str, Any], via_bytes: bool) -> dict[str, Any]:
    """``state_dict``, or what ``torch.load`` reads back from it after ``torch.save``."""
    if not via_bytes:
        return state_dict
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class Run:
    """The three optimizers of one scenario and the step counts torch.optim would keep."""

    def __init__(self, case: Case, quantized: bool, scenario: dict[str, Any]) -> None:
        self.case, self.quantized = case, quantized
        self.block_size = scenario["block_size"]
        self.options = dict(min_8bit_size=0, block_size=self.block_size) if quantized else {}
        if quantized and case.bits == 4:
            self.options["min_4bit_size"] = 0
        if quantized:
            self.options |= case.layout
        self.stochastic = self.options.get("rounding") == "stochastic"
        # The lowbit optimizers of the run are built after torch.manual_seed(rounding_torch_seed), so all draw
        # the same rounding_seed and main, plain and released round alike; those built to load a state dict
        # (_fresh) after torch.manual_seed(rounding_torch_seed + 1), so they draw another, which a round trip must
        # replace with the saved one (a torch.optim state dict has none: the three fresh ones keep theirs).
        self.rounding_torch_seed = scenario["seed"]
        gen = torch.Generator().manual_seed(scenario["seed"])
        self.p0 = [torch.randn(s, generator=gen) * 0.1 for s in scenario["shapes"]]
        self.tensor_lr = scenario["tensor_lr"]
        self.main_params, self.plain_params, self.released_params, self.ref_params = (
            [nn.Parameter(p.clone()) for p in self.p0] for _ in range(4)
        )
        self.main = self._make(case.cls, self.main_params, self.options)
        self.plain = self._make(case.cls, self.plain_params, self.options)
        self.released = self._make(case.cls, self.released_params, self.options)
        self.release = O.step_in_backward(self.released)
        self.ref = self._make(case.tcls, self.ref_params, {} if case.matrices else dict(foreach=False))
        self.steps = [0] * len(self.p0)
        # Per parameter and torch state name: the bound on |decoded quantized state - torch's| per element.
        self.bounds: list[dict[str, Tensor]] = [{} for _ in self.p0]

    def _lr(self, value: float) -> Any:
        return torch.tensor(value) if self.tensor_lr else value

    def _make(self, cls: type, params: list[nn.Parameter], options: dict[str, Any]) -> torch.optim.Optimizer:
        kw = dict(self.case.kw, lr=self._lr(self.case.kw["lr"]))
        # The second group has its own learning rate.
        groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": self._lr(self.case.kw["lr"] * 0.5)}]
        torch.manual_seed(self.rounding_torch_seed)
        return cls(groups, **kw, **options)

    def _fresh(self, params: list[nn.Parameter], state_dict: dict[str, Any]) -> torch.optim.Optimizer:
        # Built with the class defaults: the hyperparameters must come from the state dict.
        torch.manual_seed(self.rounding_torch_seed + 1)
        opt = self.case.cls([{"params": [p]} for p in params], **self.options)
        opt.load_state_dict(state_dict)
        return opt

    def _all(self) -> list[tuple[torch.optim.Optimizer, list[nn.Parameter]]]:
        return [(self.main, self.main_params), (self.plain, self.plain_params), (self.ref, self.ref_params)]

    # -- operations ------------------------------------------------------------------------------

    def apply(self, op: tuple) -> None:
        getattr(self, f"_{op[0]}")(*op[1:])
        self.check()

    def _step(self, kinds: tuple[str, str], seed: int, bad_value: float) -> None:
        gen = torch.Generator().manual_seed(seed)
        injected = []
        for j, (kind, p0) in enumerate(zip(kinds, self.p0, strict=True)):
            if kind == "keep":
                continue
            g = _grad(gen, p0.numel())
            if kind == "rows":  # all-zero rows (spans of 16 elements in the 1-D parameter)
                rows = g.view(p0.shape[0], -1) if p0.dim() > 1 else g.view(-1, 1)
                keep = torch.rand(rows.shape[0], generator=gen) < 0.3
                if p0.dim() == 1:
                    keep = (torch.rand((rows.shape[0] + 15) // 16, generator=gen) < 0.3).repeat_interleave(16)
                    keep = keep[: rows.shape[0]]
                rows[~keep] = 0.0
            if kind == "nonfinite":
                i = int(torch.randint(0, p0.numel(), (1,), generator=gen))
                g[i] = bad_value
                injected.append((j, i))
            for _, params in self._all():
                params[j].grad = g.view(p0.shape).clone()
        before = [
            (a.detach().clone(), b.detach().clone()) for a, b in zip(self.main_params, self.ref_params, strict=True)
        ]
        for opt, _ in self._all():
            opt.step()
        self._released_step()
        if self.quantized:
            for j, p in enumerate(self.main_params):
                if p.grad is not None:
                    self._advance_bounds(j, *before[j], p.grad)
        for j, p in enumerate(self.main_params):
            self.steps[j] += p.grad is not None
        for j, i in injected:
            if not math.isfinite(bad_value):  # torch.optim makes the element non-finite, and so does lowbit
                assert not bool(self.ref_params[j].view(-1)[i].isfinite())
                assert not bool(self.main_params[j].view(-1)[i].isfinite())
            if self.quantized:
                self._check_restart(self.main_params[j], i)

    def _released_step(self) -> None:
        """The step of ``released``: one backward pass whose gradient for each parameter is the one the
        ordinary optimizers stepped on (fresh, or kept from before: then zeros or the last one), and none
        for a parameter without one. d/dp sum(p * g) = 1 * g, exactly g, non-finite elements included."""
        pairs = zip(self.released_params, self.plain_params, strict=True)
        terms = [(p * q.grad).sum() for p, q in pairs if q.grad is not None]
        if terms:
            torch.stack(terms).sum().backward()
        assert all(p.grad is None for p in self.released_params)  # each freed after its step
        self.released.step()  # a no-op under release, as in a user's unchanged loop

    def _check_restart(self, p: nn.Parameter, i: int) -> None:
        # optimizer.py: a quantized state element that becomes non-finite restarts from zero (a second moment,
        # on the zero-free map, at its block's smallest value, or the floor of its rank-1 scale); the rest of
        # the block keeps finite values.
        state = self.main.dequantized_state(p)
        block = slice(i - i % self.block_size, i - i % self.block_size + self.block_size)
        for name, signed in zip(self.main._state_names, self.main._state_signed, strict=True):
            if name not in state:  # an option's state (amsgrad's max_exp_avg_sq) that is not in use
                continue
            value = state[name].view(-1)
            assert bool(value[block].isfinite().all()), name
            k = self.main._state_names.index(name)
            if signed:
                assert float(value[i]) == 0.0, name
            elif f"axis_max{k + 1}" in self.main.state[p]:
                # Rank-1 (include/lowbit/rank1.h): at the map's floor of its own scale, the min over the axes
                # of its axis maxima: (scale / 16)^2.
                stats = self.main.state[p][f"axis_max{k + 1}"].split(list(p.shape))
                index = torch.unravel_index(torch.tensor(i), p.shape)
                scale = min(float(m[int(a)]) for m, a in zip(stats, index, strict=True))
                floor = float(optimizer_state_map(False, torch.device("cpu"), 4)[0]) * scale
                assert float(value[i]) == pytest.approx(floor * floor, rel=1e-6), name
            else:
                assert float(value[i]) == float(value[block].min()), name

    def _zero_grad(self, set_to_none: bool) -> None:
        for opt, _ in self._all():
            opt.zero_grad(set_to_none=set_to_none)
        self.released.zero_grad(set_to_none=set_to_none)  # a no-op under release: no gradient to clear

    def _edit(self, index: int, edit: tuple[str, Any]) -> None:
        key, value = edit
        if key == "lr":
            value = self.case.kw["lr"] * value
        for opt, _ in [*self._all(), (self.released, self.released_params)]:
            group = opt.param_groups[index]
            if key == "lr" and isinstance(group["lr"], Tensor):
                group["lr"].fill_(value)
            else:
                group[key] = value

    def _bad_edit(self, index: int, edit: tuple[str, Any]) -> None:
        key, value = edit
        group = self.main.param_groups[index]
        old = group[key]
        group[key] = value
        before = self._snapshot()
        with pytest.raises(ValueError, match=key if key != "betas" else "beta"):
            self.main.step()
        self._assert_snapshot(before)
        group[key] = old

    def _round_trip(self, via_bytes: bool) -> None:
        self.main = self._fresh(self.main_params, _reloaded(self.main.state_dict(), via_bytes))
        # The released optimizer reloads its own state dict in place, its hooks still registered.
        self.released.load_state_dict(_reloaded(self.released.state_dict(), via_bytes))

    def _load_torch(self) -> None:
        self.main = self._fresh(self.main_params, self.ref.state_dict())
        self.plain = self._fresh(self.plain_params, self.ref.state_dict())
        self.release.remove()
        self.released = self._fresh(self.released_params, self.ref.state_dict())
        self.release = O.step_in_backward(self.released)
        for j, p in enumerate(self.ref_params):
            state = self.ref.state[p]
            # torch.optim.SGD keeps no step count: lowbit counts a loaded momentum buffer as one step.
            self.steps[j] = int(state["step"]) if "step" in state else int(bool(state))
            if self.quantized:
                # Torch's fp32 state, encoded once to nearest (a load rounds to nearest whatever ``rounding``).
                self.bounds[j] = {name: self._encode_error(j, name, stochastic=False) for name in self._stored(j)}

    # -- bounds of the quantized states--------------------------------------------------------------

    def _stored(self, j: int) -> list[str]:
        state = self.main.state.get(self.main_params[j], {})
        return [name for k, name in enumerate(self.main._state_names) if f"state{k + 1}" in state]

    def _encode_error(self, j: int, name: str, stochastic: bool) -> Tensor:
        """The most the last encode of state ``name`` of parameter j moved each element: half a code gap
        times its block's absmax (that of the values encoded, which the state stores), plus rounding; twice
        that if the encode was ``stochastic`` (it picks either code bracketing the value, so it may move it
        by a whole gap, where nearest moves it by half of one; below the 4-bit root map's floor both take the
        floor, a distance the half-gap bound already covers). A second moment v is stored as its root w,
        whose encode moves it by at most d = that much; then |w'^2 - w^2| = |w' - w| (w' + w) <= d (2 w' + d),
        with w' the decoded root."""
        p = self.main_params[j]
        k = self.main._state_names.index(name)
        signed = self.main._state_signed[k]
        state = self.main.state[p]
        # The layout the case asked for: rank-1 exactly for the second moment of the matrix when opted in.
        ranked = bool(self.case.layout.get("rank1_normalization")) and not signed and p.dim() >= 2
        assert (f"axis_max{k + 1}" in state) == ranked, (name, sorted(state))
        if ranked:
            # A rank-1 normalised second moment (include/lowbit/rank1.h): each element's scale is the min over
            # the axes of its axis maxima, which takes the place of the block absmax.
            parts = state[f"axis_max{k + 1}"].split(list(p.shape))
            views = [m.view([-1 if a == i else 1 for i in range(p.dim())]) for a, m in enumerate(parts)]
            absmax = functools.reduce(torch.minimum, views).expand(p.shape).reshape(-1)
        else:
            absmax = state[f"absmax{k + 1}"].repeat_interleave(self.block_size)[: p.numel()]
        d = ((2 if stochastic else 1) * (half_code_gap(signed, self.case.bits) + ENCODE_ROUNDING) * absmax).view(
            p.shape
        )
        if signed:
            return d
        root = self.main.dequantized_state(p)[name].sqrt()
        return d * (2 * root + d)

    def _advance_bounds(self, j: int, main_before: Tensor, ref_before: Tensor, grad: Tensor) -> None:
        """Carry the state bounds of parameter j through a step taken with ``grad``.

        Each state follows s' = a s + b f(g) in torch and in lowbit, where lowbit then encodes s'. With
        e the bound before the step, the new one is a e + (the difference of the b f(g) terms) + the
        encode's error. The b f(g) terms differ only through L2 weight decay (Adam's, SGD's), which adds
        wd * p to g, and lowbit's p has drifted from torch's. a and b come from torch's param group (edits
        reach all three optimizers alike; loads must give lowbit the same).
        """
        group = self.ref.param_groups[j]
        wd = (
            0.0 if self.case.tcls in (torch.optim.AdamW, ReferenceAdEMAMix, torch.optim.Muon) else group["weight_decay"]
        )
        # Not 0 * p: Muon's parameter is NaN everywhere once a NaN gradient element has passed Newton-Schulz.
        g_main, g_ref = (grad + wd * main_before, grad + wd * ref_before) if wd else (grad, grad)
        old = self.bounds[j]
        new = {}
        for name in self._stored(j):
            carried = old.get(name, torch.zeros_like(grad))  # a state starts at 0 in both
            if name in ("exp_avg", "exp_avg_fast"):
                b1 = group["betas"][0]
                carried = b1 * carried + (1 - b1) * (g_main - g_ref).abs()
            elif name == "exp_avg_sq":
                b2 = group["betas"][1]
                carried = b2 * carried + (1 - b2) * (g_main.square() - g_ref.square()).abs()
            elif name == "exp_avg_slow":  # AdEMAMix's m2, whose b3 follows its warm-up: any b3 in [0, 1]
                carried = carried + (g_main - g_ref).abs()
            else:  # momentum_buffer: b = 1 - dampening (SGD; 1 at the first step: torch's buf = g) or 1 - momentum
                # (Muon's lerp); 1 bounds them all
                assert name == "momentum_buffer", name
                carried = group["momentum"] * carried + (g_main - g_ref).abs()
            new[name] = carried + self._encode_error(j, name, self.stochastic)
        self.bounds[j] = new

    # -- checks ----------------------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in self.main.param_groups]
        states = [{k: copy.deepcopy(v) for k, v in self.main.state[p].items()} for p in self.main_params]
        return [p.detach().clone() for p in self.main_params], states, groups

    def _assert_snapshot(self, before: tuple) -> None:
        params, states, groups = before
        for p, q in zip(self.main_params, params, strict=True):
            assert _same(p.detach(), q)
        for p, state in zip(self.main_params, states, strict=True):
            now = self.main.state[p] if p in self.main.state else {}
            assert set(now) == set(state)
            assert all(_same(now[k], state[k]) for k in state), sorted(state)
        for g, saved in zip(self.main.param_groups, groups, strict=True):
            assert set(g) - {"params"} == set(saved)
            assert all(_same(g[k], v) for k, v in saved.items()), saved

    def check(self) -> None:
        self._check_main_is_plain()
        for j, (a, b) in enumerate(zip(self.main_params, self.ref_params, strict=True)):
            self._check_state(j, a, b)
            self._check_param(j, a.detach(), b.detach())

    def _check_main_is_plain(self) -> None:
        for opt, params in ((self.main, self.main_params), (self.released, self.released_params)):
            self._check_is_plain(opt, params)

    def _check_is_plain(self, opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        for a, b in zip(params, self.plain_params, strict=True):
            assert _same(a.detach(), b.detach())
            sa = opt.state[a] if a in opt.state else {}
            sb = self.plain.state[b] if b in self.plain.state else {}
            assert set(sa) == set(sb)
            for key in sa:
                assert _same(sa[key], sb[key]), key
        for ga, gb in zip(opt.param_groups, self.plain.param_groups, strict=True):
            # torch.optim.Optimizer.load_state_dict adds torch's "differentiable" (False) to loaded groups.
            assert set(gb) <= set(ga) <= set(gb) | {"differentiable"}
            for key in gb:
                if key != "params":
                    assert _same(ga[key], gb[key]), (key, ga[key], gb[key])

    def _check_state(self, j: int, a: nn.Parameter, b: nn.Parameter) -> None:
        ours = self.main.state[a] if a in self.main.state else {}
        theirs = self.ref.state[b] if b in self.ref.state else {}
        if "step" in theirs:
            assert float(theirs["step"]) == self.steps[j]
        if not ours:
            # torch.optim.Adagrad creates its states (step 0) in its constructor, lowbit at the first step.
            assert self.steps[j] == 0 and (not theirs or isinstance(self.ref, torch.optim.Adagrad))
            return
        assert theirs
        assert float(ours["step"]) == self.steps[j]
        deq = self.main.dequantized_state(a)
        assert set(deq) - {"step"} == set(theirs) - {"step"}
        assert "step" in deq
        if self.quantized:
            assert all(ours[f"state{k + 1}"].dtype == torch.uint8 for k in range(len(deq) - 1))
            for name in set(theirs) - {"step"}:
                # Decoded, each element is torch's within the bound carried through the steps (which also
                # fixes its sign wherever torch's exceeds the bound). Elements that are not finite in torch
                # restarted from zero in lowbit (_check_restart).
                finite = theirs[name].isfinite()
                err = (deq[name] - theirs[name]).abs()[finite]
                bound = self.bounds[j][name][finite] + STEP_ROUNDING * theirs[name].abs()[finite]
                assert bool((err <= bound).all()), (name, float((err - bound).max()), float(bound.max()))
            return
        for name in set(theirs) - {"step"}:
            # The fp32 states are torch's to the bound of the parameters, and non-finite where torch's are.
            # Not always the same non-finite value: with beta1 = 0 and an infinite gradient, torch's lerp_
            # gives a NaN first moment where lowbit's b1 * m + (1 - b1) * g gives inf (the element's
            # parameter is NaN in both).
            finite = theirs[name].isfinite()
            assert torch.equal(deq[name].isfinite(), finite), name
            torch.testing.assert_close(deq[name][finite], theirs[name][finite], rtol=1e-5, atol=1e-5)

    def _check_param(self, j: int, a: Tensor, b: Tensor) -> None:
        finite = b.isfinite()
        assert torch.equal(a.isfinite(), finite)
        if not self.quantized:
            # tests/test_optim.py::test_fp32_states_match_torch's bound.
            torch.testing.assert_close(a[finite], b[finite], rtol=1e-5, atol=1e-5)
            return
        moved, ref_moved = (a - self.p0[j])[finite], (b - self.p0[j])[finite]
        if float(ref_moved.norm()) == 0.0:
            assert torch.equal(moved, ref_moved)
        else:
            bounds = STOCHASTIC_DRIFT_BOUNDS if self.stochastic else DRIFT_BOUNDS
            assert _relative(moved, ref_moved) < bounds[self.case.bits], _relative(moved, ref_moved)


def _run(case: Case, quantized: bool, scenario: dict[str, Any]) -> None:
    run = Run(case, quantized, scenario)
    for op in scenario["ops"]:
        run.apply(op)


def _name(case: Case) -> str:
    return case.cls.__name__ + "".join(f"-{k}" for k in case.layout)


@pytest.mark.parametrize("case", TWINS, ids=_name)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_32bit_twins_follow_torch_through_operation_sequences(case, data):
    _run(case, False, data.draw(scenarios(case, False)))


@pytest.mark.parametrize("case", QUANTIZED, ids=_name)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_quantized_optimizers_follow_torch_through_operation_sequences(case, data):
    _run(case, True, data.draw(scenarios(case, True)))


@pytest.mark.parametrize("case", STOCHASTIC, ids=_name)
@settings(max_examples=20, deadline=None)  # fewer than above: the encode paths are nearest's, the draws apart
@given(data=st.data())
def test_stochastic_rounding_follows_torch_through_operation_sequences(case, data):
    _run(case, True, data.draw(scenarios(case, True)))


@pytest.mark.parametrize("case", QUANTIZED, ids=_name)
def test_loading_a_torch_state_with_a_nonfinite_element_keeps_the_rest_of_its_block(case):
    # The smallest sequence the property test above finds: one step of torch.optim with a NaN gradient
    # element, then its state dict loaded into the 8-bit optimizer. torch's state holds a NaN at that
    # element only; lowbit must not let it take the block's scale (optimizer.py: an 8-bit state element
    # that is not finite restarts from zero, the rest of its block keeps its values).
    # Muon steps a 16 x 16 matrix (its NaN element spreads to the whole parameter through Newton-Schulz, in
    # torch as in lowbit; the state keeps it to one element).
    shape = (16, 16) if case.matrices else (256,)
    layout = dict(min_8bit_size=0) | ({"min_4bit_size": 0} if case.bits == 4 else {})
    p, q = nn.Parameter(torch.zeros(shape)), nn.Parameter(torch.zeros(shape))
    ref = case.tcls([q], **({} if case.matrices else dict(foreach=False)), **case.kw)
    q.grad = torch.ones(shape)
    q.grad.view(-1)[0] = float("nan")
    ref.step()
    opt = case.cls([p], **layout, **case.kw)
    opt.load_state_dict(ref.state_dict())
    absmaxes = [v for key, v in opt.state[p].items() if key.startswith("absmax")]
    assert absmaxes and all(bool(v.isfinite().all()) for v in absmaxes)
    # Its own state dict loads back, and the next step leaves the other 255 parameters finite, as torch's.
    case.cls([nn.Parameter(torch.zeros(shape))], **layout).load_state_dict(opt.state_dict())
    with torch.no_grad():
        p.copy_(q)
    p.grad, q.grad = torch.ones(shape), torch.ones(shape)
    opt.step()
    ref.step()
    assert torch.equal(p.isfinite(), q.isfinite())


@pytest.mark.parametrize("case", TWINS[:2], ids=_name)
def test_first_moment_with_a_small_beta1_is_torchs_lerp(case):
    # The smallest sequence the 32-bit property test finds (beta1 edited to 0, a 1e21 gradient element,
    # then an ordinary one): torch.optim's exp_avg.lerp_(g, 1 - beta1) computes g - (g - m) * beta1 when
    # 1 - beta1 >= 0.5, so with beta1 = 0 the first moment is g exactly, where m + (1 - beta1) * (g - m)
    # cancels to 0 once |m| >> |g|.
    p, q = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    kw = dict(case.kw, betas=(0.0, 0.999))
    opt, ref = case.cls([p], **kw), case.tcls([q], foreach=False, **kw)
    for g in ([1e8, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]):
        p.grad, q.grad = torch.tensor(g), torch.tensor(g)
        opt.step()
        ref.step()
    # Two steps of the same fp32 formula, rounded in another order: a few ulps (2^-24 each) of the moment,
    # under tests/test_optim.py::test_fp32_states_match_torch's 1e-5; the cancellation this guards against
    # would leave 0 where torch has 1.
    torch.testing.assert_close(opt.dequantized_state(p)["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-5, atol=1e-5)
