"""Sequence parallelism: positions split over SEQUENCE, ring self-attention, token losses."""

from gridtrain.parallel.tensor.sequence.attention import VARIANTS, ring_attention
from gridtrain.parallel.tensor.sequence.layout import (
    SEQUENCE,
    is_sequence_sharded,
    mark_sequence_sharded,
    position_ids,
    sequence_group,
    split_batch,
)
from gridtrain.parallel.tensor.sequence.loss import CrossEntropyLoss, accuracy

__all__ = [
    "SEQUENCE",
    "VARIANTS",
    "CrossEntropyLoss",
    "accuracy",
    "is_sequence_sharded",
    "mark_sequence_sharded",
    "position_ids",
    "ring_attention",
    "sequence_group",
    "split_batch",
]
