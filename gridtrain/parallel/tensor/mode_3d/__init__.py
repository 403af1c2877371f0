"""3D tensor parallelism on a d x d x d cube (Bian et al. 2021)."""

from gridtrain.parallel.tensor.mode_3d.cube import Cube, split_batch, swap_orientation
from gridtrain.parallel.tensor.mode_3d.layers import (
    Classifier,
    Embedding,
    Linear,
    Norm,
    PatchEmbedding,
    VocabParallelClassifier,
    VocabParallelEmbedding,
)
from gridtrain.parallel.tensor.mode_3d.loss import CrossEntropyLoss, accuracy

__all__ = [
    "Classifier",
    "CrossEntropyLoss",
    "Cube",
    "Embedding",
    "Linear",
    "Norm",
    "PatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
    "accuracy",
    "split_batch",
    "swap_orientation",
]
