"""LPMM optimizers (lpmm.txt Algorithm 1): quantized parameters, accumulators and momentum, one fused step.

They optimize models converted with :func:`lowbit.lpmm.convert`. Each step reads the quantized
gradient accumulator, updates the momentum (bit-packed codes into the signed dynamic map, section
5.1) and the parameter (bit-packed linear codes), re-encodes both against fresh group absmaxes with
stochastic rounding (section 5.2), and clears the accumulator, in one native call per param group.
The update rules are torch.optim's (:mod:`lowbit.optim`), computed in fp32 per element.

Rounding draws: an optimizer draws one ``rounding_seed`` from its generator when it is created (a
param-group entry, saved in its state dict). Parameter ``i`` (its position in the optimizer, counting
through the groups) at its step ``t`` takes the draws at counters ``i * 2**40`` onwards of the streams
keyed by ``(rounding_seed, t)``: a pure function of the parameter, its step and the seed, whichever
parameters step in the same native call. So gradient release (:func:`lowbit.optim.step_in_backward`),
which steps one parameter at a time inside backward, rounds bit for bit as ``step()`` does, and a
resumed checkpoint continues with the same draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Optional, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lowbit import _ops
from lowbit._ops import LpmmStepArgs, StepHyper
from lowbit.lpmm.parameter import LowPrecisionParameter, any_alive, draw_seed
from lowbit.optim.hyperparams import check_options, plain_lr
from lowbit.optim.optimizer import FLAG_DECOUPLED, FLAG_NESTEROV, RULE_CODES, Params, decay_factor
from lowbit.optim.rounding import COUNTER_BITS, stream_seed
from lowbit.optim.state_storage import (
    STATE_FORMAT,
    check_state_format,
    restore_state_dtypes,
    state_map,
    upgrade_second_moment,
)

__all__ = ["LPMMAdamW", "LPMMOptimizer", "LPMMSGD"]


def storage_of(p: Tensor) -> Optional[LowPrecisionParameter]:
    """The low-precision storage that the handle ``p`` stands for, or None for an ordinary tensor."""
    lp = getattr(p, "_lpmm", None)
    return lp if isinstance(lp, LowPrecisionParameter) else None


def converted_storage(p: Tensor) -> LowPrecisionParameter:
    """``storage_of`` a parameter of an :class:`LPMMOptimizer`, which holds converted parameters only (its
    constructor checks)."""
    return cast(LowPrecisionParameter, storage_of(p))


def _refuse_other_optimizers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: any other optimizer would silently skip a converted parameter, whose
    gradient lives in its low-precision accumulator (the handle's ``.grad`` stays None)."""
    if isinstance(optimizer, LPMMOptimizer) or not any_alive():
        return
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if storage_of(p) is not None:
                raise TypeError(
                    f"lowbit: {type(optimizer).__name__} cannot step param_groups[{gi}]['params'][{i}] (shape "
                    f"{tuple(p.shape)}): it belongs to a model converted with lowbit.lpmm.convert, whose gradients "
                    "live in low-precision accumulators; optimize it with lowbit.optim.LPMMSGD or LPMMAdamW"
                )


register_optimizer_step_pre_hook(_refuse_other_optimizers)


