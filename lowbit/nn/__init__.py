"""Layers for memory-efficient training: embeddings for 8-bit optimizers, few-bit activations."""

from lowbit.nn import fewbit
from lowbit.nn.activations import (
    FewBitActivation,
    FewBitELU,
    FewBitGELU,
    FewBitHardswish,
    FewBitLeakyReLU,
    FewBitMish,
    FewBitReLU,
    FewBitSELU,
    FewBitSigmoid,
    FewBitSiLU,
    FewBitSoftplus,
    FewBitTanh,
    few_bit,
)
from lowbit.nn.embedding import Embedding, StableEmbedding
from lowbit.nn.fewbit import FewBitTable, optimal_levels

__all__ = [
    "Embedding",
    "FewBitActivation",
    "FewBitELU",
    "FewBitGELU",
    "FewBitHardswish",
    "FewBitLeakyReLU",
    "FewBitMish",
    "FewBitReLU",
    "FewBitSELU",
    "FewBitSiLU",
    "FewBitSigmoid",
    "FewBitSoftplus",
    "FewBitTable",
    "FewBitTanh",
    "StableEmbedding",
    "few_bit",
    "fewbit",
    "optimal_levels",
]
