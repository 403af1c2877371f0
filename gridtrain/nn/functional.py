"""``gt.nn`` functions: accuracy, attention and positions, right for the context's layout."""

from __future__ import annotations

import contextlib
import warnings

import torch

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.modes import mode_module
from gridtrain.parallel.tensor.sequence import position_ids as _sequence_positions
from gridtrain.parallel.tensor.sequence import ring_attention


def accuracy(logits, labels, ctx: ParallelContext | None = None):
    """(correct, total) over this data-parallel rank's batch, reduced as the mode needs."""
    return mode_module(ctx).accuracy(logits, labels, ctx)


def position_ids(seq_len: int, device=None, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Global positions of this rank's ``seq_len`` tokens, for position embeddings:
    ``arange(seq_len)``, offset by the rank's shard where the mode splits the sequence."""
    return _sequence_positions(seq_len, device, ctx)


def attention(q, k, v, causal=False, key_padding_mask=None, dropout_p=0.0, scale=None, ctx=None):
    """Softmax attention of ``[B, H, s, D]`` q, k, v; ``key_padding_mask`` ``[B, s]``, True = pad.

    Ring self-attention under 'sequence' (``parallel.tensor.ring_attention`` picks the
    variant); ``scaled_dot_product_attention`` on the local heads in every other mode.
    """
    return ring_attention(q, k, v, causal, key_padding_mask, dropout_p, scale, ctx=ctx)


@contextlib.contextmanager
def shared_input(ctx: ParallelContext | None = None):
    """Deprecated no-op: the planner reads which Linears share an input off the data flow."""
    warnings.warn(
        "gt.nn.shared_input() is no longer needed: the plan follows the data flow",
        DeprecationWarning,
        stacklevel=3,
    )
    yield
