"""No tensor mode: every rank of a model replica holds every layer whole and the whole batch.

``geometry.py`` is the torch-free half (``tensor/geometry.py``'s base as it is);
``runtime.py`` builds ``MODE``. The names below load on first use.
"""

from gridtrain.parallel.tensor.lazy import exports

_WHERE = {
    "MODE": "runtime",
    "Classifier": "layers",
    "PatchEmbedding": "layers",
    "CrossEntropyLoss": "loss",
    "accuracy": "loss",
    "split_batch": "loss",
}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
