"""Gradient release: each parameter steps inside backward as soon as its gradient is final, and that
gradient is freed at once, so a model's gradients never all exist together.

``release = lowbit.optim.step_in_backward(opt, model)`` registers a post-accumulate-grad hook on every
parameter of ``opt``. When autograd has finished accumulating a parameter's gradient (once per backward,
whatever the number of uses of the parameter), the hook steps that parameter alone through the
optimizer's own fused step and sets its ``.grad`` to None. Every lowbit step is per parameter (its
states, its whole-tensor norms: LAMB's and LARS's trust ratios, ``max_unorm``, ``percentile_clipping``'s
history), so the result is bit for bit that of ``loss.backward(); opt.step(); opt.zero_grad()``, LR
schedulers and a tensor ``lr`` included (the group's lr is read at each parameter's step, and
``scheduler.step()`` runs after the backward as it runs after ``opt.step()``).

While release is on, ``opt.step()`` and ``opt.zero_grad()`` are no-ops, because backward left no
gradient for them: an existing loop runs unchanged, and ``scheduler.step()`` after ``opt.step()`` does
not warn. A gradient put on a parameter by other means (assigned by hand) is still stepped by
``opt.step()``, as always. ``release.remove()`` restores the ordinary loop.

Gradient accumulation: backward passes inside ``with release.accumulate():`` add to ``.grad`` without
stepping; the next backward outside it steps every parameter on the total and frees it, as the
ordinary loop steps after its last micro-batch (also under FSDP2, which runs the hooks at every
micro-batch's reduce-scatter). The gradients then exist until the last micro-batch's backward, so the
peak of model bytes is the ordinary loop's; release saves the gradient bytes only without accumulation.

What cannot work is refused:

- ``GradScaler``: backward would step on the scaled gradient before ``scaler.unscale_`` can run. The
  scaler is not visible before then: ``scaler.step(opt)`` raises (the first backward has already
  stepped with the scaled gradient; reload the parameters). Use bf16 autocast, which needs no scaler.
- Global gradient clipping (``torch.nn.utils.clip_grad_norm_`` over the model): it needs every
  gradient at once, after backward, and they are freed during it; called after backward it finds no
  gradient and returns 0. It is a torch function that lowbit cannot intercept, so this is documented
  only. Use the optimizer's per-tensor ``max_unorm`` or ``percentile_clipping``, which are exact here.
- DDP: its all-reduce runs after the hooks, so each rank would step on its own gradient. Passing the
  model lets :func:`step_in_backward` refuse a ``DistributedDataParallel`` module; in a distributed run
  without it, plain (non-DTensor) parameters are refused, since lowbit cannot tell whether DDP wraps
  them. FSDP2 works: it calls the sharded parameters' post-accumulate-grad hooks after its
  reduce-scatter, so each rank steps its shard on the reduced gradient. Its sharded gradients are views
  of one reduce-scatter output per ``fully_shard`` module, which is freed once all of them are.

LPMM optimizers (:class:`~lowbit.optim.LPMMSGD`, :class:`~lowbit.optim.LPMMAdamW`): a converted
parameter's gradient lives in its quantized accumulator, and its handle's post-accumulate-grad hook runs
once autograd has fed it every contribution. The hook steps the parameter and frees the accumulator
(:meth:`~lowbit.lpmm.LowPrecisionParameter.free_grad_`; :func:`step_in_backward` frees them all at
once), so a released LPMM model holds one accumulator at a time instead of ``grad_bits`` per parameter.
Bit-identity holds because an LPMM step's rounding draws depend only on the optimizer's
``rounding_seed``, the parameter's step number and its position (:mod:`lowbit.optim.lpmm`), never on
which parameters step together. FSDP2-sharded LPMM parameters work too: their handles get no gradient
(backward reduce-scatters each use's gradient into the sharded accumulator), so the hook sits on an empty
leaf tensor that every use's backward feeds (:attr:`~lowbit.lpmm.LowPrecisionParameter.release_leaf`);
autograd runs it once the last use has been accumulated, and each rank steps its groups. Refused: LPMM's
own data parallelism over whole parameters (it averages the accumulators in ``step()``, after backward).

Parameters added to the optimizer after :func:`step_in_backward`, or that did not require gradients
then, are not released (they step in ``opt.step()`` as usual); call ``remove()`` and
:func:`step_in_backward` again to include them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from lowbit.optim.lpmm import LPMMOptimizer, converted_storage, storage_of
from lowbit.optim.optimizer import LowbitOptimizer

if TYPE_CHECKING:
    from lowbit.lpmm.parameter import LowPrecisionParameter

__all__ = ["GradientRelease", "step_in_backward"]


class GradientRelease:
    """The handle :func:`step_in_backward` returns: :meth:`remove` ends release, :meth:`accumulate`
    defers stepping over micro-batches."""

    def __init__(self, optimizer: LowbitOptimizer | LPMMOptimizer) -> None:
        self.optimizer = optimizer
        self._accumulating = False
        self._hooks: list[RemovableHandle] = []
        # Where each parameter is (group index, index in the group), read by its hook.
        # Sharded LPMM storages whose release leaf this release set (remove() unsets them).
        self._leaves: list[LowPrecisionParameter] = []
        for gi, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if not p.requires_grad:
                    continue
                lp = storage_of(p)
                if lp is not None and lp.shards is not None:
                    # FSDP2 gives a sharded LPMM handle no gradient (backward reduce-scatters into the sharded
                    # accumulator), so the hook goes on a leaf that each use's backward feeds instead.
                    lp.release_leaf = torch.zeros(0, device=lp.device, requires_grad=True)
                    self._leaves.append(lp)
                    self._hooks.append(lp.release_leaf.register_post_accumulate_grad_hook(self._hook(gi, j, p)))
                else:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(gi, j, p)))
        self._hooks.append(optimizer.register_step_pre_hook(_refuse_grad_scaler))
        # GradScaler.step then sets the optimizer's grad_scale and found_inf and calls step(), where the
        # pre-hook sees them; without it, it fails on an assertion about missing inf checks.
        optimizer._step_supports_amp_scaling = True  # type: ignore[union-attr]  # a marker attribute the optimizer classes do not declare
        optimizer._lowbit_release = self  # type: ignore[union-attr]  # a marker attribute the optimizer classes do not declare

    def _hook(self, gi: int, j: int, param: Tensor) -> Callable[[Tensor], None]:
        # Not traced, as LowbitOptimizer.step is not: the backward of a torch.compile'd training step runs
        # its hooks inside dynamo's frame evaluation, which would otherwise trace the optimizer's Python
        # (AdEMAMix's schedules failed its float guards, and each step would recompile).
        @torch._disable_dynamo  # type: ignore[attr-defined]  # torch does not export it (torch.optim uses it)
        def step_and_free(hooked: Tensor) -> None:
            if self._accumulating:
                return
            group = self.optimizer.param_groups[gi]["params"]
            if j >= len(group) or group[j] is not param:
                raise RuntimeError(
                    "lowbit: the optimizer's param groups changed after step_in_backward; call remove() on "
                    "its handle and step_in_backward again"
                )
            # The step reads param.grad; it is freed only once the step has succeeded, as a failed
            # ordinary step keeps the gradients.
            self.optimizer._step_params({gi: [j]})
            hooked.grad = None
            lp = storage_of(param)
            if lp is not None:
                lp.free_grad_()

        return step_and_free

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside this block add to ``.grad`` without stepping (micro-batches); the next
        backward outside it steps on the accumulated gradient and frees it."""
        if self._accumulating:
            raise RuntimeError("lowbit: release.accumulate() is already active")
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @property
    def active(self) -> bool:
        """Whether release is on (until :meth:`remove`)."""
        return bool(self._hooks)

    def remove(self) -> None:
        """Restore the ordinary ``backward(); step(); zero_grad()`` loop. Idempotent."""
        if not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for lp in self._leaves:
            lp.release_leaf = None
        self._leaves = []
        del self.optimizer._step_supports_amp_scaling  # type: ignore[union-attr]  # a marker attribute the optimizer classes do not declare
        del self.optimizer._lowbit_release  # type: ignore[union-attr]  # a marker attribute the optimizer classes do not declare


