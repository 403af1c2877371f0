"""No tensor mode's runtime half: ``MODE``, with the plain loss and batch (``loss.py``)."""

from gridtrain.parallel.tensor.none.geometry import GEOMETRY
from gridtrain.parallel.tensor.none.loss import CrossEntropyLoss, accuracy, split_batch
from gridtrain.parallel.tensor.spec import TensorMode

MODE = TensorMode(GEOMETRY, split_batch, CrossEntropyLoss, accuracy)
