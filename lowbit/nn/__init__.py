"""Layers for memory-efficient training: embeddings for 8-bit optimizers."""

from lowbit.nn.embedding import Embedding, StableEmbedding

__all__ = ["Embedding", "StableEmbedding"]
