"""1d's runtime half: ``MODE``, the mode's spec (``tensor/spec.py``) on its geometry
(``geometry.py``): its layer table, style inference (``styles.py``), batch split and loss
(``loss.py``)."""

from gridtrain.parallel.tensor.dropout import dropout_factory
from gridtrain.parallel.tensor.grad_summed import GradSummed
from gridtrain.parallel.tensor.mode_1d import styles
from gridtrain.parallel.tensor.mode_1d.embedding import (
    Embedding1D,
    PatchEmbedding1D,
    VocabParallelEmbedding1D,
)
from gridtrain.parallel.tensor.mode_1d.geometry import GEOMETRY
from gridtrain.parallel.tensor.mode_1d.linear import PM1D, ColumnLinear, RowLinear
from gridtrain.parallel.tensor.mode_1d.loss import CrossEntropyLoss, accuracy, split_batch
from gridtrain.parallel.tensor.mode_1d.mha import MultiheadAttention1D
from gridtrain.parallel.tensor.spec import TensorMode
from gridtrain.parallel.tensor.style import (
    ATTENTION,
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    DROPOUT,
    EMBEDDING,
    EMBEDDING_COLWISE,
    EMBEDDING_ROWWISE,
    GATHER_OUTPUT,
    GRAD_SUMMED,
    HEADS,
    LINEAR,
    NORM,
    PACKED_COLWISE,
    PATCH,
    REPLICATE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    SPLIT,
    VOCAB_PARALLEL,
    of,
)

LAYERS = {  # each style's 1d layer
    (LINEAR, COLWISE): (ColumnLinear, {}),
    (LINEAR, PACKED_COLWISE): (ColumnLinear, {}),
    (LINEAR, COLWISE_GATHER_OUTPUT): (ColumnLinear, {"gather_output": True}),
    (LINEAR, GATHER_OUTPUT): (ColumnLinear, {"gather_output": True}),
    (LINEAR, VOCAB_PARALLEL): (ColumnLinear, {"vocab_parallel": True}),
    (LINEAR, ROWWISE): (RowLinear, {}),
    (LINEAR, ROWWISE_SPLIT_INPUT): (RowLinear, {"parallel_input": False}),
    (EMBEDDING, EMBEDDING_ROWWISE): (VocabParallelEmbedding1D, {}),
    (EMBEDDING, EMBEDDING_COLWISE): (Embedding1D, {}),
    (EMBEDDING, COLWISE): (Embedding1D, {}),
    (PATCH, COLWISE): (PatchEmbedding1D, {}),
    (DROPOUT, REPLICATE): (dropout_factory(PM1D, PM1D), {}),
    (ATTENTION, HEADS): (MultiheadAttention1D, {}),
    (NORM, GRAD_SUMMED): (GradSummed, {"mode": PM1D}),
}


def _splits_output(kind: str, style: str) -> bool:
    """Only column-parallel outputs and split logits stay split; the rest come out whole."""
    return kind == LINEAR and (of(style).column or of(style).logits == SPLIT)


def _splits_input(kind: str, style: str) -> bool:
    """A row-parallel Linear reads a column-parallel output; every other layer a whole one."""
    return kind == LINEAR and of(style).row


MODE = TensorMode(
    GEOMETRY,
    split_batch,
    CrossEntropyLoss,
    accuracy,
    layers=LAYERS,
    kept=frozenset({NORM}),  # activations around norms are replicated (but a per-head norm's)
    infer_styles=styles.styles_1d,
    needs_flow=styles.needs_flow,
    entry_options=styles.dropout_options,
    tie_alternatives=(COLWISE_GATHER_OUTPUT, ROWWISE_SPLIT_INPUT, VOCAB_PARALLEL, REPLICATE),
    splits_output=_splits_output,
    splits_input=_splits_input,
    splits_weights=True,
)
