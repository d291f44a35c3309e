"""The preparation of a param group's fused calls, kept from one step to the next.

Preparing a step walks every parameter in Python: its overrides, its state's layout against the options,
the state tensors each fused call takes, and the checks of each of them. On a model of a few hundred
tensors that walk cost four times the native step itself (387 tensors, 16M parameters). Nothing it derives
changes while the group's options (the learning rate aside), the overrides, the parameters (identity,
shape, which have a gradient) and the state tensors stay the same, which is every step of an ordinary
training loop. So the first step of a group keeps what it derived (:class:`GroupPlan`, one
:class:`FusedLayout` per fused call), and a later step reuses it once :meth:`GroupPlan.matches` has
confirmed, cheaply and per parameter, that none of those inputs changed; otherwise the step is prepared
from scratch, as the first one was. What depends on the step is derived every step: the learning rate and
the other hyperparameters, the step counters and their scalars, the gradients (checked each step: dtype,
shape, device, layout), the rank-1 statistics, the factors and the rounding draws.

The plan holds references to the parameters and their states only while the optimizer does. It is not
part of the state dict, and a copied or unpickled optimizer starts without one (``torch.optim.Optimizer``
pickles only its defaults, state and param groups).
"""

from __future__ import annotations

import array
import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from lowbit._ops.optim import MetaCache

__all__ = ["FusedLayout", "GroupPlan", "layout_options"]


def layout_options(config: dict[str, Any]) -> dict[str, Any]:
    """The options of a validated group config that a plan depends on: all but the learning rate, which
    each step reads afresh (a scheduler changes it every step)."""
    return {k: v for k, v in config.items() if k != "lr"}


@dataclasses.dataclass
class FusedLayout:
    """What the preparation of one fused call derives from its parameters and their states, not from the
    step: the local tensors the native call takes, in the call's order, and the entries of the rank-1 and
    factored tables (lowbit/_ops/optim.py: StepArgs)."""

    slots: tuple[int, ...]
    """The rule's states, as indexes k of the optimizer's ``_state_names``."""
    items: list[tuple[Tensor, dict[str, Any]]]
    """(parameter, its state dict), in the call's order."""
    shards: list[Tensor]
    """The local tensor of each parameter (its FSDP2 shard, or itself)."""
    held: list[tuple[tuple[str, Tensor], ...]]
    """For each parameter, the state entries the layout took (key, tensor)."""
    states: list[list[Tensor]]
    absmaxes: list[list[Tensor]]
    rank1_entries: list[int]
    ranked_items: list[tuple[int, str, int]]
    """(index in the call, state key of its statistics, length of its statistics) of rank-1 tensors."""
    factored_entries: list[int]
    factored_items: list[tuple[dict[str, Any], int, Optional[int]]]
    """The states whose ``row2``/``col2`` the call updates: (state, the offset of its factors in the call's
    ``factors``, and the index in the call of a sharded matrix, whose factors span ranks and are computed
    before the call, lowbit/optim/factored.py; else None)."""
    factor_count: int = 0
    """The length of the call's ``factors``."""
    widths: Optional[list[int]] = None
    """Each tensor's state width, once a step of this layout has passed ``check_optimizer_step``."""
    counters: Optional[Tensor] = None
    """The step counters of the layout's states in one fp32 tensor, whose 0-d views the states hold as their
    ``step`` (:meth:`share_counters`); None where each state holds its own."""
    counter_values: array.array[float] = dataclasses.field(default_factory=lambda: array.array("f"))
    """The memory of :attr:`counters` (a tensor over this array)."""
    meta: MetaCache = dataclasses.field(default_factory=MetaCache)
    """The meta table of the call's last step, for the next one."""

    def share_counters(self) -> None:
        """Puts the step counters of the layout's states into :attr:`counters`: each state's ``step`` becomes a
        0-d view into it, with the same value, so a step reads all of them with one ``tolist`` and advances them
        at once (:meth:`advance_counters`): on a 387-tensor model the ``torch._foreach_add_`` over 0-d CPU
        tensors took 0.45 ms and their ``torch.stack`` 0.11 ms, of the 3.4 ms of Python in a step (2 threads).
        The views stay ordinary fp32 scalars for the user, the state dict and torch.optim, and the layout holds
        them (:meth:`holds`), so a state given a new ``step`` ends the plan. Unlike torch.optim's, a counter is
        a new object (with the same value) whenever its group's plan is made anew, when the set of parameters
        with a gradient changes for instance. Counters that are not 0-d fp32 CPU tensors (a state loaded by
        hand) are left as they are."""
        steps = [
            s
            for s in (entries.get("step") for _, entries in self.items)
            if type(s) is Tensor
            and s.dtype == torch.float32
            and s.device.type == "cpu"
            and s.dim() == 0
            and not s.requires_grad
        ]
        if len(steps) != len(self.items):
            return
        self.counter_values = array.array("f", torch.stack(steps).tolist())
        counters = torch.frombuffer(self.counter_values, dtype=torch.float32)
        views = counters.unbind()
        for (_, entries), view in zip(self.items, views, strict=True):
            entries["step"] = view
        self.held = [(*held, ("step", view)) for held, view in zip(self.held, views, strict=True)]
        self.counters = counters

    def advance_counters(self) -> None:
        """Adds 1 to each of :attr:`counters`, as ``add_`` would (one rounding of the exact sum to fp32), through
        their array: no torch operation, each of which costs 20-75 us right after a step has streamed the
        parameters through the caches; the counters' version counter is bumped as an in-place operation's is."""
        assert self.counters is not None
        values = self.counter_values
        values[:] = array.array("f", [v + 1.0 for v in values])
        torch.autograd.graph.increment_version(self.counters)

    def holds(self, state: Any) -> bool:
        """Whether ``state`` (the optimizer's state mapping) still holds, for every parameter, the same state
        dict with the same tensors under the keys this layout took."""
        for (p, entries), held in zip(self.items, self.held, strict=True):
            if state.get(p) is not entries:
                return False
            for key, t in held:
                if entries.get(key) is not t:
                    return False
        return True


