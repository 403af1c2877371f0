"""2d's and 2.5d's runtime half: ``MODE_2D`` and ``MODE_2P5D``, the two modes' specs
(``tensor/spec.py``): the blocked modes' planning (``tensor/blocked.py``) with the grid's
layers, batch split and loss (``loss.py``); they differ only in their geometry
(``geometry.py``: the groups of one tensor block)."""

import dataclasses

from gridtrain.parallel.tensor import blocked
from gridtrain.parallel.tensor.mode_2d import layers, mha, vocab
from gridtrain.parallel.tensor.mode_2d.geometry import GEOMETRY_2D, GEOMETRY_2P5D
from gridtrain.parallel.tensor.mode_2d.loss import CrossEntropyLoss, accuracy, split_batch

MODE_2D = blocked.blocked_mode(
    GEOMETRY_2D,
    split_batch,
    CrossEntropyLoss,
    accuracy,
    layers=blocked.layer_table(layers, vocab, mha),
)
MODE_2P5D = dataclasses.replace(MODE_2D, geometry=GEOMETRY_2P5D)
