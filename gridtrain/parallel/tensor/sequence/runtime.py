"""Sequence parallelism's runtime half: ``MODE``, the mode's spec (``tensor/spec.py``) on its
geometry (``geometry.py``): every weight stays whole, so the plan only gives each dropout
its per-rank stream; ``layout.py`` splits the batch, ``loss.py`` sums token losses over the
sequence group; ``sdpa.py`` runs a plain model's ``scaled_dot_product_attention`` as ring
attention."""

from gridtrain.parallel.tensor.dropout import dropout_factory
from gridtrain.parallel.tensor.plan import (
    ATTENTION,
    DROPOUT,
    EMBEDDING,
    LINEAR,
    NORM,
    OPAQUE,
    PATCH,
)
from gridtrain.parallel.tensor.sequence.geometry import GEOMETRY
from gridtrain.parallel.tensor.sequence.layout import SEQUENCE, split_batch
from gridtrain.parallel.tensor.sequence.loss import CrossEntropyLoss, accuracy
from gridtrain.parallel.tensor.sequence.mha import SequenceMultiheadAttention
from gridtrain.parallel.tensor.sequence.sdpa import attention_route
from gridtrain.parallel.tensor.spec import TensorMode


def _replicated(kinds, given, flow, modules, n):
    """Weights are replicated; only dropout masks differ per rank (module docstring), and
    ``nn.MultiheadAttention`` attends over the split positions (``mha.py``)."""
    styles = {m: "heads" if k == ATTENTION else "replicate" for m, k in kinds.items()}
    return styles, {m: "sequence: replicated" for m in kinds}


MODE = TensorMode(
    GEOMETRY,
    split_batch,
    CrossEntropyLoss,
    accuracy,
    layers={
        (DROPOUT, "replicate"): (dropout_factory(SEQUENCE), {}),
        (ATTENTION, "heads"): (SequenceMultiheadAttention, {}),
    },
    kept=frozenset({LINEAR, EMBEDDING, NORM, PATCH, OPAQUE}),
    infer_styles=_replicated,
    tie_alternatives=("replicate",),
    forward_mode=attention_route,
)
