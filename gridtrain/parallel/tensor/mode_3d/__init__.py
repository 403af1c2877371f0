"""3D tensor parallelism on a d x d x d cube (Bian et al. 2021).

``geometry.py`` is the torch-free half (the cube's groups, size check, head split, the
collectives ``gridtrain estimate`` counts, ``costs.py``); ``runtime.py`` builds ``MODE``, the
mode's spec, from the cube's layers, orientations (``orientations.py``), batch split
(``cube.py``) and loss (``loss.py``). The names below load on first use.
"""

from gridtrain.parallel.tensor.lazy import exports

_WHERE = {
    "MODE": "runtime",
    "Classifier": "layers",
    "Embedding": "layers",
    "Linear": "layers",
    "Norm": "layers",
    "PatchEmbedding": "layers",
    "VocabParallelClassifier": "layers",
    "VocabParallelEmbedding": "layers",
    "CrossEntropyLoss": "loss",
    "accuracy": "loss",
    "Cube": "cube",
    "split_batch": "cube",
    "swap_orientation": "cube",
    "MultiheadAttention": "mha",
}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
