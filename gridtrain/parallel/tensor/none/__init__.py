"""No tensor mode: every rank of a model replica holds every layer whole and the whole batch."""

from gridtrain.parallel.tensor.none.layers import Classifier, PatchEmbedding
from gridtrain.parallel.tensor.none.loss import CrossEntropyLoss, accuracy, split_batch
from gridtrain.parallel.tensor.spec import TensorMode

MODE = TensorMode(None, split_batch, CrossEntropyLoss, accuracy)

__all__ = ["MODE", "Classifier", "CrossEntropyLoss", "PatchEmbedding", "accuracy", "split_batch"]
