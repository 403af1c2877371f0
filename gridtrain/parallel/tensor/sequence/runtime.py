"""Sequence parallelism's runtime half: ``MODE``, the mode's spec (``tensor/spec.py``) on its
geometry (``geometry.py``): every weight stays whole, so the plan only gives each dropout
its per-rank stream; ``layout.py`` splits the batch, ``loss.py`` sums token losses over the
sequence group; ``sdpa.py`` runs a plain model's ``scaled_dot_product_attention`` as ring
attention."""

from gridtrain.parallel.tensor.dropout import dropout_factory
from gridtrain.parallel.tensor.sequence.geometry import GEOMETRY
from gridtrain.parallel.tensor.sequence.layout import SEQUENCE, split_batch
from gridtrain.parallel.tensor.sequence.loss import CrossEntropyLoss, accuracy
from gridtrain.parallel.tensor.sequence.mha import SequenceMultiheadAttention
from gridtrain.parallel.tensor.sequence.sdpa import attention_route
from gridtrain.parallel.tensor.spec import TensorMode
from gridtrain.parallel.tensor.style import (
    ATTENTION,
    DROPOUT,
    EMBEDDING,
    HEADS,
    LINEAR,
    NORM,
    OPAQUE,
    PATCH,
    REPLICATE,
)


def _replicated(kinds, given, flow, modules, n):
    """Weights are replicated; only dropout masks differ per rank (module docstring), and
    ``nn.MultiheadAttention`` attends over the split positions (``mha.py``)."""
    styles = {m: (HEADS if k == ATTENTION else REPLICATE).name for m, k in kinds.items()}
    return styles, {m: "sequence: replicated" for m in kinds}


MODE = TensorMode(
    GEOMETRY,
    split_batch,
    CrossEntropyLoss,
    accuracy,
    layers={
        (DROPOUT, REPLICATE): (dropout_factory(SEQUENCE), {}),
        (ATTENTION, HEADS): (SequenceMultiheadAttention, {}),
    },
    kept=frozenset({LINEAR, EMBEDDING, NORM, PATCH, OPAQUE}),
    infer_styles=_replicated,
    tie_alternatives=(REPLICATE,),
    forward_mode=attention_route,
)
