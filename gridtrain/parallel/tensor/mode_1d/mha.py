"""``nn.MultiheadAttention`` under 1d (Megatron-LM's attention): each rank its ``H / n`` heads.

The packed ``in_proj_weight`` ``[3E, E]`` keeps rows ``[3E/n, E]``: this rank's heads of q, k
and v (a packed column-parallel Linear, input replicated); ``out_proj`` is row-parallel on
those heads, its partial products all-reduced. ``bias_k``/``bias_v`` are split by heads. The
batch and sequence stay whole, so every argument of MHA is computed, ``need_weights=True``
included (probabilities averaged over the group's heads, or gathered per head).
"""

from __future__ import annotations

from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.tensor.mha import Limits, ShardedMultiheadAttention
from gridtrain.parallel.tensor.mode_1d.linear import PM1D, RowLinear, linear


class MultiheadAttention1D(ShardedMultiheadAttention):
    """``nn.MultiheadAttention`` with this rank's heads (module docstring)."""

    limits = Limits("1d", weights=True, unbatched=True)
    rng_mode = PM1D  # each rank's heads draw their own dropout masks

    def __init__(self, dense: nn.MultiheadAttention, ctx=None):
        super().__init__(dense, ctx)
        self.heads_split, self.head_rank = self.ctx.world_size(PM1D), self.ctx.local_rank(PM1D)
        self._build(dense)

    def _weight_spec(self, packed: int):
        return [(0, PM1D, packed)]

    def _bias_spec(self, dim: int, packed: int):
        return [(dim, PM1D, packed)]

    def _out_proj(self, dense: nn.Linear) -> nn.Module:
        return RowLinear(dense, self.ctx)

    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return linear(comm.copy_to_group(x, self.ctx.group(PM1D)), w, b, False)

    def _combine_weights(self, probs: Tensor, average: bool) -> Tensor:
        """The dense probabilities from this rank's heads ``[B, h, L, S]``: their mean over all
        heads (``average``), else every head, gathered."""
        group = self.ctx.group(PM1D)
        if average:
            return comm.reduce_from_group(probs.sum(dim=1), group) / self.num_heads
        return comm.gather_from_group(probs, 1, group)
