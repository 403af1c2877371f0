"""2d's and 2.5d's geometry (``tensor/geometry.py``): ``depth`` stacked q x q SUMMA grids.

Rank (k, i, j) is tensor rank ``k*q*q + i*q + j``; a row group holds a grid row (j varies),
a column group a grid column (i varies), and under 2.5d a depth group (k varies) and an XZ
group (k, j vary). The batch is cut into ``depth * q`` row blocks, the hidden dim into ``q``
column blocks; attention heads are split over the grid columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Any

from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.geometry import BlockGroups, ModeGeometry
from gridtrain.parallel.tensor.mode_2d import costs

Axes = tuple[PM, PM, PM | None]  # the grid's row, column and depth groups (2d: no depth)


def grid_side(size: int, depth: int = 1) -> int:
    """q, the side of the q x q grid of ``size`` ranks in ``depth`` layers (2d: depth 1)."""
    return math.isqrt(size // depth)


@dataclass(frozen=True)
class GridGeometry(ModeGeometry):
    name: str | None = "2d"
    runtime: str = "gridtrain.parallel.tensor.mode_2d.runtime:MODE_2D"
    blocked: bool = True
    vocab_parallel_loss: bool = True
    axes: Axes = (PM.PARALLEL_2D_ROW, PM.PARALLEL_2D_COL, None)

    def check(self, size: int, depth: int) -> None:
        if math.isqrt(size) ** 2 != size:
            raise ValueError(f"2d needs a square tensor size, got {size}")

    def side(self, size: int, depth: int) -> int:
        return grid_side(size, depth)

    def groups(self, size: int, depth: int) -> BlockGroups:
        row, col, dep = self.axes
        q = grid_side(size, depth)
        ks, qs = range(depth), range(q)

        def at(k: int, i: int, j: int) -> int:
            return k * q * q + i * q + j

        groups = {
            row: [[at(k, i, j) for j in qs] for k, i in product(ks, qs)],
            col: [[at(k, i, j) for i in qs] for k, j in product(ks, qs)],
        }
        if dep is not None:
            groups[dep] = [[at(k, i, j) for k in ks] for i, j in product(qs, qs)]
            groups[PM.PARALLEL_2P5D_XZ] = [[at(k, i, j) for k, j in product(ks, qs)] for i in qs]
        return groups

    def head_split(self, size: int, depth: int) -> tuple[int, str]:
        q = grid_side(size, depth)
        return q, f"the grid columns (PARALLEL_2D_ROW, q = {q})"

    def batch_split(self, size: int, depth: int) -> tuple[int, str]:
        q = grid_side(size)
        return q, f"the grid rows (q = {q})"

    def fits(self, size: int, heads: int, seq_len: int) -> tuple[int, ...]:
        q = math.isqrt(size)
        return (1,) if q * q == size and heads % q == 0 else ()

    def row_blocks(self, g: Any) -> int:
        return g.depth * g.side

    def hidden_parts(self, g: Any) -> int:
        return g.side

    def lookup_rows(self, g: Any) -> int:
        return g.depth * g.side

    def linear_input_dtype(self, after_norm: bool) -> str:
        # a SUMMA Function keeps its operands as they come (fp32 norm outputs under autocast)
        return "r" if after_norm else "e"

    def layer_collectives(self, c: Any, name: str, entry: Any) -> None:
        costs.layer(c, name, entry, self.axes)

    def loss_collectives(self, c: Any) -> None:
        costs.loss(c, self.axes)


@dataclass(frozen=True)
class TesseractGeometry(GridGeometry):
    """2.5d: ``depth`` grids; weights replicated over depth, the batch cut over it too."""

    name: str | None = "2.5d"
    runtime: str = "gridtrain.parallel.tensor.mode_2d.runtime:MODE_2P5D"
    uses_depth: bool = True
    axes: Axes = (PM.PARALLEL_2P5D_ROW, PM.PARALLEL_2P5D_COL, PM.PARALLEL_2P5D_DEP)

    def check(self, size: int, depth: int) -> None:
        q2, rest = divmod(size, depth)
        if rest or math.isqrt(q2) ** 2 != q2:
            raise ValueError(
                f"2.5d needs tensor size = depth x q^2, got size {size} with depth {depth}"
            )

    def batch_split(self, size: int, depth: int) -> tuple[int, str]:
        q = grid_side(size, depth)
        return depth * q, f"depth {depth} x q {q} = {depth * q} batch blocks"

    def fits(self, size: int, heads: int, seq_len: int) -> tuple[int, ...]:
        """Every depth of at least 2 over grids of side q >= 2 that split the heads."""
        out = []
        for depth in range(2, size + 1):
            q2, rest = divmod(size, depth)
            q = math.isqrt(q2)
            if not rest and q >= 2 and q * q == q2 and heads % q == 0:
                out.append(depth)
        return tuple(out)


GEOMETRY_2D = GridGeometry()
GEOMETRY_2P5D = TesseractGeometry()
