"""Embedding layers for training with 8-bit optimizers (8bit-optimizers.txt section 2.3, appendix B).

Word embeddings see a sparse, non-uniform stream of token ids, so their gradients vary far more than
those of dense layers (appendix B) and are the main source of instability with 8-bit states. Both
layers here therefore register their weight for fp32 optimizer state with
``lowbit.optim.override(weight, optim_bits=32)`` and initialise it Xavier-uniform;
:class:`StableEmbedding` adds a layer norm over the looked-up vectors.

The override is keyed on the weight ``Parameter`` object. The layers carry it over when the weight is
replaced by ``.to()``/``.to_empty()`` (meta-device initialisation), by assignment to ``.weight``
(``load_state_dict(assign=True)``, and FSDP2's ``fully_shard``, which assigns through ``__setattr__``
on modules that define one), and re-register it on unpickling or ``copy.deepcopy``. Wrappers that
swap parameters behind the module's back (parametrizations) lose it: call
``lowbit.optim.override(emb.weight, optim_bits=32)`` again afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeVar, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowbit.optim.config import get_override, override

__all__ = ["Embedding", "StableEmbedding"]

_M = TypeVar("_M", bound="_Fp32StateEmbedding")

Device = Union[torch.device, str, int, None]


class _Fp32StateEmbedding(nn.Embedding):
    """``nn.Embedding`` with Xavier-uniform init, a 32-bit optimizer-state override and no sparse grads."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[Tensor] = None,
        _freeze: bool = False,
        device: Device = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        _check_dense(type(self).__name__, sparse)
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            _freeze,
            device=device,
            dtype=dtype,
        )
        override(self.weight, optim_bits=32)
        self._add_modules()

    def _add_modules(self) -> None:
        """Adds the layer's submodules once its weight exists; none here."""

    def reset_parameters(self) -> None:
        """Xavier-uniform weight (section 2.3), then the ``padding_idx`` row zeroed as nn.Embedding does."""
        nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()

    def forward(self, input: Tensor) -> Tensor:
        """The rows of the weight indexed by ``input``, as nn.Embedding (``sparse`` must still be False).

        Args:
            input: integer tensor of ids, any shape.
        """
        _check_dense(type(self).__name__, self.sparse)
        return F.embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, False
        )

    # -- keep the override on whatever Parameter object is the weight -----------------------------

    def _carry_override(self, old: Optional[Tensor]) -> None:
        new = self._parameters.get("weight")
        if old is not None and new is not None and new is not old:
            options = get_override(old)
            if options:
                override(new, **options)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "weight":
            super().__setattr__(name, value)
            return
        old = self.__dict__.get("_parameters", {}).get("weight")
        super().__setattr__(name, value)
        self._carry_override(old)

    def _apply(self: _M, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _M:
        old = self._parameters.get("weight")
        result = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # unannotated in torch
        self._carry_override(old)
        return result

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]  # unannotated in torch
        weight = self._parameters.get("weight")
        if weight is not None:
            override(weight, optim_bits=32)


def _check_dense(name: str, sparse: bool) -> None:
    if sparse:
        raise ValueError(f"lowbit: {name} does not support sparse=True: lowbit optimizers take dense gradients only")


class Embedding(_Fp32StateEmbedding):
    """``torch.nn.Embedding`` with Xavier-uniform init and fp32 optimizer state for its weight.

    For models whose architecture cannot change (8bit-optimizers.txt section 2.3): no layer norm,
    so outputs keep nn.Embedding's meaning, but the weight starts Xavier-uniform in
    ±sqrt(6 / (num_embeddings + embedding_dim)) instead of N(0, 1) and is registered with
    ``lowbit.optim.override(weight, optim_bits=32)``, so 8-bit optimizers keep 32-bit state for it.

    Args:
        num_embeddings: size of the vocabulary.
        embedding_dim: size of each embedding vector.
        padding_idx: row that is zero after initialisation and receives no gradient.
        max_norm: rows looked up with a larger ``norm_type`` norm are renormalised in place to this.
        norm_type: the p of the p-norm for ``max_norm``.
        scale_grad_by_freq: scale gradients by the inverse frequency of the ids in the mini-batch.
        sparse: must be False; lowbit optimizers reject sparse gradients, so True raises ValueError.
        _weight: initial weight of shape (num_embeddings, embedding_dim), used as is (no Xavier init),
            as in nn.Embedding; ``device``/``dtype`` are then ignored.
        _freeze: create the weight with ``requires_grad=False`` (used by ``from_pretrained``).
        device: device of the weight.
        dtype: dtype of the weight.
    """


