"""2D (Optimus) and 2.5D (Tesseract) tensor parallelism on a (depth x) q x q SUMMA grid.

2.5D stacks ``depth`` q x q grids: the batch is cut into ``depth * q`` blocks,
weights are replicated over depth and every use of a weight passes through
``grid.replicated``, whose backward sums the gradient over the depth axis (the
slices back-propagate different parts of one batch whose loss is already
divided by the whole batch's count). Depth 1 is exactly 2D; the layers are the same.

``geometry.py`` is the torch-free half (the grid's groups, size checks, head split, the
collectives ``gridtrain estimate`` counts, ``costs.py``); ``runtime.py`` builds ``MODE_2D``
and ``MODE_2P5D``, the two modes' specs. The names below load on first use.
"""

from gridtrain.parallel.tensor.lazy import exports

_WHERE = {
    "MODE_2D": "runtime",
    "MODE_2P5D": "runtime",
    "Classifier": "layers",
    "Embedding": "layers",
    "Linear": "layers",
    "Norm": "layers",
    "PatchEmbedding": "layers",
    "CrossEntropyLoss": "loss",
    "accuracy": "loss",
    "split_batch": "loss",
    "MultiheadAttention": "mha",
    "SummaGrid": "grid",
    "VocabParallelClassifier": "vocab",
    "VocabParallelEmbedding": "vocab",
}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
