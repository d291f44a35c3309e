"""Layers for memory-efficient training: embeddings for 8-bit optimizers, activations that save less."""

from lowbit.nn import activations, fewbit, invact
from lowbit.nn._registry import register_activation

# The activation layers and functions: activations.__all__ is the one list of their names (added to __all__ below).
from lowbit.nn.activations import *  # noqa: F403
from lowbit.nn.blpa import ApproxBNReLUConv2d, ApproxBNReLULinear
from lowbit.nn.compress import CompressionReport, compress_activations
from lowbit.nn.embedding import Embedding, StableEmbedding
from lowbit.nn.fewbit import FewBitTable, optimal_levels

__all__ = [
    "ApproxBNReLUConv2d",
    "ApproxBNReLULinear",
    "CompressionReport",
    "Embedding",
    "FewBitTable",
    "StableEmbedding",
    "compress_activations",
    "fewbit",
    "invact",
    "optimal_levels",
    "register_activation",
]
__all__ += activations.__all__
