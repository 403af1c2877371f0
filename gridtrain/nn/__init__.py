"""Public layer namespace: the configured tensor mode picks each layer's implementation."""

from gridtrain.parallel.tensor.layers import (
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    VocabParallelClassifier,
    VocabParallelEmbedding,
    accuracy,
    attention,
    position_ids,
    shared_input,
)

__all__ = [
    "Classifier",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "PatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
    "accuracy",
    "attention",
    "position_ids",
    "shared_input",
]
