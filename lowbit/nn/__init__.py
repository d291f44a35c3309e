"""Layers for memory-efficient training: embeddings for 8-bit optimizers, activations that save less."""

from lowbit.nn import fewbit, invact
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
    InvActivation,
    InvGELU,
    InvMish,
    InvSiLU,
    few_bit,
    inv_act,
)
from lowbit.nn.blpa import ApproxBNReLUConv2d, ApproxBNReLULinear
from lowbit.nn.compress import CompressionReport, compress_activations
from lowbit.nn.embedding import Embedding, StableEmbedding
from lowbit.nn.fewbit import FewBitTable, optimal_levels

__all__ = [
    "ApproxBNReLUConv2d",
    "ApproxBNReLULinear",
    "CompressionReport",
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
    "InvActivation",
    "InvGELU",
    "InvMish",
    "InvSiLU",
    "StableEmbedding",
    "compress_activations",
    "few_bit",
    "fewbit",
    "inv_act",
    "invact",
    "optimal_levels",
]
