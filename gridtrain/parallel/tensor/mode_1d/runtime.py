"""1d's runtime half: ``MODE``, the mode's spec (``tensor/spec.py``) on its geometry
(``geometry.py``): its layer table, style inference (``styles.py``), batch split and loss
(``loss.py``)."""

from gridtrain.parallel.tensor.dropout import dropout_factory
from gridtrain.parallel.tensor.grad_summed import STYLE as GRAD_SUMMED
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
from gridtrain.parallel.tensor.plan import (
    ATTENTION,
    COL_SHARDED,
    DROPOUT,
    EMBEDDING,
    LINEAR,
    NORM,
    PATCH,
)
from gridtrain.parallel.tensor.spec import TensorMode

LAYERS = {
    (LINEAR, "colwise"): (ColumnLinear, {}),
    (LINEAR, "packed_colwise"): (ColumnLinear, {}),
    (LINEAR, "colwise_gather_output"): (ColumnLinear, {"gather_output": True}),
    (LINEAR, "gather_output"): (ColumnLinear, {"gather_output": True}),
    (LINEAR, "vocab_parallel"): (ColumnLinear, {"vocab_parallel": True}),
    (LINEAR, "rowwise"): (RowLinear, {}),
    (LINEAR, "rowwise_split_input"): (RowLinear, {"parallel_input": False}),
    (EMBEDDING, "embedding_rowwise"): (VocabParallelEmbedding1D, {}),
    (EMBEDDING, "embedding_colwise"): (Embedding1D, {}),
    (EMBEDDING, "colwise"): (Embedding1D, {}),
    (PATCH, "colwise"): (PatchEmbedding1D, {}),
    (DROPOUT, "replicate"): (dropout_factory(PM1D, PM1D), {}),
    (ATTENTION, "heads"): (MultiheadAttention1D, {}),
    (NORM, GRAD_SUMMED): (GradSummed, {"mode": PM1D}),
}


def _splits_output(kind: str, style: str) -> bool:
    """Only column-parallel outputs stay split; everything else comes out whole."""
    return kind == LINEAR and style in (*COL_SHARDED, "vocab_parallel")


def _splits_input(kind: str, style: str) -> bool:
    """A row-parallel Linear reads a column-parallel output; every other layer a whole one."""
    return kind == LINEAR and style == "rowwise"


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
    tie_alternatives=(
        "colwise_gather_output",
        "rowwise_split_input",
        "vocab_parallel",
        "replicate",
    ),
    splits_output=_splits_output,
    splits_input=_splits_input,
    splits_weights=True,
)
