"""Sequence parallelism: positions split over SEQUENCE, ring self-attention, token losses.

``geometry.py`` is the torch-free half (one SEQUENCE group, the data x sequence groups that
average gradients, the collectives ``gridtrain estimate`` counts, ``costs.py``);
``runtime.py`` builds ``MODE``, the mode's spec: ``layout.py`` splits the batch, ``loss.py``
sums token losses over the sequence group, ``attention.py`` (on ``ring.py``) is ring
self-attention, ``sdpa.py`` runs a plain model's ``scaled_dot_product_attention`` as ring
attention. The names below load on first use.
"""

from gridtrain.parallel.tensor.lazy import exports

_WHERE = {
    "MODE": "runtime",
    "SEQUENCE": "layout",
    "is_sequence_sharded": "layout",
    "mark_sequence_sharded": "layout",
    "position_ids": "layout",
    "sequence_group": "layout",
    "split_batch": "layout",
    "VARIANTS": "attention",
    "ring_attention": "attention",
    "CrossEntropyLoss": "loss",
    "accuracy": "loss",
    "SequenceMultiheadAttention": "mha",
    "SequenceAttention": "sdpa",
    "SequenceAttentionError": "sdpa",
    "attention_route": "sdpa",
    "replay_route": "sdpa",
}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