class LPMMOptimizer(torch.optim.Optimizer):
    """Base class of the LPMM optimizers; the options below are keyword arguments of both.

    Args:
        params: handles of low-precision parameters (``model.parameters()`` of a converted model),
            or param groups of them.
        defaults: the optimizer's hyperparameters (set by the subclass).
        momentum_bits: bits per optimizer-state element, 1..8 (dynamic map of that size; paper: 8).
        rounding: ``"stochastic"`` (paper) or ``"nearest"`` for the optimizer states; parameters use
            the rounding they were converted with.
        generator: source of the optimizer's ``rounding_seed``, drawn once here (torch's default
            generator if None); the gradients' accumulation draws come from each parameter's own.
        data_parallel: average the gradient accumulators over the ranks of ``process_group`` before
            each step (data-parallel training, with or without DDP around the model). None (default):
            whenever ``torch.distributed`` is initialised with more than one rank in the group.
        process_group: the group to average over (default: the default group).

    Data parallelism: each rank accumulates its own micro-batches; the step averages each accumulator
    over the ranks (decoded one tensor at a time, all-reduced in fp32 and re-encoded with stochastic
    rounding) and uses rank 0's seeds for every rounding draw, so parameters stay identical on all ranks.

    Subclasses set ``_rule`` and ``_state_signed`` and implement :meth:`_hyper` and :meth:`_scalars`.
    """

    _rule: ClassVar[str]
    _state_signed: ClassVar[tuple[bool, ...]]

    def __init__(
        self,
        params: Params,
        defaults: dict[str, Any],
        *,
        momentum_bits: int = 8,
        rounding: str = "stochastic",
        generator: Optional[torch.Generator] = None,
        data_parallel: Optional[bool] = None,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.generator = generator
        self.data_parallel = data_parallel
        self.process_group = process_group
        defaults = dict(
            defaults,
            momentum_bits=momentum_bits,
            rounding=rounding,
            state_format=STATE_FORMAT,
            rounding_seed=draw_seed(generator),
        )
        # Every group is validated as it is added (lowbit.optim.hyperparams), the first one included.
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group of low-precision parameters' handles; their states are created at once (zero),
        so that distributed checkpoints (``get_optimizer_state_dict``) see them before the first step."""
        options = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_config(options, f"{type(self).__name__} param_groups[{len(self.param_groups)}]")
        super().add_param_group(param_group)
        gi, group = len(self.param_groups) - 1, self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            lp = storage_of(p)
            if lp is None:
                raise TypeError(
                    f"lowbit: {type(self).__name__} optimizes parameters of a model converted with "
                    f"lowbit.lpmm.convert; param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)}) "
                    "is an ordinary tensor"
                )
            if p.requires_grad and not self.state[p]:
                self.state[p].update(self._init_state(lp, group))

    def _n_states(self, group: dict[str, Any]) -> int:
        return len(self._state_signed)

    def _hyper(self, group: dict[str, Any]) -> tuple[StepHyper, int]:
        """The step's hyperparameters and flags."""
        raise NotImplementedError

    def _scalars(self, group: dict[str, Any], step: int) -> list[float]:
        """(step size, sqrt of the second bias correction, 1.0 on the first step)."""
        raise NotImplementedError

    def _init_state(self, lp: LowPrecisionParameter, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        for k in range(self._n_states(group)):
            # In the parameter's layout (sharded like it under FSDP2). An absmax of 0 reads as zeros
            # whatever the codes: states start at 0, as in torch.optim.
            state[f"state{k + 1}"], state[f"absmax{k + 1}"] = lp.new_state(group["momentum_bits"])
        return state

    def _group(self) -> Optional[dist.ProcessGroup]:
        """The process group to average gradients over, or None for none."""
        if self.data_parallel is False or not (dist.is_available() and dist.is_initialized()):
            if self.data_parallel:
                raise RuntimeError("lowbit: data_parallel=True, but torch.distributed is not initialised")
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _average_gradients(self, group: dist.ProcessGroup) -> None:
        """Averages every accumulator of a whole (not sharded) parameter over ``group`` (the ones that have a
        gradient on any rank) and takes rank 0's ``rounding_seed`` for every param group. Sharded
        parameters' gradients were averaged in backward."""
        lps = [lp for g in self.param_groups for p in g["params"] if (lp := converted_storage(p)).shards is None]
        if not lps:  # sharded ranks round disjoint groups: their seeds need not agree
            return
        device = lps[0].device
        world = dist.get_world_size(group)
        own = [draw_seed(self.generator)] + [g["rounding_seed"] for g in self.param_groups]
        seeds = torch.tensor(own, dtype=torch.int64, device=device)
        dist.broadcast(seeds, src=dist.get_global_rank(group, 0), group=group)
        flags = torch.tensor([lp.has_grad for lp in lps], dtype=torch.uint8, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        base, *rounding_seeds = seeds.tolist()
        for g, seed in zip(self.param_groups, rounding_seeds, strict=True):
            g["rounding_seed"] = seed
        for i, (lp, flag) in enumerate(zip(lps, flags.tolist(), strict=True)):
            if not flag:
                continue
            total = lp.grad  # None exactly when not lp.has_grad
            if total is None:
                total = torch.zeros(lp.shape, dtype=torch.float32, device=lp.device)
            dist.all_reduce(total, group=group)
            lp.zero_grad_()
            lp.accumulate_(total.div_(world), seed=stream_seed(base, 1 + i))

    def _check_config(self, config: dict[str, Any], where: str) -> None:
        """Raise ValueError naming ``where`` if an option of ``config`` (a group's, possibly edited in
        place) is invalid; subclasses add their own rules."""
        check_options(config, where)

    def _check_state(self, lp: LowPrecisionParameter, state: dict[str, Any], group: dict[str, Any]) -> None:
        for k in range(self._n_states(group)):
            codes, absmax = state.get(f"state{k + 1}"), state.get(f"absmax{k + 1}")
            if (
                not isinstance(codes, Tensor)
                or not isinstance(absmax, Tensor)
                or isinstance(absmax, DTensor) != (lp.shards is not None)
                or absmax.shape[0] != lp.num_groups
            ):
                raise RuntimeError(
                    f"lowbit: the {type(self).__name__} state of a {tuple(lp.shape)} parameter does not match its "
                    "storage layout or options; create the optimizer after fully_shard (FSDP2 reshards the storage)"
                )

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    # torch._disable_dynamo: torch.optim's own lazy form, torch._dynamo is imported at the first step, not here
    @torch._disable_dynamo  # type: ignore[attr-defined]  # torch does not export it (it is what torch.optim uses)
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One LPMM step for every parameter with an accumulated gradient; clears the accumulators.

        Every option and state is checked first: a step that raises changes nothing."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        selection = {gi: range(len(group["params"])) for gi, group in enumerate(self.param_groups)}
        self._check_params(selection)
        group = self._group()
        if group is not None:
            self._average_gradients(group)
        self._step_checked(selection)
        return loss

    def _check_params(self, selection: Mapping[int, Iterable[int]]) -> None:
        """Raise before anything changes if a selected group's options or a parameter's state are invalid."""
        for gi, positions in selection.items():
            group = self.param_groups[gi]
            self._check_config(group, f"{type(self).__name__} param_groups[{gi}]")
            for j in positions:
                p = group["params"][j]
                lp, state = storage_of(p), self.state.get(p)
                if lp is not None and state:
                    self._check_state(lp, state, group)

    @torch.no_grad()
    def _step_params(self, selection: dict[int, list[int]]) -> None:
        """Step the selected parameters (param group index -> positions in the group) that hold a gradient,
        after checking them; what gradient release calls for one parameter. No gradient averaging: release
        refuses LPMM data parallelism over whole parameters."""
        self._check_params(selection)
        self._step_checked(selection)

    def _step_checked(self, selection: Mapping[int, Iterable[int]]) -> None:
        # Each parameter's draws depend only on the seed, its step number and its position (the module
        # docstring), so the batches below may group them in any way.
        first = 0
        firsts = []
        for group in self.param_groups:
            firsts.append(first)
            first += len(group["params"])
        for gi, positions in selection.items():
            group = self.param_groups[gi]
            batches: dict[tuple[Any, ...], list[tuple[LowPrecisionParameter, dict[str, Any], int]]] = {}
            for j in positions:
                p = group["params"][j]
                lp = storage_of(p)
                if lp is None or not lp.has_grad:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(lp, group))
                step = int(state["step"].item()) + 1
                key = (lp.bits, lp.grad_bits, lp.group_size, lp.rounding, lp.device, step)
                batches.setdefault(key, []).append((lp, state, (firsts[gi] + j) << COUNTER_BITS))
            for key, items in batches.items():
                self._fused_step(group, items, stream_seed(group["rounding_seed"], key[-1]))

    def _fused_step(
        self, group: dict[str, Any], items: list[tuple[LowPrecisionParameter, dict[str, Any], int]], seed: int
    ) -> None:
        n_states = self._n_states(group)
        lp0 = items[0][0]
        hyper, flags = self._hyper(group)
        scalars: list[float] = []
        for _, state, _ in items:
            scalars += self._scalars(group, int(state["step"].item()) + 1)
        bits = group["momentum_bits"]
        lists: dict[str, list[Tensor]] = {f"{name}{k}": [] for name in ("state", "absmax") for k in (1, 2)}
        for lp, state, _ in items:
            for k in range(n_states):
                lists[f"state{k + 1}"].append(lp.local_view(state[f"state{k + 1}"], bits))
                lists[f"absmax{k + 1}"].append(_ops.local(state[f"absmax{k + 1}"]))
        device = lp0.device
        args = LpmmStepArgs(
            params=[lp.local_codes() for lp, _, _ in items],
            param_absmax=[lp.local_absmax() for lp, _, _ in items],
            grads=[lp.grad_codes for lp, _, _ in items],
            grad_absmax=[lp.grad_absmax for lp, _, _ in items],
            state1=lists["state1"],
            state2=lists["state2"],
            absmax1=lists["absmax1"],
            absmax2=lists["absmax2"],
            numels=[lp.local_numel for lp, _, _ in items],
            scalars=scalars,
            map1=state_map(self._state_signed[0] if n_states else True, device, bits),
            map2=state_map(self._state_signed[1] if n_states > 1 else False, device, bits),
            rule=RULE_CODES[self._rule],
            hyper=hyper.values(),
            flags=flags,
            n_states=n_states,
            group_size=lp0.group_size,
            param_bits=lp0.bits,
            grad_bits=lp0.grad_bits,
            state_bits=bits,
            stochastic_param=lp0.rounding == "stochastic",
            stochastic_state=group["rounding"] == "stochastic",
            seed=seed,
            offsets=[offset for _, _, offset in items],
        )
        _ops.lpmm_step_eager(args)
        for lp, state, _ in items:
            state["step"] += 1.0
            lp.mark_stepped()

    # torch._disable_dynamo as torch.optim's zero_grad: the accumulators are not traceable tensors
    @torch._disable_dynamo  # type: ignore[attr-defined]  # torch does not export it (it is what torch.optim uses)
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the accumulated gradients, as ``torch.optim.Optimizer.zero_grad``: ``set_to_none=True``
        empties the accumulators (the next step skips those parameters); ``False`` keeps them as zero
        gradients, which the next step applies (counting the step, decaying the moments)."""
        for group in self.param_groups:
            for p in group["params"]:
                lp = storage_of(p)
                if lp is None:
                    continue
                if set_to_none:
                    p.grad = None
                lp.zero_grad_(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; codes and absmaxes keep their dtypes whatever the compute dtype, and states
        saved whole or sharded load into either layout (their groups are the parameter's). Second moments
        saved in format 1 (``lowbit.optim.state_storage.STATE_FORMAT``) are re-encoded."""
        for group in state_dict["param_groups"]:
            check_state_format(self, group)
        super().load_state_dict(state_dict)
        restore_state_dtypes(self, state_dict)
        for group in self.param_groups:
            upgrade = group.get("state_format", 1) != STATE_FORMAT
            group["state_format"] = STATE_FORMAT
            # State dicts from before the seed was saved: this optimizer's own.
            group.setdefault("rounding_seed", self.defaults["rounding_seed"])
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                lp = converted_storage(p)
                bits = group["momentum_bits"]
                if any(key.startswith("state") for key in state):
                    layout = lp.new_state(bits)
                    for key, value in state.items():
                        if key != "step" and isinstance(value, Tensor):
                            like = layout[key.startswith("absmax")]
                            state[key] = lp.in_layout(value, like, bits)
                if upgrade:
                    self._upgrade_second_moments(lp, state, bits)

    def _upgrade_second_moments(self, lp: LowPrecisionParameter, state: dict[str, Any], bits: int) -> None:
        for k, signed in enumerate(self._state_signed):
            key = f"state{k + 1}"
            if signed or key not in state:
                continue
            codes, absmax = _ops.local(state[key]), _ops.local(state[f"absmax{k + 1}"])
            # Whole: flat codes of the tensor. Sharded: one row of whole groups per local group.
            numel = lp.numel() if codes.dim() == 1 else absmax.numel() * lp.group_size
            new_codes, new_absmax = upgrade_second_moment(codes, absmax, bits, lp.group_size, numel)
            _ops.local(state[key]).copy_(new_codes)
            _ops.local(state[f"absmax{k + 1}"]).copy_(new_absmax)


class LPMMSGD(LPMMOptimizer):
    """LPMM-SGDM (lpmm.txt Algorithm 1): SGD with momentum on low-precision parameters and gradients.

    The update is ``torch.optim.SGD``'s (dampening 0): ``m <- momentum * m + g``, ``p <- p - lr * m``
    (Nesterov: ``p <- p - lr * (g + momentum * m)``), with L2 ``weight_decay`` added to ``g``; the
    accumulated gradient ``g`` is the sum over the micro-batches since the last step (section 3.3),
    so N micro-batches of the same size act as one N times larger step.

    Args:
        params: handles of a converted model's parameters (``model.parameters()``) or param groups.
        lr: learning rate.
        momentum: momentum factor; 0 keeps no state.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0).
        **options: ``momentum_bits`` (bits per momentum element, 1..8; paper: 8), ``rounding``
            (``"stochastic"`` or ``"nearest"`` for the momentum), ``generator``, ``data_parallel``,
            ``process_group``: see :class:`LPMMOptimizer`.
    """

    _rule = "sgd"
    _state_signed = (True,)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, **options)

    def _check_config(self, config: dict[str, Any], where: str) -> None:
        super()._check_config(config, where)
        momentum = config["momentum"]
        if not (isinstance(momentum, (int, float)) and not isinstance(momentum, bool) and 0 <= momentum < 1):
            raise ValueError(f"lowbit: {where}: invalid momentum value ({momentum!r}); expected a number in [0, 1)")
        if config["nesterov"] and momentum <= 0:
            raise ValueError(f"lowbit: {where}: Nesterov momentum requires momentum > 0")

    def _n_states(self, group: dict[str, Any]) -> int:
        return 1 if group["momentum"] > 0 else 0

    def _hyper(self, group: dict[str, Any]) -> tuple[StepHyper, int]:
        hyper = StepHyper(
            lr=plain_lr(group["lr"]),
            beta1=group["momentum"],
            one_minus_beta1=1.0,
            weight_decay=group["weight_decay"],
        )
        return hyper, FLAG_NESTEROV if group["nesterov"] else 0

    def _scalars(self, group: dict[str, Any], step: int) -> list[float]:
        return [plain_lr(group["lr"]), 1.0, float(step == 1)]


class LPMMAdamW(LPMMOptimizer):
    """LPMM-AdamW (lpmm.txt Appendix B): AdamW on low-precision parameters and gradients.

    The update is ``torch.optim.AdamW``'s; both moments are stored at ``momentum_bits`` in dynamic
    maps, as in the paper's LPMM-Adam: the first on the signed map, the second as its square root on
    the unsigned map without its zero code, so that it never decodes as 0 beside a surviving first
    moment (include/lowbit/state_form.h; README "Numerics").

    Args:
        params: handles of a converted model's parameters (``model.parameters()``) or param groups.
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        weight_decay: decoupled weight decay.
        **options: ``momentum_bits`` (bits per moment element, 1..8; paper: 8), ``rounding``
            (``"stochastic"`` or ``"nearest"`` for the moments), ``generator``, ``data_parallel``,
            ``process_group``: see :class:`LPMMOptimizer`.
    """

    _rule = "adam"
    _state_signed = (True, False)

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **options: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, **options)

    def _hyper(self, group: dict[str, Any]) -> tuple[StepHyper, int]:
        lr, wd = plain_lr(group["lr"]), group["weight_decay"]
        hyper = StepHyper.with_betas(lr, group["betas"], eps=group["eps"], weight_decay=wd, decay=decay_factor(lr, wd))
        return hyper, FLAG_DECOUPLED

    def _scalars(self, group: dict[str, Any], step: int) -> list[float]:
        b1, b2 = group["betas"]
        return [plain_lr(group["lr"]) / (1.0 - b1**step), math.sqrt(1.0 - b2**step), float(step == 1)]
