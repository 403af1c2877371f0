"""``nn.MultiheadAttention`` under sequence parallelism: whole weights, split positions.

The engine cuts dim 1 of every batch tensor over SEQUENCE. For a ``batch_first`` module
that is the sequence: q, k and v are projected from this rank's positions with the whole
weights and attention runs as ring attention (``attention.ring_attention``), which takes
causal masking (``is_causal=True``; the mask's values are not read, as torch's hint says)
and a boolean key padding mask; another ``attn_mask``, ``need_weights=True``,
``add_bias_kv``/``add_zero_attn`` and query/key of different lengths are refused by name.
For a ``[L, B, E]`` module dim 1 is the batch: each rank attends over whole sequences of
its rows, with every argument but ``need_weights=True``, by matmuls (an SDPA call would be
sent round the ring by ``sdpa.SequenceAttention``).
"""

from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel.tensor.mha import Limits, Rows, ShardedMultiheadAttention
from gridtrain.parallel.tensor.sequence.layout import SEQUENCE, splits_sequence

RING = Limits("sequence", extra_keys=False, attn_mask=False)
LOCAL = Limits("sequence")


class SequenceMultiheadAttention(ShardedMultiheadAttention):
    """``nn.MultiheadAttention`` on this rank's positions or rows (module docstring)."""

    rng_mode = SEQUENCE
    ring = True
    explicit = True

    def __init__(self, dense: nn.MultiheadAttention, ctx=None):
        super().__init__(dense, ctx)
        self.limits = RING if dense.batch_first else LOCAL
        self.heads_split, self.head_rank = 1, 0
        if splits_sequence(self.ctx):
            n, r = self.ctx.world_size(SEQUENCE), self.ctx.local_rank(SEQUENCE)
            self.rows = self.mask_rows = Rows(self.ctx, 1, n, r, (SEQUENCE,))
        self._build(dense)

    def _weight_spec(self, packed: int):
        return ()  # every weight whole, as every layer under sequence parallelism

    def _bias_spec(self, dim: int, packed: int):
        return ()

    def _out_proj(self, dense: nn.Linear) -> nn.Module:
        return copy.deepcopy(dense)  # the dense module's own goes to the meta device

    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.linear(x, w, b)
