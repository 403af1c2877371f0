"""2D (Optimus) and 2.5D (Tesseract) tensor parallelism on a (depth x) q x q SUMMA grid.

2.5D stacks ``depth`` q x q grids: the batch is cut into ``depth * q`` blocks,
weights are replicated over depth and every use of a weight passes through
``grid.replicated``, whose backward sums the gradient over the depth axis (the
slices back-propagate different parts of one batch whose loss is already
divided by the whole batch's count). Depth 1 is exactly 2D; the layers are the same.
"""

from gridtrain.parallel.tensor.mode_2d.grid import SummaGrid
from gridtrain.parallel.tensor.mode_2d.layers import (
    Classifier,
    Embedding,
    Linear,
    Norm,
    PatchEmbedding,
)
from gridtrain.parallel.tensor.mode_2d.loss import CrossEntropyLoss, accuracy, split_batch
from gridtrain.parallel.tensor.mode_2d.vocab import VocabParallelClassifier, VocabParallelEmbedding

__all__ = [
    "Classifier",
    "CrossEntropyLoss",
    "Embedding",
    "Linear",
    "Norm",
    "PatchEmbedding",
    "SummaGrid",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
    "accuracy",
    "split_batch",
]
