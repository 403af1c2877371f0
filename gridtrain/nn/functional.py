"""``gt.nn`` functions: accuracy, attention and positions, right for the context's layout."""

from __future__ import annotations

import torch

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.registry import spec_of
from gridtrain.parallel.tensor.sequence import position_ids as _sequence_positions
from gridtrain.parallel.tensor.sequence import ring_attention


def accuracy(logits, labels, ctx: ParallelContext | None = None):
    """(correct, total) over this data-parallel rank's batch, reduced as the mode needs."""
    return spec_of(ctx).accuracy(logits, labels, ctx)


def position_ids(seq_len: int, device=None, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Global positions of this rank's ``seq_len`` tokens, for position embeddings:
    ``arange(seq_len)``, offset by the rank's shard where the mode splits the sequence."""
    return _sequence_positions(seq_len, device, ctx)


def attention(
    q, k, v, causal=False, key_padding_mask=None, dropout_p=0.0, scale=None, ctx=None, *,
    window=None, softcap=None, sinks=None,
):  # fmt: skip
    """Softmax attention of ``[B, H, s, D]`` q, k, v; ``key_padding_mask`` ``[B, s]``, True = pad.

    Ring self-attention under sequence parallelism (``parallel.tensor.ring_attention`` picks the
    variant); ``scaled_dot_product_attention`` on the local heads in every other mode.
    ``window`` (causal only): each query sees the ``window`` keys ending at itself (a
    sliding window); ``softcap``: scaled scores become ``softcap * tanh(scores / softcap)``;
    ``sinks`` (``[H]``): a learned logit per head in each row's softmax denominator that
    attends to nothing. All from global positions, as one process computes them.
    """
    mods = dict(window=window, softcap=softcap, sinks=sinks)
    return ring_attention(q, k, v, causal, key_padding_mask, dropout_p, scale, ctx=ctx, **mods)
