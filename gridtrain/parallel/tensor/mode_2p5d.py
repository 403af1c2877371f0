"""2.5D tensor parallelism (Tesseract, Wang et al. 2021): ``depth`` stacked q x q SUMMA grids.

Tensor rank ``t = k * q * q + i * q + j``. Each depth slice k runs 2D (Optimus)
SUMMA on its own q x q grid over PARALLEL_2P5D_ROW / PARALLEL_2P5D_COL:

* the batch is cut into ``depth * q`` blocks, rank (k, i, j) holding block
  ``k * q + i`` (``split_batch``), hidden block j;
* weights are replicated over depth (each rank holds 1/q^2 = depth/T of every
  sharded parameter, not 1/T) and every use of a weight passes through
  ``summa.replicated``, whose backward all-reduces (sums) the gradient over
  PARALLEL_2P5D_DEP: the slices back-propagate different parts of one batch
  whose loss is already divided by the whole batch's count, so their
  gradients add up to the dense gradient. (The legacy engine never reduced
  over depth, so depth > 1 trained each slice on its own part of the batch.)

The layer classes are the 2D ones (``mode_2d``), which read the depth axis from
the context; depth 1 is exactly 2D.
"""

from __future__ import annotations

from gridtrain.parallel.tensor.mode_2d import (
    Classifier,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    VocabParallelClassifier,
    VocabParallelEmbedding,
)
from gridtrain.parallel.tensor.summa_loss import CrossEntropyLoss, accuracy, split_batch

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
    "split_batch",
]
