"""``nn.MultiheadAttention`` on the (depth x) q x q SUMMA grid (2D Optimus, 2.5D Tesseract).

Activations arrive blocked: rows (dim 0) over the grid rows and depth, hidden over the grid
columns. The packed ``in_proj_weight`` is the grid's packed Linear (each of q, k, v split
over the grid columns, then its input dim over the rows), so grid column j projects heads
block j of its rows; ``out_proj`` is the grid's Linear on those heads. A ``batch_first``
input's rows are batch rows, so attention needs nothing more; a ``[L, B, E]`` input's rows
are positions, so keys and values are all-gathered over the grid column (then depth) first.
Biases and ``bias_k``/``bias_v`` are split over both axes (1/q^2) and gathered down the
column when used, like the grid's other biases.
"""

from __future__ import annotations

from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.mha import Limits, Rows, ShardedMultiheadAttention
from gridtrain.parallel.tensor.mode_2d.grid import (
    both_axes,
    check_width,
    gather_col,
    grid_of,
    matmul_ab,
    replicated,
)
from gridtrain.parallel.tensor.mode_2d.layers import Linear


class MultiheadAttention(ShardedMultiheadAttention):
    """``nn.MultiheadAttention`` on the SUMMA grid (module docstring)."""

    rng_mode = ParallelMode.TENSOR  # every rank holds other rows or other heads

    def __init__(self, dense: nn.MultiheadAttention, ctx=None):
        super().__init__(dense, ctx)
        g = self.grid = grid_of(self.ctx)
        self.limits = Limits(self.ctx.tensor_mode)
        self.heads_split, self.head_rank = g.q, g.j
        modes = (g.col_mode,) + ((g.dep_mode,) if g.dep_mode is not None else ())
        self.rows = self.mask_rows = Rows(self.ctx, 0, g.batch_parts, g.batch_index, modes)
        self._build(dense)

    def _weight_spec(self, packed: int):
        return [(0, self.grid.row_mode, packed), (1, self.grid.col_mode)]

    def _bias_spec(self, dim: int, packed: int):
        return both_axes(dim, self.grid, packed)

    def _out_proj(self, dense: nn.Linear) -> nn.Module:
        return Linear(dense, self.ctx)

    def _usable_weight(self, w: Tensor) -> Tensor:
        return replicated(w, self.grid)

    def _usable_bias(self, b: Tensor, dim: int) -> Tensor:
        return gather_col(b, dim, self.grid)

    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        """The grid Linear's product (``mode_2d.layers.Linear``) with one of the packed blocks."""
        g = self.grid
        width = w.shape[1]  # this rank's block of the input features
        if g.q > 1 and x.shape[-1] == width * g.q:  # a full-width input: keep this column's
            x = comm.split_to_group(x, -1, g.row_group)
        check_width("MultiheadAttention", x, width)
        y = matmul_ab(x.reshape(-1, width), w.t(), g)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if b is None else y + b

    def _out_width(self) -> int:
        return self.embed_dim // self.grid.q
