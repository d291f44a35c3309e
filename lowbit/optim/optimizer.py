"""The base class of lowbit's optimizers: state layout, per-parameter config, one fused call per group.

State of a parameter with 8-bit state (8bit-optimizers.txt section 2): ``state1``/``state2``/``state3``
are uint8 codes shaped like the parameter, indexing the signed dynamic map (first moments) or, for second
moments and AMSGrad's running maximum of them, the zero-free unsigned one holding their square roots
(include/lowbit/state_form.h), with one fp32 ``absmax1``/``absmax2``/``absmax3`` per block of
``block_size`` elements (of the stored values). ``state{k+1}`` always holds the state named
``_state_names[k]``, whichever options are on; a state an option does not use is absent.
Parameters with fewer than ``min_8bit_size`` elements, or with ``optim_bits=32``, keep fp32 states.
With ``factored=True`` (4-bit Adam/AdamW) a parameter of 2 or more axes keeps fp32 ``row2``/``col2`` (the
factors of its second moment, lowbit/optim/factored.py) in place of ``state2``/``absmax2``.
``step`` is a float32 scalar tensor, as in torch.optim.

FSDP2: DTensor parameters are stepped shard by shard in the same fused call; their states are
DTensors with the parameter's placements (absmaxes stay local), the 8-bit choice uses the global element
count, and ``state_dict`` gives their states dequantized so that ``torch.distributed.checkpoint`` can
reshard them. Whole-tensor norms (LAMB's and LARS's trust ratios, ``max_unorm``, ``percentile_clipping``)
are summed over the shards with an all-reduce.

Non-finite values: the update is computed in fp32 exactly as torch.optim computes it, so a NaN/Inf
gradient makes that parameter element non-finite as it would in torch, and a gradient whose square
overflows gives its element a zero update. An 8-bit state element that becomes NaN or Inf cannot share
its block's scale, so all states of that element restart from zero while the rest of the block keeps
its values (32-bit states keep torch's values). A NaN whole-tensor norm (LAMB's and LARS's trust ratios,
``max_unorm``) makes the whole tensor's update NaN instead of selecting a ratio of 1. CPU and CUDA
behave identically.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Optional, Union, cast, overload

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lowbit import _C, _ops
from lowbit._ops import StepArgs, StepHyper
from lowbit.lpmm.parameter import draw_seed
from lowbit.optim import factored as factored_module
from lowbit.optim.config import get_override, overrides_version
from lowbit.optim.hyperparams import GNORM_HISTORY, LAYOUT_OPTIONS, check_option, check_options, plain_lr
from lowbit.optim.loaded_state import check_loaded_state
from lowbit.optim.rank1 import max_over_shards, rank1_layout
from lowbit.optim.rounding import COUNTER_BITS, agree_seed, global_offset, stream_seed
from lowbit.optim.sharded_norms import sum_over_shards, update_scales
from lowbit.optim.state_storage import (
    STATE_FORMAT,
    StoredStates,
    check_state_format,
    like_param,
    optimizer_state_map,
    restore_state_dtypes,
)
from lowbit.optim.step_plan import FusedLayout, GroupPlan, layout_options

__all__ = ["LowbitOptimizer"]

Params = Union[Iterable[Tensor], Iterable[dict[str, Any]]]

# include/lowbit/optim_rules.h's Rule, flag bits and NormMode, as the native module exports them.
RULE_CODES: dict[str, int] = dict(_C.RULES)
FLAG_DECOUPLED, FLAG_NESTEROV, FLAG_MAXIMIZE = _C.FLAG_DECOUPLED, _C.FLAG_NESTEROV, _C.FLAG_MAXIMIZE
NORM_NONE, NORM_TRUST, NORM_CLIP = _C.NORM_NONE, _C.NORM_TRUST, _C.NORM_CLIP


class LowbitOptimizer(StoredStates, torch.optim.Optimizer):
    """Base class of lowbit's optimizers; the options below are keyword arguments of every optimizer.

    Args:
        params: parameters or param groups.
        defaults: the optimizer's hyperparameters (set by the subclass).
        optim_bits: 8 for block-wise 8-bit states, 4 for block-wise 4-bit states (two codes per byte, on
            the maps of :func:`~lowbit.optim.state_storage.optimizer_state_map`), 32 for fp32 states.
        block_size: elements per quantization block of 8-bit and 4-bit states (a power of two,
            64..4096); default 256 at 8 bits, 128 at 4 bits (Li, Chen, Zhu 2023, section 4.1: 4-bit
            codes need the smaller block). At 8 bits, 256 stores 2 + 8/256 = 2.031 bytes per parameter
            for Adam; smaller blocks cost bytes for little accuracy, larger ones lose accuracy for few
            bytes (``benchmarks/bench_block_size.py``: 3.1% trajectory drift from fp32 Adam after 100
            steps at 256, 2.1% at 64 for 2.125 bytes, 3.4% at 2048 for 2.004 bytes). At 4 bits, 128
            stores 1 + 8/128 = 1.0625 bytes per parameter for Adam.
        min_8bit_size: with ``optim_bits=8``, parameters with fewer elements keep fp32 states.
        min_4bit_size: with ``optim_bits=4``, parameters with fewer elements keep fp32 states (as do
            one-element shards of FSDP2 parameters).
        rank1_normalization: opt-in (default False, until it measures better than block-wise: README,
            Limitations); with ``optim_bits=4``, the second moment of a parameter of 2 to 8 axes is
            normalised rank-1 (Li, Chen, Zhu 2023, section 4.2; include/lowbit/rank1.h): element (i, j)
            by min(max of row i, max of column j), N-d tensors by the min over every axis of that axis'
            maxima, which cost ``sum(shape)`` floats (``axis_max{k+1}`` in the state, in place of the
            block absmaxes). Other parameters, and False, keep block-wise absmax.
        factored: opt-in (default False), Adam and AdamW with ``optim_bits=4`` only (8-bit and fp32
            layouts refuse it, as do ``rank1_normalization``, ``amsgrad``, ``max_unorm``,
            ``percentile_clipping``, and DTensor parameters sharded on another axis than the first): the second
            moment of a 4-bit parameter of 2 or more axes is factorized (Shazeer & Stern 2018, Adafactor; Li, Chen,
            Zhu 2023, "4-bit Factor"; :mod:`lowbit.optim.factored`): fp32 EMAs of the mean of g^2 over the last axis
            (``row2``, ``shape[:-1]``) and over axis -2 (``col2``, ``shape[:-2] + shape[-1:]``) in place of
            ``state2``/``absmax2``, so a matrix's v costs ``(R + C) * 4`` bytes. The step is
            torch.optim.Adam's with v replaced by ``v_hat = (row / mean(row over its last axis)) (outer)
            col``: ``p <- p - lr / (1 - beta1^t) * m / (sqrt(v_hat) / sqrt(1 - beta2^t) + eps)``. Other
            parameters keep the block-wise 4-bit v. FSDP2 parameters (``Shard(0)``) are factorized too, their
            ``row2``/``col2`` DTensors sharded like them (a matrix's ``col2`` replicated): a matrix's column sums
            and row mean are summed over the ranks, equal to one process's bit for bit when every shard starts
            at a multiple of 64 rows (:mod:`lowbit.optim.factored`).
        max_unorm: if > 0, scales a tensor's update down so that its norm, divided by the learning
            rate, is at most ``max_unorm * ||param||`` (bitsandbytes' option; a zero parameter is not
            clipped, since it would never move).
        percentile_clipping: if < 100, clips each gradient to this percentile of its last 100 norms
            (bitsandbytes' option; lowbit ranks only the norms recorded so far, so the first steps
            are not scaled towards zero by the empty history).
        rounding: how 8-bit and 4-bit states are rounded to their codes: ``"nearest"`` (default) or
            ``"stochastic"`` (one of the two neighbouring codes, with probability proportional to
            closeness, so the stored state is unbiased; Li, Chen, Zhu 2023 list it as an option of their
            4-bit states). fp32 states are stored as they are. The draws are the LPMM optimizers'
            (:mod:`lowbit.optim.rounding`): keyed by the param group's ``rounding_seed``, the step, the
            parameter's position and the element's index in the whole parameter, so CPU and CUDA, gradient
            release, FSDP2 sharding and any batching of the native calls round alike. ``rounding_seed`` is
            drawn from torch's default generator when an optimizer (or a param group added later) asks for
            stochastic rounding, and saved in the state dict; 0 otherwise, so nearest rounding draws
            nothing. 0 means "none drawn": a group switched to ``"stochastic"`` later
            (``param_groups[i]["rounding"] = "stochastic"``), or given ``rounding_seed=0``, draws its seed
            from torch's default generator at the first step that rounds it (a step that raises draws
            none) and keeps it in the group, so optimizers and groups never share their draws through a
            common seed. Pass a nonzero ``rounding_seed`` in a param group to choose it. A group with
            DTensor parameters (FSDP2) takes the seed of its mesh's first rank (one broadcast at the first
            step that rounds with a new seed), so that every shard rounds as one process would, whatever
            each rank's generator drew; plain tensors replicated by DDP need the same seed on every rank
            (seed torch alike on every rank, or pass ``rounding_seed``), or the replicas drift apart.
            Not with ``factored=True`` (its step encodes to nearest).

    Subclasses set ``_rule`` (a key of ``RULE_CODES``), ``_state_names`` (the torch.optim state names
    of state1/state2/state3, used for interop) and ``_state_signed`` (which dynamic map each state uses),
    and implement :meth:`_hyper` and, if the states or the rule depend on the group, :meth:`_n_states`
    or :meth:`_slots` and :meth:`_rule_code`.
    """

    _rule: ClassVar[str]
    _state_names: ClassVar[tuple[str, ...]]
    _state_signed: ClassVar[tuple[bool, ...]]
    _norm_mode: ClassVar[int] = NORM_NONE
    _factorable: ClassVar[bool] = False  # whether ``factored=True`` is supported (Adam and AdamW)
    _decoupled: ClassVar[bool] = False  # AdamW's decoupled weight decay, for the factored step

    def __init__(
        self,
        params: Params,
        defaults: dict[str, Any],
        *,
        optim_bits: int = 32,
        block_size: Optional[int] = None,
        min_8bit_size: int = 4096,
        min_4bit_size: int = 4096,
        rank1_normalization: bool = False,
        factored: bool = False,
        max_unorm: float = 0.0,
        percentile_clipping: int = 100,
        rounding: str = "nearest",
    ) -> None:
        check_option("rounding", rounding, type(self).__name__)
        if block_size is None:
            block_size = 128 if optim_bits == 4 else 256
        defaults = dict(
            defaults,
            optim_bits=optim_bits,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
            min_4bit_size=min_4bit_size,
            rank1_normalization=rank1_normalization,
            factored=factored,
            max_unorm=max_unorm,
            percentile_clipping=percentile_clipping,
            rounding=rounding,
            rounding_seed=draw_seed() if rounding == "stochastic" else 0,
            state_format=STATE_FORMAT,
        )
        # Every group is validated as it is added (lowbit.optim.hyperparams), the first one included.
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's ``add_param_group``; the group's options are validated before it is added."""
        options = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_config(options, f"{type(self).__name__} param_groups[{len(self.param_groups)}]")
        # A stochastic group of an optimizer that rounds to nearest draws its own seed, once torch.optim has
        # accepted the group (it fills in the defaults), so that a refused group leaves the generator as it was.
        draw = options["rounding"] == "stochastic" and not options["rounding_seed"]
        super().add_param_group(param_group)
        if draw:
            self.param_groups[-1]["rounding_seed"] = draw_seed()

    # -- subclass hooks -------------------------------------------------------------------------

    def _n_states(self, config: dict[str, Any]) -> int:
        return len(self._state_names)

    def _slots(self, config: dict[str, Any]) -> tuple[int, ...]:
        """The states ``config`` uses, as indexes k of ``_state_names`` (stored as ``state{k+1}``), in the
        order of the native rule's state slots (include/lowbit/optim_rules.h)."""
        return tuple(range(self._n_states(config)))

    def _rule_code(self, config: dict[str, Any]) -> int:
        """The native rule (optim_rules.h: Rule) that steps ``config``."""
        return RULE_CODES[self._rule]

    def _check_config(self, config: dict[str, Any], where: str) -> None:
        """Raise ValueError naming ``where`` if an option of ``config`` is invalid; subclasses add the
        checks that combine options."""
        check_options(config, where)
        if config.get("factored", False):
            _check_factored(self, config, where)
        if config.get("factored", False) and config.get("rounding") == "stochastic":
            raise ValueError(
                f"lowbit: {where}: factored=True and rounding='stochastic' are mutually exclusive (the factored "
                "step encodes its states to nearest); turn one of them off"
            )

    def _hyper(self, config: dict[str, Any]) -> tuple[StepHyper, int]:
        """The step's hyperparameters (``max_unorm`` is the base class's to fill in) and flags."""
        raise NotImplementedError

    def _step_scalars(self, config: dict[str, Any], step: int) -> tuple[float, float, float]:
        """(step size, sqrt of the second bias correction, 1.0 on the first step)."""
        return config["lr"], 1.0, float(step == 1)

    def _adjust_grads(
        self,
        config: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        scales: Optional[Tensor],
        originals: list[Tensor],
    ) -> tuple[list[Tensor], Optional[Tensor]]:
        """Hook for rules that rewrite gradients before the step (LARS); default: unchanged. ``params``
        and ``grads`` are local tensors; ``originals`` the parameters (DTensors under FSDP2)."""
        return grads, scales

    def _norms(self, tensors: list[Tensor], originals: list[Tensor]) -> list[Tensor]:
        """Whole-tensor L2 norms of the local ``tensors`` (shards of ``originals``, or the tensors
        themselves): the squared norms of FSDP2 shards are summed over the ranks."""
        squares = torch.stack([n.float().square() for n in torch._foreach_norm(tensors)])
        return list(sum_over_shards(squares, originals).sqrt())

    def _init_value(self, k: int, config: dict[str, Any]) -> float:
        """Initial value of state k (Adagrad starts from initial_accumulator_value)."""
        return 0.0

    # -- configuration ----------------------------------------------------------------------------

    def _config(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        """The options in force for ``p``: its group's, overlaid with its overrides."""
        return self._merge(self._group_config(group), get_override(p))

    def _group_config(self, group: dict[str, Any], index: Optional[int] = None) -> dict[str, Any]:
        """The validated options of ``group`` (which may have been edited since it was added), with a
        tensor learning rate read as a float; ``index`` is its place in ``param_groups`` (found if None)."""
        config = {k: v for k, v in group.items() if k != "params"}
        if index is None:
            index = next(i for i, g in enumerate(self.param_groups) if g is group)
        self._check_config(config, f"{type(self).__name__} param_groups[{index}]")
        config["lr"] = plain_lr(config["lr"])
        return config

    def _merge(self, config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        if not overrides:
            return config
        unknown = sorted(set(overrides) - set(config))
        if unknown:
            raise ValueError(f"lowbit: {type(self).__name__} has no option {unknown} (set by lowbit.optim.override)")
        merged = {**config, **overrides}
        self._check_config(merged, f"{type(self).__name__}, an option set by lowbit.optim.override")
        merged["lr"] = plain_lr(merged["lr"])
        return merged

    # -- step -------------------------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    # torch._disable_dynamo: torch.optim's own lazy form, torch._dynamo is imported at the first step, not here
    @torch._disable_dynamo  # type: ignore[attr-defined]  # torch does not export it (it is what torch.optim uses)
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        A step that raises leaves the optimizer and the parameters as they were: every fused call is
        prepared and checked before any of them writes, and state created by the failed step is removed.
        Under ``torch.compile`` the step runs eagerly (a graph break; ``fullgraph=True`` raises, as it
        does for torch.optim's optimizers): it is already one fused native call per param group, and
        its step-dependent scalars are host arithmetic that would otherwise recompile as the
        learning rate changes. Parameters on the meta device step as torch.optim's do: their states
        are created on the meta device, shaped as a real step shapes them, and the counters advance.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_params(dict.fromkeys(range(len(self.param_groups))))
        return loss

    @torch.no_grad()
    def _step_params(self, where: dict[int, Optional[list[int]]]) -> None:
        """Step the parameters ``where`` names (group index -> indexes into its ``params``, None for all)
        that have a gradient, exactly as :meth:`step` steps them; :mod:`lowbit.optim.gradient_release`
        steps one parameter at a time through it. All fused calls are checked before any writes."""
        runs: list[Callable[[], None]] = []
        created: list[Tensor] = []
        # Seeds this step draws for stochastic groups that have none, or agrees on over FSDP2's ranks (group
        # index -> seed); they are stored once every call is prepared, and a step that raises puts torch's
        # generator back as it was.
        seeds: dict[int, int] = {}
        unseeded = any(
            self.param_groups[gi].get("rounding") == "stochastic" and not self.param_groups[gi].get("rounding_seed")
            for gi in where
        )
        rng = torch.random.get_rng_state() if unseeded else None
        try:
            for gi, indices in where.items():
                runs += self._prepare_group(gi, self.param_groups[gi], created, seeds, indices)
        except BaseException:
            for p in created:
                del self.state[p]
            if rng is not None:
                torch.random.set_rng_state(rng)
            raise
        for gi, seed in seeds.items():
            self.param_groups[gi]["rounding_seed"] = seed
        # The seeds the ranks hold alike (group index -> seed); not part of torch.optim's pickled state, so
        # a copy agrees once more.
        self._agreed_seeds = {**getattr(self, "_agreed_seeds", {}), **seeds}
        for run in runs:
            run()

    def _prepare_group(
        self,
        gi: int,
        group: dict[str, Any],
        created: list[Tensor],
        seeds: dict[int, int],
        indices: Optional[list[int]] = None,
    ) -> list[Callable[[], None]]:
        """The fused calls of ``param_groups[gi]`` (of its params at ``indices``, or all of them), prepared
        and checked; parameters whose state this creates are appended to ``created``. A stochastic group
        without a ``rounding_seed`` (0) draws one, and one with DTensor parameters takes the first rank's seed
        once per seed, recorded in ``seeds`` for the caller to store. A step of the whole group reuses the
        previous step's plan while it matches (:mod:`lowbit.optim.step_plan`)."""
        base = self._group_config(group, gi)
        if base["rounding"] == "stochastic":
            if not base["rounding_seed"]:
                base["rounding_seed"] = seeds.setdefault(gi, draw_seed())
            sharded = next((p for p in group["params"] if isinstance(p, DTensor)), None)
            if sharded is not None and getattr(self, "_agreed_seeds", {}).get(gi) != base["rounding_seed"]:
                base["rounding_seed"] = seeds[gi] = agree_seed(base["rounding_seed"], sharded)
        name = type(self).__name__
        params = group["params"]
        # The position of the group's first parameter in the optimizer: the draws of stochastic rounding.
        first = sum(len(g["params"]) for g in self.param_groups[:gi])
        options, version = layout_options(base), overrides_version()
        plans = self.__dict__.setdefault("_plans", {})
        if indices is None:
            plan = plans.get(gi)
            if plan is not None and plan.matches(options, version, first, self.state, params):
                return [
                    self._prepare_fused(self._merge(base, overrides), layout.items, places, positions, layout)
                    for overrides, places, positions, layout in plan.batches
                ]
        # Parameters with the same overrides (usually none) share one fused call.
        batches: dict[
            tuple[Any, ...],
            tuple[dict[str, Any], dict[str, Any], list[tuple[Tensor, dict[str, Any]]], list[str], list[int]],
        ] = {}
        for j in range(len(params)) if indices is None else indices:
            p = params[j]
            if p.grad is None:
                continue
            where = f"param_groups[{gi}] params[{j}]"
            if is_traceable_wrapper_subclass(p) and not isinstance(p, DTensor):
                raise NotImplementedError(
                    f"lowbit: {name} steps plain tensors and DTensors; {where} is a {type(p).__name__}"
                )
            if p.grad.is_sparse:
                raise RuntimeError(f"lowbit: {name} does not support sparse gradients ({where})")
            overrides = get_override(p)
            key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
            if key not in batches:
                batches[key] = (overrides, self._merge(base, overrides), [], [], [])
            _, config, items, places, positions = batches[key]
            state = self.state[p]
            try:
                if not state:
                    created.append(p)
                    state.update(self._init_state(p, config))
                elif not self._layout_matches(p, state, config):
                    self._relayout(p, state, config)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise type(exc)(f"lowbit: {name} {where}: {str(exc).removeprefix('lowbit: ')}") from exc
            items.append((p, state))
            places.append(where)
            positions.append(first + j)
        if indices is not None or not self._plannable(params):
            return [self._prepare_step(*batch[1:]) for batch in batches.values()]
        runs, planned = [], []
        for overrides, config, items, places, positions in batches.values():
            layout = self._fused_layout(config, items)
            layout.share_counters()
            runs.append(self._prepare_fused(config, items, places, positions, layout))
            planned.append((overrides, places, positions, layout))
        stepped = [p.grad is not None for p in params]
        plans[gi] = GroupPlan(
            options=options,
            overrides_version=version,
            first=first,
            state=self.state,
            params=list(params),
            shapes=[p.shape for p in params],
            stepped=stepped,
            device=params[stepped.index(True)].device if any(stepped) else None,
            batches=planned,
        )
        return runs

    def _plannable(self, params: list[Tensor]) -> bool:
        """Whether a plan (:mod:`lowbit.optim.step_plan`) may keep the preparation of a group of ``params``: the
        optimizer prepares its calls with :meth:`_prepare_fused` alone, and the parameters are plain, contiguous
        tensors off the meta device (FSDP2 shards are new tensors each step)."""
        if type(self)._prepare_step is not LowbitOptimizer._prepare_step:
            return False
        return all(
            type(p) in (Tensor, torch.nn.Parameter) and not p.is_meta and p.is_contiguous()
            for p in params
            if p.grad is not None
        )

    def _grad_scales(
        self, config: dict[str, Any], grads: list[Tensor], originals: list[Tensor], steps: list[int]
    ) -> tuple[Optional[Tensor], list[Tensor]]:
        """Per-tensor gradient multipliers of percentile clipping (None when it is off) at step numbers
        ``steps``, and each tensor's gradient-norm history with this step's norm recorded (to be stored
        once the step has succeeded)."""
        percentile = config["percentile_clipping"]
        if percentile >= 100:
            return None, []
        norms = self._norms(grads, originals)
        scales, histories = [], []
        for p, g, norm, step in zip(originals, grads, norms, steps, strict=True):
            old = self.state[p].get("gnorm_vec")
            history = torch.zeros(GNORM_HISTORY, dtype=torch.float32, device=g.device) if old is None else old.clone()
            history[(step - 1) % GNORM_HISTORY] = norm.float()
            recorded = history[: min(step, GNORM_HISTORY)]
            clip = torch.quantile(recorded, percentile / 100.0)
            scales.append(torch.where(norm > clip, clip / norm, torch.ones_like(clip)))
            histories.append(history)
        return torch.stack(scales).float(), histories

    def _prepare_step(
        self,
        config: dict[str, Any],
        batch: list[tuple[Tensor, dict[str, Any]]],
        places: list[str],
        positions: list[int],
    ) -> Callable[[], None]:
        """The step of ``batch``: one fused native call, factorized second moments included. ``positions``: each
        parameter's position in the optimizer (:mod:`lowbit.optim.rounding`)."""
        if any(_ops.local(p).is_meta for p, _ in batch):
            return self._meta_step(config, batch, places)
        return self._prepare_fused(config, batch, places, positions)

    def _fused_layout(self, config: dict[str, Any], batch: list[tuple[Tensor, dict[str, Any]]]) -> FusedLayout:
        """What the fused call of ``batch`` takes from its parameters and their states
        (:class:`~lowbit.optim.step_plan.FusedLayout`)."""
        slots = self._slots(config)
        layout = FusedLayout(slots, list(batch), [], [], [[], [], []], [[], [], []], [], [], [], [])
        for p, state in batch:
            layout.shards.append(_ops.local(p))  # FSDP2: the local shards of the parameter and its states
            held: list[tuple[str, Tensor]] = []
            factored = "row2" in state  # lowbit/optim/factored.py: no state2/absmax2, the factors instead
            given = factored and factored_module.spans_ranks(p)
            layout.factored_entries.append(_ops.FACTORED_GIVEN if given else int(factored))
            if factored:
                held += [("row2", state["row2"]), ("col2", state["col2"])]
                row, col = _ops.local(state["row2"]), _ops.local(state["col2"])
                layout.factored_items.append((state, layout.factor_count, len(layout.shards) - 1 if given else None))
                layout.factor_count += row.numel() + col.numel() + int(given)
            for j, k in enumerate(slots):
                key, amax = f"state{k + 1}", f"absmax{k + 1}"
                if key in state:
                    held.append((key, state[key]))
                if amax in state:
                    held.append((amax, state[amax]))
                layout.states[j].append(_NO_STATE if factored and key not in state else _ops.local(state[key]))
                layout.absmaxes[j].append(state.get(amax, _NO_ABSMAX))
            ranked = next((k for k in slots if f"axis_max{k + 1}" in state), None)
            rank1 = rank1_layout(p) if ranked is not None else None
            if ranked is not None and rank1 is not None:
                offset, dims = rank1
                layout.rank1_entries += [len(dims), offset, *dims]
                layout.ranked_items.append((len(layout.shards) - 1, f"axis_max{ranked + 1}", sum(dims)))
            else:
                layout.rank1_entries.append(0)
            layout.held.append(tuple(held))
        return layout

    def _prepare_fused(
        self,
        config: dict[str, Any],
        batch: list[tuple[Tensor, dict[str, Any]]],
        places: list[str],
        positions: list[int],
        layout: Optional[FusedLayout] = None,
    ) -> Callable[[], None]:
        """The fused call of ``batch``, checked and ready: the returned function steps the parameters and
        their states and advances the step counters. ``places`` says where each parameter is in the
        user's param groups, for error messages. ``layout``: :meth:`_fused_layout` of ``batch``, made now if
        None; its widths, once a step has checked every tensor, spare later steps the checks of the states."""
        if layout is None:
            layout = self._fused_layout(config, batch)
        slots = layout.slots
        n_states = len(slots)
        hyper, flags = self._hyper(config)
        hyper = hyper._replace(max_unorm=config["max_unorm"])
        norm_mode = self._norm_mode
        if config["max_unorm"] > 0:
            if norm_mode != NORM_NONE:  # LAMB and LARS refuse it when it is set; this catches later edits
                raise ValueError(f"lowbit: {type(self).__name__} scales its update itself; max_unorm must be 0")
            norm_mode = NORM_CLIP
        # The step numbers this step takes; the counters advance once the native call has succeeded.
        counters = layout.counters
        if counters is None:
            counters = torch.stack([state["step"] for _, state in batch])
        steps = [int(s) + 1 for s in counters.tolist()]
        scalars: list[float] = []
        by_step: dict[int, tuple[float, float, float]] = {}
        for step in steps:
            if step not in by_step:
                by_step[step] = self._step_scalars(config, step)
            scalars += by_step[step]
        params, grads = [], []
        copied: list[tuple[Tensor, Tensor]] = []
        for (p, _), shard in zip(batch, layout.shards, strict=True):
            grad = _ops.local(cast(Tensor, p.grad))  # a batch holds the parameters with a gradient
            if not shard.is_contiguous():
                # channels_last or strided parameters: a contiguous copy is stepped (states are in the
                # parameter's logical order, as for a contiguous one) and written back.
                copied.append((shard, shard.contiguous()))
                shard = copied[-1][1]
            params.append(shard)
            grads.append(grad.contiguous() if grad.dtype == shard.dtype else grad.to(shard.dtype).contiguous())
        states, absmaxes = layout.states, layout.absmaxes
        ranked_items, factored_items = layout.ranked_items, layout.factored_items
        device = params[0].device
        originals = [p for p, _ in batch]
        grad_scales, histories = self._grad_scales(config, grads, originals, steps)
        grads, grad_scales = self._adjust_grads(config, params, grads, grad_scales, originals)
        # Slots the rule does not use get a map all the same (the op checks every map).
        signed = [self._state_signed[slots[j]] if j < n_states else True for j in range(3)]
        state_bits = 4 if config["optim_bits"] == 4 else 8
        map1, map2, map3 = (optimizer_state_map(s, device, state_bits) for s in signed)
        args = StepArgs(
            params=params,
            grads=grads,
            state1=states[0],
            state2=states[1],
            state3=states[2],
            absmax1=absmaxes[0],
            absmax2=absmaxes[1],
            absmax3=absmaxes[2],
            scalars=scalars,
            grad_scales=grad_scales,
            map1=map1,
            map2=map2,
            map3=map3,
            rule=self._rule_code(config),
            hyper=hyper.values(),
            flags=flags,
            norm_mode=norm_mode,
            n_states=n_states,
            block_size=config["block_size"],
            state_bits=state_bits,
        )
        if config["rounding"] == "stochastic":
            # Each tensor's step seed and the counter of its first local element (lowbit/optim/rounding.py).
            rounding: list[int] = []
            for (p, _), step, position in zip(batch, steps, positions, strict=True):
                offset = (position << COUNTER_BITS) + global_offset(p)
                rounding += [stream_seed(config["rounding_seed"], step), offset]
            args = args._replace(rounding=rounding)
        if ranked_items:
            # The rank-1 statistics of the call, flat (lowbit/_ops/optim.py: StepArgs).
            new_axis_max = torch.zeros(sum(n for *_, n in ranked_items), dtype=torch.float32, device=device)
            axis_max = torch.cat([batch[i][1][key] for i, key, _ in ranked_items])
            args = args._replace(rank1=layout.rank1_entries, axis_max=axis_max, new_axis_max=new_axis_max)
        if factored_items:
            parts = []
            for state, _, given in factored_items:
                row, col = _ops.local(state["row2"]), _ops.local(state["col2"])
                parts += [row.reshape(-1), col.reshape(-1)]
                if given is not None:
                    parts.append(torch.zeros(1, dtype=torch.float32, device=row.device))  # its mean, from run()
            factors = torch.cat(parts)
            args = args._replace(factored=layout.factored_entries, factors=factors)
        if norm_mode != NORM_NONE and any(isinstance(p, DTensor) for p in originals):
            # The norms of FSDP2 shards span ranks: the pre-pass sums are all-reduced, and the step
            # takes the scales computed from them.
            sums = sum_over_shards(_ops.optimizer_norms(*args), originals)
            args = args._replace(update_scales=update_scales(sums, hyper, norm_mode))
        try:
            widths = _ops.check_optimizer_step(args, layout.widths)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise type(exc)(_in_user_terms(str(exc), places)) from exc
        layout.widths = widths

        def run() -> None:
            if ranked_items:
                # The statistics pass, the MAX over the shards of FSDP2 parameters, then the step that
                # encodes against the statistics of the whole parameter (include/lowbit/rank1.h).
                _ops.rank1_statistics_eager(args, widths)
                parts = new_axis_max.split([n for *_, n in ranked_items])
                for (i, _, _), part in zip(ranked_items, parts, strict=True):
                    max_over_shards(part, originals[i])  # in place: parts are views
            # The factors of sharded matrices (collectives over their ranks), which the step then reads: their new
            # rows, columns and mean, consecutive in ``factors``.
            for state, offset, given_at in factored_items:
                if given_at is not None:
                    assert args.factors is not None
                    row, col = _ops.local(state["row2"]), _ops.local(state["col2"])
                    new = factored_module.given_factors(
                        params[given_at], grads[given_at], row, col, hyper, flags, originals[given_at]
                    )
                    args.factors.narrow(0, offset, new.numel()).copy_(new)
            _ops.optimizer_step_eager(args, widths, layout.meta)
            for state, offset, _ in factored_items:
                assert args.factors is not None
                row, col = _ops.local(state["row2"]), _ops.local(state["col2"])
                row.copy_(args.factors.narrow(0, offset, row.numel()).view_as(row))
                col.copy_(args.factors.narrow(0, offset + row.numel(), col.numel()).view_as(col))
            if ranked_items:
                parts = new_axis_max.split([n for *_, n in ranked_items])
                for (i, key, _), part in zip(ranked_items, parts, strict=True):
                    batch[i][1][key] = part.clone()
            for shard, work in copied:
                shard.copy_(work)
            if layout.counters is not None:
                layout.advance_counters()
            else:
                torch._foreach_add_([state["step"] for _, state in batch], 1.0)
            if histories:
                for (_, state), history in zip(batch, histories, strict=True):
                    state["gnorm_vec"] = history

        return run

    def _meta_step(
        self, config: dict[str, Any], batch: list[tuple[Tensor, dict[str, Any]]], places: list[str]
    ) -> Callable[[], None]:
        """A step of meta parameters, as torch.optim takes one: their states exist (created on the meta
        device with the shapes and dtypes a real step gives them) and the step counters advance; there
        are no values to compute. Parameters on the meta device cannot share a step with real ones."""
        real = [where for (p, _), where in zip(batch, places, strict=True) if not _ops.local(p).is_meta]
        if real:
            raise ValueError(
                f"lowbit: {type(self).__name__}: {real[0]} is not on the meta device but others of its param group "
                "are; move every parameter off the meta device (module.to_empty) before stepping"
            )

        def run() -> None:
            torch._foreach_add_([state["step"] for _, state in batch], 1.0)
            if config["percentile_clipping"] < 100:
                for _, state in batch:
                    state.setdefault("gnorm_vec", torch.zeros(GNORM_HISTORY, dtype=torch.float32, device="meta"))

        return run

    # -- state dict -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict. States of FSDP2 parameters are given dequantized, as fp32 DTensors
        with the parameter's placements, because block-wise codes and absmaxes of one sharding do not
        reshard: ``torch.distributed.checkpoint`` can then load them at any world size."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            if isinstance(p, DTensor) and i in sd["state"]:
                entry = dict(sd["state"][i])
                for k in range(len(self._state_names)):
                    if f"state{k + 1}" in entry:
                        entry[f"state{k + 1}"] = like_param(p, self._unpack(k, p, self.state[p]).clone())
                        entry.pop(f"absmax{k + 1}", None)
                        entry.pop(f"axis_max{k + 1}", None)
                sd["state"][i] = entry
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, of another lowbit layout, or of the torch.optim optimizer
        of the same algorithm (``torch.optim.AdamW().state_dict()`` into ``AdamW8bit``).

        Hyperparameters come from the state dict, as in torch.optim. The layout options
        (``optim_bits``, ``block_size``, ``min_8bit_size``) stay this optimizer's: states saved in another
        layout, or under torch.optim's names, are converted to it (an ``Adam8bit`` stays 8-bit). 8-bit
        codes and fp32 states keep their dtype whatever the param dtype; 8-bit second moments saved in
        format 1 (``STATE_FORMAT``) are re-encoded. Every group and state entry is validated first
        (:mod:`lowbit.optim.loaded_state`): a state dict that does not fit raises and changes nothing.
        bitsandbytes' 32-bit state dicts load as they are; its 8-bit ones (codes on other maps) and torchao's
        quantized tensor subclasses raise with what to do instead (docs/migration.md).
        """
        check_loaded_state(self, state_dict)
        for group in state_dict["param_groups"]:
            check_state_format(self, group)
        layouts = [{k: group[k] for k in LAYOUT_OPTIONS} for group in self.param_groups]
        super().load_state_dict(state_dict)
        restore_state_dtypes(self, state_dict)
        for group, layout in zip(self.param_groups, layouts, strict=True):
            if group.get("state_format", 1) != STATE_FORMAT:
                for p in group["params"]:
                    self._upgrade_second_moments(p)
            for key, value in self.defaults.items():  # torch.optim's groups lack lowbit's options
                group.setdefault(key, value)
            group.update(layout, state_format=STATE_FORMAT)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                config = self._config(group, p)
                if "state1" not in state and not state.keys().isdisjoint(self._state_names):
                    self.load_dequantized_state(p, state)
                elif isinstance(p, DTensor) or not self._layout_matches(p, state, config):
                    # FSDP2 parameters arrive with dequantized states (state_dict).
                    self._relayout(p, state, config)


# The absmax entry of a state that has none (a rank-1 or factorized second moment: the op ignores it).
_NO_ABSMAX = torch.empty(0, dtype=torch.float32)
# The state entry of a factorized second moment (the op ignores it: its factors are in ``factors``).
_NO_STATE = torch.empty(0, dtype=torch.uint8)

_FUSED_LISTS = re.compile(r"\b(params|grads|state[123]|absmax[123])\[(\d+)\]")


def _in_user_terms(message: str, places: list[str]) -> str:
    """A fused call's error with each per-tensor index (``state1[3]``) replaced by where that tensor's
    parameter is in the optimizer's param groups (``state1 of param_groups[0] params[7]``)."""

    def name(m: re.Match[str]) -> str:
        i = int(m.group(2))
        return f"{m.group(1)} of {places[i]}" if i < len(places) else m.group(0)

    return _FUSED_LISTS.sub(name, message)


def _check_factored(opt: LowbitOptimizer, config: dict[str, Any], where: str) -> None:
    """Refuse ``factored=True`` where it is not supported, naming the option that conflicts."""
    if not opt._factorable:
        raise ValueError(f"lowbit: {where}: factored=True is supported by Adam and AdamW only")
    if config["optim_bits"] != 4:
        raise ValueError(
            f"lowbit: {where}: factored=True needs optim_bits=4 (got optim_bits={config['optim_bits']}); "
            "8-bit and fp32 layouts keep an element-wise second moment"
        )
    conflicts = {
        "rank1_normalization": config.get("rank1_normalization", False),
        "amsgrad": config.get("amsgrad", False),
        "max_unorm": config.get("max_unorm", 0.0) > 0,
        "percentile_clipping": config.get("percentile_clipping", 100) < 100,
    }
    for option, on in conflicts.items():
        if on:
            raise ValueError(
                f"lowbit: {where}: factored=True and {option}={config[option]!r} are mutually exclusive; "
                "turn one of them off"
            )


def decay_factor(lr: float, weight_decay: float) -> float:
    """1 - lr * weight_decay, computed in double as torch.optim does."""
    return 1.0 - lr * weight_decay
