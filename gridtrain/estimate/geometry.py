"""How one tensor rank holds a micro-batch's activations, per mode (read off each mode's layers).

* none: everything whole.
* 1d (Megatron, ``mode_1d``): tokens and the residual stream whole on every rank;
  a column Linear's output and a row Linear's input are split ``T`` ways.
* 2d / 2.5d (``mode_2d``, rank (k, i, j)): rows cut into ``depth x q`` batch blocks
  (``split_batch``), every activation's hidden dim into ``q`` column blocks.
* 3d (``mode_3d``, ``d^3`` cube): rows into ``d^2`` blocks, hidden into ``d``; a Linear
  all-gathers its input over the row axis, so what it saves has ``d``x the rows.
* sequence (``sequence``): the sequence cut ``N`` ways, widths whole.

Widths: ``in_width``/``out_width`` of a Linear of role ``"column"`` (qkv, fc, the
head) or ``"row"`` (proj, fc2) on one rank.
"""

from __future__ import annotations

import dataclasses

from gridtrain.parallel.tensor.mode_2d.grid import grid_side
from gridtrain.parallel.tensor.mode_3d.cube import cube_side


@dataclasses.dataclass(frozen=True)
class Geometry:
    mode: str | None
    size: int  # tensor group size T
    side: int  # 1d/sequence: T; 2d/2.5d: q; 3d: d; none: 1
    depth: int  # 2.5d depth (1 otherwise)

    @classmethod
    def of(cls, mode: str | None, size: int, depth: int = 1) -> Geometry:
        if mode in ("2d", "2.5d"):
            side = grid_side(size, depth)
        elif mode == "3d":
            side = cube_side(size)
        else:
            side = size
        return cls(mode, size, side, depth if mode == "2.5d" else 1)

    @property
    def grid(self) -> bool:
        return self.mode in ("2d", "2.5d", "3d")

    @property
    def row_blocks(self) -> int:
        """Batch blocks of one tensor group (``split_batch``)."""
        if self.mode in ("2d", "2.5d"):
            return self.depth * self.side
        if self.mode == "3d":
            return self.side**2
        return 1

    @property
    def seq_parts(self) -> int:
        return self.size if self.mode == "sequence" else 1

    @property
    def hidden_parts(self) -> int:
        """Split of the residual stream's hidden dim."""
        return self.side if self.grid else 1

    @property
    def gather(self) -> int:
        """How many times more rows a Linear saves than the rank's block (3d's input gather)."""
        return self.side if self.mode == "3d" else 1

    def tokens(self, m: int) -> float:
        """Tokens of a ``m``-token micro-batch on one rank's activation blocks."""
        return m / (self.row_blocks * self.seq_parts)

    def in_width(self, width: int, role: str) -> float:
        if self.mode == "1d":
            return width / self.size if role == "row" else width
        return width / self.hidden_parts

    def out_width(self, width: int, role: str) -> float:
        if self.mode == "1d":
            return width / self.size if role == "column" else width
        return width / self.hidden_parts
