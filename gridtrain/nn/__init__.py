"""Public layer namespace: plain ``torch.nn`` modules with optional hints for the planner.

Every class here *is* a plain module (``isinstance(gt.nn.Linear(...), nn.Linear)``),
works with no gridtrain context at all, and only tells ``gt.initialize`` how to
shard it when the config asks for tensor parallelism (``split=`` and friends).
A model written with plain ``torch.nn`` layers is sharded just the same, by
the traced plan (see ``gridtrain.parallel.tensor.plan``).
"""

from gridtrain.nn.functional import accuracy, attention, position_ids
from gridtrain.nn.layers import (
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    RMSNorm,
    VocabParallelClassifier,
    VocabParallelEmbedding,
)

__all__ = [
    "Classifier",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "PatchEmbedding",
    "RMSNorm",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
    "accuracy",
    "attention",
    "position_ids",
]