class StableEmbedding(_Fp32StateEmbedding):
    """Stable embedding (8bit-optimizers.txt section 2.3): Xavier init, layer norm, fp32 optimizer state.

    ``forward`` looks the ids up and applies ``self.norm``, a ``LayerNorm(embedding_dim)``; add
    position embeddings to its output, after the norm. The weight is registered with
    ``lowbit.optim.override(weight, optim_bits=32)``; the layer norm's parameters follow the param
    group (they are below ``min_8bit_size`` for any realistic ``embedding_dim``).

    Precision: the layer norm's parameters live on the weight's device in the weight's dtype (so
    ``device=``, ``dtype=``, ``_weight`` and ``.to()`` treat the module as one), and the layer norm is
    computed in fp32 (or the weight's dtype if wider) and cast back to the weight's dtype. With
    bf16/fp16 weights this keeps the mean/variance reduction and the normalisation out of 8 or 11
    mantissa bits on every backend, at the cost of an fp32 temporary of the output's size.

    Differences from bitsandbytes' ``StableEmbedding``: it creates the LayerNorm with ``device`` but
    not ``dtype`` (fp32 parameters under a bf16 weight) and casts to ``torch.get_default_dtype()``
    rather than fp32 before the norm; it passes ``sparse=True`` through unchecked; and it records
    the override as a (module, "weight", config) triple in a process-wide list that keeps every
    such module alive for the life of the process, where lowbit holds it weakly. The computation
    otherwise matches.

    The ``padding_idx`` row of the weight is zero and gets no gradient, but its output is
    ``LayerNorm(0) = norm.bias``, not zero.

    Args:
        num_embeddings: size of the vocabulary.
        embedding_dim: size of each embedding vector.
        padding_idx: row that is zero after initialisation and receives no gradient.
        max_norm: rows looked up with a larger ``norm_type`` norm are renormalised in place to this.
        norm_type: the p of the p-norm for ``max_norm``.
        scale_grad_by_freq: scale gradients by the inverse frequency of the ids in the mini-batch.
        sparse: must be False; lowbit optimizers reject sparse gradients, so True raises ValueError.
        _weight: initial weight of shape (num_embeddings, embedding_dim), used as is (no Xavier init),
            as in nn.Embedding; ``device``/``dtype`` are then ignored and the norm follows ``_weight``.
        _freeze: create the weight with ``requires_grad=False`` (used by ``from_pretrained``).
        device: device of the weight and the layer norm.
        dtype: dtype of the weight and the layer norm's parameters.
    """

    def _add_modules(self) -> None:
        """The layer norm, on the weight's device in its dtype."""
        self.norm = nn.LayerNorm(self.embedding_dim, device=self.weight.device, dtype=self.weight.dtype)

    def reset_parameters(self) -> None:
        """Xavier-uniform weight, zero ``padding_idx`` row, and a fresh layer norm (ones, zeros)."""
        super().reset_parameters()
        norm = cast(Optional[nn.LayerNorm], self._modules.get("norm"))  # absent while nn.Embedding.__init__ calls this
        if norm is not None:
            norm.reset_parameters()

    def forward(self, input: Tensor) -> Tensor:
        """Layer-normalised embeddings of the ids in ``input``, in the weight's dtype.

        Args:
            input: integer tensor of ids, any shape.
        """
        emb = super().forward(input)
        compute = torch.promote_types(emb.dtype, torch.float32)
        norm = self.norm
        out = F.layer_norm(
            emb.to(compute),
            norm.normalized_shape,
            None if norm.weight is None else norm.weight.to(compute),
            None if norm.bias is None else norm.bias.to(compute),
            norm.eps,
        )
        return out.to(emb.dtype)
