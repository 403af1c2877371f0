"""1D tensor parallelism (Megatron-LM): column/row Linears, split embeddings, vocab-parallel loss.

``geometry.py`` is the torch-free half (one PARALLEL_1D group, heads split over it, the
collectives ``gridtrain estimate`` counts, ``costs.py``); ``runtime.py`` builds ``MODE``, the
mode's spec, from its layers (``linear.py``, ``embedding.py``, ``mha.py``), style inference
(``styles.py``), batch split and loss (``loss.py``). The names below load on first use.
"""

from gridtrain.parallel.tensor.lazy import exports

_WHERE = {
    "MODE": "runtime",
    "PM1D": "linear",
    "ColumnLinear": "linear",
    "RowLinear": "linear",
    "CrossEntropyLoss": "loss",
    "accuracy": "loss",
    "split_batch": "loss",
    "Embedding1D": "embedding",
    "PatchEmbedding1D": "embedding",
    "VocabParallelEmbedding1D": "embedding",
    "MultiheadAttention1D": "mha",
}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