@dataclasses.dataclass
class GroupPlan:
    """The prepared fused calls of one param group (:mod:`lowbit.optim.step_plan`)."""

    options: dict[str, Any]
    """:func:`layout_options` of the group's config."""
    overrides_version: int
    """:func:`lowbit.optim.config.overrides_version` when the plan was made."""
    first: int
    """The position of the group's first parameter in the optimizer (stochastic rounding's draws)."""
    state: Any
    """The optimizer's state mapping (``load_state_dict`` replaces it)."""
    params: list[Tensor]
    """The group's parameters, all of them, in order."""
    shapes: list[torch.Size]
    stepped: list[bool]
    """Whether each parameter had a gradient (and so is in a call)."""
    device: Optional[torch.device]
    """The device of the first stepped parameter (the step checks every tensor against that parameter's)."""
    batches: list[tuple[dict[str, Any], list[str], list[int], FusedLayout]]
    """For each fused call: the overrides of its parameters, where each is in the user's param groups, each
    one's position in the optimizer, and its layout."""

    def matches(
        self, options: dict[str, Any], overrides_version: int, first: int, state: Any, params: list[Tensor]
    ) -> bool:
        """Whether this plan is the one a preparation from scratch would make now."""
        if (
            overrides_version != self.overrides_version
            or first != self.first
            or state is not self.state
            or len(params) != len(self.params)
            or options != self.options
        ):
            return False
        for p, q, shape, stepped in zip(params, self.params, self.shapes, self.stepped, strict=True):
            g = p.grad
            if p is not q or (g is not None) is not stepped or p.shape != shape or (g is not None and g.is_sparse):
                return False
        if self.device is not None:
            first_stepped = self.stepped.index(True)
            if params[first_stepped].device != self.device:
                return False
        return all(layout.holds(state) for *_, layout in self.batches)
