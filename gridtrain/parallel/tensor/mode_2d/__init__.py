"""2D (Optimus) and 2.5D (Tesseract) tensor parallelism on a (depth x) q x q SUMMA grid.

2.5D stacks ``depth`` q x q grids: the batch is cut into ``depth * q`` blocks,
weights are replicated over depth and every use of a weight passes through
``grid.replicated``, whose backward sums the gradient over the depth axis (the
slices back-propagate different parts of one batch whose loss is already
divided by the whole batch's count). Depth 1 is exactly 2D; the layers are the same.

``MODE_2D`` and ``MODE_2P5D`` are the two modes' specs (``tensor/spec.py``): the
blocked modes' planning (``tensor/blocked.py``) with the grid's layers, batch split
and loss (``loss.py``); they differ only in their groups (``grid.grid_groups``).
"""

import dataclasses
import functools

from gridtrain.parallel.tensor import blocked
from gridtrain.parallel.tensor.mode_2d import layers, mha, vocab
from gridtrain.parallel.tensor.mode_2d.grid import SummaGrid, grid_groups, grid_side
from gridtrain.parallel.tensor.mode_2d.layers import (
    Classifier,
    Embedding,
    Linear,
    Norm,
    PatchEmbedding,
)
from gridtrain.parallel.tensor.mode_2d.loss import CrossEntropyLoss, accuracy, split_batch
from gridtrain.parallel.tensor.mode_2d.mha import MultiheadAttention
from gridtrain.parallel.tensor.mode_2d.vocab import VocabParallelClassifier, VocabParallelEmbedding


def _head_split(size: int, depth: int) -> tuple[int, str]:
    q = grid_side(size, depth)
    return q, f"the grid columns (PARALLEL_2D_ROW, q = {q})"


MODE_2D = blocked.blocked_mode(
    "2d",
    split_batch,
    CrossEntropyLoss,
    accuracy,
    layers=blocked.layer_table(layers, vocab, mha),
    head_split=_head_split,
    groups=functools.partial(grid_groups, "2d"),
)
MODE_2P5D = dataclasses.replace(MODE_2D, name="2.5d", groups=functools.partial(grid_groups, "2.5d"))

__all__ = [
    "MODE_2D",
    "MODE_2P5D",
    "Classifier",
    "CrossEntropyLoss",
    "Embedding",
    "Linear",
    "MultiheadAttention",
    "Norm",
    "PatchEmbedding",
    "SummaGrid",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
    "accuracy",
    "split_batch",
]
