"""``nn.MultiheadAttention`` on the 3D cube (Bian et al. 2021).

The input comes at some orientation (``cube.py``); the packed ``in_proj_weight`` is the
cube's packed Linear there (each of q, k, v split over the row axis, then over INPUT, its
input dim over the hidden axis), so q, k and v come out at the other orientation with
this rank's block of heads, and ``out_proj`` is the cube's Linear back. A ``batch_first``
input's rows are batch rows: attention needs nothing more; a ``[L, B, E]`` input's rows are
positions, so keys and values are all-gathered over the row axis and INPUT first. Masks
are laid out like the model's input (orientation 0, ``split_batch``), rebuilt whole and
cut to the attention's rows. Biases and ``bias_k``/``bias_v`` are split like the cube's
Linear bias (1/d^3) and gathered over the pair group when used.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.mha import Limits, Rows, ShardedMultiheadAttention
from gridtrain.parallel.tensor.mode_3d.cube import INPUT, OUTPUT, PAIR, Cube, as_shard
from gridtrain.parallel.tensor.mode_3d.layers import Linear


class MultiheadAttention(ShardedMultiheadAttention):
    """``nn.MultiheadAttention`` on the cube, its input at ``orientation`` (module docstring)."""

    limits = Limits("3d")
    rng_mode = ParallelMode.TENSOR  # every rank holds other rows or other heads

    def __init__(self, dense: nn.MultiheadAttention, ctx=None, *, orientation: int = 0):
        super().__init__(dense, ctx)
        self.cube = Cube.of(self.ctx, orientation)  # the input's; q, k, v at the other one
        att, d = self.cube.flipped(), self.cube.d
        self.heads_split, self.head_rank = d, self.ctx.local_rank(att.hidden_axis)
        i = self.ctx.local_rank(INPUT)
        self.rows = Rows(
            self.ctx, 0, d * d, i * d + self.ctx.local_rank(att.row_axis), (att.row_axis, INPUT)
        )
        self.mask_rows = Rows(
            self.ctx, 0, d * d, i * d + self.ctx.local_rank(OUTPUT), (OUTPUT, INPUT)
        )
        self._build(dense)

    def _weight_spec(self, packed: int):
        cube = self.cube
        return [(0, cube.row_axis, packed), (0, INPUT), (1, cube.hidden_axis)]

    def _bias_spec(self, dim: int, packed: int):
        return [(dim, self.cube.row_axis, packed), (dim, PAIR[self.cube.hidden_axis])]

    def _out_proj(self, dense: nn.Linear) -> nn.Module:
        return Linear(dense, self.ctx, orientation=1 - self.cube.orientation)

    def _usable_weight(self, w: Tensor) -> Tensor:
        return comm.all_gather(w, 0, self.ctx.group(INPUT))

    def _usable_bias(self, b: Tensor, dim: int) -> Tensor:
        return comm.all_gather(b, dim, self.ctx.group(PAIR[self.cube.hidden_axis]))

    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        """The cube Linear's product (``cube.linear_3d``) with one of the packed blocks."""
        cube = self.cube
        x = as_shard("MultiheadAttention", x, w.shape[1] * cube.d, cube)
        x = comm.all_gather(x, 0, cube.group(cube.row_axis))  # the whole batch block
        y = comm.reduce_scatter(F.linear(x, w), 0, cube.group(cube.hidden_axis))
        return y if b is None else y + b

    def _out_width(self) -> int:
        return self.embed_dim // self.cube.d
