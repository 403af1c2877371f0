"""1D tensor parallelism (Megatron-LM): column/row Linears, split embeddings, vocab-parallel loss."""

from gridtrain.parallel.tensor.mode_1d.embedding import (
    Embedding1D,
    PatchEmbedding1D,
    VocabParallelEmbedding1D,
)
from gridtrain.parallel.tensor.mode_1d.linear import PM1D, ColumnLinear, RowLinear
from gridtrain.parallel.tensor.mode_1d.loss import CrossEntropyLoss, accuracy, split_batch

__all__ = [
    "PM1D",
    "ColumnLinear",
    "CrossEntropyLoss",
    "Embedding1D",
    "PatchEmbedding1D",
    "RowLinear",
    "VocabParallelEmbedding1D",
    "accuracy",
    "split_batch",
]