def _refuse_grad_scaler(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of a released optimizer: GradScaler.step leaves ``found_inf`` on it."""
    if getattr(optimizer, "found_inf", None) is not None:
        # GradScaler sets them again at each of its steps: a later step() without it must not raise.
        optimizer.__dict__.pop("found_inf")
        optimizer.__dict__.pop("grad_scale", None)
        raise RuntimeError(
            "lowbit: GradScaler cannot work with step_in_backward: backward has already stepped each parameter "
            "on its scaled gradient, before unscale_ could run (reload the parameters from a checkpoint). "
            "Train with bf16 autocast, which needs no GradScaler, or remove() the release"
        )


def _check_distributed(optimizer: LowbitOptimizer | LPMMOptimizer, model: Optional[nn.Module]) -> None:
    """Refuse the distributed setups whose gradients are not final when their hooks run."""
    if model is not None:
        for name, module in model.named_modules():
            if isinstance(module, DistributedDataParallel):
                raise ValueError(
                    f"lowbit: step_in_backward cannot release gradients under DistributedDataParallel "
                    f"({name or 'the model'}): DDP all-reduces gradients after the hooks run, so each rank "
                    "would step on its own gradient. Use FSDP2 (fully_shard), whose reduce-scatter comes "
                    "before the step, or the ordinary loop"
                )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(isinstance(p, DTensor) for p in params) and torch.torch_version.TorchVersion(torch.__version__) < "2.5":
        # pytorch#129450 (torch 2.5): FSDP2 sets the sharded gradients outside autograd and only since then
        # runs their post-accumulate-grad hooks; before, the parameters would silently never step.
        raise NotImplementedError("lowbit: step_in_backward under FSDP2 needs torch >= 2.5")
    if model is not None:
        return
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if any(not isinstance(p, DTensor) for p in params):
        raise ValueError(
            "lowbit: step_in_backward in a distributed run with plain (not FSDP2-sharded) parameters needs "
            "model=: lowbit must check that DistributedDataParallel does not wrap it, since DDP's all-reduce "
            "runs after the hooks"
        )


def _check_lpmm(optimizer: LPMMOptimizer) -> None:
    """Refuse the LPMM setups whose gradients are not final (or not seen) when the handles' hooks run."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # Sharded storages were averaged by backward's reduce-scatter; step() averages only whole ones.
    if optimizer._group() is not None and any(converted_storage(p).shards is None for p in params):
        raise ValueError(
            f"lowbit: step_in_backward cannot release {type(optimizer).__name__} with data_parallel: it averages "
            "the accumulators over the ranks in step(), after backward. Pass data_parallel=False (one process per "
            "model) or use the ordinary loop"
        )


def step_in_backward(optimizer: LowbitOptimizer | LPMMOptimizer, model: Optional[nn.Module] = None) -> GradientRelease:
    """Step each parameter of ``optimizer`` inside backward, as soon as its gradient is final, and free
    the gradient (see :mod:`lowbit.optim.gradient_release`).

    Args:
        optimizer: a lowbit block-wise or fp32 optimizer (8-bit, 4-bit, 32-bit, LAMB/LARS, ...), or an
            LPMM optimizer, whose parameters' accumulators are freed here and after each parameter's step.
        model: the module being trained. Optional, used only to refuse DDP, whose all-reduce would come
            after the step; in a distributed run with plain parameters it is required, because without it
            lowbit cannot tell a DDP-wrapped model from independent per-rank training.

    Returns:
        A :class:`GradientRelease`; its ``remove()`` restores the ordinary loop.

    Raises:
        NotImplementedError: FSDP2 parameters on torch < 2.5, whose FSDP2 does not run the sharded
            parameters' hooks.
        TypeError: ``optimizer`` is not a lowbit optimizer.
        ValueError: DDP, a distributed run with plain parameters and no ``model``, or an LPMM optimizer
            that averages gradients over ranks itself (``data_parallel``).
        RuntimeError: release is already on for ``optimizer``, or a gradient already exists (it would
            be stepped together with the next backward's, unlike the ordinary loop).
    """
    if not isinstance(optimizer, (LowbitOptimizer, LPMMOptimizer)):
        raise TypeError(
            f"lowbit: step_in_backward releases gradients of lowbit optimizers, got {type(optimizer).__name__}"
        )
    if getattr(optimizer, "_lowbit_release", None) is not None:
        raise RuntimeError("lowbit: step_in_backward is already on for this optimizer; remove() its handle first")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.grad is not None or ((lp := storage_of(p)) is not None and lp.has_grad) for p in params):
        raise RuntimeError(
            "lowbit: step_in_backward needs the gradients cleared first (optimizer.zero_grad()): a gradient "
            "left now would be added to the next backward's and stepped with it"
        )
    _check_distributed(optimizer, model)
    if isinstance(optimizer, LPMMOptimizer):
        _check_lpmm(optimizer)
        for p in params:
            converted_storage(p).free_grad_()
    return GradientRelease(optimizer)
